#include "snapcore/arena.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "snapcore/cuda_context.hpp"
#include "snapcore/error.hpp"
#include "snapcore/shim/cuda.hpp"
#include "snapcore/system.hpp"
#include "snapcore/thread_pool.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL
#endif

namespace snapcore {

namespace {

constexpr std::size_t kHugePage = std::size_t{2} << 20;
// Prefaulting less than this per thread is not worth waking a thread.
constexpr std::size_t kMinPrefaultPerThread = std::size_t{64} << 20;

std::string describe(const std::optional<std::string>& shm_path) {
  return shm_path ? *shm_path : std::string("<anonymous>");
}

// Touches one byte per page, writing back what it read, so that a shared file that
// already holds data keeps it.
void touch_pages(char* begin, std::size_t len, std::size_t page) {
  for (std::size_t off = 0; off < len; off += page) {
    volatile char* p = begin + off;
    *p = *p;
  }
}

}  // namespace

Arena::Arena(std::size_t size, ArenaOptions options)
    : size_(size), shm_path_(std::move(options.shm_path)) {
  SNAP_EXPECT_ARG(size > 0, "Arena size must be positive");
  held_ = round_up(size, page_size());
  SNAP_EXPECT_ARG(held_ >= size, "Arena size " << size << " is too large");
  try {
    map(options.huge_pages);
    if (options.numa_node >= 0) {  // before the first fault: the policy places new pages
      std::string why = prefer_numa_node(base_, held_, options.numa_node);
      if (why.empty()) {
        numa_node_ = options.numa_node;
      } else {
        numa_error_ = std::move(why);  // placement is an optimisation: go on without it
      }
    }
    if (options.prefault) {
      prefault(options.threads);
    }
    if (options.pin && shim::CudaDriver::is_available()) {
      try {
        pin(options.device);
      } catch (const CudaError& e) {
        pin_error_ = e.what();  // unpinned memory works, slower; the caller warns
      }
    }
  } catch (...) {
    try {
      close();
    } catch (...) {
      // The first failure is the one worth reporting.
    }
    throw;
  }
}

Arena::~Arena() {
  try {
    close();
  } catch (...) {
    // A destructor has no one to report to; close() explicitly to see failures.
  }
}

std::uintptr_t Arena::address() const {
  SNAP_EXPECT_ARG(base_ != nullptr, "Arena is closed");
  return reinterpret_cast<std::uintptr_t>(base_);
}

void Arena::map(bool huge_pages) {
  const std::string what = describe(shm_path_);
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
  if (shm_path_) {
    fd_ = ::open(shm_path_->c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    SYSCALL_CHECK(fd_, "open arena file", what);
    SYSCALL_CHECK(::ftruncate(fd_, static_cast<off_t>(held_)), "ftruncate arena file", what);
    flags = MAP_SHARED;
  }

  // Transparent huge pages need 2 MiB-aligned virtual addresses: reserve a larger range
  // with no access, map the arena at an aligned address inside it, return the rest.
  const bool align = huge_pages && held_ >= kHugePage;
  void* base = nullptr;
  if (align) {
    const std::size_t span = held_ + kHugePage;
    void* reserve =
        ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    SYSCALL_CHECK(reserve == MAP_FAILED ? -1 : 0, "mmap reserve for arena", what);
    const auto start = reinterpret_cast<std::uintptr_t>(reserve);
    const std::uintptr_t aligned = (start + kHugePage - 1) & ~(std::uintptr_t{kHugePage} - 1);
    base = ::mmap(reinterpret_cast<void*>(aligned), held_, PROT_READ | PROT_WRITE,
                  flags | MAP_FIXED, fd_, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      ::munmap(reserve, span);
      detail::throw_io_error(err, "mmap arena", what, __FILE__, __LINE__);
    }
    if (aligned > start) {
      ::munmap(reserve, aligned - start);
    }
    const std::uintptr_t end = aligned + held_;
    if (start + span > end) {
      ::munmap(reinterpret_cast<void*>(end), start + span - end);
    }
  } else {
    base = ::mmap(nullptr, held_, PROT_READ | PROT_WRITE, flags, fd_, 0);
    SYSCALL_CHECK(base == MAP_FAILED ? -1 : 0, "mmap arena", what);
  }
  base_ = base;
  owner_pid_ = static_cast<long>(::getpid());

  if (!shm_path_) {
    // Private memory that fork() would copy into every child, all at once once pinned.
    SYSCALL_CHECK(::madvise(base_, held_, MADV_DONTFORK), "madvise MADV_DONTFORK", what);
    dontfork_ = true;
  }
  if (huge_pages) {
    huge_pages_ = ::madvise(base_, held_, MADV_HUGEPAGE) == 0;
  }
}

void Arena::prefault(std::size_t threads) {
  const std::size_t page = page_size();
  const std::size_t workers =
      std::clamp<std::size_t>(held_ / kMinPrefaultPerThread, 1, resolve_threads(threads));
  const std::size_t share = round_up((held_ + workers - 1) / workers, page);
  const std::size_t parts = (held_ + share - 1) / share;
  char* const base = static_cast<char*>(base_);
  const std::string what = describe(shm_path_);

  parallel_for(parts, parts, [&](std::size_t i) {
    char* begin = base + i * share;
    const std::size_t len = std::min(share, held_ - i * share);
    // MADV_POPULATE_WRITE faults the range in the kernel and, unlike a store, reports a
    // full /dev/shm as an error instead of a SIGBUS.
    if (::madvise(begin, len, MADV_POPULATE_WRITE) == 0) {
      return;
    }
    const int err = errno;
    if (err == EINVAL) {  // kernel older than 5.14
      touch_pages(begin, len, page);
      return;
    }
    detail::throw_io_error(err, "prefault arena (madvise MADV_POPULATE_WRITE)", what,
                           __FILE__, __LINE__);
  });
}

void Arena::pin(int device) {
  const shim::CudaDriver& cu = shim::CudaDriver::instance();
  auto ctx = std::make_unique<PrimaryContext>(device);
  {
    ScopedContext current(ctx->get());
    CU_TRY(cu.MemHostRegister(base_, held_, cu::CU_MEMHOSTREGISTER_PORTABLE));
  }
  pin_ctx_ = std::move(ctx);
  pinned_ = true;
}

void Arena::close() {
  std::exception_ptr first;
  const bool forked = owner_pid_ != 0 && owner_pid_ != static_cast<long>(::getpid());
  if (pinned_) {
    pinned_ = false;
    // In a forked child the registration is the parent's (and CUDA is unusable).
    if (const shim::CudaDriver* cu = shim::CudaDriver::in_process(); cu != nullptr && !forked) {
      try {
        ScopedContext current(pin_ctx_->get());
        CU_TRY(cu->MemHostUnregister(base_));
      } catch (...) {
        first = std::current_exception();
      }
    }
    pin_ctx_.reset();
  }
  if (base_ != nullptr && dontfork_ && forked) {
    base_ = nullptr;  // never mapped in this child; the range may hold its own mappings now
  }
  if (base_ != nullptr) {
    const int rc = ::munmap(base_, held_);
    base_ = nullptr;
    if (rc != 0 && !first) {
      try {
        SYSCALL_CHECK(rc, "munmap arena", describe(shm_path_));
      } catch (...) {
        first = std::current_exception();
      }
    }
  }
  if (fd_ >= 0) {
    // close() of a file we only mapped cannot lose data; its result is not interesting.
    ::close(fd_);
    fd_ = -1;
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

}  // namespace snapcore
