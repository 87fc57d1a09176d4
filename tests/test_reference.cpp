// The float64 reference is the yardstick of every backend, so it is not trusted on faith:
//  * its forward is compared with an independent, textbook computation written here (own mask
//    and window predicate, own softcap and ALiBi bias, own log-sum-exp), and
//  * its gradients dQ, dK, dV of L = sum(out * dout) are compared with central finite differences
//    of its own forward, with and without sliding windows, softcaps and ALiBi slopes (zero and
//    negative ones included);
//  * NaN and Inf in its inputs give the outputs the rule of tests/nonfinite_cases.hpp names, and
//    its finite outputs do not depend on a poisoned element they do not see.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "nonfinite_cases.hpp"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

struct RefCase {
  int64_t b, hq, hkv, sq, skv, d;
  Mask mask;
  double scale;  // 0 = 1/sqrt(d)
  const char* name;
  testing::RefMods mods = {};  // window, softcap, one ALiBi slope per (b, h)
};

testing::RefMods mods(int64_t left, int64_t right, double softcap, std::vector<double> alibi = {}) {
  testing::RefMods m;
  m.window_left = left;
  m.window_right = right;
  m.softcap = softcap;
  m.alibi = std::move(alibi);
  return m;
}

// Small on purpose: finite differences cost two forwards per input element.
const RefCase kCases[] = {
    {1, 1, 1, 4, 5, 3, Mask::None, 0, "plain"},
    {1, 1, 1, 6, 3, 2, Mask::None, 0.9, "none_sq_gt_skv"},
    {2, 4, 2, 3, 4, 2, Mask::CausalTopLeft, 0, "gqa_top_left"},
    {1, 2, 1, 3, 6, 3, Mask::CausalTopLeft, 0.7, "top_left_unseen_keys"},
    {1, 3, 1, 5, 3, 4, Mask::CausalBottomRight, 0, "mqa_bottom_right_masked_rows"},
    {2, 2, 2, 4, 4, 3, Mask::CausalBottomRight, 1.3, "bottom_right_square"},
    {1, 4, 2, 3, 7, 2, Mask::CausalBottomRight, 0, "gqa_bottom_right_sq_lt_skv"},
    // Sliding windows, softcaps (small ones, where tanh bends the scores most) and ALiBi.
    {1, 1, 1, 6, 6, 3, Mask::None, 0, "window_two_sided", mods(1, 2, 0)},
    {1, 2, 1, 7, 4, 2, Mask::None, 1.1, "window_rows_without_keys", mods(1, 0, 0)},
    {1, 2, 2, 4, 6, 3, Mask::None, 2.0, "softcap_saturating", mods(-1, -1, 0.5)},
    {2, 2, 1, 5, 4, 2, Mask::CausalTopLeft, 0, "softcap_top_left", mods(-1, -1, 1.5)},
    {1, 3, 1, 4, 6, 2, Mask::None, 0.8, "alibi_heads_zero_negative", mods(-1, -1, 0, {0.5, 0.0, -0.3})},
    {2, 2, 2, 5, 3, 3, Mask::CausalBottomRight, 0, "alibi_batch_heads_masked_rows",
     mods(-1, -1, 0, {0.25, 1.0, -0.125, 0.0})},
    {2, 4, 2, 5, 6, 2, Mask::CausalBottomRight, 1.3, "all_three_gqa",
     mods(2, -1, 1.2, {0.1, 0.7, 0.0, -0.2, 0.4, 0.3, -0.05, 1.5})},
    {1, 2, 1, 6, 4, 3, Mask::None, 0.9, "all_three_two_sided", mods(1, 1, 0.8, {0.6, -0.4})},
};

std::string case_name(const ::testing::TestParamInfo<RefCase>& info) { return info.param.name; }
void PrintTo(const RefCase& c, std::ostream* os) { *os << c.name; }

