// Framework-free parameters handed from the validated API to a backend.
//
// Built exactly once, by validate.cpp, from arguments that passed every check; a backend may trust
// every field (shapes positive, strides non-negative, head_dim stride 1, index arithmetic fits in
// int64, outputs neither overlap themselves nor alias inputs). Small structs are composed rather
// than one struct growing a field per feature. Plain data only: these are copied by value into
// CUDA kernels.
#pragma once

#include <cstdint>
#include <type_traits>

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
  // A forward over one chunk of the keys (the CUDA fp32-mode forward at long Skv, forward_chunked
  // in cuda/host/backend.cu): the operands' keys are rows [kv_offset, kv_offset + Shape::seq_kv)
  // of a sequence of kv_total keys, whose band (mask_rule) and ALiBi distances stay those of the
  // whole sequence. 0 and -1: the operands hold the whole sequence.
  int64_t kv_offset = 0;
  int64_t kv_total = -1;
  bool has_window() const { return window_left >= 0 || window_right >= 0; }
  // A score transform that is not one multiply (softcap, ALiBi): kernels with a per-entry step.
  bool elementwise_scores() const { return softcap > 0.0f || alibi.slopes != nullptr; }
};

struct Exec {
  int32_t device;       // -1 CPU, n >= 0 CUDA device n
  void* stream;         // cudaStream_t
  int32_t num_threads;  // CPU threads, resolved (>= 1)
  int (*cancel)(void*);  // options.cancel (nullptr: none): polled before each CPU task
  void* cancel_arg;
  void* workspace;           // options.workspace: the caller's CUDA scratch (nullptr: the pool)
  uint64_t workspace_bytes;  // (checked against the plan's need by the backend)
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

// Packed variable-length batches (flashattn_forward_varlen): sequence b's queries are rows
// [cu_q[b], cu_q[b+1]) of the packed operands and its keys rows [cu_k[b], cu_k[b+1]), the first
// used_k[b] of them attended when used_k is given. The arrays live on the call's device and were
// checked (0-based, non-decreasing, ending at the totals, lengths <= Shape::seq_q / seq_kv, which
// hold max_seqlen_q / _k). The operands' views then have batch stride 0 and the row offset of a
// sequence is added through its sequence stride. cu_q == nullptr: a dense call.
struct Packing {
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int32_t* used_k;
  int64_t total_q, total_k;  // rows of the packed operands (cu_q[batch], cu_k[batch])
  // The arrays are device memory whose contents validation did not read: the CUDA backend checks
  // them on the stream (cuda/common/seq_check.cu) and raises the same error, with nothing written.
  bool unchecked;
  FLASHATTN_HD bool on() const { return cu_q != nullptr; }
};

// One sequence of a call: its first query row and key row in the operands (0 when dense) and its
// lengths (the shape's when dense).
struct SeqSpan {
  int64_t q0, k0;
  int64_t seq_q, seq_kv;
};
FLASHATTN_HD SeqSpan seq_span(const Shape& s, const Packing& pk, int64_t b) {
  if (!pk.on()) return SeqSpan{0, 0, s.seq_q, s.seq_kv};
  const int64_t q0 = pk.cu_q[b], k0 = pk.cu_k[b];
  const int64_t skv = pk.used_k != nullptr ? pk.used_k[b] : pk.cu_k[b + 1] - k0;
  return SeqSpan{q0, k0, pk.cu_q[b + 1] - q0, skv};
}

// Bytes of one element of a dtype (params carry validated dtypes only).
FLASHATTN_HD constexpr int64_t element_bytes(DType t) {
  return t == DType::Float64 ? 8 : (t == DType::Float32 ? 4 : 2);
}
// Operand op with its base moved by `rows` rows (of sequence stride ss).
template <class Op>
FLASHATTN_HD Op rows_from(Op op, int64_t rows, int64_t bytes) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(op.ptr)>>, const char, char>;
  op.ptr = reinterpret_cast<decltype(op.ptr)>(reinterpret_cast<Byte*>(op.ptr) + rows * op.ss * bytes);
  return op;
}

