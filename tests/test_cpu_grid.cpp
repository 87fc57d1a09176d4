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

#include "grid_tolerance.hpp"
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

// The tolerances, the gradients' rounding terms and the comparison: grid_tolerance.hpp.

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
  EXPECT_EQ(unseen_not_zero(c, out, lse, dq, dk, dv), 0)
      << "elements of fully masked rows / unseen keys that are not exact zeros (or lse not -inf)";
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
