// flashattn C++ API: exact, memory-efficient attention (FlashAttention) for training.
//
// The same semantics as the C ABI in flashattn.h (read its header comment for shapes, layouts and
// masks); here tensors are views, options a struct with defaults, and errors exceptions whose
// messages name the argument and the offending values. Nothing is written to any output before
// every argument has been validated.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "flashattn/flashattn.h"

namespace flashattn {

enum class DType : int32_t {
  Float32 = FLASHATTN_FLOAT32,
  Float16 = FLASHATTN_FLOAT16,
  BFloat16 = FLASHATTN_BFLOAT16,
  Float64 = FLASHATTN_FLOAT64,  // CPU only
  Int32 = FLASHATTN_INT32,      // index tensors only (Varlen, KvCache)
};

enum class Mask : int32_t {
  None = FLASHATTN_MASK_NONE,
  CausalTopLeft = FLASHATTN_MASK_CAUSAL_TOP_LEFT,          // j <= i
  CausalBottomRight = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT,  // j <= i + Skv - Sq
};

enum class Precision : int32_t {
  Fp32 = FLASHATTN_PRECISION_FP32,  // as accurate as plain float32 arithmetic (default)
  Tf32 = FLASHATTN_PRECISION_TF32,  // TF32 tensor cores on CUDA, ~1e-3 relative error
};

enum class Status : int {
  Ok = FLASHATTN_OK,
  InvalidArgument = FLASHATTN_ERROR_INVALID_ARGUMENT,
  Unsupported = FLASHATTN_ERROR_UNSUPPORTED,
  Backend = FLASHATTN_ERROR_BACKEND,
  OutOfMemory = FLASHATTN_ERROR_OUT_OF_MEMORY,
  Internal = FLASHATTN_ERROR_INTERNAL,
  Cancelled = FLASHATTN_ERROR_CANCELLED,
};

constexpr int32_t kCpu = FLASHATTN_CPU;

// Every failure is a flashattn::Error; status() tells the kind.
class FLASHATTN_API Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message);
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

// A non-owning view of a strided tensor (strides in elements, one per dimension).
struct FLASHATTN_API Tensor {
  void* data = nullptr;
  DType dtype = DType::Float32;
  int32_t device = kCpu;
  int32_t ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};

  // Contiguous views in the library's logical order.
  static Tensor contiguous(void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                           int32_t device = kCpu);
  // The float32 [B, Hq, Sq] log-sum-exp, contiguous. (A name of its own, not a 3-d overload of
  // contiguous(): with int arguments such an overload would silently win over the 4-d one.)
  static Tensor lse(float* data, int64_t b, int64_t h, int64_t sq, int32_t device = kCpu);
  // [B, H, S, D] logical view of memory laid out as [B, S, H, D] (FlashAttention's layout).
  static Tensor bshd(void* data, DType dtype, int64_t b, int64_t h, int64_t s, int64_t d,
                     int32_t device = kCpu);
};

struct Options {
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(D)
  Mask mask = Mask::None;
  void* stream = nullptr;      // cudaStream_t; nullptr = default stream
  int32_t num_threads = 0;     // CPU threads; 0 = all hardware threads
  Precision precision = Precision::Fp32;
  bool deterministic = false;  // bitwise-reproducible backward (see flashattn_options)
  // FlashAttention's window_size = (window_left, window_right), -1 = unbounded on that side
  // (flashattn_options: key j visible to query i when
  // i + Skv - Sq - window_left <= j <= i + Skv - Sq + window_right); combined with `mask`.
  int64_t window_left = -1;
  int64_t window_right = -1;
  float softcap = 0.0f;  // 0 = none; > 0: scores -> softcap * tanh(scores / softcap)
  // ALiBi slopes, float32 [Hq] or [B, Hq] on q's device (nullptr = none): score (i, j) of head h
  // gets -slope * |i + Skv - Sq - j| after the softcap. The view must outlive the call.
  const Tensor* alibi_slopes = nullptr;
  // Bounds on a call's running time (flashattn_options): refuse calls of more than max_flops
  // FLOPs (dense count; 0 = no bound), and cancel(cancel_arg) polled before the call and before
  // every CPU task (nonzero: the call throws Error(Status::Cancelled), outputs partly written).
  double max_flops = 0.0;
  int (*cancel)(void* cancel_arg) = nullptr;
  void* cancel_arg = nullptr;
  // Scratch from the caller (flashattn_options): workspace_query != nullptr makes the call only
  // validate and store the device scratch bytes it needs; workspace (256-byte aligned device
  // memory of workspace_bytes, overlapping no tensor) replaces the library's pool in CUDA calls.
  void* workspace = nullptr;
  uint64_t workspace_bytes = 0;
  uint64_t* workspace_query = nullptr;
};

