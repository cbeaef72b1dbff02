// Parallel memcpy between host buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace snapcore {

// One copy of `nbytes` from `src` to `dst`; addresses are plain integers so that callers
// can pass pointers of any origin (a tensor's data_ptr, an arena offset, a device pointer).
struct CopySpec {
  std::uintptr_t dst = 0;
  std::uintptr_t src = 0;
  std::size_t nbytes = 0;
};

// Performs every copy, splitting the total bytes evenly over `threads` workers
// (0 = hardware_threads()): a large copy is cut into pieces, small ones are grouped.
// The regions of one copy must not overlap (checked); different copies must not write
// the same bytes (not checked). Runs on the shared ThreadPool plus the calling thread.
void copy_host(const std::vector<CopySpec>& copies, std::size_t threads = 0);

}  // namespace snapcore
