// The score transform: the one step that turns a raw product s = q.k into the logit the softmax
// sees, shared by the forward and both backward passes of every backend (host and device).
//
// Kernels keep logits in log2 units so that exp2 (one MUFU.EX2 on a GPU, a short polynomial on a
// CPU) is the only transcendental: logit2 = s * scale * log2(e), and
//     P = exp(scale * s - LSE) = exp2(s * sl2 - LSE * log2(e)),
// one FMA per score (exp2_arg). In the backward dS = P (dP - D) is the gradient of the logit;
// the chain rule through the transform gives dQ = grad_scale() * (dS o F) K and
// dK = grad_scale() * (dS o F)^T Q, grad_scale() applied once in the epilogue and F the
// per-entry factor of a non-linear transform (1 for the plain scale).
//
// Two transforms are not one multiply, and need the entry's position (i, j) or a tanh:
//   softcap c > 0 (Gemma 2):  x = scale * s  ->  c * tanh(x / c)        F = 1 - tanh^2
//   ALiBi slope m of (b, h):  logit += -m * |i + Skv - Sq - j|          F unchanged (a constant
//                                                                        bias has no gradient)
// (FlashAttention 2's order: softcap on the scaled score, then the bias.) Kernels that support
// them (Numerics::elementwise_scores) run the per-entry step first,
//     x = head.logit2_at(s, i, j)        (log2 units; head = score.head(b, h))
// and then the linear part of `score.after_elementwise()`, whose multiplier is 1, so the code
// after the step (max, exp2_arg, LSE) is the same for both.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.hpp"
#include "core/params.hpp"

namespace flashattn {

// tanh for the softcap, host and device: float32 tanhf (within 2 ulp on CUDA, the C library's on
// the host), far below the scores' own float32 rounding. FAST (the CUDA 16-bit kernels): one
// MUFU.TANH (tanh.approx.f32, relative error about 2^-11) instead of tanhf's ~18 instructions with
// two special-function operations: the 16-bit forward's softmax is issue- and MUFU-bound, and
// tanhf made softcap cost 1.6-1.9x there (bench/mods.py, H200); the error stays below the 16-bit
// rounding of P's inputs that the tests' tolerance already covers (checked against float64).
template <bool FAST = false>
FLASHATTN_HD float softcap_tanh(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (FAST) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }
#endif
  return tanhf(x);
}

struct ScoreTransform {
  static constexpr float kLog2e = 1.4426950408889634f;
  float scale;    // softmax scale (never 0)
  float sl2;      // linear multiplier into log2 units: scale * log2(e); 1 after the per-entry step
  float cap_in;   // softcap: scale / softcap (0: no softcap)
  float cap2;     // softcap * log2(e)
  Alibi alibi;    // slopes (nullptr: none)
  int64_t diag;   // Skv - Sq: the bias is -slope * |j - i - diag|

  FLASHATTN_HD static ScoreTransform make(float scale) {
    return ScoreTransform{scale, scale * kLog2e, 0.0f, 0.0f, Alibi{nullptr, 0, 0}, 0};
  }
  // The call's transform (validated numerics: softcap >= 0 finite, slopes float32 or nullptr).
  FLASHATTN_HD static ScoreTransform make(const Shape& s, const Numerics& n) {
    ScoreTransform t = make(n.scale);
    // The softcap's ends of the float range (as the CPU kernels' fold): a multiplier scale/softcap
    // below 2^-80 (a softcap beyond any score) makes tanh the identity, i.e. no softcap (softcap *
    // log2 e could overflow there); one above 2^64 (a denormal softcap) is clamped, so that tanh
    // saturates without 0 * inf = NaN.
    if (n.softcap > 0.0f) {
      const float ci = n.scale / n.softcap, lim = 18446744073709551616.0f;  // 2^64
      if (fabsf(ci) >= 8.271806125530277e-25f) {                            // 2^-80
        t.cap_in = ci > lim ? lim : (ci < -lim ? -lim : ci);
        t.cap2 = n.softcap * kLog2e;
      }
    }
    t.alibi = n.alibi;
    // (A chunk of the keys, Numerics::kv_offset: the whole sequence's distances.)
    t.diag = (n.kv_total >= 0 ? n.kv_total : s.seq_kv) - s.seq_q - n.kv_offset;
    return t;
  }
  FLASHATTN_HD bool has_softcap() const { return cap_in != 0.0f; }
  FLASHATTN_HD bool has_alibi() const { return alibi.slopes != nullptr; }
  // Whether a per-entry step (logit2_at) is needed at all.
  FLASHATTN_HD bool elementwise() const { return has_softcap() || has_alibi(); }

