// NaN and Inf in the inputs on the CPU backend, through the public API: each output is NaN, 0,
// -inf or the float64 reference's value exactly as the rule of tests/nonfinite_cases.hpp says, in
// every dtype, forward and backward, with rows that see no key (bottom-right causal, Sq > Skv) and
// keys no row sees (top-left causal, Skv > Sq) beside the rows the NaN reaches. Also: visible
// scores that are all -inf, scores far beyond float32's exponent of exp (2e19), and the
// backward's recomputed P staying <= 1 there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "nonfinite_cases.hpp"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Tolerances of Value entries relative to max(1, max |ref|): the values are not the point here
// (the grids judge accuracy), the classes are; these only catch a wrong value.
// LSE is float32 in every dtype.
void tolerances(DType dt, double (&tol)[5]) {
  const double t = dt == DType::Float64 ? 1e-9 : (dt == DType::Float32 ? 2e-5 : 3e-2);
  for (double& x : tol) x = t;
  tol[1] = std::max(t, 1e-6);
}

// Small shapes (one tile per pass, so every hidden entry shares a tile with the poison) and one
// of several tiles per dimension (64 x 128 tiles on every instruction set, so some hidden entries
// are in tiles no pass visits).
const std::vector<NonFiniteShape> kShapes = {
    {"none", 1, 2, 1, 5, 7, 8, Mask::None},
    {"bottom_right_empty_rows", 1, 2, 1, 7, 4, 8, Mask::CausalBottomRight},  // rows 0-2 see no key
    {"top_left_unseen_keys", 2, 2, 2, 4, 7, 3, Mask::CausalTopLeft},         // keys 4-6: no row
    {"window", 1, 1, 1, 9, 9, 5, Mask::None, 1, 2},
    {"tiles_bottom_right", 1, 2, 1, 150, 140, 16, Mask::CausalBottomRight},  // rows 0-9 see no key
};

const DType kDtypes[] = {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64};

// Forward and backward through the public API (two threads), every output against the rule.
void check_case(const ProblemConfig& cfg, const std::vector<Poison>& poison) {
  Problem p(cfg);
  apply_poison(p, poison);
  const Options o = options_for(p, 2);
  ASSERT_NO_THROW(run_forward(p, o));
  ASSERT_NO_THROW(run_backward(p, o));
  double tol[5];
  tolerances(cfg.dtype, tol);
  EXPECT_TRUE(matches_wants(outputs_of(p), outputs_of(reference_for(p)), wants_for(cfg, poison, true), tol))
      << cfg.describe();
}

class CpuNonFinite : public ::testing::TestWithParam<NonFiniteParam> {};

TEST_P(CpuNonFinite, OutputsFollowTheRule) {
  const NonFiniteParam& t = GetParam();
  check_case(config_of(t.shape, t.dtype, 7), t.c.poison(t.shape));
}

INSTANTIATE_TEST_SUITE_P(All, CpuNonFinite,
                         ::testing::ValuesIn(nonfinite_params(kShapes, {std::begin(kDtypes), std::end(kDtypes)})),
                         nonfinite_param_name);

// The rule must be able to fail: before the fix a row whose scores were all NaN took the
// empty-row branch (O = 0, LSE = -inf); the same check on finite inputs with a wrong oracle
// (a NaN claimed where there is none) fails too.
TEST(CpuNonFiniteOracle, DetectsAWrongClass) {
  const ProblemConfig cfg = config_of(kShapes[1], DType::Float32, 7);
  Problem p(cfg);
  run_forward(p, options_for(p, 1));
  run_backward(p, options_for(p, 1));
  const Outputs got = outputs_of(p), ref = outputs_of(reference_for(p));
  double tol[5];
  tolerances(cfg.dtype, tol);
  EXPECT_TRUE(matches_wants(got, ref, wants_for(cfg, {}, false), tol));
  // A poison the problem does not carry: the rule then wants NaN where the outputs are finite.
  EXPECT_FALSE(matches_wants(got, ref, wants_for(cfg, {{Poison::Q, 0, 0, 5, 0, kNan}}, false), tol));
}

