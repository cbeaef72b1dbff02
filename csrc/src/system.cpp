#include "snapcore/system.hpp"

#include <sched.h>
#include <unistd.h>

#include <thread>

namespace snapcore {

std::size_t page_size() noexcept {
  static const std::size_t size = [] {
    const long ps = sysconf(_SC_PAGESIZE);
    return ps > 0 ? static_cast<std::size_t>(ps) : std::size_t{4096};
  }();
  return size;
}

std::size_t hardware_threads() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) {
      return static_cast<std::size_t>(n);
    }
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

std::size_t resolve_threads(std::size_t threads) noexcept {
  return threads > 0 ? threads : hardware_threads();
}

}  // namespace snapcore
