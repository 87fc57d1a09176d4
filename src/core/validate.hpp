// Hard validation of every public call, before anything is written.
//
// Turns user tensors and options into the params a backend trusts; every failure is an Error whose
// message names the argument and the values, e.g.
//   "k.shape[3] (head_dim) = 64 does not match q.shape[3] = 128".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/params.hpp"

namespace flashattn {

ForwardParams make_forward_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Options& options);

BackwardParams make_backward_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& dout, const Tensor& lse,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Options& options);

// Packed variable-length calls: the same checks on the packed layouts, and the sequence
// arrays' contents when they are host memory (device arrays: Packing::unchecked, the CUDA
// backend checks them on its stream with the same rules and the same errors).
ForwardParams make_forward_params_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                         const Tensor& lse, const Varlen& varlen, const Options& options);
BackwardParams make_backward_params_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                           const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                           const Tensor& dv, const Varlen& varlen, const Options& options);

// The sequence arrays' rules (prefix sums from 0, non-decreasing, ending at the totals; lengths
// within the max_seqlen bounds; seqused_k within each sequence; used may be nullptr): throws the
// InvalidArgument naming the first broken entry.
void check_sequence_values(const int32_t* cq, const int32_t* ck, const int32_t* used, int64_t batch, int64_t total_q,
                           int64_t total_k, int64_t max_seqlen_q, int64_t max_seqlen_k);

// A KV-cache call's index rules on host copies of its arrays (table: [B, f.max_blocks] dense, or
// nullptr when not paged): throws the InvalidArgument naming the first broken entry. Validation
// applies them to host reads; the CUDA backend's check on the stream (KvCheck) applies the same
// rules and calls this for the message when they fail.
void check_kv_index_values(const KvCheck& f, int64_t s_new, bool append, const int32_t* seqlens, const int32_t* start,
                           const int32_t* batch_row, const int32_t* table);

// rows x cols int32 at `data` (rows `stride` elements apart; host memory when device < 0, else
// memory of CUDA device `device`, read after the work queued on `stream`), copied dense: the
// block table's host copy (validation's read, and the CUDA backend's read-back for the message).
std::vector<int32_t> read_index_rows(const int32_t* data, int64_t rows, int64_t stride, int64_t cols, int32_t device,
                                     void* stream);

// A validated KV-cache call: its params and the host copies of the index arrays they point into
// (so the struct must stay where it is while the params are used).
struct KvcacheCall {
  KvcacheParams params;
  std::vector<int32_t> seqlen_k, first_new, pos0, batch_row, start, table;
};
// Every check of flashattn_forward_kvcache (flashattn.h), the index contents included, before
// anything is written; fills `call`.
void make_kvcache_params(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out,
                         const Tensor& lse, const KvCache& kv, const Options& options, KvcacheCall& call);

// options.workspace of a CUDA call (device `device` >= 0): memory of that device, 256-byte aligned,
// overlapping none of `tensors` (nullptr entries skipped). Nothing is checked for CPU calls, which
// ignore it, or without a workspace. (Its size is the backend's check: it knows the plan's need.)
void check_workspace(const Options& o, int32_t device, const std::vector<const Tensor*>& tensors);

// "[2, 8, 128, 64]"
std::string format_dims(const int64_t* dims, int32_t ndim);

}  // namespace flashattn
