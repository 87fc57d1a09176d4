// Bitwise determinism: the same inputs give the same bytes in every output, run after run and for
// any CPU thread count (the backward uses no atomics and no shared accumulators, and work is split
// so that each output element is always reduced in the same order).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.hpp"

namespace flashattn::test {
namespace {

struct DetCase {
  ProblemConfig cfg;
  const char* name;
};

ProblemConfig cfg(int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t d, Mask m,
                  DType dt, testing::Layout l) {
  return make_config(b, hq, hkv, sq, skv, d, m, dt, l, 0.0f, /*seed=*/77);
}

// Shapes with several blocks per head in both directions and ragged tails, GQA so that dK/dV sum
// over several query heads (the place where a thread-count-dependent reduction order would show).
const DetCase kCases[] = {
    {cfg(2, 4, 2, 193, 257, 72, Mask::CausalBottomRight, DType::Float32, testing::Layout::BHSD),
     "f32_gqa_br"},
    {cfg(1, 6, 1, 300, 129, 128, Mask::None, DType::BFloat16, testing::Layout::BSHD), "bf16_mqa"},
    {cfg(3, 2, 2, 130, 130, 64, Mask::CausalTopLeft, DType::Float16, testing::Layout::BHSD),
     "f16_tl"},
    {cfg(1, 4, 2, 100, 150, 40, Mask::None, DType::Float64, testing::Layout::BSHD), "f64"},
};

class Determinism : public ::testing::TestWithParam<DetCase> {};

TEST_P(Determinism, BitwiseAcrossRunsAndThreadCounts) {
  const ProblemConfig& c = GetParam().cfg;
  SCOPED_TRACE(c.describe());
  Problem p(c);
  auto run = [&](int32_t threads) {
    p.poison_outputs();
    const Options o = options_for(c, threads);
    run_forward(p, o);
    run_backward(p, o);
    return snapshot(p);
  };
  const Snapshot first = run(1);
  // Every output was written (the poison is NaN; a bitwise-stable NaN would otherwise "pass").
  const char* names[] = {"q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"};
  for (const testing::HostTensor* t : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv})
    for (double x : p.to_double(*t)) ASSERT_FALSE(std::isnan(x)) << "an output kept its NaN poison";
  for (int32_t threads : {1, 2, 3, 8, 64, 1, 8}) {
    const Snapshot again = run(threads);
    for (size_t i = 0; i < first.bytes.size(); ++i)
      EXPECT_TRUE(again.bytes[i] == first.bytes[i])
          << names[i] << " differs with num_threads=" << threads << " from num_threads=1";
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Determinism, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<DetCase>& i) { return i.param.name; });

}  // namespace
}  // namespace flashattn::test
