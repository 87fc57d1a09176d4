// The documented bounds of the options (FLASHATTN_MAX_THREADS, FLASHATTN_MAX_SOFTMAX_SCALE), and a
// CPU call in a process that cannot start all the threads it asks for.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "child_process.hpp"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

ProblemConfig small(float scale = 0.0f) {
  return make_config(2, 4, 2, 9, 11, 16, Mask::CausalBottomRight, DType::Float32,
                     testing::Layout::BHSD, scale, /*seed=*/17);
}

// Both directions fail with `needles` and write nothing.
void expect_rejected(const Options& o, const std::vector<std::string>& needles) {
  Problem p(small());
  const Snapshot before = snapshot(p);
  EXPECT_TRUE(throws_error([&] { run_forward(p, o); }, Status::InvalidArgument, needles));
  EXPECT_TRUE(throws_error([&] { run_backward(p, o); }, Status::InvalidArgument, needles));
  EXPECT_TRUE(snapshot(p) == before) << "written before the error";
}

// A C ABI view of a tensor.
flashattn_tensor to_c(const Tensor& t) {
  flashattn_tensor c{};
  c.data = t.data;
  c.dtype = static_cast<int32_t>(t.dtype);
  c.device = t.device;
  c.ndim = t.ndim;
  for (int i = 0; i < t.ndim; ++i) c.shape[i] = t.shape[i], c.stride[i] = t.stride[i];
  return c;
}

// ---- num_threads ---------------------------------------------------------------------------

TEST(BadInputBounds, NumThreadsAboveTheBound) {
  static_assert(FLASHATTN_MAX_THREADS == 1024, "the documented bound");
  for (int32_t n : {FLASHATTN_MAX_THREADS + 1, 2000, std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE(n);
    Options o;
    o.num_threads = n;
    expect_rejected(o, {"options.num_threads = " + std::to_string(n), "too large", "at most 1024"});
  }
}

// The bound itself is accepted, and (as for every thread count) gives the bytes of one thread.
TEST(BadInputBounds, NumThreadsAtTheBoundWorks) {
  Problem one(small()), many(small());
  run_forward(one, options_for(one.cfg, 1));
  run_backward(one, options_for(one.cfg, 1));
  ASSERT_NO_THROW(run_forward(many, options_for(many.cfg, FLASHATTN_MAX_THREADS)));
  ASSERT_NO_THROW(run_backward(many, options_for(many.cfg, FLASHATTN_MAX_THREADS)));
  EXPECT_TRUE(snapshot(one) == snapshot(many));
}

// ---- softmax_scale ---------------------------------------------------------------------------

// 3e38 used to pass validation and give all-zero outputs (scale * log2(e) overflows float32); at
// 1e30 the backward gave NaN for unit inputs.
TEST(BadInputBounds, SoftmaxScaleAboveTheBound) {
  static_assert(FLASHATTN_MAX_SOFTMAX_SCALE == 1e6f, "the documented bound");
  const float above = std::nextafter(FLASHATTN_MAX_SOFTMAX_SCALE, std::numeric_limits<float>::infinity());
  const std::pair<float, std::string> cases[] = {{3e38f, "3e+38"},
                                                 {-3e38f, "-3e+38"},
                                                 {std::numeric_limits<float>::max(), "3.40282e+38"},
                                                 {1e30f, "1e+30"},
                                                 {1e7f, "1e+07"},
                                                 {above, "1e+06"},
                                                 {-above, "-1e+06"}};
  for (const auto& [s, text] : cases) {
    SCOPED_TRACE(text);
    Options o;
    o.softmax_scale = s;
    expect_rejected(o, {"options.softmax_scale = " + text, "out of range", "<= 1e+06",
                        "FLASHATTN_MAX_SOFTMAX_SCALE"});
  }
}

// At the bound, inputs of ordinary size work: the softmax is one-hot, the forward matches the
// float64 reference, and the backward is finite (its values are rounding-dominated at such a
// scale - a one-hot softmax has ill-conditioned gradients - so they are not compared).
TEST(BadInputBounds, SoftmaxScaleAtTheBoundWorks) {
  for (float s : {FLASHATTN_MAX_SOFTMAX_SCALE, -FLASHATTN_MAX_SOFTMAX_SCALE}) {
    SCOPED_TRACE(s);
    Problem p(make_config(1, 2, 1, 7, 9, 16, Mask::None, DType::Float32, testing::Layout::BHSD, s, 3));
    Options o = options_for(p.cfg, 2);
    ASSERT_NO_THROW(run_forward(p, o));
    ASSERT_NO_THROW(run_backward(p, o));
    const Reference r = reference_for(p);
    const auto eo = testing::compare(p.to_double(p.out), r.fwd.out);
    const auto el = testing::compare(p.to_double(p.lse), r.fwd.lse);
    EXPECT_EQ(eo.nan, 0) << eo.str();
    EXPECT_LE(eo.rel, 2e-5) << eo.str();
    EXPECT_EQ(el.nan, 0) << el.str();
    EXPECT_LE(el.rel, 2e-5) << el.str();
    for (const testing::HostTensor* t : {&p.dq, &p.dk, &p.dv})
      for (double x : p.to_double(*t)) ASSERT_TRUE(std::isfinite(x)) << "a gradient is not finite";
  }
}

// Through the C ABI: the status and the message.
TEST(BadInputBounds, ThroughTheCAbi) {
  Problem p(small());
  const flashattn_tensor q = to_c(p.q.view), k = to_c(p.k.view), v = to_c(p.v.view), out = to_c(p.out.view),
                         lse = to_c(p.lse.view);
  flashattn_options o;
  flashattn_options_init(&o);
  o.softmax_scale = 3e38f;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("options.softmax_scale = 3e+38"), std::string::npos)
      << flashattn_last_error();
  o.softmax_scale = 0;
  o.num_threads = 5000;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("options.num_threads = 5000"), std::string::npos)
      << flashattn_last_error();
}

