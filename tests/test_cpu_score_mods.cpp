// The CPU backend with sliding windows, logit softcap and ALiBi, through the public C++ API,
// against the float64 reference (RefMods): forward (out, lse) and backward (dq, dk, dv).
//
// The grid:
//  * every window (left, right) with sides in {-1, 0, 1, 7, 64}, under each mask (none, causal
//    top-left, causal bottom-right): 75 cases, each with one of the score transforms (none,
//    softcap, ALiBi [Hq], ALiBi [B, Hq], softcap + ALiBi) and one dtype, so that every (transform,
//    dtype) pair recurs every 20 cases; shapes drawn from lengths {1, 17, 97, 300} (Sq != Skv both
//    ways, several query and key tiles at 300), GQA/MQA head configurations and head dims 1..256
//    under a work cap;
//  * fixed-seed random cases with a softcap in {5, 30, 50} and/or ALiBi slopes, half of them
//    windowed;
//  * hand-picked ones: zero and negative slopes, a saturating softcap (scale 2, softcap 5),
//    rows that a window leaves without keys, a band that is empty altogether, head dims 1 and
//    256, a decode-like row over 300 keys.
// Outputs are poisoned with NaN by testing::Problem and every element is checked; NaN never
// passes. Rows without a visible key must give out = 0, lse = -inf and dq = 0 exactly, keys that
// no row sees dk = dv = 0 exactly. The tolerance model is the CPU grid's (grid_tolerance.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

using testing::AlibiKind;

struct ModsCase {
  ProblemConfig cfg;
  int32_t threads;
  std::vector<float> slopes;  // overrides Problem::alibi's values when not empty
  std::string name;
};

void PrintTo(const ModsCase& c, std::ostream* os) { *os << c.name; }

constexpr int64_t kSides[] = {-1, 0, 1, 7, 64};
constexpr Mask kMasks[] = {Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight};
constexpr DType kDtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
constexpr int64_t kLens[] = {1, 17, 97, 300};
constexpr int64_t kHeads[][2] = {{1, 1}, {4, 4}, {8, 2}, {6, 1}};
constexpr int64_t kDims[] = {1, 8, 17, 32, 40, 64, 80, 96, 111, 128, 256};
constexpr float kSoftcaps[] = {5.0f, 30.0f, 50.0f};

// The score transforms the grid cycles through.
struct Transform {
  float softcap;
  AlibiKind alibi;
};
constexpr int kTransforms = 5;
Transform transform(int t, int n) {
  const float cap = kSoftcaps[n % 3];
  switch (t) {
    case 1: return {cap, AlibiKind::None};
    case 2: return {0.0f, AlibiKind::Heads};
    case 3: return {0.0f, AlibiKind::BatchHeads};
    case 4: return {cap, n % 2 ? AlibiKind::Heads : AlibiKind::BatchHeads};
    default: return {0.0f, AlibiKind::None};
  }
}

// B*Hq*Sq*Skv*D of a drawn case, as in the CPU grid.
constexpr int64_t kWorkCap = int64_t{1} << 22;

int64_t work(const ProblemConfig& c) { return c.batch * c.heads_q * c.seq_q * c.seq_kv * c.head_dim; }

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
std::string side(int64_t w) { return w < 0 ? std::string("inf") : std::to_string(w); }

std::string name_of(const ProblemConfig& c, int32_t threads, size_t idx, bool custom_slopes) {
  std::ostringstream os;
  os << idx << "_" << short_dtype(c.dtype) << "_" << short_mask(c.mask);
  if (c.has_window()) os << "_w" << side(c.window_left) << "x" << side(c.window_right);
  if (c.softcap > 0) {
    std::ostringstream cap;
    cap << c.softcap;
    std::string t;
    for (char ch : cap.str()) t += ch == '.' ? 'p' : ch == '-' ? 'm' : ch == '+' ? 'x' : ch;
    os << "_cap" << t;
  }
  if (c.alibi == AlibiKind::Heads) os << "_alibiH";
  if (c.alibi == AlibiKind::BatchHeads) os << "_alibiBH";
  if (custom_slopes) os << "custom";
  os << "_" << testing::layout_name(c.layout) << "_B" << c.batch << "_H" << c.heads_q << "x" << c.heads_kv
     << "_S" << c.seq_q << "x" << c.seq_kv << "_D" << c.head_dim << "_t" << threads;
  if (c.softmax_scale != 0.0f) os << "_scaled";
  return os.str();
}

