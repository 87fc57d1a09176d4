// NaN and Inf in the inputs: what every output must be, derived from the mask's band alone (the
// rule of docs/ALGORITHM.md, "Non-finite inputs and empty rows"). Shared by the reference's own
// tests (tests/test_reference.cpp), the CPU tests (tests/test_nonfinite.cpp) and the GPU tests
// (tests/cuda/test_nonfinite_cuda.cpp).
//
// The rule: a row that sees no key by the band is empty - O = 0, LSE = -inf, dQ = 0 - and a key no
// row sees gets dK = dV = 0, exactly, whatever the inputs. Every other output is what IEEE
// arithmetic makes of the max-shifted softmax:
//   NaN in q_i, NaN or +inf in k_j (+inf: with q's matching column positive, so the score is
//     +inf): every row R that has such a score gets O = NaN and LSE = NaN (a NaN score makes the
//     row sum NaN; +inf makes the max +inf and exp(inf - inf) = NaN); backward: dQ of R, and dK,
//     dV of every key a row of R sees, are NaN (P = exp(S - NaN) and D = rowsum(dO * O) are NaN);
//   NaN in v_j[c]: the rows R that see key j get O[c] = NaN (that column only), their LSE stays
//     finite; backward: dQ of R and dK of the keys R sees are NaN (through D = rowsum(dO * O)),
//     dV stays finite (P and dO are);
//   everything else is the finite value of the float64 reference.
// One allowance for the kernels (not the reference): a hidden entry inside a computed tile has the
// weight 0, and a tile product multiplies it with the inputs' rows, so 0 * NaN (or 0 * inf) can
// reach an output whose row or key does not see the poisoned element: O through a poisoned v
// (P V, in the poisoned column), dQ through a poisoned k or v (dS K; dS = P (dP - D) with
// dP = dO V^T), dK through a poisoned q (dS^T Q); and a row whose D = rowsum(dO * O) is NaN (or
// may be, its O having such a NaN) through dS = 0 * (dP - D) to the dK of every key of its tiles.
// Such outputs may be NaN (Want::ValueOrNaN); empty rows and unseen keys may not (the epilogues
// write their zeros).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "core/mask.hpp"
#include "test_util.hpp"

