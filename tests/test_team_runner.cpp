// CPU calls on a caller's thread team (flashattn_set_cpu_team_runner): results are bitwise those
// of the library's own pools whatever the team does within its contract (all members, one member,
// members beyond the count asked, thread numbers out of range), a runner that never calls the body
// still gets every output written, the runner is really used (and not for calls too small to be
// worth a team), and NULL restores the pools.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "flashattn/flashattn.h"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

std::atomic<int> g_runs{0};       // runner invocations
std::atomic<int> g_members{0};    // body calls

// Each runner: body on `members(n)` threads (std::thread), thread numbers from `number(i)`.
template <int Extra, bool BadNumbers>
void spawn_runner(void* /*ctx*/, int32_t n, flashattn_cpu_team_body body, void* arg) {
  g_runs++;
  const int members = n + Extra;
  std::vector<std::thread> team;
  for (int i = 1; i < members; ++i)
    team.emplace_back([=] {
      g_members++;
      body(arg, BadNumbers ? -7 * i : i);
    });
  g_members++;
  body(arg, BadNumbers ? 1000 : 0);
  for (auto& t : team) t.join();
}
void inline_runner(void*, int32_t, flashattn_cpu_team_body body, void* arg) {
  g_runs++;
  g_members++;
  body(arg, 0);
}
void idle_runner(void*, int32_t, flashattn_cpu_team_body, void*) { g_runs++; }

// Restores the library's pools at the end of a test.
struct RunnerScope {
  explicit RunnerScope(flashattn_cpu_team_runner r) { EXPECT_EQ(flashattn_set_cpu_team_runner(r, nullptr), FLASHATTN_OK); }
  ~RunnerScope() { flashattn_set_cpu_team_runner(nullptr, nullptr); }
};

Snapshot run_problem(const ProblemConfig& c, int32_t threads) {
  Problem p(c);
  p.poison_outputs();
  const Options o = options_for(c, threads);
  run_forward(p, o);
  run_backward(p, o);
  for (const testing::HostTensor* t : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv})
    for (double x : p.to_double(*t))
      if (std::isnan(x)) ADD_FAILURE() << "an output kept its NaN poison";
  return snapshot(p);
}

const ProblemConfig kCfgs[] = {
    make_config(2, 4, 2, 193, 257, 72, Mask::CausalBottomRight, DType::Float32, testing::Layout::BHSD, 0.0f, 5),
    make_config(1, 3, 1, 130, 70, 64, Mask::None, DType::BFloat16, testing::Layout::BSHD, 0.0f, 6),
};

void expect_same(const Snapshot& a, const Snapshot& b, const std::string& what) {
  ASSERT_EQ(a.bytes.size(), b.bytes.size());
  for (size_t i = 0; i < a.bytes.size(); ++i) EXPECT_TRUE(a.bytes[i] == b.bytes[i]) << what << ": output " << i;
}

TEST(CpuTeamRunner, BitwiseAsThePoolsForEveryTeamShape) {
  for (const ProblemConfig& c : kCfgs) {
    SCOPED_TRACE(c.describe());
    const Snapshot pool = run_problem(c, 3);
    struct Case {
      const char* name;
      flashattn_cpu_team_runner run;
    } cases[] = {{"full team", &spawn_runner<0, false>},
                 {"more members than asked, bad thread numbers", &spawn_runner<3, true>},
                 {"one member", &inline_runner},
                 {"no member at all", &idle_runner}};
    for (const Case& k : cases) {
      RunnerScope scope(k.run);
      g_runs = 0;
      expect_same(run_problem(c, 3), pool, k.name);
      EXPECT_GT(g_runs.load(), 0) << k.name << ": the runner was not used";
    }
  }
}

// A call smaller than a team's wake-up is worth (under 2^22 forward FLOPs: serial_if_small,
// cpu_backend.cpp) runs on the calling thread: the runner is never called, and the outputs are
// bitwise those of a one-thread call; a call above the bound still goes to the team.
TEST(CpuTeamRunner, TinyCallsRunOnTheCallingThread) {
  const ProblemConfig tiny[] = {
      make_config(1, 1, 1, 16, 16, 16, Mask::CausalBottomRight, DType::Float32, testing::Layout::BSHD, 0.0f, 8),
      make_config(2, 2, 1, 17, 33, 64, Mask::None, DType::BFloat16, testing::Layout::BHSD, 0.0f, 9),
  };
  for (const ProblemConfig& c : tiny) {
    SCOPED_TRACE(c.describe());
    const Snapshot one = run_problem(c, 1);
    RunnerScope scope(&spawn_runner<0, false>);
    g_runs = 0;
    expect_same(run_problem(c, 3), one, "tiny call with a team of 3");
    EXPECT_EQ(g_runs.load(), 0) << "a tiny call woke the team";
  }
  RunnerScope scope(&spawn_runner<0, false>);
  g_runs = 0;
  (void)run_problem(kCfgs[1], 3);  // 4 B H Sq Skv D = 7.0e6 forward FLOPs: above the bound
  EXPECT_GT(g_runs.load(), 0) << "a call above the bound did not use the team";
}

TEST(CpuTeamRunner, NullRestoresThePools) {
  {
    RunnerScope scope(&spawn_runner<0, false>);
    g_runs = 0;
    (void)run_problem(kCfgs[0], 2);
    EXPECT_GT(g_runs.load(), 0);
  }
  g_runs = 0;
  (void)run_problem(kCfgs[0], 2);
  EXPECT_EQ(g_runs.load(), 0) << "the runner was still called after set_cpu_team_runner(NULL)";
  EXPECT_NE(build_info().find("thread pools"), std::string::npos) << build_info();
}

}  // namespace
}  // namespace flashattn::test