// A row whose visible scores are all -inf (k = -inf where q > 0; top-left causal: row 0 sees key 0
// only) is not empty: O = 0/0 = NaN, LSE = log 0 = -inf; its backward is NaN (P = exp(-inf + inf)).
// Row 1 also sees key 1: P = 0 on key 0 and O = v_1; its dQ gets 0 * -inf = NaN in the poisoned
// column only.
TEST(CpuNonFinite, VisibleScoresAllMinusInf) {
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const ProblemConfig cfg = make_config(1, 1, 1, 2, 2, 4, Mask::CausalTopLeft, dt, testing::Layout::BHSD, 0.0f, 3);
    Problem p(cfg);
    apply_poison(p, {{Poison::K, 0, 0, 0, 0, -kInf}});
    const Options o = options_for(p, 1);
    run_forward(p, o);
    run_backward(p, o);
    const Reference r = reference_for(p);
    const auto out = p.to_double(p.out), lse = p.to_double(p.lse), dq = p.to_double(p.dq), dk = p.to_double(p.dk),
               dv = p.to_double(p.dv), v = p.to_double(p.v);
    for (int x = 0; x < 4; ++x) {
      EXPECT_TRUE(std::isnan(out[x])) << "out[0][" << x << "] = " << out[x];
      EXPECT_TRUE(std::isnan(r.fwd.out[x])) << "reference out[0][" << x << "]";
      EXPECT_NEAR(out[4 + x], v[4 + x], 1e-2 * std::fabs(v[4 + x])) << "row 1 is v_1";
      EXPECT_TRUE(std::isnan(dq[x]) && std::isnan(dk[x]) && std::isnan(dv[x])) << x;
      EXPECT_EQ(std::isnan(dq[4 + x]), x == 0) << "dq[1][" << x << "] = " << dq[4 + x];
      EXPECT_EQ(std::isnan(r.bwd.dq[4 + x]), x == 0) << "reference dq[1][" << x << "]";
      EXPECT_TRUE(std::isfinite(dk[4 + x]) && std::isfinite(dv[4 + x])) << x;
    }
    EXPECT_EQ(lse[0], -kInf);
    EXPECT_EQ(r.fwd.lse[0], -kInf);
    EXPECT_TRUE(std::isfinite(lse[1]));
  }
}

// Scores of 2e19 (D = 1, scale 1), and of 3.6e15 in float16 (its inputs stop at 65504; scale 1e6):
// far beyond the exponent range of exp, the softmax is one-hot and O is the argmax key's v
// exactly; LSE is the largest score. The backward recomputes P = exp(S - LSE) from a float32 LSE,
// whose rounding there (2^41 at 2e19) decides P: it must stay <= 1, and the gradients finite;
// float64 recomputes LSE in double and matches the reference (dQ = dK = 0: one-hot P has no
// slope, dV = dO on each row's argmax key).
TEST(CpuNonFinite, HugeScoresGiveTheArgmaxValue) {
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dtype_name(dt));
    const bool f16 = dt == DType::Float16;
    const double a = f16 ? 6e4 : 4.4e9;  // q_i k_j up to a^2 = 1.9e19 (times 1e6 in float16)
    ProblemConfig cfg = make_config(1, 1, 1, 3, 4, 1, Mask::None, dt, testing::Layout::BHSD, f16 ? 1e6f : 1.0f, 5);
    Problem p(cfg);
    const double q[3] = {a, -a, a / 2}, k[4] = {a / 3, a, -a / 2, a / 4}, v[4] = {1.5, -2.0, 3.0, 0.25};
    for (int i = 0; i < 3; ++i) testing::store_element(p.q.view.data, dt, i, q[i]);
    for (int j = 0; j < 4; ++j) {
      testing::store_element(p.k.view.data, dt, j, k[j]);
      testing::store_element(p.v.view.data, dt, j, v[j]);
    }
    const Options o = options_for(p, 1);
    run_forward(p, o);
    run_backward(p, o);
    const Reference r = reference_for(p);
    const auto out = p.to_double(p.out), lse = p.to_double(p.lse), kk = p.to_double(p.k), qq = p.to_double(p.q);
    for (int i = 0; i < 3; ++i) {
      int arg = 0;
      for (int j = 1; j < 4; ++j)
        if (qq[i] * kk[j] > qq[i] * kk[arg]) arg = j;
      EXPECT_EQ(out[i], v[arg]) << "row " << i;
      EXPECT_EQ(r.fwd.out[i], v[arg]) << "reference row " << i;
      const double top = cfg.scale() * qq[i] * kk[arg];
      EXPECT_NEAR(lse[i], top, 1e-6 * std::fabs(top)) << "row " << i;
    }
    for (const testing::HostTensor* t : {&p.dq, &p.dk, &p.dv})
      for (double x : p.to_double(*t)) EXPECT_TRUE(std::isfinite(x)) << "a gradient is " << x;
    {
      double bound = 0;  // dV_j = sum_i P_ij dO_i with P <= 1
      for (double x : p.to_double(p.dout)) bound += std::fabs(x);
      for (double x : p.to_double(p.dv)) EXPECT_LE(std::fabs(x), bound) << "dV beyond sum |dO|: P > 1";
    }
    if (dt == DType::Float64) {
      const std::vector<double> got[3] = {p.to_double(p.dq), p.to_double(p.dk), p.to_double(p.dv)};
      const std::vector<double>* want[3] = {&r.bwd.dq, &r.bwd.dk, &r.bwd.dv};
      for (int g = 0; g < 3; ++g)
        for (size_t e = 0; e < got[g].size(); ++e) EXPECT_EQ(got[g][e], (*want[g])[e]) << g << "[" << e << "]";
    }
  }
}

}  // namespace
}  // namespace flashattn::test