// out [B,Hq,Sq,D], lse [B,Hq,Sq] float32.
FLASHATTN_API void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                           const Tensor& lse, const Options& options = {});

// dq, dk, dv from dout, out and lse; options must match the forward's.
FLASHATTN_API void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const Tensor& dout, const Tensor& lse, const Tensor& dq,
                            const Tensor& dk, const Tensor& dv, const Options& options = {});

// Packed variable-length batches (flashattn_varlen in flashattn.h): q/out/dout/dq [total_q, Hq, D],
// k/v/dk/dv [total_k, Hkv, D] (ndim 3), lse float32 [Hq, total_q] (ndim 2).
struct Varlen {
  const Tensor* cu_seqlens_q = nullptr;  // int32 [B + 1]
  const Tensor* cu_seqlens_k = nullptr;  // int32 [B + 1]
  const Tensor* seqused_k = nullptr;     // int32 [B], optional
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
};

FLASHATTN_API void forward_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Varlen& varlen, const Options& options = {});
FLASHATTN_API void backward_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                   const Tensor& dv, const Varlen& varlen, const Options& options = {});

// KV-cache attention (flashattn_kvcache in flashattn.h has the exact semantics): q/out
// [B, Sq, Hq, D], k_cache/v_cache [B_cache, S_cache, Hkv, D] or paged [num_blocks, block_size,
// Hkv, D], lse float32 [B, Hq, Sq]. Appends k_new/v_new into the caches in place, then attends.
// Every pointer may be nullptr (absent); the views must outlive the call.
struct KvCache {
  const Tensor* k_new = nullptr;            // [B, S_new, Hkv, D]
  const Tensor* v_new = nullptr;
  const Tensor* cache_seqlens = nullptr;    // int32 [B]
  const Tensor* cache_batch_idx = nullptr;  // int32 [B]
  const Tensor* cache_leftpad = nullptr;    // int32 [B]
  const Tensor* block_table = nullptr;      // int32 [B, max_blocks]
  const Tensor* rotary_cos = nullptr;       // [S_ro, rotary_dim / 2], dtype of q
  const Tensor* rotary_sin = nullptr;
  bool rotary_interleaved = true;           // GPT-J pairs (FlashAttention's default); false: GPT-NeoX
  int32_t num_splits = 0;                   // CUDA split-KV CTAs along the cache (0: auto, 1: none; <= 128)
};

FLASHATTN_API void forward_kvcache(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out,
                                   const Tensor& lse, const KvCache& kv, const Options& options = {});

// Bytes per element of a dtype.
FLASHATTN_API int64_t dtype_size(DType dtype);
FLASHATTN_API const char* dtype_name(DType dtype);
FLASHATTN_API const char* mask_name(Mask mask);

// Build and run-time facts for `flashattn info`: backends, CPU features, kernels.
FLASHATTN_API std::string build_info();
FLASHATTN_API bool cuda_available();
// Packed and KV-cache calls captured into a CUDA graph check their index arrays on the device at
// every replay; a replay whose arrays break a rule writes nothing and counts a failure on the
// device (it cannot raise). Waits for the device's work, returns the count since the last call
// and resets it. Throws Unsupported without the CUDA backend.
FLASHATTN_API int64_t cuda_take_check_failures(int device = 0);

}  // namespace flashattn