namespace flashattn::test {

// One input element set to a non-finite value: q[b, h, row, col], or k / v[b, hk, row, col].
// all_ones: a NaN written as all-ones bytes (0xffffffff in float32: a NaN whose rounding to a
// narrower significand carries out of it, as the GPU's canonical NaN 0x7fffffff does) instead of
// the quiet NaN `value` converts to.
struct Poison {
  enum Which { Q, K, V } which;
  int64_t b, h, row, col;
  double value;
  bool all_ones = false;
};

enum class Want : uint8_t {
  Value,       // finite: the reference's value, within the caller's tolerance
  NaN,
  Zero,        // exactly 0
  NegInf,      // exactly -inf
  ValueOrNaN,  // Value, or NaN through a tile product (kernels only; see above)
};

inline const char* want_name(Want w) {
  switch (w) {
    case Want::Value: return "the reference's value";
    case Want::NaN: return "NaN";
    case Want::Zero: return "exactly 0";
    case Want::NegInf: return "-inf";
    case Want::ValueOrNaN: return "the reference's value or NaN";
  }
  return "?";
}

// Per output (out, lse, dq, dk, dv; logical contiguous [B,H,S,D] / [B,Hq,Sq] order), per element.
struct Wants {
  std::vector<Want> w[5];
};

inline MaskRule rule_of(const ProblemConfig& c) {
  return make_mask_rule(static_cast<int32_t>(c.mask), c.seq_q, c.seq_kv, c.window_left, c.window_right);
}

// kernel_tiles: allow Want::ValueOrNaN where a kernel's tile product may carry a NaN (see above).
inline Wants wants_for(const ProblemConfig& c, const std::vector<Poison>& poison, bool kernel_tiles) {
  const MaskRule rule = rule_of(c);
  const int64_t B = c.batch, Hq = c.heads_q, Hkv = c.heads_kv, Sq = c.seq_q, Skv = c.seq_kv, D = c.head_dim;
  const int64_t G = Hq / Hkv;
  auto sees = [&](int64_t i, int64_t j) { return j >= rule.key_begin(i) && j < rule.key_end(i, Skv); };
  auto row_sees = [&](int64_t i) { return rule.key_begin(i) < rule.key_end(i, Skv); };
  auto key_seen = [&](int64_t j) { return rule.row_begin(j) < rule.row_end(j, Sq); };
  auto qrow = [&](int64_t b, int64_t h, int64_t i) { return (b * Hq + h) * Sq + i; };
  auto krow = [&](int64_t b, int64_t hk, int64_t j) { return (b * Hkv + hk) * Skv + j; };

  // Rows whose P (so LSE, and O in every column) is NaN; elements of O that are NaN through v
  // alone; rows whose D = rowsum(dO * O) (so dQ) is NaN; keys whose dK, dV are NaN; the outputs
  // exposed to a tile product's 0 * NaN.
  const int64_t nrows = B * Hq * Sq, nkeys = B * Hkv * Skv;
  std::vector<char> p_nan(nrows, 0), o_nan(nrows * D, 0), d_nan(nrows, 0), dk_nan(nkeys, 0), dv_nan(nkeys, 0);
  std::vector<char> o_leak(nrows * D, 0), dq_leak(nrows, 0), dk_leak(nkeys, 0);
  for (const Poison& x : poison) {
    if (x.which == Poison::Q) {
      if (!row_sees(x.row)) continue;
      p_nan[qrow(x.b, x.h, x.row)] = 1;
      for (int64_t j = 0; j < Skv; ++j)
        if (!sees(x.row, j)) dk_leak[krow(x.b, x.h / G, j)] = 1;
      continue;
    }
    for (int64_t h = x.h * G; h < (x.h + 1) * G; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t row = qrow(x.b, h, i);
        if (sees(i, x.row)) {
          if (x.which == Poison::K) p_nan[row] = 1;
          else o_nan[row * D + x.col] = 1;  // O = P V: the poisoned column only
        } else {
          if (x.which == Poison::V) o_leak[row * D + x.col] = 1;
          dq_leak[row] = 1;
        }
      }
  }
  // A NaN in O makes D NaN; one that a tile product may have put there makes D possibly NaN.
  std::vector<char> d_leak(nrows, 0);
  for (int64_t row = 0; row < nrows; ++row)
    for (int64_t x = 0; x < D; ++x) {
      o_nan[row * D + x] |= p_nan[row];
      d_nan[row] |= o_nan[row * D + x];
      d_leak[row] |= o_leak[row * D + x];
    }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t row = qrow(b, h, i);
        if (d_leak[row]) dq_leak[row] = 1;
        for (int64_t j = 0; j < Skv; ++j) {
          // A hidden entry's dS = 0 * (dP - D) is NaN where D is (the CUDA dK/dV kernels zero its
          // P, not its dS: no per-entry work in their hottest loop), so such a row may reach the
          // dK of keys it does not see, too.
          if (!sees(i, j)) {
            if (d_nan[row] || d_leak[row]) dk_leak[krow(b, h / G, j)] = 1;
            continue;
          }
          if (d_nan[row]) dk_nan[krow(b, h / G, j)] = 1;  // dS = P (dP - D)
          if (d_leak[row]) dk_leak[krow(b, h / G, j)] = 1;
          if (p_nan[row]) dv_nan[krow(b, h / G, j)] = 1;  // P^T dO
        }
      }

  Wants r;
  for (int o = 0; o < 5; ++o) r.w[o].assign(o == 1 ? B * Hq * Sq : (o < 3 ? B * Hq * Sq * D : B * Hkv * Skv * D), Want::Value);
  auto value = [&](bool nan, bool leak) { return nan ? Want::NaN : (leak && kernel_tiles ? Want::ValueOrNaN : Want::Value); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t row = qrow(b, h, i);
        const bool empty = !row_sees(i);
        r.w[1][row] = empty ? Want::NegInf : (p_nan[row] ? Want::NaN : Want::Value);
        for (int64_t x = 0; x < D; ++x) {
          r.w[0][row * D + x] = empty ? Want::Zero : value(o_nan[row * D + x], o_leak[row * D + x]);
          r.w[2][row * D + x] = empty ? Want::Zero : value(d_nan[row], dq_leak[row]);
        }
      }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t j = 0; j < Skv; ++j) {
        const int64_t key = krow(b, hk, j);
        const bool unseen = !key_seen(j);
        for (int64_t x = 0; x < D; ++x) {
          r.w[3][key * D + x] = unseen ? Want::Zero : value(dk_nan[key], dk_leak[key]);
          r.w[4][key * D + x] = unseen ? Want::Zero : value(dv_nan[key], false);
        }
      }
  return r;
}

