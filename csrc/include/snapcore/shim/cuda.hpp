// Run-time loader of the CUDA driver (libcuda.so.1).
//
// snapcore is built without the CUDA toolkit: the few driver types and constants it
// needs are declared here, and the functions are resolved with dlsym into one table the
// first time CUDA is asked for. A machine without a driver or a GPU runs the same build
// and reports why CUDA is unavailable.
#pragma once

#include <string>

namespace snapcore::cu {

// Driver types as cuda.h declares them (ABI-compatible, no cuda.h needed).
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;
inline constexpr CUresult CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712;

inline constexpr unsigned int CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr unsigned int CU_EVENT_BLOCKING_SYNC = 0x1;
inline constexpr unsigned int CU_EVENT_DISABLE_TIMING = 0x2;
inline constexpr unsigned int CU_EVENT_WAIT_DEFAULT = 0x0;
inline constexpr unsigned int CU_MEMHOSTREGISTER_PORTABLE = 0x1;

// cuMemcpyBatchAsync (CUDA 12.8+): a batch of pointer-to-pointer copies, one call.
struct CUmemLocation {
  int type;  // CUmemLocationType; 0 (invalid) = no hint
  int id;
};
struct CUmemcpyAttributes {
  int srcAccessOrder;  // CUmemcpySrcAccessOrder
  CUmemLocation srcLocHint;
  CUmemLocation dstLocHint;
  unsigned int flags;
};
inline constexpr int CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1;

}  // namespace snapcore::cu

namespace snapcore::shim {

// The table of driver entry points. The names drop the `cu` prefix and the `_v2`
// suffix; where the driver exports a `_v2` symbol, that is the one resolved, as cuda.h
// would pick it. Stream arguments use the legacy default-stream semantics (handle 0).
class CudaDriver {
 public:
  // The loaded driver; throws snapcore::CudaError saying why when it is unavailable.
  static const CudaDriver& instance();
  // The loaded driver, or null when it is unavailable in this process. Never throws: for
  // destructors and clean-up, which must not call the driver in a forked child.
  static const CudaDriver* in_process() noexcept;
  // Whether the driver loaded, cuInit succeeded and at least one device exists, in this
  // process: a child forked after the driver was loaded has no usable CUDA (contexts,
  // streams and registrations do not survive fork). Never throws.
  static bool is_available() noexcept;
  // "ok: N device(s)" or the reason CUDA is unavailable. Never throws.
  static std::string status() noexcept;

  int device_count() const noexcept { return device_count_; }

  using CUresult = cu::CUresult;
  CUresult (*Init)(unsigned int flags) = nullptr;
  CUresult (*DeviceGet)(cu::CUdevice* device, int ordinal) = nullptr;
  CUresult (*DeviceGetCount)(int* count) = nullptr;
  CUresult (*DeviceGetPCIBusId)(char* bus_id, int len, cu::CUdevice dev) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(cu::CUcontext* ctx, cu::CUdevice dev) = nullptr;
  CUresult (*DevicePrimaryCtxRelease)(cu::CUdevice dev) = nullptr;
  CUresult (*CtxPushCurrent)(cu::CUcontext ctx) = nullptr;
  CUresult (*CtxPopCurrent)(cu::CUcontext* ctx) = nullptr;
  CUresult (*StreamCreate)(cu::CUstream* stream, unsigned int flags) = nullptr;
  CUresult (*StreamDestroy)(cu::CUstream stream) = nullptr;
  CUresult (*StreamWaitEvent)(cu::CUstream stream, cu::CUevent event, unsigned int flags) =
      nullptr;
  CUresult (*StreamSynchronize)(cu::CUstream stream) = nullptr;
  CUresult (*EventCreate)(cu::CUevent* event, unsigned int flags) = nullptr;
  CUresult (*EventRecord)(cu::CUevent event, cu::CUstream stream) = nullptr;
  CUresult (*EventSynchronize)(cu::CUevent event) = nullptr;
  CUresult (*EventQuery)(cu::CUevent event) = nullptr;
  CUresult (*EventDestroy)(cu::CUevent event) = nullptr;
  CUresult (*MemcpyDtoHAsync)(void* dst_host, cu::CUdeviceptr src_device, size_t nbytes,
                              cu::CUstream stream) = nullptr;
  CUresult (*MemcpyHtoDAsync)(cu::CUdeviceptr dst_device, const void* src_host, size_t nbytes,
                              cu::CUstream stream) = nullptr;
  // Optional (null when the driver lacks them): cuMemcpyBatchAsync_v2 (CUDA 13 drivers,
  // no failIdx) and cuMemcpyBatchAsync (CUDA 12.8-12.9, with failIdx).
  CUresult (*MemcpyBatchAsync)(cu::CUdeviceptr* dsts, cu::CUdeviceptr* srcs, size_t* sizes,
                               size_t count, cu::CUmemcpyAttributes* attrs, size_t* attrs_idxs,
                               size_t num_attrs, cu::CUstream stream) = nullptr;
  CUresult (*MemcpyBatchAsyncV1)(cu::CUdeviceptr* dsts, cu::CUdeviceptr* srcs, size_t* sizes,
                                 size_t count, cu::CUmemcpyAttributes* attrs,
                                 size_t* attrs_idxs, size_t num_attrs, size_t* fail_idx,
                                 cu::CUstream stream) = nullptr;
  // The allocation holding a device address (its base and size): copies are merged only
  // within one, since a copy that crosses two allocations is invalid even where they
  // happen to be adjacent.
  CUresult (*MemGetAddressRange)(cu::CUdeviceptr* base, size_t* size, cu::CUdeviceptr ptr) =
      nullptr;
  CUresult (*MemHostRegister)(void* ptr, size_t nbytes, unsigned int flags) = nullptr;
  CUresult (*MemHostUnregister)(void* ptr) = nullptr;
  CUresult (*GetErrorName)(CUresult error, const char** name) = nullptr;
  CUresult (*GetErrorString)(CUresult error, const char** text) = nullptr;

 private:
  friend struct CudaDriverLoader;
  CudaDriver() = default;
  int device_count_ = 0;
};

// "CUDA_ERROR_X (code): description", using the driver's own names when it is loaded.
std::string cuda_error_text(cu::CUresult rc) noexcept;

[[noreturn]] void throw_cuda_error(cu::CUresult rc, const char* call, const char* file,
                                   int line);

}  // namespace snapcore::shim

// Calls a driver function through the table; throws snapcore::CudaError naming the call,
// the driver's error name and the source line when it does not return CUDA_SUCCESS.
#define CU_TRY(call)                                                                  \
  do {                                                                                \
    const ::snapcore::cu::CUresult snap_rc_ = (call);                                 \
    if (snap_rc_ != ::snapcore::cu::CUDA_SUCCESS) {                                   \
      ::snapcore::shim::throw_cuda_error(snap_rc_, #call, __FILE__, __LINE__);        \
    }                                                                                 \
  } while (0)