std::vector<ModsCase> make_cases() {
  std::vector<ModsCase> cases;
  std::mt19937_64 rng(20261204);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  auto draw_shape = [&](ProblemConfig& c) {
    do {
      c.batch = 1 + static_cast<int64_t>(pick(2)) * 2;  // 1 or 3
      const auto* h = kHeads[pick(4)];
      c.heads_q = h[0];
      c.heads_kv = h[1];
      c.seq_q = kLens[pick(4)];
      c.seq_kv = kLens[pick(4)];
      c.head_dim = kDims[pick(11)];
    } while (work(c) > kWorkCap);
  };
  auto add = [&](ProblemConfig c, std::vector<float> slopes = {}) {
    const size_t i = cases.size();
    c.seed = 5000 + i;
    const int32_t threads = static_cast<int32_t>(1 + i % 3);  // results must not depend on it
    cases.push_back(ModsCase{c, threads, slopes, name_of(c, threads, i, !slopes.empty())});
  };

  // Every window under every mask.
  int n = 0;
  for (int64_t left : kSides)
    for (int64_t right : kSides)
      for (Mask m : kMasks) {
        ProblemConfig c;
        c.mask = m;
        c.window_left = left;
        c.window_right = right;
        const Transform t = transform(n % kTransforms, n);
        c.softcap = t.softcap;
        c.alibi = t.alibi;
        c.dtype = kDtypes[(n / kTransforms) % 4];
        c.layout = n % 2 ? testing::Layout::BSHD : testing::Layout::BHSD;
        draw_shape(c);
        add(c);
        ++n;
      }

  // Random: softcap and/or ALiBi always, a window half of the time.
  for (int i = 0; i < 60; ++i) {
    ProblemConfig c;
    const Transform t = transform(1 + i % 4, i);
    c.softcap = t.softcap;
    c.alibi = t.alibi;
    c.dtype = kDtypes[(i / 4) % 4];
    c.mask = kMasks[(i / 16) % 3];
    c.layout = i % 3 ? testing::Layout::BHSD : testing::Layout::BSHD;
    if (i % 2) {
      c.window_left = kSides[pick(5)];
      c.window_right = kSides[pick(5)];
    }
    draw_shape(c);
    add(c);
  }

  using L = testing::Layout;
  auto hand = [&](int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t d, Mask m,
                  DType dt, int64_t left, int64_t right, float cap, AlibiKind alibi,
                  std::vector<float> slopes = {}, float scale = 0.0f, L layout = L::BHSD) {
    ProblemConfig c = make_config(b, hq, hkv, sq, skv, d, m, dt, layout, scale);
    c.window_left = left;
    c.window_right = right;
    c.softcap = cap;
    c.alibi = alibi;
    add(c, slopes);
  };
  // Zero and negative slopes, [Hq] and [B, Hq].
  for (DType dt : kDtypes) {
    hand(1, 4, 2, 97, 300, 64, Mask::None, dt, -1, -1, 0.0f, AlibiKind::Heads, {0.0f, -0.05f, 0.3f, 1.0f});
    hand(2, 3, 1, 300, 97, 40, Mask::CausalBottomRight, dt, 64, -1, 30.0f, AlibiKind::BatchHeads,
         {0.0f, -0.02f, 0.5f, 0.125f, 0.0f, -0.1f}, 0.0f, L::BSHD);
  }
  // A saturating softcap: scores of scale 2 span ~100 nats, tanh flattens most of them.
  hand(1, 4, 4, 97, 255, 64, Mask::None, DType::Float32, -1, -1, 5.0f, AlibiKind::None, {}, 2.0f);
  hand(1, 4, 4, 255, 97, 64, Mask::CausalTopLeft, DType::BFloat16, -1, -1, 5.0f, AlibiKind::Heads, {}, 2.0f);
  hand(1, 2, 2, 97, 97, 32, Mask::None, DType::Float64, 7, 7, 5.0f, AlibiKind::BatchHeads, {}, 2.0f);
  // A negative scale: the folded multiplier scale / softcap is negative.
  hand(1, 2, 2, 97, 64, 32, Mask::None, DType::Float32, -1, -1, 5.0f, AlibiKind::Heads, {}, -0.3f);
  // Softcaps at the ends of the float range: a denormal or tiny one (every score +-softcap, the
  // fold clamped), and ones so large that tanh is the identity.
  for (DType dt : {DType::Float32, DType::Float64}) {
    for (float cap : {std::numeric_limits<float>::denorm_min(), 1e-30f, 1e-6f, 1e30f, 3e38f})
      hand(1, 2, 1, 33, 40, 16, Mask::CausalBottomRight, dt, 20, -1, cap, AlibiKind::Heads);
  }
  // A window that leaves rows without keys (rows 0..79: j = i - 80 < 0), and one whose band is
  // empty altogether (causal top-left caps j <= i, the window asks j >= i + 73).
  hand(2, 4, 2, 97, 17, 32, Mask::None, DType::Float32, 0, 0, 30.0f, AlibiKind::Heads);
  hand(1, 2, 1, 300, 17, 16, Mask::CausalBottomRight, DType::Float16, 1, -1, 0.0f, AlibiKind::BatchHeads);
  hand(1, 2, 2, 17, 97, 8, Mask::CausalTopLeft, DType::Float32, 7, -1, 5.0f, AlibiKind::Heads);
  hand(1, 2, 2, 17, 97, 8, Mask::CausalTopLeft, DType::Float64, 7, -1, 50.0f, AlibiKind::None);
  // Head dims 1 and 256; a decode-like row; several tiles both ways with everything on.
  hand(1, 8, 2, 128, 128, 256, Mask::None, DType::Float32, 64, 7, 30.0f, AlibiKind::Heads);
  hand(1, 1, 1, 97, 300, 256, Mask::CausalBottomRight, DType::BFloat16, 64, 0, 50.0f, AlibiKind::Heads);
  hand(1, 1, 1, 300, 300, 1, Mask::CausalBottomRight, DType::Float16, 64, 0, 5.0f, AlibiKind::Heads);
  hand(1, 1, 1, 300, 97, 1, Mask::None, DType::Float64, 7, 64, 30.0f, AlibiKind::Heads);
  hand(1, 8, 2, 1, 300, 64, Mask::CausalBottomRight, DType::Float32, 64, 0, 30.0f, AlibiKind::BatchHeads);
  hand(1, 4, 2, 300, 300, 64, Mask::CausalBottomRight, DType::Float32, 64, 0, 30.0f, AlibiKind::BatchHeads);
  hand(1, 4, 2, 300, 300, 64, Mask::None, DType::Float64, -1, -1, 30.0f, AlibiKind::Heads);
  return cases;
}

