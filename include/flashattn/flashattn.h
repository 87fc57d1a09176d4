/*
 * flashattn C ABI: exact, memory-efficient attention (FlashAttention) for training.
 *
 * This header is the stable contract that other languages bind to. It uses no C++ types, and no
 * function declared here throws, aborts or exits: every failure comes back as a non-zero status,
 * with a human-readable message from flashattn_last_error() (thread-local, valid until the next
 * call on the same thread).
 *
 * Tensors are non-owning views. Logical shapes:
 *   q, out, dout, dq : ndim 4, [B, Hq, Sq, D]
 *   k, v, dk, dv     : ndim 4, [B, Hkv, Skv, D]      (Hkv divides Hq; query head h reads kv head
 *                                                      h / (Hq / Hkv): GQA / MQA)
 *   lse              : ndim 3, [B, Hq, Sq], always float32, natural log
 * Strides are in elements, one per logical dimension, so [B,H,S,D] and [B,S,H,D] memory layouts
 * (or any other) work without copies. The head_dim stride must be 1; strides must not be negative.
 * No output may share a byte with an input or with another output. Views of one buffer that
 * share no byte are fine, whatever their shapes and dtypes: packed q/k/v of a [B,S,3,H,D] buffer,
 * or dq/dk/dv as head ranges of one fused [B,S,Hq+2*Hkv,D] gradient buffer. (This check is exact;
 * only for strides built to defeat its bounded search may it refuse views that do not overlap.)
 * An output's strides must be nested - sorted by size, each stride exceeds the span of the
 * dimensions with smaller strides (true of every contiguous or padded layout) - so that no
 * element is reached twice.
 *
 * Semantics: S = softmax_scale * Q K^T, then softcap * tanh(S / softcap) when a softcap is set,
 * plus the ALiBi bias when slopes are given; masked (causal and/or sliding window: hidden entries
 * are -inf); P = softmax(S) per row; O = P V; lse = log(sum_j exp(S_ij)).
 * Rows without keys and non-finite inputs: a row that sees no key under the mask, window and
 * lengths gets O = 0, lse = -inf and dq = 0, and a key that no row sees dk = dv = 0, exactly,
 * whatever the inputs hold. Every other output is what IEEE arithmetic makes of the max-shifted
 * softmax (m = max_j S_ij, lse = m + log(sum_j exp(S_ij - m)), O = sum_j exp(S_ij - lse) V_j): a
 * NaN score (NaN in q or k) or a +inf one gives that row O = NaN and lse = NaN (not +inf: the row
 * sum is exp(inf - inf) = NaN); visible scores that are all -inf give O = NaN (0/0) and lse = -inf;
 * a NaN in v gives NaN in that column of O for the rows that see it; scores beyond the range of exp
 * (1e19) give the largest one's v exactly. In the backward a row whose O has a NaN has dq = NaN and
 * makes dk NaN for every key it sees (through rowsum(dout * O)), and dv too when its lse is NaN.
 * Within one kernel tile a hidden entry has the weight 0, and 0 * NaN is NaN, so a NaN or inf
 * element of q, k, v or dout can also make NaN outputs of rows or keys that share a tile with it
 * without seeing it (on CUDA also the dk of keys that share a tile with a row whose O has a NaN;
 * tile sizes are the backend's). In precision fp32 on CUDA (3xTF32) an infinite input element
 * becomes NaN in the products it enters. docs/ALGORITHM.md ("Non-finite inputs and empty rows") has
 * the details.
 * Accumulation is float32 for float32/float16/bfloat16 inputs (float64 for float64 inputs).
 * Results are deterministic: bitwise identical run to run and for any thread count.
 */
#ifndef FLASHATTN_FLASHATTN_H
#define FLASHATTN_FLASHATTN_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define FLASHATTN_API __declspec(dllexport)
#else
#define FLASHATTN_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FLASHATTN_VERSION_MAJOR 0
#define FLASHATTN_VERSION_MINOR 1
#define FLASHATTN_VERSION_PATCH 0

/* dtype codes */
#define FLASHATTN_FLOAT32 0
#define FLASHATTN_FLOAT16 1
#define FLASHATTN_BFLOAT16 2
#define FLASHATTN_FLOAT64 3 /* CPU only: for gradient checking in double precision */
#define FLASHATTN_INT32 4   /* index tensors only (varlen cu_seqlens / seqused_k, kvcache) */

