// Framework-free parameters handed from the validated API to a backend.
//
// Built exactly once, by validate.cpp, from arguments that passed every check; a backend may trust
// every field (shapes positive, strides non-negative, head_dim stride 1, index arithmetic fits in
// int64, outputs neither overlap themselves nor alias inputs). Small structs are composed rather
// than one struct growing a field per feature. Plain data only: these are copied by value into
// CUDA kernels.
#pragma once

#include <cstdint>

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

struct Numerics {
  DType dtype;          // of q, k, v, out, dout, dq, dk, dv (lse is always float32)
  float scale;          // softmax scale, resolved (never 0)
  Mask mask;
  Precision precision;  // CUDA float32 only
  bool deterministic;   // backward must be bitwise reproducible (CUDA 16-bit: split design)
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

}  // namespace flashattn
