#include "snapcore/system.hpp"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

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

int pci_numa_node(const std::string& bus_id, const std::string& sysfs_root) noexcept {
  try {
    std::string id = bus_id;
    std::transform(id.begin(), id.end(), id.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    const std::size_t colon = id.find(':');
    if (colon == 8 && id.compare(0, 4, "0000") == 0) {
      id.erase(0, 4);  // the driver's 8-digit domain; sysfs names have 4
    }
    if (id.empty() || id.find('/') != std::string::npos) {
      return -1;
    }
    std::ifstream in(sysfs_root + "/" + id + "/numa_node");
    int node = -1;
    if (!(in >> node) || node < 0) {
      return -1;
    }
    return node;
  } catch (...) {
    return -1;
  }
}

namespace {

constexpr int kMpolPreferred = 1;  // MPOL_PREFERRED of <linux/mempolicy.h>

// libnuma's entry points, loaded once; null when libnuma.so.1 is not installed.
struct Libnuma {
  int (*available)() = nullptr;
  long (*mbind)(void* start, unsigned long len, int mode, const unsigned long* nodemask,
                unsigned long maxnode, unsigned flags) = nullptr;
  std::string reason;

  Libnuma() {
    void* lib = dlopen("libnuma.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NODELETE);
    if (lib == nullptr) {
      const char* err = dlerror();
      reason = std::string("libnuma.so.1 not found: ") + (err != nullptr ? err : "?");
      return;
    }
    available = reinterpret_cast<int (*)()>(dlsym(lib, "numa_available"));
    mbind = reinterpret_cast<decltype(mbind)>(dlsym(lib, "mbind"));
    if (available == nullptr || mbind == nullptr) {
      available = nullptr;
      mbind = nullptr;
      reason = "libnuma.so.1 lacks numa_available or mbind";
    }
  }
};

}  // namespace

std::string prefer_numa_node(void* addr, std::size_t len, int node) noexcept {
  try {
    static const Libnuma numa;
    if (numa.mbind == nullptr) {
      return numa.reason;
    }
    if (numa.available() < 0) {
      return "NUMA is unavailable on this machine (numa_available() < 0)";
    }
    if (node < 0 || node >= 4096) {
      return "NUMA node " + std::to_string(node) + " is out of range";
    }
    constexpr std::size_t kBits = 8 * sizeof(unsigned long);
    std::vector<unsigned long> mask(static_cast<std::size_t>(node) / kBits + 1, 0);
    mask[static_cast<std::size_t>(node) / kBits] |= 1UL << (static_cast<std::size_t>(node) % kBits);
    if (numa.mbind(addr, len, kMpolPreferred, mask.data(), mask.size() * kBits + 1, 0) != 0) {
      const int err = errno;
      return std::string("mbind(MPOL_PREFERRED, node ") + std::to_string(node) +
             ") failed: " + std::strerror(err);
    }
    return {};
  } catch (...) {
    return "prefer_numa_node failed";
  }
}

}  // namespace snapcore
