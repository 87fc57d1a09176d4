// Naive attention: plain float32 forward and backward that materialise the full score and
// probability matrices, as an eager framework does. It is the O(Sq*Skv)-memory baseline that
// `flashattn bench` puts next to the library, and is checked against the float64 reference by
// `flashattn check --impl naive`. CPU only.
//
// Memory: the forward keeps P [B, Hq, Sq, Skv] (float32) for the backward, which adds a second
// matrix of that size for dP/dS: 2 * B*Hq*Sq*Skv*4 bytes in all (naive_matrix_bytes()).
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::testing {

struct NaiveShape {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
};

// What the forward saves for the backward (autograd's saved tensors): P = softmax(S).
struct NaiveSaved {
  std::vector<float> p;  // [B, Hq, Sq, Skv]
};

// Bytes of the Sq x Skv matrices a forward + backward holds at its peak (P and dS).
double naive_matrix_bytes(const NaiveShape& s);

// All arrays are logical and contiguous: q/out/dout/dq [B,Hq,Sq,D], k/v/dk/dv [B,Hkv,Skv,D],
// lse [B,Hq,Sq]. A row that sees no key gets out = 0, lse = -inf and no gradient.
// num_threads <= 0 means all hardware threads.
void naive_forward(const NaiveShape& s, const float* q, const float* k, const float* v, float scale,
                   Mask mask, float* out, float* lse, NaiveSaved& saved, int num_threads);

// Gradients of sum(out * dout); needs the forward's saved P. dk/dv are summed over the query
// heads of a kv group.
void naive_backward(const NaiveShape& s, const float* q, const float* k, const float* v,
                    const float* dout, const NaiveSaved& saved, float scale, float* dq, float* dk,
                    float* dv, int num_threads);

}  // namespace flashattn::testing
