#include "snapcore/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <mutex>
#include <sstream>

#include "snapcore/error.hpp"
#include "snapcore/system.hpp"
#include "snapcore/thread_pool.hpp"

namespace snapcore {

namespace {

// Linux moves at most this much in one read or write call.
constexpr std::size_t kMaxIo = 0x7ffff000;
// Reads smaller than this per thread are not split.
constexpr std::size_t kMinReadPerThread = std::size_t{16} << 20;

std::string at(std::uint64_t offset, std::size_t nbytes) {
  std::ostringstream os;
  os << " (" << nbytes << " bytes at offset " << offset << ")";
  return os.str();
}

void check_range(std::uint64_t offset, std::size_t nbytes) {
  constexpr auto kMaxOff = static_cast<std::uint64_t>(std::numeric_limits<off_t>::max());
  SNAP_EXPECT_ARG(offset <= kMaxOff && nbytes <= kMaxOff - offset,
                  "offset " << offset << " + " << nbytes << " bytes is past the largest file");
}

// Reads [offset, offset + nbytes) of `fd`, retrying short reads and EINTR.
void pread_all(int fd, char* dst, std::size_t nbytes, std::uint64_t offset,
               const std::string& path) {
  while (nbytes > 0) {
    const ssize_t n = ::pread(fd, dst, std::min(nbytes, kMaxIo), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      SYSCALL_CHECK(-1, "pread" + at(offset, nbytes), path);
    }
    if (n == 0) {
      SNAP_EXPECT(false, "truncated: " << path << " ended at offset " << offset << ", "
                                       << nbytes << " more bytes expected");
    }
    dst += n;
    nbytes -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

// Closes a descriptor on scope exit.
struct Fd {
  int fd;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

}  // namespace

FileWriter::FileWriter(std::string path, bool direct, bool truncate) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | (truncate ? O_TRUNC : 0) | O_CLOEXEC, 0644);
  SYSCALL_CHECK(fd_, "open for writing", path_);
  if (direct) {
    direct_fd_ = ::open(path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
    if (direct_fd_ < 0) {
      const int err = errno;
      if (err != EINVAL) {
        ::close(fd_);
        fd_ = -1;
        detail::throw_io_error(err, "open with O_DIRECT", path_, __FILE__, __LINE__);
      }
      // This file system has no O_DIRECT: stay buffered.
    }
  }
  direct_.store(direct_fd_ >= 0);
}

FileWriter::~FileWriter() {
  try {
    close();
  } catch (...) {
    // Nothing to report to from a destructor.
  }
}

void FileWriter::write_buffered(std::uint64_t offset, const char* src, std::size_t nbytes) {
  while (nbytes > 0) {
    const ssize_t n = ::pwrite(fd_, src, std::min(nbytes, kMaxIo), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      SYSCALL_CHECK(-1, "pwrite" + at(offset, nbytes), path_);
    }
    if (n == 0) {
      detail::throw_io_error(EIO, "pwrite wrote nothing" + at(offset, nbytes), path_, __FILE__,
                             __LINE__);
    }
    src += n;
    nbytes -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
    bytes_written_.fetch_add(static_cast<std::uint64_t>(n));
  }
}

// `offset`, `src` and `nbytes` are multiples of the page size here.
void FileWriter::write_direct(std::uint64_t offset, const char* src, std::size_t nbytes) {
  const std::size_t page = page_size();
  while (nbytes > 0) {
    if (!direct_.load(std::memory_order_relaxed)) {
      write_buffered(offset, src, nbytes);
      return;
    }
    const std::size_t piece = std::min(nbytes, kDirectPiece);
    const ssize_t n = ::pwrite(direct_fd_, src, piece, static_cast<off_t>(offset));
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) {
        continue;
      }
      if (err == EINVAL) {
        // Opened fine but refuses the I/O (alignment rules stricter than a page, some
        // FUSE and network file systems): use the page cache from now on.
        direct_.store(false);
        continue;
      }
      detail::throw_io_error(err, "pwrite (O_DIRECT)" + at(offset, piece), path_, __FILE__,
                             __LINE__);
    }
    if (n == 0) {
      detail::throw_io_error(EIO, "pwrite (O_DIRECT) wrote nothing" + at(offset, piece),
                             path_, __FILE__, __LINE__);
    }
    src += n;
    nbytes -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
    bytes_written_.fetch_add(static_cast<std::uint64_t>(n));
    if (static_cast<std::size_t>(n) % page != 0) {
      // A short write left the rest unaligned: O_DIRECT cannot take it.
      write_buffered(offset, src, nbytes);
      return;
    }
  }
}

void FileWriter::write_at(std::uint64_t offset, const void* src, std::size_t nbytes) {
  std::shared_lock<std::shared_mutex> lock(lifecycle_);
  SNAP_EXPECT_ARG(fd_ >= 0, "FileWriter for " << path_ << " is closed");
  check_range(offset, nbytes);
  if (nbytes == 0) {
    return;
  }
  SNAP_EXPECT_ARG(src != nullptr, "write_at: null address");
  const char* p = static_cast<const char*>(src);
  const std::size_t page = page_size();
  const auto addr = reinterpret_cast<std::uintptr_t>(p);

  if (!direct_.load() || addr % page != offset % page) {
    write_buffered(offset, p, nbytes);
    return;
  }
  // Head up to the first page boundary, aligned middle, tail after the last one.
  const std::size_t head = std::min<std::size_t>(nbytes, (page - offset % page) % page);
  const std::size_t middle = (nbytes - head) / page * page;
  const std::size_t tail = nbytes - head - middle;
  if (head > 0) {
    write_buffered(offset, p, head);
  }
  if (middle > 0) {
    write_direct(offset + head, p + head, middle);
  }
  if (tail > 0) {
    write_buffered(offset + head + middle, p + head + middle, tail);
  }
}

void FileWriter::sync() {
  std::shared_lock<std::shared_mutex> lock(lifecycle_);
  SNAP_EXPECT_ARG(fd_ >= 0, "FileWriter for " << path_ << " is closed");
  // Both descriptors name the same inode, so one fdatasync covers the data written through
  // either; O_DIRECT writes may still sit in the device cache until it.
  SYSCALL_CHECK(::fdatasync(fd_), "fdatasync", path_);
  if (direct_fd_ >= 0) {
    SYSCALL_CHECK(::fdatasync(direct_fd_), "fdatasync (O_DIRECT descriptor)", path_);
  }
}

void FileWriter::close() {
  std::unique_lock<std::shared_mutex> lock(lifecycle_);
  int err = 0;
  if (direct_fd_ >= 0) {
    if (::close(direct_fd_) != 0) {
      err = errno;
    }
    direct_fd_ = -1;
  }
  if (fd_ >= 0) {
    // Linux always releases the descriptor, even when close() reports a deferred error.
    if (::close(fd_) != 0 && err == 0) {
      err = errno;
    }
    fd_ = -1;
  }
  if (err != 0 && err != EINTR) {
    detail::throw_io_error(err, "close", path_, __FILE__, __LINE__);
  }
}

void read_into(const std::string& path, std::uint64_t offset, std::size_t nbytes, void* dst,
               std::size_t threads) {
  check_range(offset, nbytes);
  SNAP_EXPECT_ARG(dst != nullptr || nbytes == 0, "read_into: null address");
  // O_NONBLOCK: a FIFO put where a data file should be must not block the open; it is
  // refused below (only regular files are data files). Regular files ignore the flag.
  Fd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  SYSCALL_CHECK(file.fd, "open for reading", path);

  struct stat st {};
  SYSCALL_CHECK(::fstat(file.fd, &st), "fstat", path);
  SNAP_EXPECT(S_ISREG(st.st_mode), "not a regular file: " << path);
  const auto size = static_cast<std::uint64_t>(st.st_size);
  SNAP_EXPECT(size >= offset + nbytes,
              "truncated: " << path << " has " << size << " bytes, need " << offset + nbytes);
  if (nbytes == 0) {
    return;
  }
  // Advice only: a file system that ignores it reads correctly all the same.
  (void)::posix_fadvise(file.fd, static_cast<off_t>(offset), static_cast<off_t>(nbytes),
                        POSIX_FADV_SEQUENTIAL);

  char* out = static_cast<char*>(dst);
  const std::size_t workers =
      std::clamp<std::size_t>(nbytes / kMinReadPerThread, 1, resolve_threads(threads));
  const std::size_t share = round_up((nbytes + workers - 1) / workers, page_size());
  const std::size_t parts = (nbytes + share - 1) / share;
  parallel_for(parts, parts, [&](std::size_t i) {
    const std::size_t begin = i * share;
    pread_all(file.fd, out + begin, std::min(share, nbytes - begin), offset + begin, path);
  });
}

bool drop_page_cache(const std::string& path) {
  Fd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  SYSCALL_CHECK(file.fd, "open", path);
  // Dirty pages cannot be dropped: write them back first. Some special files answer
  // EINVAL, which leaves nothing to write back.
  if (::fdatasync(file.fd) != 0 && errno != EINVAL) {
    return false;
  }
  return ::posix_fadvise(file.fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
}

}  // namespace snapcore