// Writes the poisoned elements into a problem's inputs. A +inf or -inf in k also makes q's column
// of that element positive (|q| + 0.25) in every row of the kv group, so that each score it meets
// is an infinity of the same sign (a zero or negative q there would make it NaN or flip it).
inline void apply_poison(Problem& p, const std::vector<Poison>& poison) {
  const int64_t G = p.cfg.heads_q / p.cfg.heads_kv;
  auto at = [](const Tensor& t, int64_t b, int64_t h, int64_t s, int64_t d) {
    return b * t.stride[0] + h * t.stride[1] + s * t.stride[2] + d * t.stride[3];
  };
  for (const Poison& x : poison) {
    const testing::HostTensor& t = x.which == Poison::Q ? p.q : (x.which == Poison::K ? p.k : p.v);
    if (x.which == Poison::K && std::isinf(x.value))
      for (int64_t h = x.h * G; h < (x.h + 1) * G; ++h)
        for (int64_t i = 0; i < p.cfg.seq_q; ++i) {
          const int64_t off = at(p.q.view, x.b, h, i, x.col);
          testing::store_element(p.q.view.data, p.cfg.dtype, off,
                                 std::fabs(testing::load_element(p.q.view.data, p.cfg.dtype, off)) + 0.25);
        }
    const int64_t off = at(t.view, x.b, x.h, x.row, x.col);
    if (x.all_ones) {
      const size_t bytes = dtype_size(p.cfg.dtype);
      std::memset(static_cast<unsigned char*>(t.view.data) + off * bytes, 0xff, bytes);
    } else {
      testing::store_element(t.view.data, p.cfg.dtype, off, x.value);
    }
  }
}

// ---- the cases the CPU and GPU suites share ----------------------------------------------------

// A problem shape with its mask (and window), named for the test.
struct NonFiniteShape {
  const char* name;
  int64_t b, hq, hkv, sq, skv, d;
  Mask mask;
  int64_t window_left = -1, window_right = -1;
};
inline ProblemConfig config_of(const NonFiniteShape& s, DType dt, uint64_t seed) {
  ProblemConfig c = make_config(s.b, s.hq, s.hkv, s.sq, s.skv, s.d, s.mask, dt, testing::Layout::BSHD, 0.0f, seed);
  c.window_left = s.window_left;
  c.window_right = s.window_right;
  return c;
}

// Poisons near the middle of the sequences (rows and keys some rows see and some do not), in
// batch and head 0, and in the last batch's last head too.
inline std::vector<Poison> poison_pair(Poison::Which w, const NonFiniteShape& s, double value, bool all_ones = false) {
  const int64_t row = w == Poison::Q ? s.sq - 2 : s.skv / 2, h = w == Poison::Q ? s.hq - 1 : s.hkv - 1;
  return {{w, 0, 0, row, 0, value, all_ones}, {w, s.b - 1, h, row / 2, s.d - 1, value, all_ones}};
}
struct NonFiniteCase {
  const char* name;
  std::vector<Poison> (*poison)(const NonFiniteShape&);
};
// NaN in q, k, v; +inf in k; a NaN in the first key (every row that sees a key sees it under a
// causal mask); NaNs of all-ones bytes in q and k.
inline const std::vector<NonFiniteCase>& nonfinite_cases() {
  constexpr double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  static const std::vector<NonFiniteCase> cases = {
      {"nan_q", [](const NonFiniteShape& s) { return poison_pair(Poison::Q, s, nan); }},
      {"nan_k", [](const NonFiniteShape& s) { return poison_pair(Poison::K, s, nan); }},
      {"nan_v", [](const NonFiniteShape& s) { return poison_pair(Poison::V, s, nan); }},
      {"inf_k", [](const NonFiniteShape& s) { return poison_pair(Poison::K, s, inf); }},
      {"nan_k_first", [](const NonFiniteShape&) { return std::vector<Poison>{{Poison::K, 0, 0, 0, 0, nan}}; }},
      {"nan_all_ones_q_k",
       [](const NonFiniteShape& s) {
         std::vector<Poison> r = poison_pair(Poison::Q, s, nan, true);
         for (const Poison& x : poison_pair(Poison::K, s, nan, true)) r.push_back(x);
         return r;
       }},
  };
  return cases;
}

