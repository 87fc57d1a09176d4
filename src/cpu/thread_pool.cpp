#include "cpu/thread_pool.hpp"

#include <atomic>
#include <memory>
#include <system_error>
#include <utility>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define FLASHATTN_HAVE_ATFORK 1
#endif

namespace flashattn::cpu {

namespace {

#if defined(FLASHATTN_THREAD_POOL_TESTING)
std::atomic<int> g_start_limit{-1};
#endif

template <class F>
void start_thread(std::vector<std::thread>& threads, F&& f) {
#if defined(FLASHATTN_THREAD_POOL_TESTING)
  for (int left = g_start_limit.load(); left >= 0;) {
    if (left == 0)
      throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                              "thread start refused by the test limit");
    if (g_start_limit.compare_exchange_weak(left, left - 1)) break;
  }
#endif
  threads.emplace_back(std::forward<F>(f));
}

}  // namespace

#if defined(FLASHATTN_THREAD_POOL_TESTING)
void set_thread_start_limit_for_testing(int n) { g_start_limit.store(n < 0 ? -1 : n); }
#endif

// A thread that cannot be started (std::system_error from pthread_create's EAGAIN, or bad_alloc)
// ends the loop: the pool keeps the workers it has. Nothing here may throw once a worker runs:
// an exception leaving the constructor would destroy wake_ while workers wait on it (glibc's
// pthread_cond_destroy then blocks forever) and destroy joinable std::threads (std::terminate).
ThreadPool::ThreadPool(int threads) {
  if (threads < 1) threads = 1;
  requested_ = threads;
  try {
    workers_.reserve(static_cast<size_t>(threads - 1));
  } catch (...) {
    // emplace_back grows the vector as needed (and stops the loop below if it cannot)
  }
  for (int t = 1; t < threads; ++t) {
    try {
      start_thread(workers_, [this, t] { worker_main(t); });
    } catch (...) {
      break;
    }
  }
}

void ThreadPool::stop_workers() noexcept {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_)
    if (w.joinable()) w.join();
}

ThreadPool::~ThreadPool() { stop_workers(); }

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

// The pools: idle ones, and how many exist (idle or leased). Never destroyed: worker threads
// sleeping at exit are simply ended with the process, and nothing runs during static destruction.
struct Registry {
  std::mutex mu;
  std::condition_variable released;
  std::vector<std::unique_ptr<PoolLease::Slot>> idle;
  int live = 0;
};
Registry* g_registry = nullptr;
std::once_flag g_once;

#if defined(FLASHATTN_HAVE_ATFORK)
// A child process (e.g. a Python DataLoader worker forked from a process that already used the
// CPU backend) has only the forking thread: the pools' workers do not exist there, and the lock
// may be held by a thread that does not exist either. Abandon everything and start afresh.
void after_fork_in_child() {
  if (g_registry) g_registry = new Registry;  // the old one is leaked, never touched again
}
#endif

Registry& registry() {
  std::call_once(g_once, [] {
    g_registry = new Registry;
#if defined(FLASHATTN_HAVE_ATFORK)
    pthread_atfork(nullptr, nullptr, &after_fork_in_child);
#endif
  });
  return *g_registry;
}

}  // namespace

PoolLease::PoolLease(int threads) {
  if (threads < 1) threads = 1;
  Registry& r = registry();
  std::unique_ptr<Slot> replaced;
  {
    std::unique_lock<std::mutex> lock(r.mu);
    for (;;) {
      for (auto it = r.idle.begin(); it != r.idle.end(); ++it)
        if ((*it)->pool->requested() == threads) {
          slot_ = std::move(*it);
          r.idle.erase(it);
          return;
        }
      if (r.live < kMaxPools) {
        ++r.live;
        break;
      }
      if (!r.idle.empty()) {  // every pool exists: replace an idle one of another size
        replaced = std::move(r.idle.back());
        r.idle.pop_back();
        break;
      }
      r.released.wait(lock);
    }
  }
  replaced.reset();  // join its workers (outside the lock) before starting new ones
  try {
    slot_ = std::make_unique<Slot>();
    slot_->pool = std::make_unique<ThreadPool>(threads);  // never fails for want of threads
  } catch (...) {
    const std::lock_guard<std::mutex> g(r.mu);
    --r.live;
    r.released.notify_one();
    throw;
  }
}

PoolLease::~PoolLease() {
  Registry& r = registry();
  const std::lock_guard<std::mutex> g(r.mu);
  try {
    r.idle.push_back(std::move(slot_));
  } catch (...) {
    --r.live;  // no room to keep it: it is destroyed with the lease
  }
  r.released.notify_one();
}

}  // namespace flashattn::cpu
