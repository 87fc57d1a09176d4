// Accuracy at long key ranges on the CPU backend (issue: reliability): a row's output is a sum
// over every key it sees, and a float32 running sum loses digits as it outgrows its terms (n
// equal terms: ~n * 2^-24 relative; 1e-2 at 1M keys). The forward keeps each key tile's sum in
// float32 and the sum over tiles in double (Forward::Tiles), so the error must stay at the level
// of one tile's at any length. Checked where the float32 sum is worst, uniform attention (every
// P = 1, q = 0) over V > 0, against the float64 mean; and at random scores against the float64
// reference.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "test_util.hpp"

namespace flashattn::test {
namespace {

using testing::load_element;
using testing::store_element;

// O = mean of V's rows exactly (q = 0: every score 0, every weight 1), LSE = ln(Skv). Every key
// holds the same V row, whose entries 1 + 3 (e + 1) / 1024 carry bits below the unit in the last
// place of a float32 sum past 2^17: a running sum over the row drops them at every addition
// (~3e-3 relative at 128k keys), a tile's sum of 128 keys keeps them.
TEST(CpuLongSequences, UniformAttentionOver128kKeysIsExactToFloat32) {
  const int64_t skv = 131072, sq = 3, d = 64;
  Problem p(make_config(1, 1, 1, sq, skv, d, Mask::None, DType::Float32));
  auto value = [](int64_t e) { return 1.0 + 3.0 * static_cast<double>(e + 1) / 1024.0; };
  for (int64_t i = 0; i < sq * d; ++i) store_element(p.q.view.data, DType::Float32, i, 0.0);
  for (int64_t i = 0; i < skv * d; ++i) store_element(p.v.view.data, DType::Float32, i, value(i % d));
  ASSERT_NO_THROW(run_forward(p, options_for(p, 2)));
  double worst = 0;
  for (int64_t i = 0; i < sq; ++i)
    for (int64_t e = 0; e < d; ++e) {
      const double got = load_element(p.out.view.data, DType::Float32, i * d + e);
      worst = std::max(worst, std::fabs(got - value(e)) / value(e));
    }
  EXPECT_LE(worst, 1e-6) << "max relative error of O";
  for (int64_t i = 0; i < sq; ++i)
    EXPECT_NEAR(load_element(p.lse.view.data, DType::Float32, i), std::log(static_cast<double>(skv)), 1e-5);
}

// Random scores (a causal band over 131072 keys with the rows at its end) against the float64
// reference: forward and backward within float32's error at this length.
TEST(CpuLongSequences, RandomScoresOver128kKeysMatchTheReference) {
  Problem p(make_config(1, 1, 1, 5, 131072, 32, Mask::CausalBottomRight, DType::Float32));
  const Options o = options_for(p, 2);
  ASSERT_NO_THROW(run_forward(p, o));
  ASSERT_NO_THROW(run_backward(p, o));
  const Reference ref = reference_for(p);
  const testing::ErrorStats eo = testing::compare(p.to_double(p.out), ref.fwd.out);
  const testing::ErrorStats el = testing::compare(p.to_double(p.lse), ref.fwd.lse);
  const testing::ErrorStats edq = testing::compare(p.to_double(p.dq), ref.bwd.dq);
  const testing::ErrorStats edk = testing::compare(p.to_double(p.dk), ref.bwd.dk);
  const testing::ErrorStats edv = testing::compare(p.to_double(p.dv), ref.bwd.dv);
  for (const testing::ErrorStats* e : {&eo, &el, &edq, &edk, &edv}) EXPECT_EQ(e->nan, 0);
  EXPECT_LE(eo.rel, 1e-5) << "O " << eo.str();
  EXPECT_LE(el.max_abs, 1e-5) << "LSE " << el.str();
  EXPECT_LE(edq.rel, 1e-4) << "dQ " << edq.str();
  EXPECT_LE(edk.rel, 1e-4) << "dK " << edk.str();
  EXPECT_LE(edv.rel, 1e-4) << "dV " << edv.str();
}

}  // namespace
}  // namespace flashattn::test
