// The host arena: one block of host memory, sized exactly, optionally backed by a shared
// memory file, prefaulted and pinned once, then reused for every snapshot. An anonymous
// arena is not inherited by fork() (MADV_DONTFORK): fork would copy its pinned pages at
// once into every child (a DataLoader worker), which never needs them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace snapcore {

class PrimaryContext;

struct ArenaOptions {
  // Map this file (e.g. under /dev/shm) MAP_SHARED instead of anonymous memory. The file
  // is created (0600) if needed, sized to the arena, and never unlinked by the arena.
  std::optional<std::string> shm_path;
  bool huge_pages = true;  // madvise(MADV_HUGEPAGE); failure is recorded, not raised
  bool pin = true;         // cuMemHostRegister when CUDA is available
  // The device whose primary context registers the memory (PORTABLE: every context may
  // use it). The one the state lives on: a context of its own on another GPU costs memory
  // there, and fails where that GPU is in EXCLUSIVE_PROCESS mode.
  int device = 0;
  // The NUMA node its pages should come from (the GPU's: see cuda_device_numa_node), made
  // their preferred node before they are faulted; -1 = the kernel's default placement.
  int numa_node = -1;
  bool prefault = true;    // touch every page now, in parallel
  std::size_t threads = 0;  // for prefaulting; 0 = hardware_threads()
};

class Arena {
 public:
  // Maps round_up(size, page_size()) bytes. Throws std::invalid_argument for size 0 or a
  // device that does not exist, IoError when a system call fails. When the driver refuses
  // to pin (locked-memory limits, a GPU in EXCLUSIVE_PROCESS mode), the arena stays
  // unpinned and pin_error() says why: staging is slower, not impossible.
  Arena(std::size_t size, ArenaOptions options);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Unpins, unmaps and closes the file; idempotent. Every step runs even if an earlier
  // one failed; the first failure is then thrown.
  void close();

  [[nodiscard]] std::uintptr_t address() const;  // throws std::invalid_argument once closed
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::size_t bytes_held() const noexcept { return held_; }
  [[nodiscard]] std::size_t bytes_pinned() const noexcept { return pinned_ ? held_ : 0; }
  [[nodiscard]] bool pinned() const noexcept { return pinned_; }
  [[nodiscard]] bool huge_pages() const noexcept { return huge_pages_; }
  // Why pinning was asked for, with CUDA available, and failed; nullopt otherwise.
  [[nodiscard]] const std::optional<std::string>& pin_error() const noexcept {
    return pin_error_;
  }
  // The NUMA node its pages were placed on (preferred), or -1; numa_error() says why a
  // node asked for was not used.
  [[nodiscard]] int numa_node() const noexcept { return numa_node_; }
  [[nodiscard]] const std::optional<std::string>& numa_error() const noexcept {
    return numa_error_;
  }
  [[nodiscard]] bool closed() const noexcept { return base_ == nullptr; }
  [[nodiscard]] const std::optional<std::string>& shm_path() const noexcept {
    return shm_path_;
  }

 private:
  void map(bool huge_pages);
  void prefault(std::size_t threads);
  void pin(int device);

  std::size_t size_ = 0;
  std::size_t held_ = 0;
  std::optional<std::string> shm_path_;
  int fd_ = -1;
  void* base_ = nullptr;
  // Anonymous arenas are MADV_DONTFORK: a forked child does not have them mapped, and must
  // not unmap their range (which it may have reused) when it frees its copy of this object.
  bool dontfork_ = false;
  long owner_pid_ = 0;
  bool huge_pages_ = false;
  int numa_node_ = -1;
  std::optional<std::string> numa_error_;
  bool pinned_ = false;
  std::optional<std::string> pin_error_;
  std::unique_ptr<PrimaryContext> pin_ctx_;  // held while the registration lives
};

}  // namespace snapcore
