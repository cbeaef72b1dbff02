// Facts about the machine that the other parts size their work by.
#pragma once

#include <cstddef>

namespace snapcore {

// The virtual-memory page size; also the alignment used for O_DIRECT.
std::size_t page_size() noexcept;

// CPUs this process may run on (its affinity mask, so a container's or taskset's limit
// counts), at least 1.
std::size_t hardware_threads() noexcept;

// `threads` when positive, else hardware_threads().
std::size_t resolve_threads(std::size_t threads) noexcept;

inline std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace snapcore
