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

// How the bytes reach the destination.
enum class Stores {
  kNormal,       // memcpy: the C library picks (non-temporal only for very large calls)
  kNonTemporal,  // streaming stores that bypass the caches (x86-64; memcpy elsewhere)
};

// Performs every copy, splitting the total bytes evenly over `threads` workers
// (0 = hardware_threads()): a large copy is cut into pieces, small ones are grouped.
// The regions of one copy must not overlap (checked); different copies must not write
// the same bytes (not checked). Runs on the shared ThreadPool plus the calling thread.
//
// kNonTemporal is for copies far larger than the caches whose destination is not read
// back at once (staging a state into the arena). memcpy switches to streaming stores only
// for a single copy above glibc's x86_non_temporal_threshold (derived from the cache
// sizes; 240 MiB on a 2-core EPYC VM), so a state made of many tensors of tens of MB each
// is copied with ordinary stores, which read every destination line before writing it: a
// third more memory traffic.
void copy_host(const std::vector<CopySpec>& copies, std::size_t threads = 0,
               Stores stores = Stores::kNormal);

}  // namespace snapcore
