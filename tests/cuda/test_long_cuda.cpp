// Accuracy over a million keys on the CUDA backend (issue: reliability): each output row is a sum
// over every key it sees, accumulated across 2^20 / block_n key tiles. Checked against a float64
// reduction computed here row by row (streaming: no S matrix), for the float32 kernels in both
// precisions and for bfloat16, at random scores and at uniform attention (q = 0: every weight 1,
// O = the mean of V, the case where a float32 running sum loses the most).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "cuda_test_util.hpp"

namespace flashattn::test {
namespace {

using testing::load_element;
using testing::store_element;

constexpr int64_t kKeys = int64_t{1} << 20;

// O and LSE of every query row in float64 (two passes over the keys per row: max, then sums),
// rows spread over the host's threads.
void reference_rows(const Problem& p, int64_t sq, int64_t skv, int64_t d, double scale, std::vector<double>& o,
                    std::vector<double>& lse) {
  const DType t = p.q.view.dtype;
  std::vector<double> K(static_cast<size_t>(skv * d)), V(K.size());
  for (int64_t i = 0; i < skv * d; ++i) K[i] = load_element(p.k.view.data, t, i), V[i] = load_element(p.v.view.data, t, i);
  o.assign(static_cast<size_t>(sq * d), 0.0);
  lse.assign(static_cast<size_t>(sq), 0.0);
  auto row = [&](int64_t i) {
    std::vector<double> q(static_cast<size_t>(d)), acc(static_cast<size_t>(d), 0.0);
    for (int64_t e = 0; e < d; ++e) q[e] = load_element(p.q.view.data, t, i * d + e);
    double m = -INFINITY;
    for (int64_t j = 0; j < skv; ++j) {
      double s = 0;
      for (int64_t e = 0; e < d; ++e) s += q[e] * K[j * d + e];
      m = std::max(m, s * scale);
    }
    double l = 0;
    for (int64_t j = 0; j < skv; ++j) {
      double s = 0;
      for (int64_t e = 0; e < d; ++e) s += q[e] * K[j * d + e];
      const double w = std::exp(s * scale - m);
      l += w;
      for (int64_t e = 0; e < d; ++e) acc[e] += w * V[j * d + e];
    }
    for (int64_t e = 0; e < d; ++e) o[i * d + e] = acc[e] / l;
    lse[i] = m + std::log(l);
  };
  const int64_t n = std::max<int64_t>(1, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < n; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < sq; i += n) row(i);
    });
  for (auto& th : pool) th.join();
}

struct Errors {
  double o_rel = 0, lse_abs = 0;
  bool nan = false;
};

Errors run_and_compare(Problem& p, int64_t sq, int64_t d, Precision prec) {
  DeviceProblem dp(p);
  EXPECT_TRUE(dp.ok());
  Options o = p.options(0);
  o.precision = prec;
  dp.forward(o);
  dp.download();
  std::vector<double> ro, rl;
  reference_rows(p, sq, kKeys, d, 1.0 / std::sqrt(static_cast<double>(d)), ro, rl);
  Errors e;
  double num = 0, den = 0;
  for (int64_t i = 0; i < sq * d; ++i) {
    const double g = load_element(p.out.view.data, p.out.view.dtype, i);
    e.nan |= std::isnan(g);
    num = std::max(num, std::fabs(g - ro[i]));
    den = std::max(den, std::fabs(ro[i]));
  }
  e.o_rel = num / den;
  for (int64_t i = 0; i < sq; ++i) {
    const double g = load_element(p.lse.view.data, DType::Float32, i);
    e.nan |= std::isnan(g);
    e.lse_abs = std::max(e.lse_abs, std::fabs(g - rl[i]));
  }
  return e;
}