// One test parameter: shape x case x dtype, over every combination of the given lists.
struct NonFiniteParam {
  NonFiniteShape shape;
  NonFiniteCase c;
  DType dtype;
};
inline void PrintTo(const NonFiniteParam& p, std::ostream* os) {
  *os << p.shape.name << "/" << p.c.name << "/" << dtype_name(p.dtype);
}
inline std::vector<NonFiniteParam> nonfinite_params(const std::vector<NonFiniteShape>& shapes,
                                                    const std::vector<DType>& dtypes) {
  std::vector<NonFiniteParam> r;
  for (const NonFiniteShape& s : shapes)
    for (const NonFiniteCase& c : nonfinite_cases())
      for (DType dt : dtypes) r.push_back({s, c, dt});
  return r;
}
inline std::string nonfinite_param_name(const ::testing::TestParamInfo<NonFiniteParam>& i) {
  return std::string(i.param.shape.name) + "_" + i.param.c.name + "_" + dtype_name(i.param.dtype);
}

// The five outputs (out, lse, dq, dk, dv) of a problem or of the reference, as matches_wants reads them.
struct Outputs {
  std::vector<double> v[5];
};
inline Outputs outputs_of(const Problem& p) {
  return Outputs{{p.to_double(p.out), p.to_double(p.lse), p.to_double(p.dq), p.to_double(p.dk), p.to_double(p.dv)}};
}
inline Outputs outputs_of(const Reference& r) { return Outputs{{r.fwd.out, r.fwd.lse, r.bwd.dq, r.bwd.dk, r.bwd.dv}}; }

// Every output element of `got` (out, lse, dq, dk, dv: outputs_of) against
// `wants`, Value entries against `ref` within tol[o] * max(1, max |ref| of the output's Value
// entries; for the gradients the largest of the three). Lists the first mismatches.
inline ::testing::AssertionResult matches_wants(const Outputs& got_outputs, const Outputs& ref_outputs,
                                                const Wants& wants, const double (&tol)[5]) {
  const std::vector<double>(&got)[5] = got_outputs.v;
  const std::vector<double>(&ref)[5] = ref_outputs.v;
  static const char* kNames[5] = {"out", "lse", "dq", "dk", "dv"};
  double scale[5];
  for (int o = 0; o < 5; ++o) {
    scale[o] = 1.0;
    for (size_t e = 0; e < ref[o].size(); ++e)
      if (wants.w[o][e] == Want::Value && std::isfinite(ref[o][e])) scale[o] = std::max(scale[o], std::fabs(ref[o][e]));
  }
  const double gs = std::max({scale[2], scale[3], scale[4]});
  scale[2] = scale[3] = scale[4] = gs;
  std::ostringstream bad;
  int64_t nbad = 0;
  for (int o = 0; o < 5; ++o) {
    if (got[o].size() != wants.w[o].size() || ref[o].size() != wants.w[o].size())
      return ::testing::AssertionFailure() << kNames[o] << ": size mismatch";
    for (size_t e = 0; e < got[o].size(); ++e) {
      const double g = got[o][e], r = ref[o][e];
      const Want w = wants.w[o][e];
      const bool close = std::isfinite(g) && std::isfinite(r) && std::fabs(g - r) <= tol[o] * scale[o];
      bool ok = false;
      switch (w) {
        case Want::Value: ok = close; break;
        case Want::NaN: ok = std::isnan(g); break;
        case Want::Zero: ok = g == 0.0; break;
        case Want::NegInf: ok = g == -std::numeric_limits<double>::infinity(); break;
        case Want::ValueOrNaN: ok = close || std::isnan(g); break;
      }
      if (!ok && nbad++ < 12)
        bad << "\n  " << kNames[o] << "[" << e << "] = " << g << ", want " << want_name(w) << " (reference " << r << ")";
    }
  }
  if (nbad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << nbad << " elements differ from the rule:" << bad.str();
}

}  // namespace flashattn::test
