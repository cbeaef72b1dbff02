// Device<->host copies on a side stream of snapcore's own, ordered after the caller's
// stream by events, so that staging never blocks the training stream.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "snapcore/host_copy.hpp"
#include "snapcore/shim/cuda.hpp"

namespace snapcore {

class PrimaryContext;

// A CUDA event in a device's primary context: timing disabled, and blocking sync, so that
// synchronize() sleeps in the driver instead of spinning a CPU core.
class CudaEvent {
 public:
  explicit CudaEvent(std::shared_ptr<PrimaryContext> ctx);  // throws CudaError
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(cu::CUstream stream);
  void synchronize() const;                    // blocks the calling thread
  [[nodiscard]] bool query() const;            // true when the recorded work is done
  void make_stream_wait(cu::CUstream stream) const;  // GPU-side wait; returns at once
  [[nodiscard]] cu::CUevent get() const noexcept { return event_; }

 private:
  std::shared_ptr<PrimaryContext> ctx_;
  cu::CUevent event_ = nullptr;
};

class CudaCopier {
 public:
  // Retains `device`'s primary context and creates a non-blocking stream in it.
  explicit CudaCopier(int device);
  ~CudaCopier();
  CudaCopier(const CudaCopier&) = delete;
  CudaCopier& operator=(const CudaCopier&) = delete;

  // Copies (dst host, src device, nbytes) after the work already queued on `after_stream`
  // (0 = the legacy default stream); returns the event that completes with the copies.
  // Source and destination must stay alive, and the source unmodified, until then.
  // Copies that continue one another (both ends adjacent) are merged into one, and the
  // rest go to the driver in one cuMemcpyBatchAsync where the driver has it (CUDA 12.8+),
  // one call per copy otherwise or if the driver refuses the batch.
  std::unique_ptr<CudaEvent> d2h(const std::vector<CopySpec>& copies,
                                 std::uintptr_t after_stream);
  // Copies (dst device, src host, nbytes); same ordering and lifetime rules.
  std::unique_ptr<CudaEvent> h2d(const std::vector<CopySpec>& copies,
                                 std::uintptr_t after_stream);
  // Waits for the stream's work, destroys it and releases the context; idempotent.
  void close();

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] std::uintptr_t stream() const;
  [[nodiscard]] bool closed() const noexcept { return stream_ == nullptr; }

 private:
  enum class Direction { DeviceToHost, HostToDevice };
  std::unique_ptr<CudaEvent> copy(Direction dir, const std::vector<CopySpec>& copies,
                                  std::uintptr_t after_stream);

  // Queues `runs` as one batch; false (nothing to undo: a retry rewrites the same bytes)
  // when the driver has no batch call or refuses it.
  bool copy_batch(const std::vector<CopySpec>& runs);

  int device_;
  std::shared_ptr<PrimaryContext> ctx_;
  cu::CUstream stream_ = nullptr;
  bool batch_ok_ = true;  // false once the driver refused a batch (pageable memory, say)
};

}  // namespace snapcore