// Uniform attention: q = 0, V rows all equal to 1 + 3 (e + 1) / 1024 (bits a float32 running sum
// past 2^17 drops at every addition).
void make_uniform(Problem& p, int64_t sq, int64_t d) {
  const DType t = p.q.view.dtype;
  for (int64_t i = 0; i < sq * d; ++i) store_element(p.q.view.data, t, i, 0.0);
  for (int64_t i = 0; i < kKeys * d; ++i) store_element(p.v.view.data, t, i, 1.0 + 3.0 * static_cast<double>(i % d + 1) / 1024.0);
}

TEST(CudaLongSequences, MillionKeysFloat32) {
  REQUIRE_GPU();
  const int64_t sq = 64, d = 64;
  for (Precision prec : {Precision::Fp32, Precision::Tf32}) {
    SCOPED_TRACE(prec == Precision::Fp32 ? "fp32" : "tf32");
    Problem p(make_config(1, 1, 1, sq, kKeys, d, Mask::None, DType::Float32));
    // (The fp32 mode's key chunks are the default: select.hpp kKeyChunksByDefault.)
    const Errors r = run_and_compare(p, sq, d, prec);
    EXPECT_FALSE(r.nan);
    // tf32 rounds q, k and P to 10 mantissa bits: its error is that of the inputs' rounding.
    EXPECT_LE(r.o_rel, prec == Precision::Fp32 ? 1e-5 : 3e-3) << "random scores: O";
    EXPECT_LE(r.lse_abs, prec == Precision::Fp32 ? 1e-4 : 3e-3) << "random scores: LSE";
    make_uniform(p, sq, d);
    const Errors u = run_and_compare(p, sq, d, prec);
    EXPECT_FALSE(u.nan);
    // Uniform attention is the adversarial case: every tile adds the same value to a running
    // sum that grows to 2^20, so each addition's rounding has the same sign; a one-level float32
    // sum errs by up to tiles * 2^-24 (measured on an H100 over 16384 tiles: fp32 4.8e-4). The
    // fp32 mode runs keys in chunks of 16384 merged in float64 (ForwardPlan::key_chunk): at most
    // 256 tiles per float32 sum, ~7e-6. tf32 is not chunked (its error is its inputs' rounding;
    // its tensor-core accumulation truncates: 1.0e-2 measured).
    EXPECT_LE(u.o_rel, prec == Precision::Fp32 ? 1e-5 : 2e-2) << "uniform attention: O";
    EXPECT_LE(u.lse_abs, 1e-5) << "uniform attention: LSE";
    std::printf("[ ACCURACY ] 1M keys %s: random O %.3g LSE %.3g; uniform O %.3g LSE %.3g\n",
                prec == Precision::Fp32 ? "fp32" : "tf32", r.o_rel, r.lse_abs, u.o_rel, u.lse_abs);
  }
}

TEST(CudaLongSequences, MillionKeysBFloat16) {
  REQUIRE_GPU();
  const int64_t sq = 64, d = 128;
  Problem p(make_config(1, 1, 1, sq, kKeys, d, Mask::None, DType::BFloat16));
  const Errors r = run_and_compare(p, sq, d, Precision::Fp32);
  EXPECT_FALSE(r.nan);
  EXPECT_LE(r.o_rel, 2e-2) << "random scores: O";
  EXPECT_LE(r.lse_abs, 1e-3) << "random scores: LSE";
  make_uniform(p, sq, d);
  const Errors u = run_and_compare(p, sq, d, Precision::Fp32);
  EXPECT_FALSE(u.nan);
  // V itself is rounded to bfloat16 (the reference reads the rounded values); O is rounded to
  // bfloat16 on the way out (up to 2^-9 relative) on top of the one-level sum's error (see the
  // float32 test): measured 5.7e-3 on an H100.
  EXPECT_LE(u.o_rel, 1e-2) << "uniform attention: O";
  EXPECT_LE(u.lse_abs, 1e-5) << "uniform attention: LSE";
  std::printf("[ ACCURACY ] 1M keys bf16: random O %.3g LSE %.3g; uniform O %.3g LSE %.3g\n", r.o_rel, r.lse_abs,
              u.o_rel, u.lse_abs);
}

}  // namespace
}  // namespace flashattn::test
