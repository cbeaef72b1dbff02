#include "snapcore/host_copy.hpp"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "snapcore/error.hpp"
#include "snapcore/system.hpp"
#include "snapcore/thread_pool.hpp"

namespace snapcore {

namespace {

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

// memcpy with streaming (non-temporal) stores for the cache-line-aligned middle part.
// SSE2 is part of x86-64, so no run-time dispatch is needed; the copy is bound by memory
// bandwidth, not by the width of the registers. The caller fences.
void copy_streaming(char* dst, const char* src, std::size_t n) {
#if defined(__x86_64__)
  constexpr std::size_t kLine = 64;
  const std::size_t head =
      std::min(n, (kLine - reinterpret_cast<std::uintptr_t>(dst) % kLine) % kLine);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const std::size_t body = n - n % kLine;
  for (std::size_t i = 0; i < body; i += kLine) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace

void copy_host(const std::vector<CopySpec>& copies, std::size_t threads, Stores stores) {
  std::size_t total = 0;
  for (const CopySpec& c : copies) {
    check(c);
    total += c.nbytes;
  }
  if (total == 0) {
    return;
  }
  const std::size_t workers = workers_for(total, threads);
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
  parallel_for(plan.size(), plan.size(), [&plan, stores](std::size_t i) {
    for (const CopySpec& c : plan[i]) {
      if (stores == Stores::kNonTemporal) {
        copy_streaming(reinterpret_cast<char*>(c.dst), reinterpret_cast<const char*>(c.src),
                       c.nbytes);
      } else {
        std::memcpy(reinterpret_cast<void*>(c.dst), reinterpret_cast<const void*>(c.src),
                    c.nbytes);
      }
    }
#if defined(__x86_64__)
    if (stores == Stores::kNonTemporal) {
      _mm_sfence();  // streaming stores are weakly ordered: visible before we report done
    }
#endif
  });
}

}  // namespace snapcore
