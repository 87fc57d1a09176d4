// A small persistent thread pool for the CPU backend (no OpenMP dependency).
//
// run(n, fn) executes fn(task, thread) for task in [0, n) on `threads` threads (the caller is
// thread 0). Tasks are handed out dynamically through one atomic counter, so which thread runs a
// task varies from run to run; determinism comes from the kernels (every output element is
// written by exactly one task with a fixed order of operations), never from the schedule.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace flashattn::cpu {

class ThreadPool {
 public:
  using TaskFn = void (*)(const void* ctx, int64_t task, int thread);

  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs every task; rethrows the first exception a task threw (remaining tasks are skipped).
  void run(int64_t num_tasks, TaskFn fn, const void* ctx);

 private:
  void worker_main(int thread);
  void drain(int thread);

  std::vector<std::thread> workers_;
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

// The process-wide pool with exactly `threads` threads, created or resized on demand. The
// returned lock serialises concurrent callers (the pool runs one job at a time).
ThreadPool& shared_pool(int threads, std::unique_lock<std::mutex>& lock);

}  // namespace flashattn::cpu