/* device codes: -1 is the CPU; n >= 0 is CUDA device n */
#define FLASHATTN_CPU (-1)

/* mask codes */
#define FLASHATTN_MASK_NONE 0
#define FLASHATTN_MASK_CAUSAL_TOP_LEFT 1     /* key j visible to query i when j <= i */
#define FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT 2 /* key j visible to query i when j <= i + Skv - Sq */

/* precision codes: how float32 inputs are multiplied on CUDA (ignored elsewhere) */
#define FLASHATTN_PRECISION_FP32 0 /* default: as accurate as plain float32 arithmetic */
#define FLASHATTN_PRECISION_TF32 1 /* opt-in: TF32 tensor cores, about 1e-3 relative error */

/* Largest accepted options.num_threads (a larger value is an invalid argument). 1024 is above
 * the hardware threads of the largest current servers (2 sockets x 192 cores x 2 = 768); more
 * threads than that only oversubscribe the cores, and each costs a stack (8 MiB of address space
 * by default). num_threads = 0 (all hardware threads) is capped at this value too. */
#define FLASHATTN_MAX_THREADS 1024

/* Largest accepted |options.softmax_scale| (a larger or non-finite one is an invalid argument).
 * The scores S = softmax_scale * q.k are float32, and their rounding alone moves the softmax
 * probabilities by about |S| * 6e-8 relative: at |S| ~ 1e6, reached with unit-norm q and k at
 * this bound, that is already ~6%; beyond ~1e9 the backward's recomputed exp(S - lse) overflows
 * to inf (scale 1e30 gave NaN gradients for unit inputs, 3e38 all-zero outputs). No cheap check
 * can see |S| (it needs the inputs), so the bound is on the scale: 1e6 is four orders of
 * magnitude above practical scales (1/sqrt(head_dim); cosine attention's logit scale <= 100),
 * and with it the scores cannot overflow in either pass while |q.k| <= 700. */
#define FLASHATTN_MAX_SOFTMAX_SCALE 1e6f

/* status codes */
#define FLASHATTN_OK 0
#define FLASHATTN_ERROR_INVALID_ARGUMENT 1 /* bad shape, dtype, stride, pointer, aliasing, ... */
#define FLASHATTN_ERROR_UNSUPPORTED 2      /* valid, but no backend in this build serves it */
#define FLASHATTN_ERROR_BACKEND 3          /* a CUDA call or launch failed */
#define FLASHATTN_ERROR_OUT_OF_MEMORY 4    /* workspace allocation failed */
#define FLASHATTN_ERROR_INTERNAL 5         /* a bug: please report the message */
#define FLASHATTN_ERROR_CANCELLED 6        /* options.cancel asked the call to stop */

typedef struct {
  void* data;
  int32_t dtype;
  int32_t device;
  int32_t ndim;
  int64_t shape[4];
  int64_t stride[4];
} flashattn_tensor;

