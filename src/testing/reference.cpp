#include "testing/reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "core/half.hpp"
#include "core/mask.hpp"

namespace flashattn::testing {
namespace {

// Row-major matrix helpers for one head: explicit and slow on purpose.
struct HeadView {
  const double* q;
  const double* k;
  const double* v;
  int64_t sq, skv, d;
};

// S = scale * q k^T (softcapped, plus the ALiBi bias) of the visible entries; P = softmax(S) per
// row, masked entries exactly 0. F (when given) gets d S / d (scale * q.k): 1 - tanh^2 under a
// softcap, else 1.
// Non-finite values follow IEEE arithmetic through the max-shifted form every backend computes,
//     m = max_j S_ij,  lse = m + log(sum_j exp(S_ij - m)),  P_ij = exp(S_ij - lse)
// with one convention of the online softmax: a row whose visible scores are all -inf shifts by 0
// instead of m (exp(-inf - -inf) would be NaN), so its sum is 0, lse = -inf and P = exp(-inf + inf)
// = NaN. A NaN score makes the sum NaN whether or not the max saw it (std::max drops it), so lse
// and the row's P are NaN; a +inf score makes m = +inf and exp(inf - inf) = NaN likewise. Only a
// row with no visible key (decided by the band, never by the values) is empty: lse = -inf, P = 0.
void scores_and_probs(const HeadView& h, double scale, const MaskRule& rule, double softcap, double slope,
                      std::vector<double>& P, std::vector<double>& lse, std::vector<double>* F = nullptr) {
  P.assign(h.sq * h.skv, 0.0);
  lse.assign(h.sq, -std::numeric_limits<double>::infinity());
  if (F) F->assign(h.sq * h.skv, 0.0);
  std::vector<double> S(h.skv);
  const int64_t diag = h.skv - h.sq;
  for (int64_t i = 0; i < h.sq; ++i) {
    const int64_t j0 = rule.key_begin(i), j1 = rule.key_end(i, h.skv);
    if (j0 >= j1) continue;  // no visible key
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = j0; j < j1; ++j) {
      double acc = 0;
      for (int64_t x = 0; x < h.d; ++x) acc += h.q[i * h.d + x] * h.k[j * h.d + x];
      double s = scale * acc, f = 1.0;
      if (softcap > 0) {
        const double t = std::tanh(s / softcap);
        s = softcap * t;
        f = 1.0 - t * t;
      }
      if (slope != 0) s -= slope * static_cast<double>(std::llabs(j - i - diag));
      S[j] = s;
      if (F) (*F)[i * h.skv + j] = f;
      m = std::max(m, S[j]);
    }
    const double shift = m == -std::numeric_limits<double>::infinity() ? 0.0 : m;
    double sum = 0;
    for (int64_t j = j0; j < j1; ++j) sum += std::exp(S[j] - shift);
    lse[i] = m + std::log(sum);
    for (int64_t j = j0; j < j1; ++j) P[i * h.skv + j] = std::exp(S[j] - lse[i]);
  }
}

MaskRule rule_of(const RefShape& s, Mask mask, const RefMods& mods) {
  return make_mask_rule(static_cast<int32_t>(mask), s.seq_q, s.seq_kv, mods.window_left, mods.window_right);
}
double slope_of(const RefShape& s, const RefMods& mods, int64_t b, int64_t h) {
  return mods.alibi.empty() ? 0.0 : mods.alibi[b * s.heads_q + h];
}

}  // namespace

RefForward reference_forward(const RefShape& s, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v,
                             double scale, Mask mask, const RefMods& mods) {
  RefForward r;
  r.out.assign(s.batch * s.heads_q * s.seq_q * s.head_dim, 0.0);
  r.lse.assign(s.batch * s.heads_q * s.seq_q, 0.0);
  const MaskRule rule = rule_of(s, mask, mods);
  const int64_t group = s.heads_q / s.heads_kv, D = s.head_dim;
  std::vector<double> P, lse;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t qo = (b * s.heads_q + h) * s.seq_q * D;
      const int64_t ko = (b * s.heads_kv + h / group) * s.seq_kv * D;
      HeadView hv{&q[qo], &k[ko], &v[ko], s.seq_q, s.seq_kv, D};
      scores_and_probs(hv, scale, rule, mods.softcap, slope_of(s, mods, b, h), P, lse);
      // Loops below run their innermost index over contiguous memory: walking a column of P or
      // dS touches a new page per element (10x slower at S = 2048). Every element still sums its
      // terms from zero in ascending index order, so results are bitwise those of the textbook
      // loop nest. They visit the band only: a masked entry is absent, not a zero weight, so a
      // NaN or inf in a key a row does not see cannot reach that row (0 * inf would be NaN).
      for (int64_t i = 0; i < s.seq_q; ++i) {
        r.lse[(b * s.heads_q + h) * s.seq_q + i] = lse[i];
        double* o = &r.out[qo + i * D];
        for (int64_t j = rule.key_begin(i); j < rule.key_end(i, s.seq_kv); ++j) {
          const double p = P[i * s.seq_kv + j];
          for (int64_t x = 0; x < D; ++x) o[x] += p * hv.v[j * D + x];
        }
      }
    }
  return r;
}

