// The CPU backend against the float64 reference, forward (out, lse) and backward (dq, dk, dv),
// over a sampled grid of shapes, masks, dtypes and layouts.
//
// The full grid (2 batches x 4 head configs x 8 x 8 lengths x 10 head dims x 3 masks x 4 dtypes x
// 2 layouts = 122880 problems) is far too large for a suite that also runs under ASan+UBSan, so it
// is sampled: every (dtype, mask, layout) combination cycles every 24 cases, the other parameters
// are drawn by a fixed-seed generator under a work cap (the reference is O(Sq*Skv*D) in double),
// and hand-picked cases add what a cap would starve: the long sequences, head dim 256, fully
// masked rows (bottom-right with Sq > Skv), unseen keys (top-left with Skv > Sq), odd scales.
//
// Outputs are poisoned with NaN by testing::Problem and every element is checked; NaN never
// passes (compare() counts it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace flashattn::test {
namespace {

struct GridCase {
  ProblemConfig cfg;
  int32_t threads;
  std::string name;
};

constexpr int64_t kBatches[] = {1, 3};
constexpr int64_t kHeads[][2] = {{1, 1}, {4, 4}, {8, 2}, {6, 1}};
constexpr int64_t kLens[] = {1, 2, 17, 64, 97, 128, 255, 1000};
constexpr int64_t kDims[] = {1, 8, 32, 40, 64, 80, 96, 111, 128, 256};
constexpr Mask kMasks[] = {Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight};
constexpr DType kDtypes[] = {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64};
constexpr testing::Layout kLayouts[] = {testing::Layout::BHSD, testing::Layout::BSHD};

// B*Hq*Sq*Skv*D of a random case: about 4M multiply-adds per matrix product, i.e. ~30M for the
// seven products of the reference's forward+backward. Keeps the whole grid to seconds in Release.
constexpr int64_t kRandomWorkCap = int64_t{1} << 22;
constexpr int kRandomCases = 168;

int64_t work(const ProblemConfig& c) {
  return c.batch * c.heads_q * c.seq_q * c.seq_kv * c.head_dim;
}

const char* short_dtype(DType d) {
  switch (d) {
    case DType::Float32: return "f32";
    case DType::Float16: return "f16";
    case DType::BFloat16: return "bf16";
    case DType::Float64: return "f64";
  }
  return "x";
}

const char* short_mask(Mask m) {
  switch (m) {
    case Mask::None: return "none";
    case Mask::CausalTopLeft: return "tl";
    case Mask::CausalBottomRight: return "br";
  }
  return "x";
}

std::string name_of(const ProblemConfig& c, int32_t threads, size_t idx) {
  std::ostringstream os;
  os << idx << "_" << short_dtype(c.dtype) << "_" << short_mask(c.mask) << "_"
     << testing::layout_name(c.layout) << "_B" << c.batch << "_H" << c.heads_q << "x" << c.heads_kv
     << "_S" << c.seq_q << "x" << c.seq_kv << "_D" << c.head_dim << "_t" << threads;
  if (c.softmax_scale != 0.0f) os << "_scaled";
  return os.str();
}

std::vector<GridCase> make_grid() {
  std::vector<ProblemConfig> cfgs;
  auto hand = [&](int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t d, Mask m,
                  DType dt, testing::Layout l, float scale = 0.0f) {
    cfgs.push_back(make_config(b, hq, hkv, sq, skv, d, m, dt, l, scale));
  };
  using L = testing::Layout;
  // Hand-picked edge cases.
  for (Mask m : kMasks)
    for (DType dt : kDtypes) hand(1, 1, 1, 1, 1, 1, m, dt, L::BHSD);            // smallest problem
  for (Mask m : kMasks) hand(1, 4, 4, 2, 2, 8, m, DType::Float32, L::BSHD);
  hand(1, 8, 2, 1, 1000, 64, Mask::None, DType::Float32, L::BSHD);               // decode-like row
  hand(1, 8, 2, 1, 1000, 128, Mask::CausalBottomRight, DType::BFloat16, L::BHSD);
  hand(1, 1, 1, 1000, 1, 32, Mask::CausalBottomRight, DType::Float32, L::BHSD);  // 999 masked rows
  hand(1, 1, 1, 1000, 1000, 8, Mask::CausalTopLeft, DType::Float32, L::BSHD);    // long, both ways
  hand(1, 1, 1, 1000, 1000, 1, Mask::CausalBottomRight, DType::Float16, L::BHSD);
  hand(1, 1, 1, 1000, 255, 40, Mask::CausalBottomRight, DType::Float64, L::BSHD);
  hand(1, 6, 1, 255, 1000, 8, Mask::CausalTopLeft, DType::BFloat16, L::BSHD);    // unseen keys
  hand(1, 8, 2, 128, 128, 256, Mask::None, DType::Float32, L::BHSD);              // head dim 256
  hand(1, 1, 1, 97, 255, 256, Mask::CausalTopLeft, DType::BFloat16, L::BSHD);
  hand(1, 4, 4, 64, 64, 256, Mask::CausalBottomRight, DType::Float16, L::BSHD);
  hand(1, 1, 1, 255, 64, 256, Mask::CausalBottomRight, DType::Float64, L::BHSD);
  hand(3, 6, 1, 97, 255, 111, Mask::CausalBottomRight, DType::Float32, L::BSHD);  // odd sizes, MQA
  hand(1, 6, 1, 97, 255, 111, Mask::CausalBottomRight, DType::BFloat16, L::BHSD);
  hand(3, 8, 2, 17, 97, 80, Mask::CausalTopLeft, DType::Float16, L::BHSD);
  hand(1, 4, 4, 97, 64, 96, Mask::None, DType::Float16, L::BSHD);
  hand(3, 8, 2, 97, 17, 96, Mask::CausalBottomRight, DType::Float32, L::BHSD);
  hand(1, 4, 4, 128, 128, 128, Mask::CausalTopLeft, DType::Float32, L::BSHD, 0.3f);
  // A large scale makes the scores span ~100 nats: the online softmax must rescale correctly.
  hand(1, 4, 4, 255, 97, 64, Mask::None, DType::Float32, L::BHSD, 2.0f);
  hand(1, 4, 4, 97, 255, 64, Mask::CausalTopLeft, DType::BFloat16, L::BSHD, 2.0f);
  hand(3, 8, 2, 64, 64, 64, Mask::None, DType::Float32, L::BHSD, -0.2f);          // negative scale
  hand(1, 1, 1, 128, 128, 32, Mask::None, DType::Float64, L::BSHD);

  // Deterministic pseudo-random cases.
  std::mt19937_64 rng(20240607);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  for (int i = 0; i < kRandomCases; ++i) {
    ProblemConfig c;
    c.dtype = kDtypes[i % 4];
    c.mask = kMasks[(i / 4) % 3];
    c.layout = kLayouts[(i / 12) % 2];
    do {
      c.batch = kBatches[pick(2)];
      const auto* h = kHeads[pick(4)];
      c.heads_q = h[0];
      c.heads_kv = h[1];
      c.seq_q = kLens[pick(8)];
      c.seq_kv = kLens[pick(8)];
      c.head_dim = kDims[pick(10)];
    } while (work(c) > kRandomWorkCap);
    cfgs.push_back(c);
  }

  std::vector<GridCase> grid;
  for (size_t i = 0; i < cfgs.size(); ++i) {
    cfgs[i].seed = 1000 + i;
    const int32_t threads = static_cast<int32_t>(1 + i % 3);  // results must not depend on it
    grid.push_back(GridCase{cfgs[i], threads, name_of(cfgs[i], threads, i)});
  }
  return grid;
}

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
Tolerance tolerance(DType d) {
  switch (d) {
    case DType::Float64: return {1e-10, 2e-7, 1e-10, 0x1p-24, 0};
    case DType::Float32: return {2e-5, 2e-5, 2e-5, 0x1p-24, 0};
    case DType::Float16: return {2e-3, 2e-5, 2e-3, 0x1p-24, 0x1p-12};
    case DType::BFloat16: return {1e-2, 2e-5, 1e-2, 0x1p-24, 0x1p-9};
  }
  return {0, 0, 0, 0, 0};
}

bool visible(Mask m, int64_t i, int64_t j, int64_t sq, int64_t skv) {
  switch (m) {
    case Mask::None: return true;
    case Mask::CausalTopLeft: return j <= i;
    case Mask::CausalBottomRight: return j <= i + skv - sq;
  }
  return false;
}

// For each gradient, the largest sum of |terms| that one of its elements is made of:
//   dq_i = scale * sum_j P_ij (dP_ij - D_i) k_j      dk_j = scale * sum_i P_ij (dP_ij - D_i) q_i
//   dv_j = sum_i P_ij dO_i                          D_i = sum_x dO_ix O_ix
// with |dP_ij - D_i| bounded by |dP_ij| + sum_x |dO_ix O_ix|. Rounding errors scale with these
// magnitudes, not with the result, which can vanish by cancellation: with a single visible key
// P = 1 and dP = D, so dq = dk = 0 exactly although dP is O(sqrt(D)).
// The part of dq and dk that comes from D alone (scale * sum P * |D| * |k or q|) is kept apart:
// for float16/bfloat16 the backward reads O rounded to the storage type, so D carries that
// rounding.
struct Magnitudes {
  double dq = 0, dk = 0, dv = 0;
  double dq_from_d = 0, dk_from_d = 0;
};
Magnitudes grad_magnitudes(const ProblemConfig& c, const std::vector<double>& q,
                           const std::vector<double>& k, const std::vector<double>& v,
                           const std::vector<double>& dout, const std::vector<double>& out) {
  const int64_t D = c.head_dim, Sq = c.seq_q, Skv = c.seq_kv, group = c.heads_q / c.heads_kv;
  const double scale = std::fabs(c.scale());
  auto rowmax = [&](const std::vector<double>& x, int64_t row) {
    double m = 0;
    for (int64_t d = 0; d < D; ++d) m = std::max(m, std::fabs(x[row * D + d]));
    return m;
  };
  Magnitudes mag;
  std::vector<double> mk(k.size() / D, 0.0), mv(mk), mkd(mk), s(Skv);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h) {
      const int64_t qrow0 = (b * c.heads_q + h) * Sq, krow0 = (b * c.heads_kv + h / group) * Skv;
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t qi = qrow0 + i;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < Skv; ++j) {
          if (!visible(c.mask, i, j, Sq, Skv)) continue;
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += q[qi * D + d] * k[(krow0 + j) * D + d];
          s[j] = scale * acc;
          m = std::max(m, s[j]);
        }
        if (m == -std::numeric_limits<double>::infinity()) continue;
        double z = 0;
        for (int64_t j = 0; j < Skv; ++j) z += visible(c.mask, i, j, Sq, Skv) ? std::exp(s[j] - m) : 0;
        double dabs = 0;
        for (int64_t d = 0; d < D; ++d) dabs += std::fabs(dout[qi * D + d] * out[qi * D + d]);
        const double qmax = rowmax(q, qi), domax = rowmax(dout, qi);
        double mq = 0, mqd = 0;
        for (int64_t j = 0; j < Skv; ++j) {
          if (!visible(c.mask, i, j, Sq, Skv)) continue;
          const double pj = std::exp(s[j] - m) / z;
          double acc = 0;
          for (int64_t d = 0; d < D; ++d) acc += dout[qi * D + d] * v[(krow0 + j) * D + d];
          const double kmax = rowmax(k, krow0 + j);
          mq += scale * pj * (std::fabs(acc) + dabs) * kmax;
          mqd += scale * pj * dabs * kmax;
          mk[krow0 + j] += scale * pj * (std::fabs(acc) + dabs) * qmax;
          mkd[krow0 + j] += scale * pj * dabs * qmax;
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

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  return m;
}

// max|got - ref| <= rtol * max|ref| + extra; NaN (or a missing element) never passes.
::testing::AssertionResult close(const char* what, const std::vector<double>& got,
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

// gtest prints a failing parameter; the name says everything about it.
void PrintTo(const GridCase& g, std::ostream* os) { *os << g.name; }

class CpuVsReference : public ::testing::TestWithParam<GridCase> {};

TEST_P(CpuVsReference, ForwardBackward) {
  const GridCase& gc = GetParam();
  const ProblemConfig& c = gc.cfg;
  SCOPED_TRACE(c.describe());
  if (std::getenv("FLASHATTN_TEST_STATS")) std::fprintf(stderr, "CASE %s\n", gc.name.c_str());
  Problem p(c);
  const Options o = options_for(c, gc.threads);
  const Tolerance tol = tolerance(c.dtype);
  const Reference ref = reference_for(p);
  const auto inputs_before = snapshot(p);

  run_forward(p, o);
  const auto out = p.to_double(p.out), lse = p.to_double(p.lse);
  EXPECT_TRUE(close("out", out, ref.fwd.out, tol.out));
  EXPECT_TRUE(close("lse", lse, ref.fwd.lse, tol.lse));

  run_backward(p, o);
  const auto dq = p.to_double(p.dq), dk = p.to_double(p.dk), dv = p.to_double(p.dv);
  const Magnitudes mag = grad_magnitudes(c, p.to_double(p.q), p.to_double(p.k), p.to_double(p.v),
                                         p.to_double(p.dout), ref.fwd.out);
  const double acc = 2 * tol.acc * std::max(1.0, max_abs(ref.fwd.lse)), store = 2 * tol.store;
  EXPECT_TRUE(close("dq", dq, ref.bwd.dq, tol.grad, acc * mag.dq + store * mag.dq_from_d));
  EXPECT_TRUE(close("dk", dk, ref.bwd.dk, tol.grad, acc * mag.dk + store * mag.dk_from_d));
  EXPECT_TRUE(close("dv", dv, ref.bwd.dv, tol.grad, acc * mag.dv));

  // Inputs are read-only (the backward's out and lse included).
  const auto after = snapshot(p);
  for (int i : {0, 1, 2, 3}) EXPECT_TRUE(after.bytes[i] == inputs_before.bytes[i]) << "input " << i;
  EXPECT_EQ(p.to_double(p.out), out) << "backward modified out";
  EXPECT_EQ(p.to_double(p.lse), lse) << "backward modified lse";

  // Rows that see no key: out exactly 0, lse -inf, dq exactly 0. Keys no row sees: dk = dv = 0.
  const int64_t D = c.head_dim;
  int64_t bad = 0;
  for (int64_t bh = 0; bh < c.batch * c.heads_q; ++bh)
    for (int64_t i = 0; i < c.seq_q; ++i) {
      bool any = false;
      for (int64_t j = 0; j < c.seq_kv && !any; ++j) any = visible(c.mask, i, j, c.seq_q, c.seq_kv);
      const int64_t row = bh * c.seq_q + i;
      if (any) continue;
      bad += !(lse[row] == -std::numeric_limits<double>::infinity());
      for (int64_t x = 0; x < D; ++x) bad += !(out[row * D + x] == 0.0) + !(dq[row * D + x] == 0.0);
    }
  for (int64_t bh = 0; bh < c.batch * c.heads_kv; ++bh)
    for (int64_t j = 0; j < c.seq_kv; ++j) {
      bool any = false;
      for (int64_t i = 0; i < c.seq_q && !any; ++i) any = visible(c.mask, i, j, c.seq_q, c.seq_kv);
      if (any) continue;
      for (int64_t x = 0; x < D; ++x)
        bad += !(dk[(bh * c.seq_kv + j) * D + x] == 0.0) + !(dv[(bh * c.seq_kv + j) * D + x] == 0.0);
    }
  EXPECT_EQ(bad, 0) << "elements of fully masked rows / unseen keys that are not exact zeros "
                       "(or lse not -inf)";
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuVsReference, ::testing::ValuesIn(make_grid()),
                         [](const ::testing::TestParamInfo<GridCase>& i) { return i.param.name; });

// The grid's sampling must actually cover every value of every axis (a change to the sampler that
// silently dropped, say, head dim 111 or length 1000 would otherwise go unnoticed).
TEST(CpuGridCoverage, EveryAxisValueIsSampled) {
  const auto grid = make_grid();
  auto has = [&](auto pred) {
    return std::any_of(grid.begin(), grid.end(), [&](const GridCase& g) { return pred(g.cfg); });
  };
  for (int64_t b : kBatches) EXPECT_TRUE(has([&](const ProblemConfig& c) { return c.batch == b; })) << b;
  for (const auto& h : kHeads)
    EXPECT_TRUE(has([&](const ProblemConfig& c) {
      return c.heads_q == h[0] && c.heads_kv == h[1];
    })) << h[0] << "/" << h[1];
  for (int64_t s : kLens) {
    EXPECT_TRUE(has([&](const ProblemConfig& c) { return c.seq_q == s; })) << "Sq " << s;
    EXPECT_TRUE(has([&](const ProblemConfig& c) { return c.seq_kv == s; })) << "Skv " << s;
  }
  for (int64_t d : kDims)
    for (DType dt : kDtypes)
      EXPECT_TRUE(has([&](const ProblemConfig& c) { return c.head_dim == d && c.dtype == dt; }))
          << "D " << d << " " << dtype_name(dt);
  for (Mask m : kMasks)
    for (DType dt : kDtypes)
      for (auto l : kLayouts)
        EXPECT_TRUE(has([&](const ProblemConfig& c) {
          return c.mask == m && c.dtype == dt && c.layout == l;
        }));
  EXPECT_TRUE(has([](const ProblemConfig& c) { return c.seq_q != c.seq_kv; }));
  EXPECT_TRUE(has([](const ProblemConfig& c) {
    return c.mask == Mask::CausalBottomRight && c.seq_q > c.seq_kv;
  }));
}

}  // namespace
}  // namespace flashattn::test
