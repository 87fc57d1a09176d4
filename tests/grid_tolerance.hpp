// The tolerance model of the CPU-vs-reference grids (test_cpu_grid.cpp, test_cpu_score_mods.cpp):
// per-dtype relative bounds, the per-problem rounding terms of the gradients, and the comparison.
// docs/TESTING.md ("Tolerances") explains every term.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace flashattn::test {

// Tolerances: max|got - ref| <= rtol * max|ref| (+ the rounding terms below for gradients).
//  float64: the kernels accumulate in double; out agrees to ~1e-15 (observed), 1e-10 is the bound.
//  float32: observed max relative errors are ~3e-6 (out) and ~5e-6 (gradients), the largest with
//    a softmax scale of 2 (scores spanning ~100 nats); 2e-5 (~170 float32 ulps) leaves 4x margin
//    while a real mistake (a dropped block, a wrong mask edge, a missed rescale) is >= 1e-3.
//  float16 / bfloat16: the reference sees exactly the rounded inputs the kernel sees, and products
//    of two fp16/bf16 values are exact in float32, so the extra error is the final rounding of
//    each output to the storage type: half an ulp, 2^-9 = 2.0e-3 (bf16) or 2^-12 = 2.4e-4 (fp16)
//    of the element, hence of max|ref|. 1e-2 and 2e-3 are ~5 and ~8 such roundings (observed:
//    3.5e-3 and 4.5e-4 for out).
//  lse is float32 for every dtype and never rounded to fp16/bf16: the float32 bound (for float64
//    inputs, float32 rounding of an accurate value: 2^-24 relative, 2e-7 allows some accumulation).
// Gradients get two more terms, each a first-order bound on a known rounding, times 2:
//  * acc * max(1, max|lse|) * magnitude: the backward recomputes P = exp(S - lse) with lse held in
//    float32, so every P of a row carries a relative error up to 2^-24 * |lse| (this is what limits
//    float64 gradients to ~1e-7 relative: observed 2.3e-7), and float32 sums round relative to
//    their terms, not their result. It matters where the exact gradient cancels to ~0 (one visible
//    key: dq = dk = 0) and is negligible elsewhere.
//  * store * (D-part of the magnitude): for fp16/bf16 the backward reads O rounded to the storage
//    type, so D = rowsum(dO * O) is off by up to half an ulp of sum|dO * O| (the "rounding of the
//    outputs", propagated). With head dim 1 and bf16 this reaches 1.5% of max|dq|.
struct Tolerance {
  double out, lse, grad, acc, store;
};
inline Tolerance tolerance(DType d) {
  switch (d) {
    case DType::Float64: return {1e-10, 2e-7, 1e-10, 0x1p-24, 0};
    case DType::Float32: return {2e-5, 2e-5, 2e-5, 0x1p-24, 0};
    case DType::Float16: return {2e-3, 2e-5, 2e-3, 0x1p-24, 0x1p-12};
    case DType::BFloat16: return {1e-2, 2e-5, 1e-2, 0x1p-24, 0x1p-9};
  }
  return {0, 0, 0, 0, 0};
}

// Whether key j is visible to query i: the mask and the sliding window of flashattn.h, written
// out here independently of core/mask.hpp.
inline bool visible(const ProblemConfig& c, int64_t i, int64_t j) {
  const int64_t d = c.seq_kv - c.seq_q;
  if (c.mask == Mask::CausalTopLeft && j > i) return false;
  if (c.mask == Mask::CausalBottomRight && j > i + d) return false;
  if (c.window_left >= 0 && j < i + d - c.window_left) return false;
  if (c.window_right >= 0 && j > i + d + c.window_right) return false;
  return true;
}

// How many elements break the exact zeros of what the mask leaves out: rows that see no key must
// give out = 0, lse = -inf and dq = 0; keys no row sees dk = dv = 0 (all logical [B, H, S, D] /
// [B, Hq, Sq] float64 copies of the outputs).
inline int64_t unseen_not_zero(const ProblemConfig& c, const std::vector<double>& out, const std::vector<double>& lse,
                               const std::vector<double>& dq, const std::vector<double>& dk,
                               const std::vector<double>& dv) {
  const int64_t D = c.head_dim;
  int64_t bad = 0;
  for (int64_t bh = 0; bh < c.batch * c.heads_q; ++bh)
    for (int64_t i = 0; i < c.seq_q; ++i) {
      bool any = false;
      for (int64_t j = 0; j < c.seq_kv && !any; ++j) any = visible(c, i, j);
      const int64_t row = bh * c.seq_q + i;
      if (any) continue;
      bad += !(lse[row] == -std::numeric_limits<double>::infinity());
      for (int64_t x = 0; x < D; ++x) bad += !(out[row * D + x] == 0.0) + !(dq[row * D + x] == 0.0);
    }
  for (int64_t bh = 0; bh < c.batch * c.heads_kv; ++bh)
    for (int64_t j = 0; j < c.seq_kv; ++j) {
      bool any = false;
      for (int64_t i = 0; i < c.seq_q && !any; ++i) any = visible(c, i, j);
      if (any) continue;
      for (int64_t x = 0; x < D; ++x)
        bad += !(dk[(bh * c.seq_kv + j) * D + x] == 0.0) + !(dv[(bh * c.seq_kv + j) * D + x] == 0.0);
    }
  return bad;
}

