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

// KV-cache attention of one sequence (flashattn_forward_kvcache), from the definitions: the
// rotary embedding applied to q and to the new keys, the new rows appended after the valid cache
// prefix, then reference_forward over the result (batch 1; mods.alibi holds this sequence's Hq
// slopes).
struct RefRotary {
  std::vector<double> cos, sin;  // [rows, rotary_dim / 2], row-major; empty: no rotary
  int64_t rotary_dim = 0;
  bool interleaved = true;       // pairs (2i, 2i + 1); else (i, i + rotary_dim / 2)
  // The library stores rotated values in the call's dtype (float16 / bfloat16 / float32 round
  // them); the reference rounds its exact rotation the same way. Float64: no rounding.
  DType round_to = DType::Float64;
};
struct RefKvcacheSeq {
  int64_t heads_q = 0, heads_kv = 0, seq_q = 0, head_dim = 0;
  std::vector<double> q;             // [Hq, Sq, D]
  int64_t len_old = 0;               // valid cache rows before the append
  std::vector<double> k_old, v_old;  // [Hkv, len_old, D]
  int64_t seq_new = 0;
  std::vector<double> k_new, v_new;  // [Hkv, seq_new, D]
  int64_t pos0 = 0;                  // absolute position of the first new key (cache_seqlens[b])
  bool q_advances = false;           // query row i at pos0 + i (else every row at pos0)
};
struct RefKvcache {
  RefForward fwd;                  // out [Hq, Sq, D], lse [Hq, Sq]
  std::vector<double> k_appended;  // [Hkv, seq_new, D]: the new keys as the cache must hold them
};
RefKvcache reference_kvcache(const RefKvcacheSeq& s, const RefRotary& rot, double scale, Mask mask,
                             const RefMods& mods = {});

}  // namespace flashattn::testing