typedef struct {
  uint32_t struct_size; /* sizeof(flashattn_options) as the caller knows it: the struct grows
                           compatibly by appending fields; fields past struct_size take defaults */
  float softmax_scale;  /* 0 means 1/sqrt(D); finite, |scale| <= FLASHATTN_MAX_SOFTMAX_SCALE */
  int32_t mask;         /* FLASHATTN_MASK_* */
  void* stream;         /* CUDA stream (cudaStream_t); NULL = the default stream */
  /* ---- end of version 1 (FLASHATTN_OPTIONS_V1_SIZE) ---- */
  int32_t num_threads; /* CPU worker threads, 0..FLASHATTN_MAX_THREADS; 0 = all hardware threads
                          (at most FLASHATTN_MAX_THREADS). Results do not depend on it. When the
                          system refuses to start some threads (a container's pid limit,
                          RLIMIT_NPROC, an address-space limit), the call is not an error: it
                          runs on the threads that did start (at least the calling thread),
                          with the same results */
  int32_t precision;   /* FLASHATTN_PRECISION_*; 0 = fp32-accurate */
  int32_t deterministic; /* nonzero: bitwise-reproducible backward on every backend (CUDA
                            float16/bfloat16 then uses the split dQ + dK/dV passes instead of
                            float atomics for dQ). CPU and CUDA float32 are always deterministic */
  int32_t reserved0;     /* unused, never read: version-2 callers' struct_size (40) covers it as
                            padding, so it can carry nothing */
  /* ---- end of version 2 (FLASHATTN_OPTIONS_V2_SIZE) ---- */
  /* Sliding window (local) attention, FlashAttention's window_size = (window_left, window_right),
   * read only when sliding_window is nonzero (so a zero-filled struct means no window): key j is
   * visible to query i when i + Skv - Sq - window_left <= j <= i + Skv - Sq + window_right; -1
   * leaves that side unbounded; other negative values are invalid. Combined with a causal mask
   * by intersection (causal bottom-right with (left, -1) is FlashAttention's causal local). */
  int64_t window_left;
  int64_t window_right;
  /* Logit softcap (Gemma 2): 0 = none; > 0: each score s = softmax_scale * q.k becomes
   * softcap * tanh(s / softcap) before the softmax (and before the ALiBi bias); must be finite. */
  float softcap;
  int32_t sliding_window; /* nonzero: window_left / window_right apply */
  /* ALiBi: NULL = none; else a float32 tensor of slopes, ndim 1 [Hq] or ndim 2 [B, Hq], on q's
   * device, that adds -slope[b, h] * |i + Skv - Sq - j| to score (i, j) of query head h (after the
   * softcap). Read-only; outputs must not overlap it. */
  const flashattn_tensor* alibi_slopes;
  /* ---- end of version 3 (FLASHATTN_OPTIONS_V3_SIZE) ---- */
  /* Bounds on a call's running time, for absurd-but-valid sizes (a call that is running cannot
   * otherwise be stopped from outside):
   * max_flops: 0 = no bound; else (finite, > 0) a call whose FLOP count exceeds it fails with
   *   FLASHATTN_ERROR_INVALID_ARGUMENT, naming both, before anything is written. The count is the
   *   dense one: 4 * B * Hq * Sq * Skv * D for a forward, 2.5x that for a backward (masks and
   *   windows not subtracted; packed batches: B * max_seqlen_q * max_seqlen_k; KV cache: Skv =
   *   the most keys a sequence attends after the append). For scale: a 2-core CPU does ~3e11
   *   FLOP/s, an H200 ~5e14.
   * cancel: NULL = none; else the CPU backend calls cancel(cancel_arg) before the call starts
   *   and, from its worker threads (concurrently: it must be thread-safe, and must not throw or
   *   longjmp), before every task (a block of query or key rows of one head: microseconds to
   *   milliseconds of work). Once it returns nonzero no further task starts and the call fails
   *   with FLASHATTN_ERROR_CANCELLED;
   *   outputs are then partly written (unspecified), inputs untouched (a KV-cache append may be
   *   done already). The CUDA backend calls it once, before its first launch (kernels cannot be
   *   interrupted). */
  double max_flops;
  int (*cancel)(void* cancel_arg);
  void* cancel_arg;
  /* ---- end of version 4 (FLASHATTN_OPTIONS_V4_SIZE) ---- */
  /* Scratch memory from the caller (a framework's allocator), for CUDA calls:
   * workspace_query: non-NULL: the call validates everything as usual (errors as always), then
   *   stores the bytes of device scratch it would take in *workspace_query and returns
   *   FLASHATTN_OK without running anything or writing any tensor. The size depends on the call's
   *   shapes, dtype, options and device (not on data, except a KV-cache call's index arrays);
   *   CPU calls need none (0: their scratch is the library's own host memory).
   * workspace: NULL: a CUDA call takes its scratch from the library's own stream-ordered pool.
   *   Else it uses [workspace, workspace + workspace_bytes) instead and allocates nothing: memory
   *   of the call's device, 256-byte aligned, at least the queried size, overlapping no tensor of
   *   the call; the call reads and writes it in the order of options.stream, so it may be reused
   *   by later work on that stream. Ignored by CPU calls. */
  void* workspace;
  uint64_t workspace_bytes;
  uint64_t* workspace_query;
} flashattn_options;

#define FLASHATTN_OPTIONS_V1_SIZE 24u
#define FLASHATTN_OPTIONS_V2_SIZE 40u
#define FLASHATTN_OPTIONS_V3_SIZE 72u /* through alibi_slopes (64-bit pointers) */
#define FLASHATTN_OPTIONS_V4_SIZE 96u /* through cancel_arg (64-bit pointers) */

