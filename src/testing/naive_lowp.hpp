// Naive attention in float16 / bfloat16 as PyTorch's eager mode computes it on a GPU: the
// baseline of FlashAttention's accuracy criterion for 16-bit kernels (a kernel may be at most 2x
// (out) / 3x (dq, dk, dv) as far from the float64 reference as this baseline is, both measured on
// the same 16-bit inputs). CPU only; a CPU emulation so the C++ GPU tests need no PyTorch.
//
// Emulated: python/tests/torch_helpers.py attention_ref(q, k, v, dtype=float16/bfloat16),
// differentiated by autograd, which python/tests/test_cuda_lowp.py runs with PyTorch itself.
// Every tensor is stored in the 16-bit type; r() below rounds a float32 to it (nearest even).
// Each matrix product accumulates in float32 and rounds its result once (cuBLAS with float32
// compute and no reduced-precision reductions); each elementwise op or row reduction computes in
// float32 from its 16-bit operands and rounds its result once (PyTorch's opmath for half types).
// The summation order inside a product is not PyTorch's (cuBLAS does not publish one); the
// difference is float32 rounding, far below the 16-bit roundings that make up this baseline.
//
//   forward (masked entries of S are -inf; a row with no visible key gets P = 0, O = 0,
//   LSE = -inf, as attention_ref's masked_fill steps give)
//     S0  = r(Q K^T)
//     S   = r(scale * S0)
//     P   = r(softmax(S))                  max, exp, sum and divide in float32
//     O   = r(P V)
//     LSE = r(logsumexp(S))                float32 from the 16-bit S, rounded once (torch's
//                                          half logsumexp rounds a few more intermediates)
//   backward (dO in the 16-bit type)
//     dP  = r(dO V^T)
//     dS  = r(P * (dP - rowsum(P * dP)))   autograd's softmax backward (_softmax_backward_data);
//                                          not rowsum(dO * O), which is equal only in exact
//                                          arithmetic (a row with one visible key gets dS = 0
//                                          exactly here, as in PyTorch)
//     dS0 = r(scale * dS)
//     dQ  = r(dS0 K)
//     dK  = r(sum_h r(dS0_h^T Q_h)),  dV = r(sum_h r(P_h^T dO_h))
//                                          per query head h of a kv group, then the group sum
//                                          (repeat_interleave's backward) in float32
//
// Memory: one Sq x Skv float32 matrix pair per worker thread.
#pragma once

#include <cstdint>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace flashattn::testing {

struct LowpShape {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
};

// All arrays are logical and contiguous, as float32 holding 16-bit values: q/out/dout/dq
// [B,Hq,Sq,D], k/v/dk/dv [B,Hkv,Skv,D], lse [B,Hq,Sq].
struct LowpResult {
  std::vector<float> out, lse, dq, dk, dv;
};

// Rounds x to the nearest float16 / bfloat16 (ties to even) and returns it as a float.
float round_to(DType dtype, float x);

// Forward and backward (gradients of sum(out * dout)) of the emulated graph above. dtype is
// Float16 or BFloat16; inputs are rounded to it first (a no-op for values that already are).
// num_threads <= 0 means all hardware threads.
LowpResult naive_lowp(const LowpShape& s, DType dtype, const float* q, const float* k,
                      const float* v, const float* dout, float scale, Mask mask,
                      int num_threads = 0);

}  // namespace flashattn::testing
