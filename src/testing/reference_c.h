/* The float64 reference attention (src/testing/reference.hpp) behind a small C ABI, so that the
 * Python and Rust test suites judge the library by the same yardstick as the C++ tests.
 *
 * Built only with the tests (FLASHATTN_BUILD_TESTS=ON) as the shared library
 * libflashattn_reference (build/src/testing/); it is not part of libflashattn, not installed and
 * not exported. It computes in float64 only: callers convert their inputs to float64 first
 * (16-bit or float32 inputs rounded to the library's dtype beforehand, so that the reference sees
 * exactly what the kernels see).
 *
 * Arrays are logical [B, H, S, D] views of float64 memory with per-dimension strides in elements
 * (signed; NULL means contiguous, i.e. strides {H*S*D, S*D, D, 1}), so any memory layout
 * ([B, H, S, D], [B, S, H, D], padded, packed) is read and written in place:
 *   q, out, dout, dq   [B, Hq,  Sq,  D]
 *   k, v, dk, dv       [B, Hkv, Skv, D]   Hkv divides Hq; query head h reads kv head h / (Hq/Hkv)
 *   lse                [B, Hq,  Sq]       natural log; -inf for a row that sees no key
 * Semantics are those of flashattn.h: S = softmax_scale * Q K^T with masked entries -inf,
 * P = softmax(S) per row, O = P V; a row with no visible key gives O = 0, lse = -inf and no
 * gradient. NaN and Inf in the inputs propagate as flashattn.h describes; hidden entries are
 * absent from every sum (never 0 * NaN), so an output that does not see a poisoned element does
 * not depend on it. The backward returns the gradients of sum(O * dO); dk and dv sum over the
 * query heads of each kv group. softmax_scale is used exactly as given (the library carries it as a float32:
 * pass that float32's value to compare with it). The backward recomputes P from q and k: it needs
 * no forward output.
 *
 * Outputs are overwritten on success and untouched on failure; every input is read in full before
 * any output is written, so outputs may alias inputs. Every size is at least 1 and no data
 * pointer may be NULL.
 */
#ifndef FLASHATTN_TESTING_REFERENCE_C_H
#define FLASHATTN_TESTING_REFERENCE_C_H

#include <stdint.h>

#if defined(_WIN32)
#define FLASHATTN_REF_API __declspec(dllexport)
#else
#define FLASHATTN_REF_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* return codes */
#define FLASHATTN_REF_OK 0
#define FLASHATTN_REF_INVALID_ARGUMENT 1 /* bad shape, mask or NULL pointer: see the message */
#define FLASHATTN_REF_FAILED 2           /* out of memory (the reference is O(Sq * Skv) per head) */

/* the mask codes of flashattn.h (FLASHATTN_MASK_*) */
#define FLASHATTN_REF_MASK_NONE 0
#define FLASHATTN_REF_MASK_CAUSAL_TOP_LEFT 1     /* key j visible to query i when j <= i */
#define FLASHATTN_REF_MASK_CAUSAL_BOTTOM_RIGHT 2 /* key j visible to query i when j <= i + Skv - Sq */

typedef struct flashattn_ref_shape {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim; /* all >= 1 */
} flashattn_ref_shape;

/* out [B,Hq,Sq,D] and lse [B,Hq,Sq] of attention over q, k, v. */
FLASHATTN_REF_API int flashattn_ref_forward(const flashattn_ref_shape* shape,
                                            const double* q, const int64_t* q_strides,
                                            const double* k, const int64_t* k_strides,
                                            const double* v, const int64_t* v_strides,
                                            double softmax_scale, int32_t mask,
                                            double* out, const int64_t* out_strides,
                                            double* lse, const int64_t* lse_strides);

/* dq, dk, dv: the gradients of sum(out * dout) with respect to q, k and v. */
FLASHATTN_REF_API int flashattn_ref_backward(const flashattn_ref_shape* shape,
                                             const double* q, const int64_t* q_strides,
                                             const double* k, const int64_t* k_strides,
                                             const double* v, const int64_t* v_strides,
                                             const double* dout, const int64_t* dout_strides,
                                             double softmax_scale, int32_t mask,
                                             double* dq, const int64_t* dq_strides,
                                             double* dk, const int64_t* dk_strides,
                                             double* dv, const int64_t* dv_strides);