  // The multiplier that can be folded into Q once (CPU kernels pack Q pre-scaled): after it, a
  // product is already a log2-unit logit (linear transform only).
  FLASHATTN_HD float prescale() const { return sl2; }
  // The same multiplier in the compute type T (float: exactly prescale(); double: scale * log2(e)
  // rounded once in double, so that the float64 path carries no float rounding of its logits).
  template <class T>
  FLASHATTN_HD T prescale_as() const {
    return static_cast<T>(scale) * static_cast<T>(1.4426950408889634);
  }
  FLASHATTN_HD float apply2(float s2) const { return s2; }  // on a pre-scaled product
  // The log2-unit logit of a raw product (linear part).
  FLASHATTN_HD float logit2(float s) const { return s * sl2; }
  // The exponent of P = exp2(logit2(s) - m2) for a row's running max or LSE m2 (log2 units): one FMA.
  FLASHATTN_HD float exp2_arg(float s, float m2) const { return fmaf(s, sl2, -m2); }
  // Backward: the factor applied once to dQ and dK (d logit / d s for the linear part).
  FLASHATTN_HD float grad_scale() const { return scale; }

  // The transform that follows the per-entry step: values are already log2-unit logits, so the
  // linear multiplier is 1 (grad_scale() stays: the step's factor F excludes the scale).
  FLASHATTN_HD ScoreTransform after_elementwise() const {
    ScoreTransform t = *this;
    t.sl2 = 1.0f;
    return t;
  }

  // The per-entry step for one (batch, query head): the slope is loaded once per head.
  struct Head {
    float sl2, cap_in, cap2;
    float slope2;  // ALiBi slope * log2(e) (0: none)
    int64_t diag;
    // The log2-unit logit of raw product s at query row i, key j (FAST: softcap_tanh<true>).
    template <bool FAST = false>
    FLASHATTN_HD float logit2_at(float s, int64_t i, int64_t j) const {
      float x = cap_in != 0.0f ? cap2 * softcap_tanh<FAST>(s * cap_in) : s * sl2;
      if (slope2 != 0.0f) x -= slope2 * static_cast<float>(distance(i, j));
      return x;
    }
    // The same, and F = d logit / d (scale * s) / ... : the per-entry factor on dS (1 - tanh^2
    // under a softcap, else 1).
    template <bool FAST = false>
    FLASHATTN_HD float logit2_at(float s, int64_t i, int64_t j, float& grad_factor) const {
      float x;
      if (cap_in != 0.0f) {
        const float t = softcap_tanh<FAST>(s * cap_in);
        x = cap2 * t;
        grad_factor = fmaf(-t, t, 1.0f);
      } else {
        x = s * sl2;
        grad_factor = 1.0f;
      }
      if (slope2 != 0.0f) x -= slope2 * static_cast<float>(distance(i, j));
      return x;
    }
    FLASHATTN_HD int64_t distance(int64_t i, int64_t j) const {
      const int64_t d = j - i - diag;
      return d < 0 ? -d : d;
    }
  };
  FLASHATTN_HD Head head(int64_t b, int64_t h) const {
    Head r{sl2, cap_in, cap2, 0.0f, diag};
    if (alibi.slopes != nullptr) r.slope2 = alibi.slopes[b * alibi.sb + h * alibi.sh] * kLog2e;
    return r;
  }
};

}  // namespace flashattn