// For each gradient, the largest sum of |terms| that one of its elements is made of:
//   dq_i = scale * sum_j P_ij (dP_ij - D_i) F_ij k_j   dk_j = scale * sum_i P_ij (dP_ij - D_i) F_ij q_i
//   dv_j = sum_i P_ij dO_i                            D_i = sum_x dO_ix O_ix
// with |dP_ij - D_i| bounded by |dP_ij| + sum_x |dO_ix O_ix| and F the softcap's 1 - tanh^2 (1
// without one). Rounding errors scale with these magnitudes, not with the result, which can
// vanish by cancellation: with a single visible key P = 1 and dP = D, so dq = dk = 0 exactly
// although dP is O(sqrt(D)). The part of dq and dk that comes from D alone is kept apart: for
// float16/bfloat16 the backward reads O rounded to the storage type, so D carries that rounding.
struct Magnitudes {
  double dq = 0, dk = 0, dv = 0;
  double dq_from_d = 0, dk_from_d = 0;
};
inline Magnitudes grad_magnitudes(const ProblemConfig& c, const std::vector<double>& q,
                                  const std::vector<double>& k, const std::vector<double>& v,
                                  const std::vector<double>& dout, const std::vector<double>& out,
                                  const testing::RefMods& mods = {}) {
  const int64_t D = c.head_dim, Sq = c.seq_q, Skv = c.seq_kv, group = c.heads_q / c.heads_kv;
  const double scale = std::fabs(c.scale()), sscale = c.scale();
  auto rowmax = [&](const std::vector<double>& x, int64_t row) {
    double m = 0;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(x[row * D + d]));
    return m;
  };
  Magnitudes mag;
  std::vector<double> mk(k.size() / D, 0.0), mv(mk), mkd(mk), s(Skv), f(Skv);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h) {
      const int64_t qrow0 = (b * c.heads_q + h) * Sq, krow0 = (b * c.heads_kv + h / group) * Skv;
      const double slope = mods.alibi.empty() ? 0.0 : mods.alibi[b * c.heads_q + h];
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t qi = qrow0 + i;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Skv; ++j) {
          if (!visible(c, i, j)) continue;
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += q[qi * D + d] * k[(krow0 + j) * D + d];
          double x = sscale * acc;
          f[j] = 1.0;
          if (mods.softcap > 0) {
            const double t = std::tanh(x / mods.softcap);
            x = mods.softcap * t;
            f[j] = 1.0 - t * t;
          }
          s[j] = x - slope * std::fabs(static_cast<double>(i + Skv - Sq - j));
          m = std::max(m, s[j]);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;
        double z = 0;
        for (int64_t j = 0; j < Skv; ++j) z += visible(c, i, j) ? std::exp(s[j] - m) : 0;
        double dabs = 0;
        for (int64_t d = 0; d < D; ++d) dabs += std::fabs(dout[qi * D + d] * out[qi * D + d]);
        const double qmax = rowmax(q, qi), domax = rowmax(dout, qi);
        double mq = 0, mqd = 0;
        for (int64_t j = 0; j < Skv; ++j) {
          if (!visible(c, i, j)) continue;
          const double pj = std::exp(s[j] - m) / z, pf = pj * f[j];
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += dout[qi * D + d] * v[(krow0 + j) * D + d];
          const double kmax = rowmax(k, krow0 + j);
          mq += scale * pf * (std::fabs(acc) + dabs) * kmax;
          mqd += scale * pf * dabs * kmax;
          mk[krow0 + j] += scale * pf * (std::fabs(acc) + dabs) * qmax;
          mkd[krow0 + j] += scale * pf * dabs * qmax;
          mv[krow0 + j] += pj * domax;
        }
        mag.dq = std::max(mag.dq, mq);
        mag.dq_from_d = std::max(mag.dq_from_d, mqd);
      }
    }
  for (size_t r = 0; r < mk.size(); ++r) {
    mag.dk = std::max(mag.dk, mk[r]);
    mag.dk_from_d = std::max(mag.dk_from_d, mkd[r]);
    mag.dv = std::max(mag.dv, mv[r]);
  }
  return mag;
}

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  return m;
}

// max|got - ref| <= rtol * max|ref| + extra; NaN (or a missing element) never passes.
inline ::testing::AssertionResult close(const char* what, const std::vector<double>& got,
                                        const std::vector<double>& ref, double rtol, double extra = 0) {
  const testing::ErrorStats e = testing::compare(got, ref);
  const double bound = rtol * e.max_ref + extra;
  ::testing::Test::RecordProperty(std::string("err_") + what, std::to_string(e.max_abs));
  if (std::getenv("FLASHATTN_TEST_STATS"))
    std::fprintf(stderr, "STAT %s max_abs=%.3e max_ref=%.3e rel=%.3e extra=%.3e usage=%.3f\n",
                 what, e.max_abs, e.max_ref, e.max_abs / std::max(e.max_ref, 1e-300), extra,
                 e.max_abs / bound);
  if (e.nan == 0 && e.count == static_cast<int64_t>(ref.size()) && e.max_abs <= bound)
    return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << e.str() << " (bound " << rtol
                                       << " * max|ref| + " << extra << " = " << bound << ")";
}

}  // namespace flashattn::test