/* Fills *opts with defaults (struct_size = sizeof, everything else 0 / NULL). */
FLASHATTN_API void flashattn_options_init(flashattn_options* opts);

/* Forward: out [B,Hq,Sq,D] (dtype of q), lse [B,Hq,Sq] float32. opts may be NULL (defaults). */
FLASHATTN_API int flashattn_forward(const flashattn_tensor* q, const flashattn_tensor* k,
                                    const flashattn_tensor* v, const flashattn_tensor* out,
                                    const flashattn_tensor* lse, const flashattn_options* opts);

/* Backward: from dout, out and lse (as returned by the forward, same options) computes dq, dk, dv.
 * dk and dv are summed over the query heads sharing a kv head. Outputs are overwritten. */
FLASHATTN_API int flashattn_backward(const flashattn_tensor* q, const flashattn_tensor* k,
                                     const flashattn_tensor* v, const flashattn_tensor* out,
                                     const flashattn_tensor* dout, const flashattn_tensor* lse,
                                     const flashattn_tensor* dq, const flashattn_tensor* dk,
                                     const flashattn_tensor* dv, const flashattn_options* opts);

/* Packed variable-length batches (FlashAttention's *_varlen_* functions): B sequences of
 * different lengths packed without padding. Sequence b's queries are rows
 * [cu_seqlens_q[b], cu_seqlens_q[b+1]) of q, out, dout, dq (logical [total_q, Hq, D], ndim 3) and
 * its keys rows [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k, v, dk, dv ([total_k, Hkv, D]); lse is
 * float32 [Hq, total_q] (ndim 2: FlashAttention 2's varlen layout). Each sequence attends only
 * within itself, with every option of the dense call applied per sequence (causal bottom-right,
 * windows and ALiBi relative to that sequence's own Sq and Skv). cu_seqlens_q / _k: int32
 * [B + 1] prefix sums on q's device, starting at 0, non-decreasing, ending at total_q / total_k;
 * seqused_k (optional, int32 [B]): only the first seqused_k[b] keys of sequence b are attended
 * (<= its length). Zero-length sequences are allowed. max_seqlen_q / _k bound every sequence's
 * length (FlashAttention's max_seqlen arguments; they size the launch). The arrays' contents are
 * checked with nothing written on failure: on the host when they are host memory; on CUDA by a
 * small kernel on the stream, the call's kernels queued behind it doing nothing when it fails,
 * and the call returning (with the same error) once that check has run - so the call waits for
 * the stream's earlier work, but the GPU does not wait for the host. Inside a CUDA graph capture
 * the check is captured with the kernels and nothing waits: a replay whose arrays break a rule
 * writes nothing and is counted (flashattn_cuda_take_check_failures). */
typedef struct {
  uint32_t struct_size; /* sizeof(flashattn_varlen) as the caller knows it */
  const flashattn_tensor* cu_seqlens_q;
  const flashattn_tensor* cu_seqlens_k;
  const flashattn_tensor* seqused_k; /* NULL: every key of each sequence */
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
} flashattn_varlen;

FLASHATTN_API int flashattn_forward_varlen(const flashattn_tensor* q, const flashattn_tensor* k,
                                           const flashattn_tensor* v, const flashattn_tensor* out,
                                           const flashattn_tensor* lse, const flashattn_varlen* varlen,
                                           const flashattn_options* opts);
FLASHATTN_API int flashattn_backward_varlen(const flashattn_tensor* q, const flashattn_tensor* k,
                                            const flashattn_tensor* v, const flashattn_tensor* out,
                                            const flashattn_tensor* dout, const flashattn_tensor* lse,
                                            const flashattn_tensor* dq, const flashattn_tensor* dk,
                                            const flashattn_tensor* dv, const flashattn_varlen* varlen,
                                            const flashattn_options* opts);

