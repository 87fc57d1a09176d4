// A small persistent thread pool for the CPU backend (no OpenMP dependency).
//
// run(n, fn) executes fn(task, thread) for task in [0, n) on `threads` threads (the caller is
// thread 0). Tasks are handed out dynamically through one atomic counter, so which thread runs a
// task varies from run to run; determinism comes from the kernels (every output element is
// written by exactly one task with a fixed order of operations), never from the schedule.
//
// Starting threads can fail (a container's pid limit, RLIMIT_NPROC, an address-space limit too
// small for another stack). The pool then runs on the threads it did start - at least the
// caller's - and never fails because of it: results do not depend on the thread count.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace flashattn::cpu {

class ThreadPool {
 public:
  using TaskFn = void (*)(const void* ctx, int64_t task, int thread);

  // Asks for `threads` threads in all (the caller included); threads() tells how many it got.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  int requested() const { return requested_; }
  // Runs every task; rethrows the first exception a task threw (remaining tasks are skipped).
  void run(int64_t num_tasks, TaskFn fn, const void* ctx);

 private:
  void worker_main(int thread);
  void drain(int thread);
  void stop_workers() noexcept;

  std::vector<std::thread> workers_;
  int requested_ = 1;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;  // bumped per run(); workers wait for a new one
  int busy_ = 0;             // workers still inside the current run
  bool stop_ = false;

  // The current job (valid while busy_ > 0 or the caller drains).
  TaskFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t num_tasks_ = 0;
  alignas(64) std::atomic<int64_t> next_{0};
  std::exception_ptr error_;
};

// A pool of `threads` requested threads, leased by one call for its duration. Calls made at the
// same time (from several user threads) each lease a pool of their own, so they run concurrently
// instead of taking turns; pools are kept for reuse once released (a pool that got fewer threads
// than requested is kept too, not re-created on every call). At most kMaxPools pools exist at once:
// a caller beyond that waits for one to be released (an idle pool of another size is replaced).
// Each pool carries one attachment of the caller's choosing (the CPU backend's per-thread scratch),
// created on first use and reused with the pool.
class PoolLease {
 public:
  static constexpr int kMaxPools = 8;
  explicit PoolLease(int threads);
  ~PoolLease();
  PoolLease(const PoolLease&) = delete;
  PoolLease& operator=(const PoolLease&) = delete;

  ThreadPool& pool() const { return *slot_->pool; }
  template <class T>
  T& attached() {
    if (!slot_->attachment) slot_->attachment = std::make_shared<T>();
    return *static_cast<T*>(slot_->attachment.get());
  }

  struct Slot {
    std::unique_ptr<ThreadPool> pool;
    std::shared_ptr<void> attachment;
  };

 private:
  std::unique_ptr<Slot> slot_;
};

#if defined(FLASHATTN_THREAD_POOL_TESTING)
// Test builds only (tests/test_thread_pool.cpp compiles this file with the macro): the next
// `n` thread starts succeed and every later one throws std::system_error(EAGAIN), as
// pthread_create does at a pid limit; n < 0 removes the limit.
void set_thread_start_limit_for_testing(int n);
#endif

}  // namespace flashattn::cpu