class CpuScoreMods : public ::testing::TestWithParam<ModsCase> {};

// A problem with the case's slopes in place.
void apply_slopes(Problem& p, const std::vector<float>& slopes) {
  if (slopes.empty()) return;
  ASSERT_EQ(p.alibi.bytes.size(), slopes.size() * sizeof(float)) << "slopes of the wrong size";
  std::memcpy(p.alibi.bytes.data(), slopes.data(), p.alibi.bytes.size());
}

TEST_P(CpuScoreMods, ForwardBackward) {
  const ModsCase& mc = GetParam();
  const ProblemConfig& c = mc.cfg;
  SCOPED_TRACE(c.describe());
  if (std::getenv("FLASHATTN_TEST_STATS")) std::fprintf(stderr, "CASE %s\n", mc.name.c_str());
  Problem p(c);
  apply_slopes(p, mc.slopes);
  const Options o = options_for(p, mc.threads);
  const Tolerance tol = tolerance(c.dtype);
  const Reference ref = reference_for(p);
  const auto inputs_before = snapshot(p);
  const std::vector<unsigned char> slopes_before = p.alibi.bytes;

  run_forward(p, o);
  const auto out = p.to_double(p.out), lse = p.to_double(p.lse);
  EXPECT_TRUE(close("out", out, ref.fwd.out, tol.out));
  EXPECT_TRUE(close("lse", lse, ref.fwd.lse, tol.lse));

  run_backward(p, o);
  const auto dq = p.to_double(p.dq), dk = p.to_double(p.dk), dv = p.to_double(p.dv);
  const Magnitudes mag = grad_magnitudes(c, p.to_double(p.q), p.to_double(p.k), p.to_double(p.v),
                                         p.to_double(p.dout), ref.fwd.out, p.ref_mods());
  const double acc = 2 * tol.acc * std::max(1.0, max_abs(ref.fwd.lse)), store = 2 * tol.store;
  EXPECT_TRUE(close("dq", dq, ref.bwd.dq, tol.grad, acc * mag.dq + store * mag.dq_from_d));
  EXPECT_TRUE(close("dk", dk, ref.bwd.dk, tol.grad, acc * mag.dk + store * mag.dk_from_d));
  EXPECT_TRUE(close("dv", dv, ref.bwd.dv, tol.grad, acc * mag.dv));

  // Inputs are read-only (the backward's out and lse, and the slopes, included).
  const auto after = snapshot(p);
  for (int i : {0, 1, 2, 3}) EXPECT_TRUE(after.bytes[i] == inputs_before.bytes[i]) << "input " << i;
  EXPECT_EQ(p.to_double(p.out), out) << "backward modified out";
  EXPECT_EQ(p.to_double(p.lse), lse) << "backward modified lse";
  EXPECT_TRUE(p.alibi.bytes == slopes_before) << "the slopes were modified";

  // Rows that see no key: out exactly 0, lse -inf, dq exactly 0. Keys no row sees: dk = dv = 0.
  EXPECT_EQ(unseen_not_zero(c, out, lse, dq, dk, dv), 0)
      << "elements of rows without keys / unseen keys that are not exact zeros (or lse not -inf)";
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuScoreMods, ::testing::ValuesIn(make_cases()),
                         [](const ::testing::TestParamInfo<ModsCase>& i) { return i.param.name; });

