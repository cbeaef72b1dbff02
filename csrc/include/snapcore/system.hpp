// Facts about the machine that the other parts size their work by.
#pragma once

#include <cstddef>
#include <string>

namespace snapcore {

// The virtual-memory page size; also the alignment used for O_DIRECT.
std::size_t page_size() noexcept;

// CPUs this process may run on (its affinity mask, so a container's or taskset's limit
// counts), at least 1.
std::size_t hardware_threads() noexcept;

// `threads` when positive, else hardware_threads().
std::size_t resolve_threads(std::size_t threads) noexcept;

// The NUMA node of a PCI device, from <sysfs_root>/<bus id>/numa_node; -1 when the file is
// missing or says -1 (a machine of one node). `bus_id` as the CUDA driver gives it
// ("0000:3B:00.0", or with an 8-digit domain): matched in lowercase, 4-digit domain.
int pci_numa_node(const std::string& bus_id,
                  const std::string& sysfs_root = "/sys/bus/pci/devices") noexcept;

// Makes `node` the preferred NUMA node of the pages of [addr, addr + len) not yet faulted
// (mbind MPOL_PREFERRED through libnuma.so.1, loaded at run time). Returns an empty string
// on success, else why not (no libnuma, NUMA unavailable, mbind's error).
std::string prefer_numa_node(void* addr, std::size_t len, int node) noexcept;

inline std::size_t round_up(std::size_t n, std::size_t multiple) noexcept {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace snapcore
