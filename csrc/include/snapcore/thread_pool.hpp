// A process-wide pool of worker threads, created once and reused by every parallel call,
// and the one primitive the other parts use it through: parallel_for.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace snapcore {

class ThreadPool {
 public:
  // The shared pool. It is never destroyed (joining at interpreter exit could hang), and a
  // forked child gets a fresh one, because the parent's threads do not exist there.
  static ThreadPool& shared();

  ThreadPool() = default;
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  // Starts workers until there are at least `n` (capped at kMaxWorkers).
  void ensure_workers(std::size_t n);
  void submit(std::function<void()> task);

  static constexpr std::size_t kMaxWorkers = 256;

 private:
  void work();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
};

// Calls fn(i) for every i in [0, parts) on up to `threads` threads, the caller being one
// of them, and returns when all calls are done. The caller claims parts too, so progress
// never depends on a busy pool. The first exception is rethrown after every started call
// has returned; parts not yet started when it happened are skipped.
void parallel_for(std::size_t parts, std::size_t threads,
                  const std::function<void(std::size_t)>& fn);

// How many workers a job of `nbytes` is worth on up to `threads` threads (0 = all): one
// per MiB at least, since below that waking another thread costs more than it saves.
std::size_t workers_for(std::size_t nbytes, std::size_t threads);

}  // namespace snapcore
