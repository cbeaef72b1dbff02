#include "snapcore/shuffle.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "snapcore/error.hpp"
#include "snapcore/host_copy.hpp"
#include "snapcore/system.hpp"
#include "snapcore/thread_pool.hpp"

namespace snapcore {

namespace {

// Elements per block. The W byte streams of the shuffled layout lie n bytes apart, and n
// is often a multiple of the page size: written (or read) 16 bytes at a time, W streams
// would fall into one cache set and evict each other. Each block is transposed through a
// small buffer instead, and the streams are written (or read) in runs of kBlock bytes.
constexpr std::size_t kBlock = 512;

using Range = void (*)(std::uint8_t* dst, const std::uint8_t* src, std::size_t n,
                       std::size_t begin, std::size_t end);

#if defined(__SSE2__)
using V = __m128i;
constexpr std::size_t kLanes = 16;  // elements per step: byte k of 16 elements fills a register

// Splits two registers holding consecutive W-byte elements into one register of their
// lower halves and one of their upper halves (little-endian: lower = lower addresses), in
// element order. SSE2 has no plain narrowing, so each width uses a pack or a shuffle that
// is exact on the values it is given.
template <std::size_t W>
inline void halve(V a, V b, V& lo, V& hi);

template <>
inline void halve<2>(V a, V b, V& lo, V& hi) {
  // packus saturates int16 to 0..255: zero-extended bytes pass through unchanged.
  const V mask = _mm_set1_epi16(0x00ff);
  lo = _mm_packus_epi16(_mm_and_si128(a, mask), _mm_and_si128(b, mask));
  hi = _mm_packus_epi16(_mm_srli_epi16(a, 8), _mm_srli_epi16(b, 8));
}

template <>
inline void halve<4>(V a, V b, V& lo, V& hi) {
  // packs saturates int32 to int16: sign-extended halves pass through unchanged.
  lo = _mm_packs_epi32(_mm_srai_epi32(_mm_slli_epi32(a, 16), 16),
                       _mm_srai_epi32(_mm_slli_epi32(b, 16), 16));
  hi = _mm_packs_epi32(_mm_srai_epi32(a, 16), _mm_srai_epi32(b, 16));
}

template <>
inline void halve<8>(V a, V b, V& lo, V& hi) {
  // Per register, the two elements' low dwords to the low quadword, high dwords above.
  const V a2 = _mm_shuffle_epi32(a, _MM_SHUFFLE(3, 1, 2, 0));
  const V b2 = _mm_shuffle_epi32(b, _MM_SHUFFLE(3, 1, 2, 0));
  lo = _mm_unpacklo_epi64(a2, b2);
  hi = _mm_unpackhi_epi64(a2, b2);
}

template <>
inline void halve<16>(V a, V b, V& lo, V& hi) {
  lo = _mm_unpacklo_epi64(a, b);
  hi = _mm_unpackhi_epi64(a, b);
}

// The inverse of halve: interleaves lower and upper halves back into W-byte elements.
template <std::size_t W>
inline void interleave(V lo, V hi, V& a, V& b);

template <>
inline void interleave<2>(V lo, V hi, V& a, V& b) {
  a = _mm_unpacklo_epi8(lo, hi);
  b = _mm_unpackhi_epi8(lo, hi);
}

template <>
inline void interleave<4>(V lo, V hi, V& a, V& b) {
  a = _mm_unpacklo_epi16(lo, hi);
  b = _mm_unpackhi_epi16(lo, hi);
}

template <>
inline void interleave<8>(V lo, V hi, V& a, V& b) {
  a = _mm_unpacklo_epi32(lo, hi);
  b = _mm_unpackhi_epi32(lo, hi);
}

template <>
inline void interleave<16>(V lo, V hi, V& a, V& b) {
  a = _mm_unpacklo_epi64(lo, hi);
  b = _mm_unpackhi_epi64(lo, hi);
}

// v[0..W) hold 16 consecutive W-byte elements; afterwards v[k] holds byte k of each. A
// byte of a W-byte element is a byte of its lower or upper half, so the transpose is a
// halving followed by two transposes of half the width.
template <std::size_t W>
inline void transpose(V* v) {
  if constexpr (W > 1) {
    V lo[W / 2];
    V hi[W / 2];
    for (std::size_t j = 0; j < W / 2; ++j) {
      halve<W>(v[2 * j], v[2 * j + 1], lo[j], hi[j]);
    }
    transpose<W / 2>(lo);
    transpose<W / 2>(hi);
    for (std::size_t j = 0; j < W / 2; ++j) {
      v[j] = lo[j];
      v[W / 2 + j] = hi[j];
    }
  }
}

// The inverse of transpose.
template <std::size_t W>
inline void untranspose(V* v) {
  if constexpr (W > 1) {
    V lo[W / 2];
    V hi[W / 2];
    for (std::size_t j = 0; j < W / 2; ++j) {
      lo[j] = v[j];
      hi[j] = v[W / 2 + j];
    }
    untranspose<W / 2>(lo);
    untranspose<W / 2>(hi);
    for (std::size_t j = 0; j < W / 2; ++j) {
      interleave<W>(lo[j], hi[j], v[2 * j], v[2 * j + 1]);
    }
  }
}
#endif  // __SSE2__

// Shuffles elements [begin, end) of n: one sequential read, then W runs of up to kBlock
// bytes written per block.
template <std::size_t W>
void shuffle_range(std::uint8_t* dst, const std::uint8_t* src, std::size_t n,
                   std::size_t begin, std::size_t end) {
  alignas(64) std::uint8_t block[W * kBlock];
  for (std::size_t first = begin; first < end; first += kBlock) {
    const std::size_t len = std::min(kBlock, end - first);
    const std::uint8_t* in = src + first * W;
    std::size_t i = 0;
#if defined(__SSE2__)
    for (; i + kLanes <= len; i += kLanes) {
      V v[W];
      for (std::size_t j = 0; j < W; ++j) {
        v[j] = _mm_loadu_si128(reinterpret_cast<const V*>(in + i * W + j * kLanes));
      }
      transpose<W>(v);
      for (std::size_t k = 0; k < W; ++k) {
        _mm_store_si128(reinterpret_cast<V*>(block + k * kBlock + i), v[k]);
      }
    }
#endif
    for (; i < len; ++i) {
      for (std::size_t k = 0; k < W; ++k) {
        block[k * kBlock + i] = in[i * W + k];
      }
    }
    for (std::size_t k = 0; k < W; ++k) {
      std::memcpy(dst + k * n + first, block + k * kBlock, len);
    }
  }
}

// Unshuffles elements [begin, end) of n: W runs of up to kBlock bytes read per block, then
// one sequential write.
template <std::size_t W>
void unshuffle_range(std::uint8_t* dst, const std::uint8_t* src, std::size_t n,
                     std::size_t begin, std::size_t end) {
  alignas(64) std::uint8_t block[W * kBlock];
  for (std::size_t first = begin; first < end; first += kBlock) {
    const std::size_t len = std::min(kBlock, end - first);
    for (std::size_t k = 0; k < W; ++k) {
      std::memcpy(block + k * kBlock, src + k * n + first, len);
    }
    std::uint8_t* out = dst + first * W;
    std::size_t i = 0;
#if defined(__SSE2__)
    for (; i + kLanes <= len; i += kLanes) {
      V v[W];
      for (std::size_t k = 0; k < W; ++k) {
        v[k] = _mm_load_si128(reinterpret_cast<const V*>(block + k * kBlock + i));
      }
      untranspose<W>(v);
      for (std::size_t j = 0; j < W; ++j) {
        _mm_storeu_si128(reinterpret_cast<V*>(out + i * W + j * kLanes), v[j]);
      }
    }
#endif
    for (; i < len; ++i) {
      for (std::size_t k = 0; k < W; ++k) {
        out[i * W + k] = block[k * kBlock + i];
      }
    }
  }
}

template <bool Shuffle, std::size_t W>
constexpr Range range_for() {
  return Shuffle ? &shuffle_range<W> : &unshuffle_range<W>;
}

template <bool Shuffle>
void transform(const char* name, void* dst, const void* src, std::size_t nbytes,
               std::size_t element_size, std::size_t threads) {
  Range range = nullptr;
  switch (element_size) {
    case 1:
      break;
    case 2:
      range = range_for<Shuffle, 2>();
      break;
    case 4:
      range = range_for<Shuffle, 4>();
      break;
    case 8:
      range = range_for<Shuffle, 8>();
      break;
    case 16:
      range = range_for<Shuffle, 16>();
      break;
    default:
      SNAP_EXPECT_ARG(false, name << ": element_size must be 1, 2, 4, 8 or 16, not "
                                  << element_size);
  }
  if (nbytes == 0) {
    return;
  }
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  SNAP_EXPECT_ARG(d != 0 && s != 0, name << ": null address for " << nbytes << " bytes");
  SNAP_EXPECT_ARG(d + nbytes > d && s + nbytes > s, name << ": address range wraps around");
  SNAP_EXPECT_ARG(d + nbytes <= s || s + nbytes <= d,
                  name << ": source and destination overlap (dst=" << d << ", src=" << s
                       << ", nbytes=" << nbytes << ")");
  const std::size_t n = nbytes / element_size;
  if (range == nullptr || n == 0) {
    copy_host({CopySpec{d, s, nbytes}}, threads);
    return;
  }

  auto* out = static_cast<std::uint8_t*>(dst);
  const auto* in = static_cast<const std::uint8_t*>(src);
  const std::size_t workers = workers_for(nbytes, threads);
  const std::size_t share = round_up((n + workers - 1) / workers, kBlock);
  const std::size_t parts = (n + share - 1) / share;
  parallel_for(parts, parts, [&](std::size_t p) {
    range(out, in, n, p * share, std::min(n, (p + 1) * share));
  });
  const std::size_t body = n * element_size;
  std::memcpy(out + body, in + body, nbytes - body);  // trailing bytes of no whole element
}

}  // namespace

void byte_shuffle(void* dst, const void* src, std::size_t nbytes, std::size_t element_size,
                  std::size_t threads) {
  transform<true>("byte_shuffle", dst, src, nbytes, element_size, threads);
}

void byte_unshuffle(void* dst, const void* src, std::size_t nbytes, std::size_t element_size,
                    std::size_t threads) {
  transform<false>("byte_unshuffle", dst, src, nbytes, element_size, threads);
}

}  // namespace snapcore