// FlashAttention's window: j - (i + skv - sq) in [-left, right], either side unbounded at -1.
bool visible(Mask m, const testing::RefMods& w, int64_t i, int64_t j, int64_t sq, int64_t skv) {
  const int64_t off = j - (i + skv - sq);
  if (w.window_left >= 0 && off < -w.window_left) return false;
  if (w.window_right >= 0 && off > w.window_right) return false;
  switch (m) {
    case Mask::None: return true;
    case Mask::CausalTopLeft: return j <= i;
    case Mask::CausalBottomRight: return j - (skv - sq) <= i;
  }
  return false;
}

struct Inputs {
  testing::RefShape s;
  std::vector<double> q, k, v, dout;
  double scale;
  Mask mask;
  testing::RefMods mods;
};

Inputs make_inputs(const RefCase& c, uint64_t seed) {
  ProblemConfig cfg;
  cfg.batch = c.b;
  cfg.heads_q = c.hq;
  cfg.heads_kv = c.hkv;
  cfg.seq_q = c.sq;
  cfg.seq_kv = c.skv;
  cfg.head_dim = c.d;
  cfg.dtype = DType::Float64;
  cfg.seed = seed;
  Problem p(cfg);
  Inputs in{ref_shape(cfg), p.to_double(p.q), p.to_double(p.k), p.to_double(p.v),
            p.to_double(p.dout), c.scale != 0 ? c.scale : 1.0 / std::sqrt(double(c.d)), c.mask,
            c.mods};
  if (!in.mods.alibi.empty()) EXPECT_EQ(in.mods.alibi.size(), static_cast<size_t>(c.b * c.hq)) << c.name;
  return in;
}

// Textbook attention, independent of reference.cpp and core/mask.hpp: score = scale * q.k, then
// softcap * tanh(score / softcap), then minus slope * |i + skv - sq - j|.
testing::RefForward textbook_forward(const Inputs& in) {
  const auto& s = in.s;
  testing::RefForward r;
  r.out.assign(in.q.size(), 0.0);
  r.lse.assign(s.batch * s.heads_q * s.seq_q, 0.0);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t hk = h * s.heads_kv / s.heads_q;  // == h / (Hq / Hkv)
      for (int64_t i = 0; i < s.seq_q; ++i) {
        std::vector<double> sc;
        std::vector<int64_t> idx;
        const double slope = in.mods.alibi.empty() ? 0.0 : in.mods.alibi[b * s.heads_q + h];
        for (int64_t j = 0; j < s.seq_kv; ++j) {
          if (!visible(in.mask, in.mods, i, j, s.seq_q, s.seq_kv)) continue;
          double dot = 0;
          for (int64_t x = 0; x < s.head_dim; ++x)
            dot += in.q[((b * s.heads_q + h) * s.seq_q + i) * s.head_dim + x] *
                   in.k[((b * s.heads_kv + hk) * s.seq_kv + j) * s.head_dim + x];
          double score = in.scale * dot;
          if (in.mods.softcap > 0) score = in.mods.softcap * std::tanh(score / in.mods.softcap);
          score -= slope * std::abs(static_cast<double>(i + s.seq_kv - s.seq_q - j));
          sc.push_back(score);
          idx.push_back(j);
        }
        const int64_t row = (b * s.heads_q + h) * s.seq_q + i;
        if (sc.empty()) {
          r.lse[row] = -std::numeric_limits<double>::infinity();
          continue;
        }
        const double m = *std::max_element(sc.begin(), sc.end());
        double z = 0;
        for (double x : sc) z += std::exp(x - m);
        r.lse[row] = m + std::log(z);
        for (size_t t = 0; t < sc.size(); ++t) {
          const double pr = std::exp(sc[t] - m) / z;
          for (int64_t x = 0; x < s.head_dim; ++x)
            r.out[row * s.head_dim + x] +=
                pr * in.v[((b * s.heads_kv + hk) * s.seq_kv + idx[t]) * s.head_dim + x];
        }
      }
    }
  return r;
}