// The grid holds what the header says.
TEST(CpuScoreModsCoverage, GridHoldsEveryCombination) {
  const auto cases = make_cases();
  auto has = [&](auto pred) {
    return std::any_of(cases.begin(), cases.end(), [&](const ModsCase& m) { return pred(m.cfg, m); });
  };
  for (int64_t l : kSides)
    for (int64_t r : kSides)
      for (Mask m : kMasks)
        EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase&) {
          return c.window_left == l && c.window_right == r && c.mask == m;
        })) << "window " << l << "," << r << " mask " << static_cast<int>(m);
  for (int t = 0; t < kTransforms; ++t)
    for (DType dt : kDtypes)
      EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase&) {
        const bool cap = c.softcap > 0, alibi = c.alibi != AlibiKind::None;
        const bool kind = t == 0 ? !cap && !alibi
                          : t == 1 ? cap && !alibi
                          : t == 2 ? !cap && c.alibi == AlibiKind::Heads
                          : t == 3 ? !cap && c.alibi == AlibiKind::BatchHeads
                                   : cap && alibi;
        return kind && c.dtype == dt;
      })) << "transform " << t << " " << dtype_name(dt);
  for (float cap : kSoftcaps)
    EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase&) { return c.softcap == cap; })) << cap;
  for (int64_t s : kLens) {
    EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase&) { return c.seq_q == s; })) << "Sq " << s;
    EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase&) { return c.seq_kv == s; })) << "Skv " << s;
  }
  for (int64_t d : {1, 17, 111, 256})
    EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase&) { return c.head_dim == d; })) << "D " << d;
  EXPECT_TRUE(has([](const ProblemConfig& c, const ModsCase&) {
    return c.seq_q > c.seq_kv && c.has_window();
  }));
  EXPECT_TRUE(has([](const ProblemConfig& c, const ModsCase&) {
    return c.seq_q < c.seq_kv && c.has_window();
  }));
  EXPECT_TRUE(has([](const ProblemConfig& c, const ModsCase&) {
    return c.heads_q > c.heads_kv && c.softcap > 0;
  }));
  // zero and negative slopes, in both slope shapes
  for (AlibiKind k : {AlibiKind::Heads, AlibiKind::BatchHeads})
    EXPECT_TRUE(has([&](const ProblemConfig& c, const ModsCase& m) {
      const bool zero = std::count(m.slopes.begin(), m.slopes.end(), 0.0f) > 0;
      const bool neg = std::any_of(m.slopes.begin(), m.slopes.end(), [](float s) { return s < 0; });
      return c.alibi == k && zero && neg;
    }));
  // rows without keys next to rows with keys; problems whose band is empty
  bool partial = false, empty = false;
  for (const ModsCase& m : cases) {
    const ProblemConfig& c = m.cfg;
    int64_t rows = 0;
    for (int64_t i = 0; i < c.seq_q; ++i) {
      bool any = false;
      for (int64_t j = 0; j < c.seq_kv && !any; ++j) any = visible(c, i, j);
      rows += any;
    }
    partial |= rows > 0 && rows < c.seq_q && c.has_window();
    empty |= rows == 0;
  }
  EXPECT_TRUE(partial);
  EXPECT_TRUE(empty);
}

