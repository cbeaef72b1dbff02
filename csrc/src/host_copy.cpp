#include "snapcore/host_copy.hpp"

#include <algorithm>
#include <cstring>

#include "snapcore/error.hpp"
#include "snapcore/system.hpp"
#include "snapcore/thread_pool.hpp"

namespace snapcore {

namespace {

// Below this many bytes per worker, waking another thread costs more than it saves.
constexpr std::size_t kMinBytesPerWorker = std::size_t{1} << 20;
// Pieces are cut at this granularity so that no two workers share a cache line or page.
constexpr std::size_t kSplitAlign = 4096;

void check(const CopySpec& c) {
  if (c.nbytes == 0) {
    return;
  }
  SNAP_EXPECT_ARG(c.dst != 0 && c.src != 0, "copy_host: null address in a copy of "
                                                << c.nbytes << " bytes");
  SNAP_EXPECT_ARG(c.dst + c.nbytes > c.dst && c.src + c.nbytes > c.src,
                  "copy_host: address range wraps around");
  SNAP_EXPECT_ARG(c.dst + c.nbytes <= c.src || c.src + c.nbytes <= c.dst,
                  "copy_host: source and destination overlap (dst=" << c.dst << ", src="
                                                                    << c.src << ", nbytes="
                                                                    << c.nbytes << ")");
}

}  // namespace

void copy_host(const std::vector<CopySpec>& copies, std::size_t threads) {
  std::size_t total = 0;
  for (const CopySpec& c : copies) {
    check(c);
    total += c.nbytes;
  }
  if (total == 0) {
    return;
  }
  std::size_t workers = std::max<std::size_t>(1, total / kMinBytesPerWorker);
  workers = std::min(workers, resolve_threads(threads));
  const std::size_t share = round_up((total + workers - 1) / workers, kSplitAlign);

  // Deal the bytes out in order: each worker's list is a contiguous run of the total.
  std::vector<std::vector<CopySpec>> plan(1);
  std::size_t filled = 0;  // bytes in plan.back()
  for (const CopySpec& c : copies) {
    std::size_t done = 0;
    while (done < c.nbytes) {
      if (filled == share) {
        plan.emplace_back();
        filled = 0;
      }
      const std::size_t n = std::min(c.nbytes - done, share - filled);
      plan.back().push_back(CopySpec{c.dst + done, c.src + done, n});
      done += n;
      filled += n;
    }
  }
  parallel_for(plan.size(), plan.size(), [&plan](std::size_t i) {
    for (const CopySpec& c : plan[i]) {
      std::memcpy(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src),
                  c.nbytes);
    }
  });
}

}  // namespace snapcore
