// Byte shuffle: the transposition that groups byte k of every element together, so that
// the slowly varying bytes of float data (sign, exponent) form long runs a compressor can
// use. The layout is the one Blosc and HDF5 call "shuffle".
#pragma once

#include <cstddef>

namespace snapcore {

// For n = nbytes / element_size elements: dst[k * n + i] = src[i * element_size + k];
// the nbytes % element_size trailing bytes are copied unchanged to the end of dst.
// element_size is 1 (a plain copy), 2, 4, 8 or 16 (std::invalid_argument otherwise);
// the regions must not overlap (checked). Large inputs are split over `threads` workers
// (0 = hardware_threads()) of the shared ThreadPool, the caller being one of them.
void byte_shuffle(void* dst, const void* src, std::size_t nbytes, std::size_t element_size,
                  std::size_t threads = 0);

// The inverse: dst[i * element_size + k] = src[k * n + i], trailing bytes copied.
void byte_unshuffle(void* dst, const void* src, std::size_t nbytes, std::size_t element_size,
                    std::size_t threads = 0);

}  // namespace snapcore
