#include "cpu/thread_pool.hpp"

#include <atomic>
#include <memory>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define FLASHATTN_HAVE_ATFORK 1
#endif

namespace flashattn::cpu {

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) threads = 1;
  workers_.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) workers_.emplace_back([this, t] { worker_main(t); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::drain(int thread) {
  for (;;) {
    int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    if (t >= num_tasks_) return;
    try {
      fn_(ctx_, t, thread);
    } catch (...) {
      std::lock_guard<std::mutex> g(mu_);
      if (!error_) error_ = std::current_exception();
      next_.store(num_tasks_, std::memory_order_relaxed);  // skip the rest
    }
  }
}

void ThreadPool::worker_main(int thread) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain(thread);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::run(int64_t num_tasks, TaskFn fn, const void* ctx) {
  if (num_tasks <= 0) return;
  fn_ = fn;
  ctx_ = ctx;
  num_tasks_ = num_tasks;
  error_ = nullptr;
  next_.store(0, std::memory_order_relaxed);
  // Waking workers costs tens of microseconds; a single task runs inline.
  const bool parallel = !workers_.empty() && num_tasks > 1;
  if (parallel) {
    {
      std::lock_guard<std::mutex> g(mu_);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
  }
  drain(0);
  if (parallel) {
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [&] { return busy_ == 0; });
  }
  if (error_) std::rethrow_exception(error_);
}

namespace {

// The process-wide pool and its lock. Never destroyed: worker threads sleeping at exit are simply
// ended with the process, and nothing runs during static destruction.
struct Shared {
  std::mutex mu;
  std::unique_ptr<ThreadPool> pool;
};
Shared* g_shared = nullptr;
std::once_flag g_once;

#if defined(FLASHATTN_HAVE_ATFORK)
// A child process (e.g. a Python DataLoader worker forked from a process that already used the
// CPU backend) has only the forking thread: the pool's workers do not exist there, and the lock
// may be held by a thread that does not exist either. Abandon both and start afresh on first use.
void after_fork_in_child() {
  if (g_shared) {
    (void)g_shared->pool.release();
    g_shared = new Shared;
  }
}
#endif

}  // namespace

ThreadPool& shared_pool(int threads, std::unique_lock<std::mutex>& lock) {
  std::call_once(g_once, [] {
    g_shared = new Shared;
#if defined(FLASHATTN_HAVE_ATFORK)
    pthread_atfork(nullptr, nullptr, &after_fork_in_child);
#endif
  });
  Shared& s = *g_shared;
  lock = std::unique_lock<std::mutex>(s.mu);
  if (!s.pool || s.pool->threads() != threads) {
    s.pool.reset();  // join the old workers before starting new ones
    s.pool = std::make_unique<ThreadPool>(threads);
  }
  return *s.pool;
}

}  // namespace flashattn::cpu
