// NaN and Inf in the inputs on the CUDA backend: every output of every kernel family against the
// rule of tests/nonfinite_cases.hpp (the one the float64 reference and the CPU backend follow) -
// NaN, exactly 0 on rows that see no key and keys no row sees, -inf, or the reference's value
// (with the kernels' allowance for a tile product's 0 * NaN). Poisons: NaN in q, k, v; +inf in k;
// a NaN in the first key (every row of a causal mask sees it); a NaN of all-ones bytes (the GPU's
// canonical NaN 0x7fffffff and a memset's 0xffffffff used to round to -0 / 0 in tf32). Each case
// runs in float32 through every arithmetic and kernel family (the FMA kernels, 3xTF32, tf32, the
// mma.sync and sm_90a kernels, both tf32 backwards, the pair kernels) and in float16 / bfloat16
// through both forward families and both backward designs. Also: visible scores all -inf (O NaN,
// LSE -inf), and scores of 1.8e19, where O must be the argmax key's v (the sm_90a forward's fused
// exponent gave O = 0 there). Without a CUDA device every test reports SKIPPED.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.hpp"
#include "nonfinite_cases.hpp"

namespace flashattn::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using Env = std::vector<std::pair<const char*, const char*>>;
struct EnvSet {
  std::vector<std::unique_ptr<EnvScope>> scopes;
  explicit EnvSet(const Env& env) {
    for (const auto& [k, v] : env) scopes.push_back(std::make_unique<EnvScope>(k, v));
  }
};

// One way through the kernels: options and FLASHATTN_CUDA_* overrides. x3: a 3xTF32 product is
// involved, where an infinite input element becomes NaN in every product it enters (its split
// partner's small part times the infinity: 0 * inf), so -inf in k does not hide a key there.
struct Route {
  const char* label;
  Precision prec;
  bool deterministic;
  Env env;
  bool x3;
  double tol;  // Value entries, relative to max(1, max |ref|)
};

std::vector<Route> routes_for(const ProblemConfig& c) {
  using P = Precision;
  std::vector<Route> r;
  if (c.dtype == DType::Float32) {
    r = {{"fma", P::Fp32, true, {{"FLASHATTN_CUDA_MATH", "fma"}}, false, 1e-4},
         {"fp32", P::Fp32, true, {}, true, 1e-4},
         {"tf32", P::Tf32, true, {}, false, 1e-2},
         {"tf32 mma.sync", P::Tf32, true, {{"FLASHATTN_CUDA_ARCH", "sm80"}}, false, 1e-2},
         {"fp32 mma.sync", P::Fp32, true, {{"FLASHATTN_CUDA_ARCH", "sm80"}}, true, 1e-4},
         // The fp32-mode forward over chunks of 128 keys (merged in float64; a long key sequence's
         // path): the rule must hold across chunks, e.g. a NaN key in one chunk, a row that sees no
         // key in one chunk but some in another.
         {"fp32 key chunks", P::Fp32, true, {{"FLASHATTN_CUDA_KEY_CHUNK", "128"}}, true, 1e-4},
         {"fma key chunks", P::Fp32, true, {{"FLASHATTN_CUDA_MATH", "fma"}, {"FLASHATTN_CUDA_KEY_CHUNK", "128"}}, false,
          1e-4}};
    if (c.head_dim <= 128) {
      r.push_back({"fp32 fwd/bwd mma", P::Fp32, true, {{"FLASHATTN_CUDA_FP32_FWD", "mma"}, {"FLASHATTN_CUDA_FP32_BWD", "mma"}},
                   true, 1e-4});
      r.push_back({"tf32 bwd mma, fwd copies v", P::Tf32, true,
                   {{"FLASHATTN_CUDA_TF32_BWD", "mma"}, {"FLASHATTN_CUDA_TF32_FWD_COPIES", "v"}}, false, 1e-2});
      r.push_back({"tf32 fwd copies kv", P::Tf32, true, {{"FLASHATTN_CUDA_TF32_FWD_COPIES", "kv"}}, false, 1e-2});
    }
    if (c.head_dim <= 64) {
      r.push_back({"tf32 pair", P::Tf32, true, {{"FLASHATTN_CUDA_TF32_BWD", "pair"}}, false, 1e-2});
      r.push_back({"tf32 wgmma-dq", P::Tf32, true, {{"FLASHATTN_CUDA_TF32_BWD", "wgmma-dq"}}, false, 1e-2});
    }
    return r;
  }
  r = {{"deterministic", P::Fp32, true, {}, false, 5e-2},  // (sm_90a: the ordered pass)
       {"atomic", P::Fp32, false, {{"FLASHATTN_CUDA_BWD", "atomic"}}, false, 5e-2},
       {"sm80 split", P::Fp32, true, {{"FLASHATTN_CUDA_ARCH", "sm80"}}, false, 5e-2},
       {"sm80 atomic", P::Fp32, false, {{"FLASHATTN_CUDA_BWD", "atomic"}, {"FLASHATTN_CUDA_ARCH", "sm80"}}, false, 5e-2},
       {"split-nondet, pingpong 0", P::Fp32, false,
        {{"FLASHATTN_CUDA_BWD", "split"}, {"FLASHATTN_CUDA_PINGPONG", "0"}}, false, 5e-2}};
  if (c.head_dim <= 64) {
    r.push_back({"atomic v0", P::Fp32, false, {{"FLASHATTN_CUDA_BWD", "atomic"}, {"FLASHATTN_CUDA_SM90_VARIANT", "0"}},
                 false, 5e-2});
    r.push_back({"atomic v1", P::Fp32, false, {{"FLASHATTN_CUDA_BWD", "atomic"}, {"FLASHATTN_CUDA_SM90_VARIANT", "1"}},
                 false, 5e-2});
  }
  return r;
}