/* KV-cache attention (FlashAttention 2's flash_attn_with_kvcache), forward only: decoding and
 * chunked prefill against a key/value cache that the call may extend in place.
 *
 * Layouts here are FlashAttention's [batch, seq, heads, head_dim] order (any strides, unit
 * head_dim stride, as everywhere):
 *   q, out            : [B, Sq, Hq, D]
 *   k_cache, v_cache  : [B_cache, S_cache, Hkv, D] (B_cache >= B unless cache_batch_idx maps the
 *                       sequences to rows), or paged (block_table given):
 *                       [num_blocks, block_size, Hkv, D], block_size a multiple of 16
 *   k_new, v_new      : [B, S_new, Hkv, D] (optional, both or neither)
 *   lse               : [B, Hq, Sq] float32, natural log (as flashattn_forward)
 *   cache_seqlens     : int32 [B]            block_table : int32 [B, max_blocks] (unit last stride)
 *   cache_batch_idx   : int32 [B]            cache_leftpad : int32 [B]
 *                       (the [B] vectors contiguous: stride 1 when B > 1)
 *   rotary_cos, _sin  : [S_ro, rotary_dim / 2], dtype of q (unit last stride); rotary_dim <= D
 * All on q's device, q's dtype unless stated. Cache rows are absolute positions 0..capacity-1 of
 * a sequence's cache: capacity = S_cache (contiguous) or max_blocks * block_size (paged, row r
 * in page block_table[b, r / block_size] at row r % block_size). Sequence b uses cache batch row
 * cache_batch_idx[b] (default b; contiguous caches only) and
 *   1. when k_new / v_new are given (cache_seqlens required), writes them, k_new rotated when the
 *      rotary tables are given, into cache rows [cache_seqlens[b], cache_seqlens[b] + S_new): the
 *      one call of the library that writes into an input;
 *   2. attends, with q (rotated when the tables are given), the keys and values of cache rows
 *      [leftpad[b], cache_seqlens[b] + S_new): Sk_b = cache_seqlens[b] + S_new - leftpad[b] keys
 *      (no cache_seqlens: every row of the cache, cache_seqlens[b] = capacity, S_new = 0; no
 *      leftpad: 0). Mask, window, softcap and ALiBi are those of flashattn_forward with
 *      Skv = Sk_b (bottom-right causal is FlashAttention's causal).
 * Rotary (RoPE): position p rotates dims [0, rotary_dim) in rotary_dim / 2 pairs by the angle
 * whose cosine and sine are rotary_cos[p, i], rotary_sin[p, i]: pair i is (x[2i], x[2i+1]) when
 * rotary_interleaved (GPT-J), (x[i], x[i + rotary_dim/2]) otherwise (GPT-NeoX); the pair (a, b)
 * becomes (a cos - b sin, a sin + b cos), computed in float32 (float64 for float64 data) and
 * rounded to the dtype; dims >= rotary_dim pass unchanged. New key j sits at position
 * cache_seqlens[b] + j; query row i at cache_seqlens[b] + i when the mask is causal or a sliding
 * window with a bounded side is set (window_left or window_right >= 0), else every query row at cache_seqlens[b] (FlashAttention's rule). S_ro must
 * exceed every position used. The tables need k_new / v_new (as in FlashAttention: the cache
 * holds rotated keys, so q alone is never rotated).
 * Checked before anything is written: shapes, dtypes, devices, strides; the index tensors'
 * contents - on the host when they are host memory, on CUDA (cache_seqlens in device memory) by a
 * small kernel on the stream whose failure makes the call's kernels write nothing, the call
 * returning the error once that check has run (inside a CUDA graph capture: counted at replay,
 * flashattn_cuda_take_check_failures, as for packed calls): 0 <= leftpad[b] <= cache_seqlens[b] and cache_seqlens[b] + S_new <= capacity;
 * cache_batch_idx in [0, B_cache) and, when appending, without repeats (FlashAttention lets one of
 * the duplicates win; here it is an error); the block_table entries of
 * the rows a sequence uses in [0, num_blocks) (entries past them are neither checked nor used); block_table is
 * not combined with cache_batch_idx or cache_leftpad. Two sequences whose block tables share a
 * page are not detected (as in FlashAttention): appending through both writes that page twice.
 * out and lse must not overlap any input, the caches included; when appending, the caches are
 * outputs too and must not overlap each other or any other argument. */
