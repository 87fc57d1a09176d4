// The score transform: the one step that turns a raw product s = q.k into the logit the softmax
// sees, shared by the forward and both backward passes of every backend (host and device).
//
// Kernels keep logits in log2 units so that exp2 (one MUFU.EX2 on a GPU, a short polynomial on a
// CPU) is the only transcendental: logit2 = s * scale * log2(e), and
//     P = exp(scale * s - LSE) = exp2(s * sl2 - LSE * log2(e)),
// one FMA per score (exp2_arg). In the backward dS = P (dP - D) is the gradient of the scaled
// score; the chain rule through the transform gives dQ = grad_scale() * dS K and
// dK = grad_scale() * dS^T Q (applied once, in the epilogue), times grad_factor(s) per element for
// a transform that is not linear (none yet). A new transform (logit softcap, ALiBi) changes this
// struct and the places that call it, not the kernels' loops.
#pragma once

#include <cmath>

#include "core/host_device.hpp"

namespace flashattn {

struct ScoreTransform {
  static constexpr float kLog2e = 1.4426950408889634f;
  float scale;  // softmax scale (never 0)
  float sl2;    // scale * log2(e): a raw score times sl2 is its logit in log2 units

  FLASHATTN_HD static ScoreTransform make(float scale) { return ScoreTransform{scale, scale * kLog2e}; }
  // The multiplier that can be folded into Q once (CPU kernels pack Q pre-scaled): after it, a
  // product is already a log2-unit logit and apply2() finishes the transform.
  FLASHATTN_HD float prescale() const { return sl2; }
  // The same multiplier in the compute type T (float: exactly prescale(); double: scale * log2(e)
  // rounded once in double, so that the float64 path carries no float rounding of its logits).
  template <class T>
  FLASHATTN_HD T prescale_as() const {
    return static_cast<T>(scale) * static_cast<T>(1.4426950408889634);
  }
  FLASHATTN_HD float apply2(float s2) const { return s2; }  // on a pre-scaled product
  // The log2-unit logit of a raw product.
  FLASHATTN_HD float logit2(float s) const { return s * sl2; }
  // The exponent of P = exp2(logit2(s) - m2) for a row's running max or LSE m2 (log2 units): one FMA.
  FLASHATTN_HD float exp2_arg(float s, float m2) const { return fmaf(s, sl2, -m2); }
  // Backward: the factor applied once to dQ and dK (d logit / d s for the linear part).
  FLASHATTN_HD float grad_scale() const { return scale; }
  // Backward: per-element factor on dS for a non-linear transform (1 for the plain scale; the
  // kernels skip the multiply when kElementwiseGrad is false).
  static constexpr bool kElementwiseGrad = false;
  FLASHATTN_HD float grad_factor(float /*s*/) const { return 1.0f; }
};

}  // namespace flashattn