// Forward and backward of one run on a fresh device copy; the outputs back in `got`.
bool run_once(Problem& p, const Route& run, Outputs& got) {
  EnvSet env(run.env);
  DeviceProblem d(p);
  if (!d.ok()) {
    ADD_FAILURE() << "cudaMalloc failed";
    return false;
  }
  Options o = p.options();
  o.precision = run.prec;
  o.deterministic = run.deterministic;
  try {
    d.forward(o);
    d.backward(o);
  } catch (const Error& e) {
    ADD_FAILURE() << run.label << " threw (status " << static_cast<int>(e.status()) << "): " << e.what() << "\n"
                  << p.cfg.describe();
    return false;
  }
  p.poison_outputs();
  d.download();
  got = outputs_of(p);
  return true;
}

// Rows without keys and keys without rows in CTAs that also hold rows and keys the NaN reaches;
// head dims that reach every kernel family (the sm_90a kernels at 32 - 128, col_split at 256, a
// padded D = 1).
const std::vector<NonFiniteShape> kShapes = {
    {"none_D128", 1, 4, 2, 33, 47, 128, Mask::None},
    {"bottom_right_empty_rows_D64", 1, 2, 1, 150, 70, 64, Mask::CausalBottomRight},  // rows 0-79: no key
    {"top_left_unseen_keys_D64", 2, 2, 2, 40, 150, 64, Mask::CausalTopLeft},         // keys 40-149: no row
    {"window_D32", 1, 2, 2, 90, 90, 32, Mask::None, 5, 3},
    {"bottom_right_D256", 1, 2, 1, 70, 40, 256, Mask::CausalBottomRight},
    {"bottom_right_D1", 1, 1, 1, 9, 5, 1, Mask::CausalBottomRight},
};

class CudaNonFinite : public ::testing::TestWithParam<NonFiniteParam> {};

