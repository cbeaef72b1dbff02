// File I/O for the persist and restore paths: positional writes with O_DIRECT where the
// file system takes it, exact reads, and dropping a file from the page cache.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <shared_mutex>
#include <string>

namespace snapcore {

// Writes one file at explicit offsets. write_at() and sync() may be called from several
// threads at once (on disjoint ranges); close() waits for calls in progress.
class FileWriter {
 public:
  // Creates or truncates `path` (0644); with `truncate` false an existing file keeps its
  // bytes and blocks, so that writes over them need no new allocation (a recycled file).
  // With `direct`, a second descriptor is opened with O_DIRECT; where the file system
  // refuses it (EINVAL: tmpfs, some FUSE), the writer stays buffered and direct() is false.
  FileWriter(std::string path, bool direct, bool truncate = true);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Writes `nbytes` from `src` at `offset`. The page-aligned middle goes through O_DIRECT
  // in large pieces (when the address and offset agree modulo the page size), the
  // unaligned head and tail through the page cache. An O_DIRECT write refused with EINVAL
  // turns O_DIRECT off for the rest of this writer. Throws IoError.
  void write_at(std::uint64_t offset, const void* src, std::size_t nbytes);
  void sync();   // fdatasync; throws IoError
  void close();  // idempotent

  [[nodiscard]] bool direct() const noexcept { return direct_.load(); }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  [[nodiscard]] std::uint64_t bytes_written() const noexcept { return bytes_written_.load(); }
  [[nodiscard]] bool closed() const noexcept { return fd_ < 0; }

  // Size of one O_DIRECT write.
  static constexpr std::size_t kDirectPiece = std::size_t{32} << 20;

 private:
  void write_buffered(std::uint64_t offset, const char* src, std::size_t nbytes);
  void write_direct(std::uint64_t offset, const char* src, std::size_t nbytes);

  std::string path_;
  int fd_ = -1;
  int direct_fd_ = -1;
  std::atomic<bool> direct_{false};
  std::atomic<std::uint64_t> bytes_written_{0};
  mutable std::shared_mutex lifecycle_;  // shared: write_at, sync; exclusive: close
};

// Reads exactly `nbytes` at `offset` of `path` into `dst`, split over `threads` threads
// for large reads. Throws Error("truncated: ...") when the file is too short and IoError
// when opening or reading fails.
void read_into(const std::string& path, std::uint64_t offset, std::size_t nbytes, void* dst,
               std::size_t threads);

// Writes back and evicts `path` from the page cache so that the next read comes from the
// device. Returns whether the kernel accepted the eviction; throws IoError when the file
// cannot be opened.
bool drop_page_cache(const std::string& path);

}  // namespace snapcore