/* The sliding window, softcap and ALiBi of flashattn.h's options (the _ex functions; NULL = none):
 * window_left / window_right as FlashAttention's window_size (-1 = unbounded side, no window with
 * both -1); softcap 0 = none; alibi NULL = none, else one slope per (batch, query head) at
 * alibi[b * Hq + h] (a [Hq] slope vector is repeated over the batch by the caller). */
typedef struct flashattn_ref_mods {
  int64_t window_left, window_right;
  double softcap;
  const double* alibi;
} flashattn_ref_mods;

FLASHATTN_REF_API int flashattn_ref_forward_ex(const flashattn_ref_shape* shape,
                                               const double* q, const int64_t* q_strides,
                                               const double* k, const int64_t* k_strides,
                                               const double* v, const int64_t* v_strides,
                                               double softmax_scale, int32_t mask,
                                               const flashattn_ref_mods* mods,
                                               double* out, const int64_t* out_strides,
                                               double* lse, const int64_t* lse_strides);
FLASHATTN_REF_API int flashattn_ref_backward_ex(const flashattn_ref_shape* shape,
                                                const double* q, const int64_t* q_strides,
                                                const double* k, const int64_t* k_strides,
                                                const double* v, const int64_t* v_strides,
                                                const double* dout, const int64_t* dout_strides,
                                                double softmax_scale, int32_t mask,
                                                const flashattn_ref_mods* mods,
                                                double* dq, const int64_t* dq_strides,
                                                double* dk, const int64_t* dk_strides,
                                                double* dv, const int64_t* dv_strides);

/* KV-cache attention of one sequence (flashattn_forward_kvcache; the C++ reference_kvcache): the
 * caller gathers the sequence's rows from its cache layout (contiguous, cache_batch_idx,
 * cache_leftpad, block_table) and passes contiguous arrays:
 *   q [Hq, Sq, D]; k_old, v_old [Hkv, len_old, D]: the attended rows before the append
 *   (leftpad .. cache_seqlens); k_new, v_new [Hkv, seq_new, D] (NULL when seq_new = 0);
 *   rotary_cos, rotary_sin [rotary_rows, rotary_dim / 2] (NULL when rotary_dim = 0).
 * The rotary embedding rotates q (row i at position pos0 + i when q_advances, else pos0) and the
 * new keys (key j at pos0 + j); rotated values are rounded to round_to (a FLASHATTN_* dtype code:
 * what the library stores). Outputs: out [Hq, Sq, D], lse [Hq, Sq] over len_old + seq_new keys,
 * and k_appended [Hkv, seq_new, D], the new keys as the cache must hold them (NULL when
 * seq_new = 0). mods as the _ex functions with batch 1 (alibi: Hq slopes). */
typedef struct flashattn_ref_kvcache_seq {
  int64_t heads_q, heads_kv, seq_q, head_dim; /* all >= 1 */
  int64_t len_old, seq_new;                   /* >= 0 each */
  int64_t pos0;                               /* cache_seqlens[b]: position of the first new key */
  int32_t q_advances;
  int32_t rotary_interleaved; /* nonzero: pairs (2i, 2i + 1); else (i, i + rotary_dim / 2) */
  int64_t rotary_dim;         /* 0: no rotary; else even, <= head_dim */
  int64_t rotary_rows;
  int32_t round_to;           /* flashattn.h's dtype code: 0 float32, 1 float16, 2 bfloat16,
                                 3 float64 (no rounding) */
} flashattn_ref_kvcache_seq;

FLASHATTN_REF_API int flashattn_ref_kvcache(const flashattn_ref_kvcache_seq* seq, const double* q,
                                            const double* k_old, const double* v_old,
                                            const double* k_new, const double* v_new,
                                            const double* rotary_cos, const double* rotary_sin,
                                            double softmax_scale, int32_t mask,
                                            const flashattn_ref_mods* mods, double* out,
                                            double* lse, double* k_appended);

/* What the last failed call on this thread objected to ("" before any failure). Owned by the
 * library, valid until the next call on this thread. */
FLASHATTN_REF_API const char* flashattn_ref_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHATTN_TESTING_REFERENCE_C_H */
