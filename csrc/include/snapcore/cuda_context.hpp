// A device's primary context, held for as long as snapcore uses it, and a scope guard
// that makes it current on the calling thread.
#pragma once

#include <string>

#include "snapcore/shim/cuda.hpp"

namespace snapcore {

// Retains the primary context of `device` (the one PyTorch and the runtime API use), so
// that streams, events and pinned registrations made in it stay valid while this lives.
class PrimaryContext {
 public:
  explicit PrimaryContext(int device);  // throws CudaError
  ~PrimaryContext();
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;

  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] cu::CUcontext get() const noexcept { return ctx_; }

 private:
  int device_;
  cu::CUdevice handle_ = 0;
  cu::CUcontext ctx_ = nullptr;
};

// Pushes a context on this thread's stack for the scope; pops it at the end.
class ScopedContext {
 public:
  explicit ScopedContext(cu::CUcontext ctx);  // throws CudaError
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
};

// The NUMA node of CUDA device `device` (its PCI bus id from the driver, then sysfs's
// numa_node under `sysfs_root`); -1 on a machine of one node. Throws CudaError.
int cuda_device_numa_node(int device,
                          const std::string& sysfs_root = "/sys/bus/pci/devices");

}  // namespace snapcore
