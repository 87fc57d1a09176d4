// Framework-free parameters handed from the validated API to a backend.
//
// Built exactly once, by validate.cpp, from arguments that passed every check; a backend may trust
// every field (shapes positive, strides non-negative, head_dim stride 1, index arithmetic fits in
// int64, outputs neither overlap themselves nor alias inputs). Small structs are composed rather
// than one struct growing a field per feature. Plain data only: these are copied by value into
// CUDA kernels.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "core/mask.hpp"
#include "flashattn/flashattn.hpp"

namespace flashattn {

struct Shape {
  int64_t batch;
  int64_t heads_q;
  int64_t heads_kv;  // divides heads_q
  int64_t seq_q;
  int64_t seq_kv;
  int64_t head_dim;
  int64_t group() const { return heads_q / heads_kv; }  // query heads per kv head
};

// ALiBi slopes (float32, on the call's device): slope of (batch b, query head h) at
// slopes[b * sb + h * sh]; sb = 0 for one [Hq] vector shared by the batch. slopes == nullptr: none.
struct Alibi {
  const float* slopes;
  int64_t sb, sh;
};

struct Numerics {
  DType dtype;          // of q, k, v, out, dout, dq, dk, dv (lse is always float32)
  float scale;          // softmax scale, resolved (never 0)
  Mask mask;
  Precision precision;  // CUDA float32 only
  bool deterministic;   // backward must be bitwise reproducible (CUDA 16-bit: split design)
  int64_t window_left;  // sliding window (FlashAttention's window_size), -1 = unbounded side;
  int64_t window_right; // the band they make with `mask` is mask_rule() (core/mask.hpp)
  float softcap;        // 0 = none, else > 0 and finite (core/score.hpp)
  Alibi alibi;
  bool has_window() const { return window_left >= 0 || window_right >= 0; }
  // A score transform that is not one multiply (softcap, ALiBi): kernels with a per-entry step.
  bool elementwise_scores() const { return softcap > 0.0f || alibi.slopes != nullptr; }
};

struct Exec {
  int32_t device;       // -1 CPU, n >= 0 CUDA device n
  void* stream;         // cudaStream_t
  int32_t num_threads;  // CPU threads, resolved (>= 1)
};

// A [B, H, S, D] operand with unit head_dim stride; element (b,h,s,d) is at
// ptr + b*sb + h*sh + s*ss + d (in elements of the operand's dtype).
template <class Ptr>
struct Operand4 {
  Ptr ptr;
  int64_t sb, sh, ss;
};
using In4 = Operand4<const void*>;
using Out4 = Operand4<void*>;

// LSE [B, Hq, Sq], float32: element (b,h,s) at ptr + b*sb + h*sh + s*ss.
template <class Ptr>
struct Operand3 {
  Ptr ptr;
  int64_t sb, sh, ss;
};
using InLse = Operand3<const float*>;
using OutLse = Operand3<float*>;

struct ForwardParams {
  Shape shape;
  Numerics num;
  Exec exec;
  In4 q, k, v;
  Out4 out;
  OutLse lse;
};

struct BackwardParams {
  Shape shape;
  Numerics num;
  Exec exec;
  In4 q, k, v, out, dout;
  InLse lse;
  Out4 dq, dk, dv;
};

// The call's mask band: its mask and sliding window over its sequence lengths.
FLASHATTN_HD MaskRule mask_rule(const Shape& s, const Numerics& n) {
  return make_mask_rule(static_cast<int32_t>(n.mask), s.seq_q, s.seq_kv, n.window_left, n.window_right);
}

}  // namespace flashattn