// The transforms are not vacuous at this grid's tolerances: on float32 problems like the grid's,
// the reference with each transform differs from the one without it by far more than the bound
// the grid holds the kernels to (so a kernel that ignored it would fail).
TEST(CpuScoreModsCoverage, TransformsChangeTheResult) {
  struct Variant {
    float cap;
    AlibiKind alibi;
    std::vector<float> slopes;
  };
  const Variant variants[] = {{5.0f, AlibiKind::None, {}},
                              {30.0f, AlibiKind::None, {}},
                              {50.0f, AlibiKind::None, {}},
                              {0.0f, AlibiKind::Heads, {}},
                              {0.0f, AlibiKind::BatchHeads, {}},
                              {0.0f, AlibiKind::Heads, {-0.05f, -0.01f, 0.0f, -0.2f}}};
  for (const Variant& var : variants) {
    ProblemConfig c = make_config(2, 4, 2, 97, 97, 64, Mask::None, DType::Float32, testing::Layout::BHSD,
                                  /*scale=*/0.25f, /*seed=*/9);
    c.softcap = var.cap;
    c.alibi = var.alibi;
    Problem p(c);
    apply_slopes(p, var.slopes);
    const Reference with = reference_for(p);
    ProblemConfig plain_cfg = c;
    plain_cfg.softcap = 0.0f;
    plain_cfg.alibi = AlibiKind::None;
    Problem plain(plain_cfg);
    const Reference without = reference_for(plain);
    SCOPED_TRACE(c.describe());
    const auto eo = testing::compare(with.fwd.out, without.fwd.out);
    const auto eq = testing::compare(with.bwd.dq, without.bwd.dq);
    EXPECT_GT(eo.rel, 50 * tolerance(DType::Float32).out) << eo.str();
    EXPECT_GT(eq.rel, 50 * tolerance(DType::Float32).grad) << eq.str();
  }
}

// Bitwise the same outputs for any thread count, with every modification on, every dtype.
class CpuScoreModsDeterminism : public ::testing::TestWithParam<DType> {};

