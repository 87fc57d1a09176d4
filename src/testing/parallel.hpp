// The thread fan-out of the test-side implementations (naive, naive_lowp) and of the GPU tests'
// host-side references: tasks pulled from a shared counter by plain std::threads. Kept apart from
// the library's pool on purpose: what checks the library must not share its machinery.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace flashattn::testing {

// n > 0 threads as asked; otherwise all hardware threads (at least 1).
inline int resolve_threads(int n) {
  if (n > 0) return n;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Runs fn(t) for t in [0, tasks) on up to `threads` threads pulling from a shared counter.
template <class F>
void parallel_for(int64_t tasks, int threads, F&& fn) {
  const int n = static_cast<int>(std::min<int64_t>(threads, tasks));
  if (n <= 1) {
    for (int64_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t);
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(n - 1));
  // A thread that cannot start (the process's thread or memory limit) leaves the work to those
  // that did and the caller: the counter hands out every task either way. (Letting the exception
  // leave with joinable threads in `pool` would call std::terminate.)
  for (int i = 0; i < n - 1; ++i) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;
    }
  }
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace flashattn::testing
