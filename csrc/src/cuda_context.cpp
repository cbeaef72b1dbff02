#include "snapcore/cuda_context.hpp"

#include "snapcore/error.hpp"
#include "snapcore/system.hpp"

namespace snapcore {

PrimaryContext::PrimaryContext(int device) : device_(device) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  SNAP_EXPECT_ARG(device >= 0 && device < cu.device_count(),
                  "CUDA device " << device << " does not exist (" << cu.device_count()
                                 << " device(s))");
  CU_TRY(cu.DeviceGet(&handle_, device));
  CU_TRY(cu.DevicePrimaryCtxRetain(&ctx_, handle_));
}

PrimaryContext::~PrimaryContext() {
  // Nothing to report to from a destructor; the driver keeps the context for other users.
  // In a forked child the retain was the parent's: nothing to release.
  if (const shim::CudaDriver* cu = shim::CudaDriver::in_process()) {
    (void)cu->DevicePrimaryCtxRelease(handle_);
  }
}

ScopedContext::ScopedContext(cu::CUcontext ctx) {
  CU_TRY(shim::CudaDriver::instance().CtxPushCurrent(ctx));
}

ScopedContext::~ScopedContext() {
  cu::CUcontext popped = nullptr;
  if (const shim::CudaDriver* cu = shim::CudaDriver::in_process()) {
    (void)cu->CtxPopCurrent(&popped);
  }
}

int cuda_device_numa_node(int device, const std::string& sysfs_root) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  SNAP_EXPECT_ARG(device >= 0 && device < cu.device_count(),
                  "CUDA device " << device << " does not exist (" << cu.device_count()
                                 << " device(s))");
  cu::CUdevice handle = 0;
  CU_TRY(cu.DeviceGet(&handle, device));
  char bus_id[64] = {};
  CU_TRY(cu.DeviceGetPCIBusId(bus_id, sizeof(bus_id) - 1, handle));
  return pci_numa_node(bus_id, sysfs_root);
}

}  // namespace snapcore