TEST_P(CudaNonFinite, OutputsFollowTheRule) {
  REQUIRE_GPU();
  const NonFiniteParam& t = GetParam();
  const ProblemConfig cfg = config_of(t.shape, t.dtype, 11);
  const std::vector<Poison> poison = t.c.poison(t.shape);
  Problem p(cfg);
  apply_poison(p, poison);
  const Outputs ref = outputs_of(reference_for(p));
  const Wants wants = wants_for(cfg, poison, true);
  for (const Route& run : routes_for(cfg)) {
    Outputs got;
    if (!run_once(p, run, got)) continue;
    const double tol[5] = {run.tol, std::max(run.tol, 1e-4), run.tol, run.tol, run.tol};
    EXPECT_TRUE(matches_wants(got, ref, wants, tol)) << run.label << "\n" << cfg.describe();
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaNonFinite,
                         ::testing::ValuesIn(nonfinite_params(kShapes, {DType::Float32, DType::BFloat16, DType::Float16})),
                         nonfinite_param_name);

// A row whose visible scores are all -inf (k = -inf where q > 0; top-left causal: row 0 sees key 0
// only) is not empty: O = 0/0 = NaN, LSE = -inf, and its backward is NaN (P = exp2(-inf + inf)).
// Row 1 also sees key 1: O = v_1. (Not in 3xTF32: see Route::x3.)
TEST(CudaNonFiniteRows, VisibleScoresAllMinusInf) {
  REQUIRE_GPU();
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(dt));
    const ProblemConfig cfg = make_config(1, 1, 1, 2, 2, 8, Mask::CausalTopLeft, dt, testing::Layout::BHSD, 0.0f, 3);
    Problem p(cfg);
    apply_poison(p, {{Poison::K, 0, 0, 0, 0, -kInf}});
    const auto v = p.to_double(p.v);
    for (const Route& run : routes_for(cfg)) {
      if (run.x3) continue;
      SCOPED_TRACE(run.label);
      Outputs out;
      if (!run_once(p, run, out)) continue;
      const std::vector<double>(&got)[5] = out.v;
      EXPECT_EQ(got[1][0], -kInf);
      EXPECT_TRUE(std::isfinite(got[1][1]));
      for (int x = 0; x < 8; ++x) {
        EXPECT_TRUE(std::isnan(got[0][x])) << "out[0][" << x << "] = " << got[0][x];
        EXPECT_NEAR(got[0][8 + x], v[8 + x], 2e-2 * (1 + std::fabs(v[8 + x]))) << "row 1 is v_1";
        EXPECT_TRUE(std::isnan(got[2][x]) && std::isnan(got[3][x]) && std::isnan(got[4][x])) << x;
      }
    }
  }
}

// Scores of 2^64 = 1.8e19 (float16: 2^30 x scale 1e6): O is the argmax key's v exactly (every
// input a power of two, so every product is exact in every arithmetic), LSE the top score. D = 1
// (padded) and D = 64 (the sm_90a forwards, whose fused exponent lost P there). The backward is
// not checked: it recomputes P from a float32 LSE whose rounding there is 2^41 (flashattn.h).
TEST(CudaNonFiniteRows, HugeScoresGiveTheArgmaxValue) {
  REQUIRE_GPU();
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
    for (int64_t d : {1, 64}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " D=" + std::to_string(d));
      const bool f16 = dt == DType::Float16;
      const double a = f16 ? 32768.0 : 4294967296.0;  // 2^15, 2^32
      ProblemConfig cfg = make_config(1, 1, 1, 3, 4, d, Mask::None, dt, testing::Layout::BHSD, f16 ? 1e6f : 1.0f, 5);
      Problem p(cfg);
      const double q[3] = {a, -a, a / 2}, k[4] = {a / 4, a, -a / 2, a / 8};
      for (int i = 0; i < 3; ++i)
        for (int64_t x = 0; x < d; ++x) testing::store_element(p.q.view.data, dt, i * d + x, x == 0 ? q[i] : 0.0);
      for (int j = 0; j < 4; ++j)
        for (int64_t x = 0; x < d; ++x) {
          testing::store_element(p.k.view.data, dt, j * d + x, x == 0 ? k[j] : 0.0);
          testing::store_element(p.v.view.data, dt, j * d + x, 0.25 * (j + 1) - 0.5 * static_cast<double>(x % 5));
        }
      const auto v = p.to_double(p.v);
      for (const Route& run : routes_for(cfg)) {
        SCOPED_TRACE(run.label);
        Outputs out;
        if (!run_once(p, run, out)) continue;
        const std::vector<double>(&got)[5] = out.v;
        for (int i = 0; i < 3; ++i) {
          int arg = 0;
          for (int j = 1; j < 4; ++j)
            if (q[i] * k[j] > q[i] * k[arg]) arg = j;
          for (int64_t x = 0; x < d; ++x) EXPECT_EQ(got[0][i * d + x], v[arg * d + x]) << "row " << i << " col " << x;
          const double top = cfg.scale() * q[i] * k[arg];
          EXPECT_NEAR(got[1][i], top, 1e-6 * top) << "row " << i;
        }
      }
    }
}

}  // namespace
}  // namespace flashattn::test