TEST_P(CpuScoreModsDeterminism, BitwiseAcrossThreadCounts) {
  ProblemConfig c = make_config(2, 4, 2, 193, 257, 72, Mask::CausalBottomRight, GetParam(),
                                testing::Layout::BHSD, 0.0f, /*seed=*/78);
  c.window_left = 100;
  c.window_right = 0;
  c.softcap = 30.0f;
  c.alibi = AlibiKind::BatchHeads;
  SCOPED_TRACE(c.describe());
  Problem p(c);
  auto run = [&](int32_t threads) {
    p.poison_outputs();
    const Options o = options_for(p, threads);
    run_forward(p, o);
    run_backward(p, o);
    return snapshot(p);
  };
  const Snapshot first = run(1);
  for (const testing::HostTensor* t : {&p.out, &p.lse, &p.dq, &p.dk, &p.dv})
    for (double x : p.to_double(*t)) ASSERT_FALSE(std::isnan(x)) << "an output kept its NaN poison";
  const char* names[] = {"q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"};
  for (int32_t threads : {2, 3, 8, 1}) {
    const Snapshot again = run(threads);
    for (size_t i = 0; i < first.bytes.size(); ++i)
      EXPECT_TRUE(again.bytes[i] == first.bytes[i])
          << names[i] << " differs with num_threads=" << threads << " from num_threads=1";
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, CpuScoreModsDeterminism, ::testing::ValuesIn(kDtypes),
                         [](const ::testing::TestParamInfo<DType>& i) { return short_dtype(i.param); });

// A sliding window of (-1, -1) or (INT64_MAX, INT64_MAX) is no window, and a softcap so large that
// tanh is linear to float precision changes nothing beyond rounding: through the public API
// against the plain call.
TEST(CpuScoreModsApi, NeutralSettingsMatchThePlainCall) {
  ProblemConfig c = make_config(1, 4, 2, 97, 130, 64, Mask::CausalBottomRight, DType::Float32,
                                testing::Layout::BSHD, 0.0f, /*seed=*/12);
  Problem p(c);
  Options plain = options_for(p, 2);
  run_forward(p, plain);
  run_backward(p, plain);
  const Snapshot want = snapshot(p);
  Options unbounded = plain;
  unbounded.window_left = -1;
  unbounded.window_right = -1;
  p.poison_outputs();
  run_forward(p, unbounded);
  run_backward(p, unbounded);
  EXPECT_TRUE(snapshot(p) == want) << "window (-1, -1) is not bitwise the plain call";
  // Sides beyond every index are unbounded too (and must not overflow the band's arithmetic).
  Options huge = plain;
  huge.window_left = std::numeric_limits<int64_t>::max();
  huge.window_right = std::numeric_limits<int64_t>::max();
  p.poison_outputs();
  run_forward(p, huge);
  run_backward(p, huge);
  EXPECT_TRUE(snapshot(p) == want) << "window (INT64_MAX, INT64_MAX) is not bitwise the plain call";

  // x - c tanh(x / c) = x^3 / (3 c^2) + ...: below 1e-12 of |x| <= 6 at c = 1e7.
  Options cap = plain;
  cap.softcap = 1e7f;
  p.poison_outputs();
  run_forward(p, cap);
  run_backward(p, cap);
  // The snapshot's bytes are those tensors in the same layout: compare through a copy.
  const std::pair<const testing::HostTensor*, size_t> outs[] = {
      {&p.out, 4}, {&p.lse, 5}, {&p.dq, 6}, {&p.dk, 7}, {&p.dv, 8}};
  for (const auto& [t, idx] : outs) {
    testing::HostTensor before = *t;
    before.bytes = want.bytes[idx];
    before.view.data = before.bytes.data();
    const auto e = testing::compare(p.to_double(*t), p.to_double(before));
    EXPECT_EQ(e.nan, 0);
    EXPECT_LE(e.rel, 1e-5) << "output " << idx << ": " << e.str();
  }
}

}  // namespace
}  // namespace flashattn::test