// KV-cache calls (flashattn_forward_kvcache): the keys of sequence b are rows [0, seqlen_k[b]) of
// its cache relative to its first valid row start[b] (the leftpad). Element offset of relative
// row s, head h, in the K or V operand t (whose sb is the cache's batch or page stride, ss its row
// stride): kv_offset below. The arrays are host memory (the CPU backend serves these calls) and
// were checked (rows within the capacity, pages within the pool). seqlen_k == nullptr: no cache.
struct KvMap {
  const int32_t* seqlen_k;     // [B] keys attended (after the append)
  const int32_t* batch_row;    // [B] cache batch row (nullptr: b)
  const int32_t* start;        // [B] first valid cache row (nullptr: 0)
  const int32_t* block_table;  // [B, bt_stride] pages (nullptr: contiguous cache)
  int64_t bt_stride;
  int64_t block_size;          // rows per page
  FLASHATTN_HD bool on() const { return seqlen_k != nullptr; }
};
template <class Op>
FLASHATTN_HD int64_t kv_offset(const KvMap& m, const Op& t, int64_t b, int64_t h, int64_t s) {
  if (m.block_table != nullptr) {
    const int64_t page = m.block_table[b * m.bt_stride + s / m.block_size];
    return page * t.sb + h * t.sh + (s % m.block_size) * t.ss;
  }
  const int64_t row = m.batch_row != nullptr ? m.batch_row[b] : b;
  return row * t.sb + h * t.sh + ((m.start != nullptr ? m.start[b] : 0) + s) * t.ss;
}

struct ForwardParams {
  Shape shape;
  Numerics num;
  Exec exec;
  In4 q, k, v;
  Out4 out;
  OutLse lse;
  Packing packing;  // last: dense callers may leave it out of an aggregate initializer
  KvMap kv;         // after packing, for the same reason (never on together with it)
};

// What a KV-cache call does before its attention (core/validate.cpp built it; the forward part,
// p.kv on, reads the caches). The append writes k_new / v_new (k rotated) into the caches at
// relative rows first_new[b] + j, j < s_new (first_new = cache_seqlens - start); rotary
// positions are absolute cache rows: new key j at pos0[b] + j, query row i at pos0[b] + i when
// q_advances, else pos0[b].
struct KvRotary {
  const void* cos;  // [rows, rotary_dim / 2] in the call's dtype; nullptr: no rotary
  const void* sin;
  int64_t cos_ss, sin_ss;  // row strides (elements)
  int64_t rotary_dim;      // even, <= head_dim
  bool interleaved;        // GPT-J pairs (2i, 2i + 1); else GPT-NeoX (i, i + rotary_dim / 2)
  bool q_advances;
};
// A KV-cache call's index arrays left to the CUDA backend's check on the stream (device memory:
// reading them on the host would stop the GPU every call). The facts the rules need, and the
// user's arrays; KvcacheParams::check.on = false when validation read and checked them itself.
struct KvCheck {
  bool on;
  const int32_t* cache_seqlens;  // [B] (device)
  const int32_t* start;          // [B] cache_leftpad, or nullptr
  const int32_t* batch_row;      // [B] cache_batch_idx, or nullptr
  const int32_t* table;          // [B, table_stride] block_table, or nullptr
  int64_t table_stride, max_blocks;
  int64_t batch, cache_batch, block_rows;  // B, k_cache.shape[0], k_cache.shape[1]
  int64_t capacity;                        // rows a sequence can hold
  int64_t rotary_rows;                     // rotary_cos.shape[0] (0: no rotary)
  int64_t rotary_ahead;                    // rows past cache_seqlens[b] the rotary tables must cover

  // The rules, entry by entry: one definition for the host's check (check_kv_index_values, which
  // says which rule broke) and the device's (kv_check_kernel, a verdict only). sl = cache_seqlens[b].
  FLASHATTN_HD bool fits(int64_t sl, int64_t s_new) const {  // the prefix and the append fit the cache
    return sl >= 0 && sl <= capacity && s_new <= capacity - sl;
  }
  FLASHATTN_HD static bool positions_fit(int64_t sl, int64_t s_new) { return sl + s_new <= 0x7fffffff; }  // int32 rows
  FLASHATTN_HD static bool start_ok(int64_t start, int64_t sl) { return start >= 0 && start <= sl; }  // cache_leftpad
  FLASHATTN_HD bool row_ok(int64_t r) const { return r >= 0 && r < cache_batch; }  // a cache row, a page
  FLASHATTN_HD int64_t pages_used(int64_t sl, int64_t s_new) const { return (sl + s_new + block_rows - 1) / block_rows; }
  FLASHATTN_HD bool rotary_ok(int64_t sl) const { return rotary_rows <= 0 || sl + rotary_ahead <= rotary_rows; }
};