double loss(const Inputs& in) {
  auto f = testing::reference_forward(in.s, in.q, in.k, in.v, in.scale, in.mask, in.mods);
  double l = 0;
  for (size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * in.dout[i];
  return l;
}

class ReferenceCheck : public ::testing::TestWithParam<RefCase> {};

TEST_P(ReferenceCheck, ForwardMatchesTextbook) {
  const Inputs in = make_inputs(GetParam(), 11);
  const auto got = testing::reference_forward(in.s, in.q, in.k, in.v, in.scale, in.mask, in.mods);
  const auto want = textbook_forward(in);
  ASSERT_EQ(got.out.size(), want.out.size());
  ASSERT_EQ(got.lse.size(), want.lse.size());
  for (size_t i = 0; i < want.out.size(); ++i)
    EXPECT_NEAR(got.out[i], want.out[i], 1e-13) << "out[" << i << "]";
  for (size_t i = 0; i < want.lse.size(); ++i) {
    if (std::isinf(want.lse[i])) {
      EXPECT_EQ(got.lse[i], want.lse[i]) << "lse[" << i << "] of a fully masked row";
    } else {
      EXPECT_NEAR(got.lse[i], want.lse[i], 1e-13) << "lse[" << i << "]";
    }
  }
}

// dX of L = sum(out * dout) by central differences, h = 1e-5: the truncation error is
// O(h^2 * |L'''|) ~ 1e-10 and the cancellation error O(eps * |L| / h) ~ 1e-11 for these O(1)
// inputs, so 1e-7 relative to max|grad| leaves a wide margin while any real mistake (a missing
// scale, a wrong GQA sum, a masked entry leaking) is O(1).
TEST_P(ReferenceCheck, GradientsMatchFiniteDifferences) {
  Inputs in = make_inputs(GetParam(), 23);
  const auto g =
      testing::reference_backward(in.s, in.q, in.k, in.v, in.dout, in.scale, in.mask, in.mods);
  const double h = 1e-5;
  struct Item {
    std::vector<double>* x;
    const std::vector<double>* grad;
    const char* name;
  };
  for (const Item& it : {Item{&in.q, &g.dq, "dq"}, Item{&in.k, &g.dk, "dk"},
                         Item{&in.v, &g.dv, "dv"}}) {
    ASSERT_EQ(it.x->size(), it.grad->size()) << it.name;
    double max_grad = 0;
    for (double v : *it.grad) max_grad = std::max(max_grad, std::fabs(v));
    ASSERT_GT(max_grad, 1e-3) << it.name << " is (nearly) all zero: the check would be vacuous";
    for (size_t i = 0; i < it.x->size(); ++i) {
      const double x0 = (*it.x)[i];
      (*it.x)[i] = x0 + h;
      const double lp = loss(in);
      (*it.x)[i] = x0 - h;
      const double lm = loss(in);
      (*it.x)[i] = x0;
      const double fd = (lp - lm) / (2 * h);
      EXPECT_NEAR((*it.grad)[i], fd, 1e-7 * max_grad) << it.name << "[" << i << "]";
    }
  }
}

// Rows that see no key: out 0, lse -inf, dq 0; keys that no row sees: dk = dv = 0. Exactly.
TEST_P(ReferenceCheck, MaskedRowsAndKeysAreExactZeros) {
  const RefCase& c = GetParam();
  const Inputs in = make_inputs(c, 5);
  const auto f = testing::reference_forward(in.s, in.q, in.k, in.v, in.scale, in.mask, in.mods);
  const auto g =
      testing::reference_backward(in.s, in.q, in.k, in.v, in.dout, in.scale, in.mask, in.mods);
  for (int64_t bh = 0; bh < c.b * c.hq; ++bh)
    for (int64_t i = 0; i < c.sq; ++i) {
      bool any = false;
      for (int64_t j = 0; j < c.skv; ++j) any |= visible(c.mask, c.mods, i, j, c.sq, c.skv);
      const int64_t row = bh * c.sq + i;
      if (any) {
        EXPECT_TRUE(std::isfinite(f.lse[row])) << "row " << row;
        continue;
      }
      EXPECT_EQ(f.lse[row], -std::numeric_limits<double>::infinity()) << "row " << row;
      for (int64_t x = 0; x < c.d; ++x) {
        EXPECT_EQ(f.out[row * c.d + x], 0.0) << "row " << row;
        EXPECT_EQ(g.dq[row * c.d + x], 0.0) << "row " << row;
      }
    }
  for (int64_t bh = 0; bh < c.b * c.hkv; ++bh)
    for (int64_t j = 0; j < c.skv; ++j) {
      bool any = false;
      for (int64_t i = 0; i < c.sq; ++i) any |= visible(c.mask, c.mods, i, j, c.sq, c.skv);
      if (any) continue;
      for (int64_t x = 0; x < c.d; ++x) {
        EXPECT_EQ(g.dk[(bh * c.skv + j) * c.d + x], 0.0) << "key " << j;
        EXPECT_EQ(g.dv[(bh * c.skv + j) * c.d + x], 0.0) << "key " << j;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Small, ReferenceCheck, ::testing::ValuesIn(kCases), case_name);

// NaN and Inf in q, k, v: every output of the reference is what the rule of
// tests/nonfinite_cases.hpp says - NaN, exactly 0 (empty rows, unseen keys), -inf, or a finite
// value - and each finite one is bitwise that of the same problem with the poisoned element
// replaced by a finite value (it does not depend on it at all: a hidden entry is absent from the
// sums, not a zero weight). (No infinity under a softcap: tanh makes an infinite score finite.)
TEST_P(ReferenceCheck, NonFiniteInputsFollowTheRule) {
  const RefCase& c = GetParam();
  ProblemConfig cfg = make_config(c.b, c.hq, c.hkv, c.sq, c.skv, c.d, c.mask, DType::Float64, testing::Layout::BHSD,
                                  static_cast<float>(c.scale), 9);
  cfg.window_left = c.mods.window_left;
  cfg.window_right = c.mods.window_right;
  if (!c.mods.alibi.empty()) cfg.alibi = testing::AlibiKind::BatchHeads;  // the Problem's own slopes
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::vector<std::vector<Poison>> cases = {
      {{Poison::Q, 0, c.hq - 1, c.sq - 1, 0, nan}},
      {{Poison::Q, c.b - 1, 0, c.sq / 2, c.d - 1, nan}, {Poison::K, 0, 0, c.skv - 1, 0, nan}},
      {{Poison::K, c.b - 1, c.hkv - 1, c.skv / 2, 0, nan}},
      {{Poison::V, 0, 0, 0, c.d - 1, nan}, {Poison::V, c.b - 1, c.hkv - 1, c.skv - 1, 0, nan}},
      {{Poison::K, 0, 0, c.skv / 2, c.d - 1, inf}},
  };
  for (size_t n = 0; n < cases.size() - (c.mods.softcap > 0 ? 1 : 0); ++n) {
    SCOPED_TRACE("poison set " + std::to_string(n));
    Problem p(cfg), same(cfg);
    apply_poison(p, cases[n]);
    // The finite twin: the same inputs (q's column made positive for an infinity included), the
    // poisoned elements 0.5.
    apply_poison(same, cases[n]);
    std::vector<Poison> finite = cases[n];
    for (Poison& x : finite) x.value = 0.5;
    apply_poison(same, finite);
    const Reference r = reference_for(p), t = reference_for(same);
    const double exact[5] = {0, 0, 0, 0, 0};
    EXPECT_TRUE(matches_wants(outputs_of(r), outputs_of(t), wants_for(cfg, cases[n], false), exact));
  }
}

}  // namespace
}  // namespace flashattn::test