// ---- a process that cannot start all its threads -----------------------------------------------

long status_field(const char* key) {  // a "Key:   123 kB" line of /proc/self/status
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(f, line))
    if (line.compare(0, k.size(), k) == 0) return std::stol(line.substr(k.size()));
  return -1;
}

// A forked child caps its address space a little above what it uses (RLIMIT_AS, as `ulimit -v`
// does), then asks for 512 threads: at 8 MiB of stack each, most cannot start. The calls must
// still succeed with the bytes of a one-thread run, and later calls must work too. Before the fix
// the first call hung for ever (the pool's cleanup blocked in pthread_cond_destroy holding the
// process-wide pool lock); the alarm turns that into a failure. tests/test_thread_pool.cpp
// provokes the failure at every possible thread, deterministically, with a test hook.
// The cap bites only where new threads need new stacks: after earlier tests of the same process
// started threads, a forked child inherits their stacks, which glibc keeps to reuse, and starts
// hundreds of threads within the cap. Then the test runs in a fresh process of this binary
// (as ctest runs every test).
TEST(ThreadLimits, CallsSucceedWhenThreadsCannotStart) {
  if (status_field("Threads") > 1 && std::getenv("FLASHATTN_TEST_FRESH_PROCESS") == nullptr) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {
      setenv("FLASHATTN_TEST_FRESH_PROCESS", "1", 1);
      execl("/proc/self/exe", "/proc/self/exe", "--gtest_filter=ThreadLimits.CallsSucceedWhenThreadsCannotStart",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "the test in a fresh process failed (status " << status << ")";
    return;
  }
  const ProblemConfig cfg = small();
  Problem want(cfg);
  run_forward(want, options_for(cfg, 1));
  run_backward(want, options_for(cfg, 1));
  const Snapshot expected = snapshot(want);

  EXPECT_TRUE(in_child(
      [&] {
        std::string msg;
        Problem p(cfg);  // allocated before the cap
        const long vm_kb = status_field("VmSize");
        const rlim_t cap = static_cast<rlim_t>(vm_kb + 48 * 1024) * 1024;  // + 48 MiB
        struct rlimit rl = {cap, cap};
        if (vm_kb < 0 || setrlimit(RLIMIT_AS, &rl) != 0) {
          msg = "setrlimit failed";
        } else {
          for (int32_t threads : {512, 512, 3, 700}) {
            p.poison_outputs();
            run_forward(p, options_for(cfg, threads));
            run_backward(p, options_for(cfg, threads));
            if (!(snapshot(p) == expected))
              msg += "num_threads=" + std::to_string(threads) + ": results differ from 1 thread; ";
            const long running = status_field("Threads");
            if (threads >= 512 && running >= threads)
              msg += "the limit did not bite (" + std::to_string(running) + " threads running); ";
          }
        }
        return msg;
      },
      60));
}

// ---- max_flops and cancel: bounds on a call's running time --------------------------------------

// small(): B 2, Hq 4, Sq 9, Skv 11, D 16: forward 4 * 2 * 4 * 9 * 11 * 16 = 50688 FLOPs.
TEST(WorkBounds, MaxFlopsRefusesLargerCallsBeforeWriting) {
  Options o;
  o.max_flops = 50687.0;
  Problem p(small());
  const Snapshot before = snapshot(p);
  EXPECT_TRUE(throws_error([&] { run_forward(p, o); }, Status::InvalidArgument,
                           {"50688 FLOPs", "4 * B 2 * Hq 4 * Sq 9 * Skv 11 * D 16", "options.max_flops = 50687"}));
  o.max_flops = 50688.0;  // the forward fits; the backward (2.5x) does not
  EXPECT_TRUE(throws_error([&] { run_backward(p, o); }, Status::InvalidArgument,
                           {"126720 FLOPs", "2.5 x", "options.max_flops = 50688"}));
  EXPECT_TRUE(snapshot(p) == before) << "written before the error";
  ASSERT_NO_THROW(run_forward(p, o));
  o.max_flops = 126720.0;
  ASSERT_NO_THROW(run_backward(p, o));
}

TEST(WorkBounds, MaxFlopsMustBeFiniteAndNonNegative) {
  for (double m : {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE(m);
    Options o;
    o.max_flops = m;
    expect_rejected(o, {"options.max_flops", "is invalid"});
  }
}

// A cancel callback: counts its polls, asks to stop from poll `stop_at` on (0: never).
struct Canceller {
  std::atomic<int64_t> polls{0};
  int64_t stop_at = 0;
  static int poll(void* arg) {
    auto& c = *static_cast<Canceller*>(arg);
    const int64_t n = c.polls.fetch_add(1) + 1;
    return c.stop_at > 0 && n >= c.stop_at ? 1 : 0;
  }
};

// Asked before the call starts: nothing is written.
TEST(WorkBounds, CancelBeforeTheCallWritesNothing) {
  Canceller c;
  c.stop_at = 1;
  Options o;
  o.cancel = &Canceller::poll;
  o.cancel_arg = &c;
  Problem p(small());
  const Snapshot before = snapshot(p);
  EXPECT_TRUE(throws_error([&] { run_forward(p, o); }, Status::Cancelled, {"cancelled by options.cancel before"}));
  EXPECT_TRUE(throws_error([&] { run_backward(p, o); }, Status::Cancelled, {"cancelled by options.cancel before"}));
  EXPECT_TRUE(snapshot(p) == before);
}

// Asked during the call (forward and backward of many tasks, several threads): the call stops
// with Cancelled and runs no task after the answer; a callback that never asks changes nothing.
TEST(WorkBounds, CancelDuringTheCallStopsIt) {
  const ProblemConfig cfg = make_config(2, 4, 2, 700, 700, 32, Mask::CausalBottomRight);
  Problem plain(cfg);
  run_forward(plain, options_for(plain.cfg, 2));
  run_backward(plain, options_for(plain.cfg, 2));
  for (bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward" : "forward");
    Canceller never;
    Problem p(cfg);
    Options o = options_for(p.cfg, 2);
    o.cancel = &Canceller::poll;
    o.cancel_arg = &never;
    ASSERT_NO_THROW(run_forward(p, o));
    ASSERT_NO_THROW(run_backward(p, o));
    EXPECT_TRUE(snapshot(p) == snapshot(plain)) << "a callback that never cancels changed the results";
    EXPECT_GT(never.polls.load(), 16) << "polled before every task";

    Canceller c;
    c.stop_at = 5;  // after the call's own check, a few tasks run, then the rest are skipped
    Problem q(cfg);
    Options oc = options_for(q.cfg, 2);
    oc.cancel = &Canceller::poll;
    oc.cancel_arg = &c;
    if (backward) ASSERT_NO_THROW(run_forward(q, options_for(q.cfg, 2)));
    EXPECT_TRUE(throws_error([&] { backward ? run_backward(q, oc) : run_forward(q, oc); }, Status::Cancelled,
                             {"cancelled by options.cancel during the call"}));
    // Each task polls once; after the answer every remaining task polls at most once more (the
    // skip test comes first), so the total stays far below a full call's.
    EXPECT_LT(c.polls.load(), never.polls.load());
  }
}

// Through the C ABI: the new fields are read only from callers whose struct has them, and the
// status has its code and name.
TEST(WorkBounds, ThroughTheCAbi) {
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_ERROR_CANCELLED), "cancelled");
  Problem p(small());
  const flashattn_tensor q = to_c(p.q.view), k = to_c(p.k.view), v = to_c(p.v.view), out = to_c(p.out.view), lse = to_c(p.lse.view);
  flashattn_options o;
  flashattn_options_init(&o);
  o.max_flops = 1.0;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  Canceller c;
  c.stop_at = 1;
  o.max_flops = 0.0;
  o.cancel = &Canceller::poll;
  o.cancel_arg = &c;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_ERROR_CANCELLED);
  EXPECT_NE(std::string(flashattn_last_error()).find("cancelled"), std::string::npos);
  o.struct_size = FLASHATTN_OPTIONS_V3_SIZE;  // a version-3 caller: neither field exists
  o.max_flops = 1.0;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_OK) << flashattn_last_error();
}