struct KvcacheParams {
  ForwardParams fwd;
  In4 k_new, v_new;  // [B, Hkv, S_new, D] logical (s_new == 0: no append)
  Out4 k_cache, v_cache;  // the caches as outputs (same views as fwd.k / fwd.v)
  int64_t s_new;
  const int32_t* first_new;  // [B] host (check.on: nullptr, the backend's check derives them)
  const int32_t* pos0;       // [B] host: cache_seqlens (check.on: nullptr)
  KvRotary rotary;
  int32_t num_splits;        // the caller's split-KV count (0: the backend's choice; the CPU has none)
  // check.on: fwd.kv.seqlen_k is the user's cache_seqlens until the backend's check replaces it
  // with the derived keys per sequence; fwd.shape.seq_kv is the capacity (an upper bound).
  KvCheck check;
};

struct BackwardParams {
  Shape shape;
  Numerics num;
  Exec exec;
  In4 q, k, v, out, dout;
  InLse lse;
  Out4 dq, dk, dv;
  Packing packing;  // last, as in ForwardParams
};

// Sequence b of a call as a dense call of its own: the shape's lengths are the sequence's, the
// operands' bases its first rows (packed views have batch stride 0, so b * sb adds nothing and
// the kernels' index arithmetic is unchanged). A dense call is returned as it is. This is how the
// CUDA kernels serve packed batches: the grid covers max_seqlen rows per sequence, and a CTA
// whose rows lie past its sequence's end has no work (QueryBlock/KeyBlock rows <= 0).
FLASHATTN_HD ForwardParams at_sequence(ForwardParams p, int64_t b) {
  if (!p.packing.on()) return p;
  const SeqSpan sp = seq_span(p.shape, p.packing, b);
  const int64_t e = element_bytes(p.num.dtype);
  p.shape.seq_q = sp.seq_q;
  p.shape.seq_kv = sp.seq_kv;
  p.q = rows_from(p.q, sp.q0, e);
  p.out = rows_from(p.out, sp.q0, e);
  p.lse = rows_from(p.lse, sp.q0, 4);
  p.k = rows_from(p.k, sp.k0, e);
  p.v = rows_from(p.v, sp.k0, e);
  return p;
}
FLASHATTN_HD BackwardParams at_sequence(BackwardParams p, int64_t b) {
  if (!p.packing.on()) return p;
  const SeqSpan sp = seq_span(p.shape, p.packing, b);
  const int64_t e = element_bytes(p.num.dtype);
  p.shape.seq_q = sp.seq_q;
  p.shape.seq_kv = sp.seq_kv;
  p.q = rows_from(p.q, sp.q0, e);
  p.out = rows_from(p.out, sp.q0, e);
  p.dout = rows_from(p.dout, sp.q0, e);
  p.dq = rows_from(p.dq, sp.q0, e);
  p.lse = rows_from(p.lse, sp.q0, 4);
  p.k = rows_from(p.k, sp.k0, e);
  p.v = rows_from(p.v, sp.k0, e);
  p.dk = rows_from(p.dk, sp.k0, e);
  p.dv = rows_from(p.dv, sp.k0, e);
  return p;
}

// The call's mask band: its mask and sliding window over its sequence lengths; for a chunk of the
// keys (Numerics::kv_offset), the whole sequence's band in the chunk's key numbering.
FLASHATTN_HD MaskRule mask_rule(const Shape& s, const Numerics& n) {
  const int64_t total = n.kv_total >= 0 ? n.kv_total : s.seq_kv;
  MaskRule r = make_mask_rule(static_cast<int32_t>(n.mask), s.seq_q, total, n.window_left, n.window_right);
  if (r.bounded_below()) r.lo -= n.kv_offset;
  if (r.bounded_above()) r.hi -= n.kv_offset;
  return r;
}

}  // namespace flashattn