RefBackward reference_backward(const RefShape& s, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<double>& dout, double scale, Mask mask,
                               const RefMods& mods) {
  RefBackward r;
  r.dq.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0);
  const MaskRule rule = rule_of(s, mask, mods);
  const int64_t group = s.heads_q / s.heads_kv, D = s.head_dim, Sq = s.seq_q, Skv = s.seq_kv;
  std::vector<double> P, lse, F, dP(Sq * Skv), dS(Sq * Skv), acc;
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t qo = (b * s.heads_q + h) * Sq * D;
      const int64_t ko = (b * s.heads_kv + h / group) * Skv * D;
      HeadView hv{&q[qo], &k[ko], &v[ko], Sq, Skv, D};
      scores_and_probs(hv, scale, rule, mods.softcap, slope_of(s, mods, b, h), P, lse, &F);
      const double* dO = &dout[qo];
      // dV += P^T dO ; dP = dO V^T
      // (innermost loops over contiguous memory, sums in the textbook order, the band only: see
      // the forward)
      acc.assign(Skv * D, 0.0);
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t j = rule.key_begin(i); j < rule.key_end(i, Skv); ++j) {
          const double p = P[i * Skv + j];
          for (int64_t x = 0; x < D; ++x) acc[j * D + x] += p * dO[i * D + x];
        }
      for (int64_t e = 0; e < Skv * D; ++e) r.dv[ko + e] += acc[e];
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t j = rule.key_begin(i); j < rule.key_end(i, Skv); ++j) {
          double acc = 0;
          for (int64_t x = 0; x < D; ++x) acc += dO[i * D + x] * hv.v[j * D + x];
          dP[i * Skv + j] = acc;
        }
      // dS = P * (dP - rowsum(P * dP))   (the softmax Jacobian, written out), times the
      // softcap's derivative F (the bias is constant)
      for (int64_t i = 0; i < Sq; ++i) {
        const int64_t j0 = rule.key_begin(i), j1 = rule.key_end(i, Skv);
        double rs = 0;
        for (int64_t j = j0; j < j1; ++j) rs += P[i * Skv + j] * dP[i * Skv + j];
        for (int64_t j = j0; j < j1; ++j)
          dS[i * Skv + j] = P[i * Skv + j] * (dP[i * Skv + j] - rs) * F[i * Skv + j];
      }
      // dQ = scale * dS K ; dK += scale * dS^T Q
      for (int64_t i = 0; i < Sq; ++i) {
        acc.assign(D, 0.0);
        for (int64_t j = rule.key_begin(i); j < rule.key_end(i, Skv); ++j) {
          const double d = dS[i * Skv + j];
          for (int64_t x = 0; x < D; ++x) acc[x] += d * hv.k[j * D + x];
        }
        for (int64_t x = 0; x < D; ++x) r.dq[qo + i * D + x] = scale * acc[x];
      }
      acc.assign(Skv * D, 0.0);
      for (int64_t i = 0; i < Sq; ++i)
        for (int64_t j = rule.key_begin(i); j < rule.key_end(i, Skv); ++j) {
          const double d = dS[i * Skv + j];
          for (int64_t x = 0; x < D; ++x) acc[j * D + x] += d * hv.q[i * D + x];
        }
      for (int64_t e = 0; e < Skv * D; ++e) r.dk[ko + e] += scale * acc[e];
    }
  return r;
}

namespace {

double round_to(double x, DType t) {
  switch (t) {
    case DType::Float32: return static_cast<float>(x);
    case DType::Float16: return fp16_to_float(float_to_fp16(static_cast<float>(x)));
    case DType::BFloat16: return bf16_to_float(float_to_bf16(static_cast<float>(x)));
    default: return x;
  }
}

// Row x[0, D) rotated at position pos: each pair (a, b) of the first rotary_dim dims becomes
// (a cos - b sin, a sin + b cos), i.e. the complex product (a + ib) e^{i theta}.
void rotate(double* x, int64_t pos, const RefRotary& r) {
  const int64_t half = r.rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double c = r.cos[pos * half + i], s = r.sin[pos * half + i];
    double& a = x[r.interleaved ? 2 * i : i];
    double& b = x[r.interleaved ? 2 * i + 1 : i + half];
    const double a2 = a * c - b * s, b2 = a * s + b * c;
    a = round_to(a2, r.round_to);
    b = round_to(b2, r.round_to);
  }
}

}  // namespace

RefKvcache reference_kvcache(const RefKvcacheSeq& s, const RefRotary& rot, double scale, Mask mask,
                             const RefMods& mods) {
  const int64_t D = s.head_dim, L = s.len_old, N = s.seq_new, Sk = L + N;
  RefKvcache r;
  std::vector<double> q = s.q;
  r.k_appended = s.k_new;
  if (rot.rotary_dim > 0) {
    for (int64_t h = 0; h < s.heads_q; ++h)
      for (int64_t i = 0; i < s.seq_q; ++i) rotate(&q[(h * s.seq_q + i) * D], s.pos0 + (s.q_advances ? i : 0), rot);
    for (int64_t h = 0; h < s.heads_kv; ++h)
      for (int64_t j = 0; j < N; ++j) rotate(&r.k_appended[(h * N + j) * D], s.pos0 + j, rot);
  }
  // The cache after the append: per kv head, the old rows then the new ones.
  std::vector<double> k(s.heads_kv * Sk * D), v(s.heads_kv * Sk * D);
  for (int64_t h = 0; h < s.heads_kv; ++h)
    for (int64_t j = 0; j < Sk; ++j)
      for (int64_t x = 0; x < D; ++x) {
        const int64_t o = (h * Sk + j) * D + x;
        k[o] = j < L ? s.k_old[(h * L + j) * D + x] : r.k_appended[(h * N + j - L) * D + x];
        v[o] = j < L ? s.v_old[(h * L + j) * D + x] : s.v_new[(h * N + j - L) * D + x];
      }
  const RefShape shape{1, s.heads_q, s.heads_kv, s.seq_q, Sk, D};
  r.fwd = reference_forward(shape, q, k, v, scale, mask, mods);
  return r;
}

}  // namespace flashattn::testing
