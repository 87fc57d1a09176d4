// The float64 reference: deliberately plain attention with explicit S, P, dP and dS matrices
// (O(Sq*Skv) memory per head). It is the yardstick for every backend, and it is itself checked
// against central finite differences of its own forward (tests/test_reference.cpp).
#pragma once

#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::testing {

struct RefShape {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
};

// What the mask and score transform add beyond scale and mask (flashattn.h's options):
// a sliding window (-1 = unbounded side), the softcap (0 = none) and ALiBi slopes, one per
// (batch, query head) at alibi[b * Hq + h] (empty = none).
struct RefMods {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  std::vector<double> alibi;
};

// All arrays are logical, contiguous: q/out/dout/dq [B,Hq,Sq,D], k/v/dk/dv [B,Hkv,Skv,D],
// lse [B,Hq,Sq].
struct RefForward {
  std::vector<double> out, lse;
};
struct RefBackward {
  std::vector<double> dq, dk, dv;
};

RefForward reference_forward(const RefShape& s, const std::vector<double>& q,
                             const std::vector<double>& k, const std::vector<double>& v,
                             double scale, Mask mask, const RefMods& mods = {});

// Gradients of sum(out * dout) with respect to q, k and v.
RefBackward reference_backward(const RefShape& s, const std::vector<double>& q,
                               const std::vector<double>& k, const std::vector<double>& v,
                               const std::vector<double>& dout, double scale, Mask mask,
                               const RefMods& mods = {});

}  // namespace flashattn::testing