typedef struct {
  uint32_t struct_size; /* sizeof(flashattn_kvcache) as the caller knows it */
  const flashattn_tensor* k_new;           /* NULL: nothing is appended (then v_new NULL too) */
  const flashattn_tensor* v_new;
  const flashattn_tensor* cache_seqlens;   /* NULL: the whole cache is valid (no append then) */
  const flashattn_tensor* cache_batch_idx; /* NULL: sequence b uses cache row b */
  const flashattn_tensor* cache_leftpad;   /* NULL: every sequence's cache starts at row 0 */
  const flashattn_tensor* block_table;     /* NULL: contiguous cache */
  const flashattn_tensor* rotary_cos;      /* NULL (with rotary_sin): no rotary embedding */
  const flashattn_tensor* rotary_sin;
  int32_t rotary_interleaved; /* nonzero: GPT-J pairs (FlashAttention's default, and what
                                 flashattn_kvcache_init sets); 0: GPT-NeoX halves */
  int32_t num_splits;         /* split-KV: CTAs per (sequence, kv head) along the cache on CUDA, as
                                 FlashAttention's num_splits: 0 = the library's choice (from the
                                 device's size), 1 = none, n > 1 = n (bounded by the cache's 64-key
                                 tiles); 0..128. The CPU backend ignores it. (Was reserved0, which
                                 had to be 0: older callers get the default.) */
} flashattn_kvcache;

/* Fills *kv with defaults: struct_size = sizeof, every tensor NULL, rotary_interleaved = 1. */
FLASHATTN_API void flashattn_kvcache_init(flashattn_kvcache* kv);

/* CPU: every dtype. CUDA: float16/bfloat16 (a float32 call is FLASHATTN_ERROR_UNSUPPORTED). */
FLASHATTN_API int flashattn_forward_kvcache(const flashattn_tensor* q, const flashattn_tensor* k_cache,
                                            const flashattn_tensor* v_cache, const flashattn_tensor* out,
                                            const flashattn_tensor* lse, const flashattn_kvcache* kv,
                                            const flashattn_options* opts);

/* The message of the last failed call on this thread; "" after a successful call. Never NULL. */
FLASHATTN_API const char* flashattn_last_error(void);

/* Static name of a status code ("ok", "invalid argument", ...). Never NULL. */
FLASHATTN_API const char* flashattn_status_string(int status);

/* "major.minor.patch" of the library actually loaded. */
FLASHATTN_API const char* flashattn_version(void);

/* 1 when this build has the CUDA backend and at least one CUDA device is usable, else 0. */
FLASHATTN_API int flashattn_cuda_available(void);

/* Packed (varlen) and KV-cache calls whose index arrays are in device memory check them on the
 * device. Called eagerly, a call whose arrays break a rule fails with FLASHATTN_ERROR_INVALID_ARGUMENT
 * and writes nothing. Captured into a CUDA graph, the check is captured too and runs at every
 * replay, where nothing can return an error: a replay whose arrays break a rule writes nothing (no
 * output, no cache row) and adds one to a count of the device's. This waits for the device's work
 * (cudaDeviceSynchronize: not while this thread or, in global capture mode, another one captures),
 * stores that count since the last call into *failures and resets it (a replay launched by another
 * thread during the call may go uncounted). FLASHATTN_ERROR_UNSUPPORTED without the CUDA backend. */
FLASHATTN_API int flashattn_cuda_take_check_failures(int32_t device, int64_t* failures);

/* CPU calls on a framework's threads. By default the CPU backend runs each call on a pool of its
 * own threads. A framework that keeps a team of worker threads (e.g. PyTorch's OpenMP threads,
 * which spin for a while after each of its operations and would compete with a second set of
 * threads for the cores) can install a team runner instead: run(ctx, threads, body, arg) must call
 * body(arg, t) on one or more threads at the same time, each with a distinct t in [0, threads),
 * and return once every call has returned (the calling thread may be one of them; fewer threads
 * than asked, even one, is fine: the work is handed out dynamically, results do not depend on the
 * team). body never throws or longjmps out. With OpenMP:
 *   void run(void* ctx, int32_t n, flashattn_cpu_team_body body, void* arg) {
 *     #pragma omp parallel num_threads(n)
 *     body(arg, omp_get_thread_num());
 *   }
 * The runner is process-wide and applies to calls that start after it is set; NULL restores the
 * library's own pools. Returns FLASHATTN_OK. */
typedef void (*flashattn_cpu_team_body)(void* arg, int32_t thread);
typedef void (*flashattn_cpu_team_runner)(void* ctx, int32_t threads, flashattn_cpu_team_body body, void* arg);
FLASHATTN_API int flashattn_set_cpu_team_runner(flashattn_cpu_team_runner run, void* ctx);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHATTN_FLASHATTN_H */