// ---- caller-owned workspace (options.workspace, workspace_query) ------------------------------

// A query validates as a call does, stores 0 on the CPU (no device scratch) and writes nothing.
TEST(CallerWorkspace, QueryOnTheCpuIsZeroAndWritesNothing) {
  Problem p(small());
  const Snapshot before = snapshot(p);
  uint64_t need = 12345;
  Options o;
  o.workspace_query = &need;
  ASSERT_NO_THROW(run_forward(p, o));
  EXPECT_EQ(need, 0u);
  need = 777;
  ASSERT_NO_THROW(run_backward(p, o));
  EXPECT_EQ(need, 0u);
  EXPECT_TRUE(snapshot(p) == before) << "a query wrote a tensor";
  // An invalid call is an error as always (the query is not stored).
  Options bad = o;
  bad.mask = static_cast<Mask>(9);
  need = 5;
  EXPECT_TRUE(throws_error([&] { run_forward(p, bad); }, Status::InvalidArgument, {"mask"}));
  EXPECT_EQ(need, 5u);
}

// CPU calls ignore a workspace (results unchanged), whatever it is.
TEST(CallerWorkspace, IgnoredByCpuCalls) {
  Problem a(small()), b(small());
  run_forward(a, options_for(a.cfg, 1));
  Options o = options_for(b.cfg, 1);
  alignas(256) static unsigned char scratch[512];
  o.workspace = scratch + 3;  // (misaligned, small: not looked at on the CPU)
  o.workspace_bytes = 1;
  ASSERT_NO_THROW(run_forward(b, o));
  EXPECT_TRUE(snapshot(a) == snapshot(b));
}

// Through the C ABI: the fields are read only from version-4 structs.
TEST(CallerWorkspace, ThroughTheCAbi) {
  Problem p(small());
  const flashattn_tensor q = to_c(p.q.view), k = to_c(p.k.view), v = to_c(p.v.view), out = to_c(p.out.view), lse = to_c(p.lse.view);
  const Snapshot before = snapshot(p);
  flashattn_options o;
  flashattn_options_init(&o);
  EXPECT_EQ(o.workspace, nullptr);
  EXPECT_EQ(o.workspace_bytes, 0u);
  EXPECT_EQ(o.workspace_query, nullptr);
  uint64_t need = 99;
  o.workspace_query = &need;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_OK);
  EXPECT_EQ(need, 0u);
  EXPECT_TRUE(snapshot(p) == before);
  // A version-3 caller's struct ends before the fields: a real call, the pointer never read.
  need = 99;
  o.struct_size = FLASHATTN_OPTIONS_V4_SIZE;
  EXPECT_EQ(flashattn_forward(&q, &k, &v, &out, &lse, &o), FLASHATTN_OK);
  EXPECT_EQ(need, 99u);
  EXPECT_FALSE(snapshot(p) == before);
}

}  // namespace
}  // namespace flashattn::test
