#include "snapcore/error.hpp"

#include <cstring>

namespace snapcore::detail {

std::string where(const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  return std::string(slash != nullptr ? slash + 1 : file) + ":" + std::to_string(line);
}

void throw_io_error(int err, const std::string& what, const std::string& path,
                    const char* file, int line) {
  // strerror_r (GNU flavour) may return a static string instead of filling the buffer.
  char buf[256];
  const char* text = strerror_r(err, buf, sizeof(buf));
  throw IoError(err, what + ": " + text + " [" + where(file, line) + "]", path);
}

}  // namespace snapcore::detail
