#include "snapcore/shim/cuda.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <sstream>
#include <utility>

#include "snapcore/error.hpp"

namespace snapcore::shim {

// Loads the driver once; holds either a complete table or the reason there is none.
struct CudaDriverLoader {
  CudaDriver driver;
  bool ok = false;
  std::string reason;
  // The process that loaded the driver: in a child forked from it CUDA is unusable.
  pid_t pid = ::getpid();

  CudaDriverLoader() {
    try {
      load();
      ok = true;
    } catch (const std::exception& e) {
      reason = e.what();
    }
  }

  template <typename Fn>
  static void resolve(void* lib, Fn& fn, const char* name) {
    // dlerror() is reset first so a null from dlsym can be told apart from a failure.
    dlerror();
    void* sym = dlsym(lib, name);
    if (sym == nullptr) {
      const char* err = dlerror();
      throw Error(std::string("libcuda.so.1 has no symbol ") + name +
                  " (driver too old?): " + (err != nullptr ? err : "null"));
    }
    fn = reinterpret_cast<Fn>(sym);
  }

  // A symbol that newer drivers have: null when this one lacks it.
  template <typename Fn>
  static void resolve_optional(void* lib, Fn& fn, const char* name) {
    dlerror();
    fn = reinterpret_cast<Fn>(dlsym(lib, name));
  }

  void load() {
    // RTLD_NODELETE: the driver stays mapped even if this table is torn down at exit while
    // other threads (or torch) still use it.
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL | RTLD_NODELETE);
    if (lib == nullptr) {
      const char* err = dlerror();
      throw Error(std::string("libcuda.so.1 not found: ") + (err != nullptr ? err : "?"));
    }
    CudaDriver& d = driver;
    resolve(lib, d.Init, "cuInit");
    resolve(lib, d.DeviceGet, "cuDeviceGet");
    resolve(lib, d.DeviceGetCount, "cuDeviceGetCount");
    resolve(lib, d.DeviceGetPCIBusId, "cuDeviceGetPCIBusId");
    resolve(lib, d.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    resolve(lib, d.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    resolve(lib, d.CtxPushCurrent, "cuCtxPushCurrent_v2");
    resolve(lib, d.CtxPopCurrent, "cuCtxPopCurrent_v2");
    resolve(lib, d.StreamCreate, "cuStreamCreate");
    resolve(lib, d.StreamDestroy, "cuStreamDestroy_v2");
    resolve(lib, d.StreamWaitEvent, "cuStreamWaitEvent");
    resolve(lib, d.StreamSynchronize, "cuStreamSynchronize");
    resolve(lib, d.EventCreate, "cuEventCreate");
    resolve(lib, d.EventRecord, "cuEventRecord");
    resolve(lib, d.EventSynchronize, "cuEventSynchronize");
    resolve(lib, d.EventQuery, "cuEventQuery");
    resolve(lib, d.EventDestroy, "cuEventDestroy_v2");
    resolve(lib, d.MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    resolve(lib, d.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    resolve_optional(lib, d.MemcpyBatchAsync, "cuMemcpyBatchAsync_v2");
    if (d.MemcpyBatchAsync == nullptr) {
      resolve_optional(lib, d.MemcpyBatchAsyncV1, "cuMemcpyBatchAsync");
    }
    resolve(lib, d.MemGetAddressRange, "cuMemGetAddressRange_v2");
    resolve(lib, d.MemHostRegister, "cuMemHostRegister_v2");
    resolve(lib, d.MemHostUnregister, "cuMemHostUnregister");
    resolve(lib, d.GetErrorName, "cuGetErrorName");
    resolve(lib, d.GetErrorString, "cuGetErrorString");

    const cu::CUresult rc = d.Init(0);
    if (rc != cu::CUDA_SUCCESS) {
      throw Error("cuInit failed: " + describe(rc));
    }
    int count = 0;
    const cu::CUresult rc_count = d.DeviceGetCount(&count);
    if (rc_count != cu::CUDA_SUCCESS) {
      throw Error("cuDeviceGetCount failed: " + describe(rc_count));
    }
    if (count <= 0) {
      throw Error("the CUDA driver sees no device");
    }
    d.device_count_ = count;
  }

  // Error text from the driver's own tables; usable before `ok` is set.
  bool forked() const noexcept { return pid != ::getpid(); }

  std::string describe(cu::CUresult rc) const noexcept {
    try {
      const char* name = nullptr;
      const char* text = nullptr;
      if (driver.GetErrorName == nullptr || driver.GetErrorName(rc, &name) != 0) {
        name = nullptr;
      }
      if (driver.GetErrorString == nullptr || driver.GetErrorString(rc, &text) != 0) {
        text = nullptr;
      }
      std::ostringstream os;
      os << (name != nullptr ? name : "CUDA_ERROR_UNKNOWN") << " (" << rc << ")";
      if (text != nullptr) {
        os << ": " << text;
      }
      return os.str();
    } catch (...) {
      return "CUDA error";
    }
  }
};

namespace {
// Built on first use, thread-safely (C++11 static initialisation); never destroyed
// before the process exits.
CudaDriverLoader& loader() {
  static CudaDriverLoader* instance = new CudaDriverLoader();
  return *instance;
}

constexpr const char* kForked =
    "this process was forked from the one that loaded the CUDA driver (CUDA does not "
    "survive fork)";

}  // namespace

const CudaDriver& CudaDriver::instance() {
  CudaDriverLoader& l = loader();
  if (!l.ok) {
    throw CudaError(-1, "CUDA is unavailable: " + l.reason);
  }
  if (l.forked()) {
    throw CudaError(-1, std::string("CUDA is unavailable: ") + kForked);
  }
  return l.driver;
}

const CudaDriver* CudaDriver::in_process() noexcept {
  try {
    CudaDriverLoader& l = loader();
    return l.ok && !l.forked() ? &l.driver : nullptr;
  } catch (...) {
    return nullptr;
  }
}

bool CudaDriver::is_available() noexcept { return in_process() != nullptr; }

std::string CudaDriver::status() noexcept {
  try {
    CudaDriverLoader& l = loader();
    if (l.ok && l.forked()) {
      return kForked;
    }
    if (l.ok) {
      return "ok: " + std::to_string(l.driver.device_count()) + " device(s)";
    }
    return l.reason;
  } catch (...) {
    return "unknown error while loading the CUDA driver";
  }
}

std::string cuda_error_text(cu::CUresult rc) noexcept { return loader().describe(rc); }

void throw_cuda_error(cu::CUresult rc, const char* call, const char* file, int line) {
  std::ostringstream os;
  os << call << " failed: " << cuda_error_text(rc) << " [" << detail::where(file, line)
     << "]";
  throw CudaError(rc, os.str());
}

}  // namespace snapcore::shim
