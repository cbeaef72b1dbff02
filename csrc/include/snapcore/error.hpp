// Exception types of the native core and the macros that raise them.
//
// The macros add the source file and line, and build their message only when the check
// fails, so a check on a hot path costs one branch.
#pragma once

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace snapcore {

// A failure that is neither I/O nor CUDA: a broken invariant, a truncated file.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An operating-system call on a file or mapping failed; keeps errno and the path.
class IoError : public Error {
 public:
  IoError(int err, const std::string& message, std::string path)
      : Error(message), errno_(err), path_(std::move(path)) {}
  [[nodiscard]] int error_code() const noexcept { return errno_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  int errno_;
  std::string path_;
};

// A CUDA driver call failed, or CUDA is needed and unavailable (code -1 then).
class CudaError : public Error {
 public:
  CudaError(int code, const std::string& message) : Error(message), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

namespace detail {

// "file.cpp:123" with the directories stripped: enough to find the check, and stable
// across build trees.
std::string where(const char* file, int line);

[[noreturn]] void throw_io_error(int err, const std::string& what, const std::string& path,
                                 const char* file, int line);

}  // namespace detail
}  // namespace snapcore

// Throws snapcore::Error when `cond` is false. `msg` may be a stream expression:
// SNAP_EXPECT(n > 0, "bad count " << n).
#define SNAP_EXPECT(cond, msg)                                                  \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::ostringstream snap_os_;                                              \
      snap_os_ << msg << " [" << ::snapcore::detail::where(__FILE__, __LINE__) \
               << "]";                                                          \
      throw ::snapcore::Error(snap_os_.str());                                  \
    }                                                                           \
  } while (0)

// Like SNAP_EXPECT, for a bad argument from the caller (ValueError in Python).
#define SNAP_EXPECT_ARG(cond, msg)                 \
  do {                                             \
    if (!(cond)) {                                 \
      std::ostringstream snap_os_;                 \
      snap_os_ << msg;                             \
      throw std::invalid_argument(snap_os_.str()); \
    }                                              \
  } while (0)

// For calls that return -1 and set errno: throws snapcore::IoError(errno, what, path).
#define SYSCALL_CHECK(ret, what, path)                                                 \
  do {                                                                                 \
    if ((ret) == -1) {                                                                 \
      const int snap_err_ = errno; /* before `what` or `path` can clobber it */        \
      ::snapcore::detail::throw_io_error(snap_err_, (what), (path), __FILE__, __LINE__); \
    }                                                                                  \
  } while (0)
