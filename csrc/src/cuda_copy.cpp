#include "snapcore/cuda_copy.hpp"

#include "snapcore/cuda_context.hpp"
#include "snapcore/error.hpp"

namespace snapcore {

namespace {

cu::CUstream as_stream(std::uintptr_t handle) {
  return reinterpret_cast<cu::CUstream>(handle);
}

// The copies without the empty ones, each run of copies that continue one another (the
// next starts where the last ended, at both ends) merged into one, but only within one
// device allocation: two allocations can be adjacent in the address space, and a copy
// across both is invalid (CUDA_ERROR_INVALID_VALUE). `device_side` picks the device
// address of a copy; the driver says which allocation holds it (asked only when a merge
// is possible, in the current context). Where it cannot say, nothing is merged.
std::vector<CopySpec> coalesce(const std::vector<CopySpec>& copies,
                               std::uintptr_t CopySpec::*device_side) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  std::vector<CopySpec> runs;
  runs.reserve(copies.size());
  cu::CUdeviceptr end_of_alloc = 0;  // of the last run's allocation; 0: not asked yet
  for (const CopySpec& c : copies) {
    if (c.nbytes == 0) {
      continue;
    }
    if (!runs.empty()) {
      CopySpec& last = runs.back();
      if (last.dst + last.nbytes == c.dst && last.src + last.nbytes == c.src) {
        if (end_of_alloc == 0) {
          cu::CUdeviceptr base = 0;
          size_t size = 0;
          const cu::CUdeviceptr at = static_cast<cu::CUdeviceptr>(last.*device_side);
          if (cu.MemGetAddressRange != nullptr &&
              cu.MemGetAddressRange(&base, &size, at) == cu::CUDA_SUCCESS &&
              size > 0) {
            end_of_alloc = size > ~base ? ~cu::CUdeviceptr{0} : base + size;
          } else {
            end_of_alloc = at;  // unknown: merge nothing into this run
          }
        }
        const cu::CUdeviceptr from = static_cast<cu::CUdeviceptr>(c.*device_side);
        if (from + c.nbytes <= end_of_alloc && from + c.nbytes > from) {
          last.nbytes += c.nbytes;
          continue;
        }
      }
    }
    runs.push_back(c);
    end_of_alloc = 0;
  }
  return runs;
}

}  // namespace

CudaEvent::CudaEvent(std::shared_ptr<PrimaryContext> ctx) : ctx_(std::move(ctx)) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());
  // Blocking sync: a thread waiting for the copies sleeps instead of spinning a core.
  CU_TRY(cu.EventCreate(&event_, cu::CU_EVENT_BLOCKING_SYNC | cu::CU_EVENT_DISABLE_TIMING));
}

CudaEvent::~CudaEvent() {
  if (event_ == nullptr || shim::CudaDriver::in_process() == nullptr) {
    return;  // in a forked child the event is the parent's
  }
  try {
    // Destroying an event whose work is pending is allowed: the driver frees it later.
    ScopedContext current(ctx_->get());
    (void)shim::CudaDriver::instance().EventDestroy(event_);
  } catch (...) {
    // Nothing to report to from a destructor.
  }
}

void CudaEvent::record(cu::CUstream stream) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());
  CU_TRY(cu.EventRecord(event_, stream));
}

void CudaEvent::synchronize() const {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());
  CU_TRY(cu.EventSynchronize(event_));
}

bool CudaEvent::query() const {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());
  const cu::CUresult rc = cu.EventQuery(event_);
  if (rc == cu::CUDA_ERROR_NOT_READY) {
    return false;
  }
  CU_TRY(rc);
  return true;
}

void CudaEvent::make_stream_wait(cu::CUstream stream) const {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());
  CU_TRY(cu.StreamWaitEvent(stream, event_, cu::CU_EVENT_WAIT_DEFAULT));
}

CudaCopier::CudaCopier(int device)
    : device_(device), ctx_(std::make_shared<PrimaryContext>(device)) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());
  // Non-blocking: the side stream must not serialise with the legacy default stream.
  CU_TRY(cu.StreamCreate(&stream_, cu::CU_STREAM_NON_BLOCKING));
}

CudaCopier::~CudaCopier() {
  try {
    close();
  } catch (...) {
    // Nothing to report to from a destructor.
  }
}

std::uintptr_t CudaCopier::stream() const {
  SNAP_EXPECT_ARG(stream_ != nullptr, "CudaCopier is closed");
  return reinterpret_cast<std::uintptr_t>(stream_);
}

