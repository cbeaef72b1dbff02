#include "snapcore/thread_pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <new>

#include "snapcore/system.hpp"

namespace snapcore {

namespace {

std::mutex* shared_mutex_ptr = nullptr;
ThreadPool* shared_pool = nullptr;

void reset_after_fork() noexcept {
  // Only the forking thread exists in the child: the old pool's workers and whatever its
  // mutexes protected are gone. Leak both and start over on first use.
  shared_mutex_ptr = new (std::nothrow) std::mutex();
  shared_pool = nullptr;
}

std::mutex& shared_mutex() {
  static const bool registered = [] {
    shared_mutex_ptr = new std::mutex();
    pthread_atfork(nullptr, nullptr, reset_after_fork);
    return true;
  }();
  (void)registered;
  return *shared_mutex_ptr;
}

}  // namespace

ThreadPool& ThreadPool::shared() {
  std::lock_guard<std::mutex> lock(shared_mutex());
  if (shared_pool == nullptr) {
    shared_pool = new ThreadPool();
  }
  return *shared_pool;
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) {
    t.join();
  }
}

void ThreadPool::ensure_workers(std::size_t n) {
  std::lock_guard<std::mutex> lock(mutex_);
  n = std::min(n, kMaxWorkers);
  while (workers_.size() < n) {
    workers_.emplace_back([this] { work(); });
  }
}

void ThreadPool::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  wake_.notify_one();
}

void ThreadPool::work() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) {
        return;  // stopping
      }
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();  // tasks catch their own exceptions (parallel_for's do)
  }
}

namespace {

// One parallel_for call; shared with the helper tasks, which may start after it is over.
struct Batch {
  const std::function<void(std::size_t)>* fn = nullptr;
  std::size_t parts = 0;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable all_done;
  std::size_t done = 0;
  std::exception_ptr error;

  // Claims and runs parts until none is left.
  void drain() {
    for (;;) {
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= parts) {
        return;
      }
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          (*fn)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!error) {
            error = std::current_exception();
          }
          failed.store(true, std::memory_order_relaxed);
        }
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (++done == parts) {
        all_done.notify_all();
      }
    }
  }
};

}  // namespace

void parallel_for(std::size_t parts, std::size_t threads,
                  const std::function<void(std::size_t)>& fn) {
  threads = std::min(threads, parts);
  if (threads <= 1) {
    for (std::size_t i = 0; i < parts; ++i) {
      fn(i);
    }
    return;
  }
  auto batch = std::make_shared<Batch>();
  batch->fn = &fn;
  batch->parts = parts;

  ThreadPool& pool = ThreadPool::shared();
  pool.ensure_workers(threads - 1);
  for (std::size_t t = 0; t + 1 < threads; ++t) {
    pool.submit([batch] { batch->drain(); });
  }
  batch->drain();
  {
    // A helper that claimed a part may still be running it: `fn` must outlive it.
    std::unique_lock<std::mutex> lock(batch->mutex);
    batch->all_done.wait(lock, [&] { return batch->done == batch->parts; });
  }
  if (batch->error) {
    std::rethrow_exception(batch->error);
  }
}

std::size_t workers_for(std::size_t nbytes, std::size_t threads) {
  constexpr std::size_t kMinBytesPerWorker = std::size_t{1} << 20;
  return std::min(std::max<std::size_t>(1, nbytes / kMinBytesPerWorker),
                  resolve_threads(threads));
}

}  // namespace snapcore
