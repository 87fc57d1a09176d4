// The CPU thread pool when the system refuses to start some of its threads (a container's pid
// limit, RLIMIT_NPROC, an address-space limit too small for another stack).
//
// This binary compiles src/cpu/thread_pool.cpp itself with FLASHATTN_THREAD_POOL_TESTING, whose
// hook makes every thread start after the first n throw std::system_error(EAGAIN), exactly what
// std::thread does when pthread_create fails. Before the fix the pool's constructor let that
// exception unwind past workers already waiting on its condition variable: the unwinding blocked
// forever in pthread_cond_destroy while the process-wide pool lock was held, so that call and
// every later one hung. Each case therefore runs in a forked child with an alarm: a hang fails the
// test within seconds instead of stalling CI. (tests/test_limits.cpp provokes the same
// failure in the real library with RLIMIT_AS.)
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include "child_process.hpp"
#include "cpu/thread_pool.hpp"

namespace flashattn::cpu {
namespace {

using test::in_child;

// Runs `tasks` tasks on the pool; "" when each ran exactly once on a thread index below threads().
std::string run_and_count(ThreadPool& pool, int64_t tasks) {
  struct Ctx {
    explicit Ctx(int64_t n, int t) : hits(static_cast<size_t>(n)), threads(t) {}
    std::vector<std::atomic<int>> hits;
    std::atomic<int> bad_thread{0};
    int threads;
  } ctx(tasks, pool.threads());
  pool.run(
      tasks,
      [](const void* c, int64_t task, int thread) {
        Ctx& x = *const_cast<Ctx*>(static_cast<const Ctx*>(c));
        x.hits[static_cast<size_t>(task)]++;
        if (thread < 0 || thread >= x.threads) x.bad_thread++;
        std::this_thread::sleep_for(std::chrono::microseconds(50));  // let every worker join in
      },
      &ctx);
  for (int64_t t = 0; t < tasks; ++t)
    if (ctx.hits[static_cast<size_t>(t)] != 1)
      return "task " + std::to_string(t) + " ran " + std::to_string(ctx.hits[static_cast<size_t>(t)]) + " times";
  if (ctx.bad_thread) return "a task saw a thread index outside [0, threads())";
  return "";
}

TEST(ThreadPoolStartFailure, RunsOnTheThreadsThatStarted) {
  EXPECT_TRUE(in_child([]() -> std::string {
    set_thread_start_limit_for_testing(3);  // workers 1..3 start, worker 4 fails
    std::string err;
    {
      ThreadPool pool(8);
      if (pool.threads() != 4) return "threads() = " + std::to_string(pool.threads()) + ", expected 4";
      if (pool.requested() != 8) return "requested() = " + std::to_string(pool.requested());
      err = run_and_count(pool, 500);
      if (err.empty()) err = run_and_count(pool, 3);
    }  // the destructor joins the three workers
    return err;
  }));
}

TEST(ThreadPoolStartFailure, NoThreadAtAllRunsInline) {
  EXPECT_TRUE(in_child([]() -> std::string {
    set_thread_start_limit_for_testing(0);
    ThreadPool pool(16);
    if (pool.threads() != 1) return "threads() = " + std::to_string(pool.threads()) + ", expected 1";
    return run_and_count(pool, 100);
  }));
}

TEST(ThreadPoolStartFailure, TaskExceptionsStillPropagate) {
  EXPECT_TRUE(in_child([]() -> std::string {
    set_thread_start_limit_for_testing(2);
    ThreadPool pool(6);
    try {
      pool.run(
          64,
          [](const void*, int64_t task, int) {
            if (task == 17) throw std::runtime_error("task 17");
          },
          nullptr);
    } catch (const std::runtime_error& e) {
      return std::string(e.what()) == "task 17" ? run_and_count(pool, 50) : "wrong exception";
    }
    return std::string("the task's exception was lost");
  }));
}

// The leased pools: a start failure neither leaves the registry locked nor breaks later calls; a
// pool that got fewer threads than asked is kept for that request (no new attempt, and no
// thread churn, on every call), and a different request gets a pool of its own.
TEST(ThreadPoolStartFailure, LeasedPoolsStayUsable) {
  EXPECT_TRUE(in_child([]() -> std::string {
    set_thread_start_limit_for_testing(2);
    {
      PoolLease lease(8);
      if (lease.pool().threads() != 3) return "first pool: threads() = " + std::to_string(lease.pool().threads());
      std::string err = run_and_count(lease.pool(), 200);
      if (!err.empty()) return err;
    }
    set_thread_start_limit_for_testing(-1);
    // Another thread gets the same (released) pool back.
    std::string err;
    std::thread other([&] {
      PoolLease lease(8);
      if (lease.pool().threads() != 3) err = "second call: threads() = " + std::to_string(lease.pool().threads());
      else err = run_and_count(lease.pool(), 200);
    });
    other.join();
    if (!err.empty()) return err;
    PoolLease lease(5);
    if (lease.pool().threads() != 5) return "new request: threads() = " + std::to_string(lease.pool().threads());
    return run_and_count(lease.pool(), 200);
  }));
}

// Every possible failure point of a pool's thread starts, a new pool each time.
TEST(ThreadPoolStartFailure, EveryFailurePoint) {
  EXPECT_TRUE(in_child([]() -> std::string {
    for (int limit = 0; limit <= 12; ++limit) {
      set_thread_start_limit_for_testing(limit);
      // A distinct size each time: a new pool (released pools are kept and reused per size);
      // past PoolLease::kMaxPools sizes, idle pools of other sizes are replaced.
      PoolLease lease(20 + limit);
      ThreadPool& pool = lease.pool();
      const int want = limit + 1;
      if (pool.threads() != want)
        return "limit " + std::to_string(limit) + ": threads() = " + std::to_string(pool.threads()) +
               ", expected " + std::to_string(want);
      const std::string err = run_and_count(pool, 97);
      if (!err.empty()) return "limit " + std::to_string(limit) + ": " + err;
    }
    return std::string();
  }, 60));
}

// Calls at the same time run at the same time: each of two threads leases a pool and runs a job
// that waits (up to 10 s) until the other's job has started. With one pool shared under a lock
// (the old design) the second call could not start before the first finished, so the first
// waited out its 10 s and the test fails.
TEST(PoolLeases, ConcurrentCallsRunConcurrently) {
  std::atomic<int> started{0};
  std::atomic<bool> timed_out{false};
  auto call = [&] {
    PoolLease lease(2);
    struct Ctx {
      std::atomic<int>* started;
      std::atomic<bool>* timed_out;
    } ctx{&started, &timed_out};
    lease.pool().run(
        1,
        [](const void* c, int64_t, int) {
          const Ctx& x = *static_cast<const Ctx*>(c);
          x.started->fetch_add(1);
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (x.started->load() < 2)
            if (std::chrono::steady_clock::now() > until) {
              x.timed_out->store(true);
              return;
            } else {
              std::this_thread::yield();
            }
        },
        &ctx);
  };
  std::thread a(call), b(call);
  a.join();
  b.join();
  EXPECT_FALSE(timed_out.load()) << "a call waited for the other to finish";
  EXPECT_EQ(started.load(), 2);
}

// More concurrent callers than pools: they wait their turn rather than fail, and every task of
// every call runs exactly once.
TEST(PoolLeases, MoreCallersThanPools) {
  constexpr int kCallers = PoolLease::kMaxPools * 2 + 3;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kCallers);
  for (int i = 0; i < kCallers; ++i)
    threads.emplace_back([&, i] {
      PoolLease lease(1 + i % 3);
      errors[i] = run_and_count(lease.pool(), 37 + i);
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kCallers; ++i) EXPECT_EQ(errors[i], "") << "caller " << i;
}

}  // namespace
}  // namespace flashattn::cpu