void CudaCopier::close() {
  if (stream_ == nullptr) {
    return;
  }
  if (shim::CudaDriver::in_process() == nullptr) {
    // A forked child: the stream and the context are the parent's; let go of them only.
    stream_ = nullptr;
    ctx_.reset();
    return;
  }
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  cu::CUstream stream = stream_;
  stream_ = nullptr;
  // Events handed out keep the context alive on their own; the copier lets go of it.
  const std::shared_ptr<PrimaryContext> ctx = std::move(ctx_);
  cu::CUresult rc_sync = cu::CUDA_SUCCESS;
  cu::CUresult rc_destroy = cu::CUDA_SUCCESS;
  {
    ScopedContext current(ctx->get());
    // Copies still in flight must finish before the stream goes away.
    rc_sync = cu.StreamSynchronize(stream);
    rc_destroy = cu.StreamDestroy(stream);
  }
  CU_TRY(rc_sync);
  CU_TRY(rc_destroy);
}

std::unique_ptr<CudaEvent> CudaCopier::d2h(const std::vector<CopySpec>& copies,
                                           std::uintptr_t after_stream) {
  return copy(Direction::DeviceToHost, copies, after_stream);
}

std::unique_ptr<CudaEvent> CudaCopier::h2d(const std::vector<CopySpec>& copies,
                                           std::uintptr_t after_stream) {
  return copy(Direction::HostToDevice, copies, after_stream);
}

std::unique_ptr<CudaEvent> CudaCopier::copy(Direction dir, const std::vector<CopySpec>& copies,
                                            std::uintptr_t after_stream) {
  SNAP_EXPECT_ARG(stream_ != nullptr, "CudaCopier is closed");
  for (const CopySpec& c : copies) {
    SNAP_EXPECT_ARG(c.nbytes == 0 || (c.dst != 0 && c.src != 0),
                    "null address in a copy of " << c.nbytes << " bytes");
  }
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  ScopedContext current(ctx_->get());

  // The side stream starts only after what the caller has queued so far (the values to
  // copy are written by it).
  {
    CudaEvent ready(ctx_);
    ready.record(as_stream(after_stream));
    CU_TRY(cu.StreamWaitEvent(stream_, ready.get(), cu::CU_EVENT_WAIT_DEFAULT));
  }
  try {
    const std::vector<CopySpec> runs =
        coalesce(copies, dir == Direction::DeviceToHost ? &CopySpec::src : &CopySpec::dst);
    const bool batched = runs.size() > 1 && copy_batch(runs);
    for (std::size_t i = 0; !batched && i < runs.size(); ++i) {
      const CopySpec& c = runs[i];
      if (dir == Direction::DeviceToHost) {
        CU_TRY(cu.MemcpyDtoHAsync(reinterpret_cast<void*>(c.dst),
                                  static_cast<cu::CUdeviceptr>(c.src), c.nbytes, stream_));
      } else {
        CU_TRY(cu.MemcpyHtoDAsync(static_cast<cu::CUdeviceptr>(c.dst),
                                  reinterpret_cast<const void*>(c.src), c.nbytes, stream_));
      }
    }
    auto done = std::make_unique<CudaEvent>(ctx_);
    done->record(stream_);
    return done;
  } catch (...) {
    // Some copies may be queued: let them finish so the caller may free its buffers.
    (void)cu.StreamSynchronize(stream_);
    throw;
  }
}

}  // namespace snapcore

namespace snapcore {

bool CudaCopier::copy_batch(const std::vector<CopySpec>& runs) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  if (!batch_ok_ || (cu.MemcpyBatchAsync == nullptr && cu.MemcpyBatchAsyncV1 == nullptr)) {
    return false;
  }
  std::vector<cu::CUdeviceptr> dsts;
  std::vector<cu::CUdeviceptr> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(runs.size());
  srcs.reserve(runs.size());
  sizes.reserve(runs.size());
  for (const CopySpec& c : runs) {  // unified addressing: host pointers are addresses too
    dsts.push_back(static_cast<cu::CUdeviceptr>(c.dst));
    srcs.push_back(static_cast<cu::CUdeviceptr>(c.src));
    sizes.push_back(c.nbytes);
  }
  // One set of attributes for every copy: the source is read in stream order (after the
  // event the side stream waits on), no location hints (they are for managed memory).
  cu::CUmemcpyAttributes attrs{cu::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, {0, 0}, {0, 0}, 0};
  size_t first = 0;
  cu::CUresult rc = cu::CUDA_SUCCESS;
  if (cu.MemcpyBatchAsync != nullptr) {
    rc = cu.MemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), runs.size(), &attrs,
                             &first, 1, stream_);
  } else {
    size_t fail_idx = 0;
    rc = cu.MemcpyBatchAsyncV1(dsts.data(), srcs.data(), sizes.data(), runs.size(), &attrs,
                               &first, 1, &fail_idx, stream_);
  }
  if (rc != cu::CUDA_SUCCESS) {
    batch_ok_ = false;  // one call per copy from now on: each reports its own error
    return false;
  }
  return true;
}

}  // namespace snapcore
