//! Raw declarations of the flashattn C ABI, written by hand from `include/flashattn/flashattn.h`.
//!
//! Nothing here is safe to call without reading the header's contract; the `flashattn` crate wraps
//! it. The struct layouts and every `#define` are compared with the C compiler's view of the header
//! by `tests/layout.rs`, so a change to the header that is not mirrored here fails `cargo test`.
//!
//! Names follow the C header exactly so that its documentation applies word for word.
#![no_std]
#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_int, c_void};

pub const FLASHATTN_VERSION_MAJOR: c_int = 0;
pub const FLASHATTN_VERSION_MINOR: c_int = 1;
pub const FLASHATTN_VERSION_PATCH: c_int = 0;

// dtype codes
pub const FLASHATTN_FLOAT32: i32 = 0;
pub const FLASHATTN_FLOAT16: i32 = 1;
pub const FLASHATTN_BFLOAT16: i32 = 2;
/// CPU only: for gradient checking in double precision.
pub const FLASHATTN_FLOAT64: i32 = 3;
/// Index tensors only (the varlen `cu_seqlens` / `seqused_k`, the KV-cache index tensors).
pub const FLASHATTN_INT32: i32 = 4;

/// Device code of the CPU; n >= 0 is CUDA device n.
pub const FLASHATTN_CPU: i32 = -1;

// mask codes
pub const FLASHATTN_MASK_NONE: i32 = 0;
/// Key j visible to query i when j <= i.
pub const FLASHATTN_MASK_CAUSAL_TOP_LEFT: i32 = 1;
/// Key j visible to query i when j <= i + Skv - Sq.
pub const FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT: i32 = 2;

// precision codes: how float32 inputs are multiplied on CUDA (ignored elsewhere)
pub const FLASHATTN_PRECISION_FP32: i32 = 0;
pub const FLASHATTN_PRECISION_TF32: i32 = 1;

// Largest accepted options.num_threads and |options.softmax_scale| (larger: invalid argument)
pub const FLASHATTN_MAX_THREADS: i32 = 1024;
pub const FLASHATTN_MAX_SOFTMAX_SCALE: f32 = 1e6;

// status codes
pub const FLASHATTN_OK: c_int = 0;
pub const FLASHATTN_ERROR_INVALID_ARGUMENT: c_int = 1;
pub const FLASHATTN_ERROR_UNSUPPORTED: c_int = 2;
pub const FLASHATTN_ERROR_BACKEND: c_int = 3;
pub const FLASHATTN_ERROR_OUT_OF_MEMORY: c_int = 4;
pub const FLASHATTN_ERROR_INTERNAL: c_int = 5;
pub const FLASHATTN_ERROR_CANCELLED: c_int = 6;

/// A non-owning tensor view. Shapes and strides are in elements, one per logical dimension.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct flashattn_tensor {
    pub data: *mut c_void,
    pub dtype: i32,
    pub device: i32,
    pub ndim: i32,
    pub shape: [i64; 4],
    pub stride: [i64; 4],
}

/// Call options. `struct_size` tells the library which fields the caller knows; fill it with
/// `flashattn_options_init` or `size_of::<flashattn_options>()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct flashattn_options {
    pub struct_size: u32,
    /// 0 means 1/sqrt(D).
    pub softmax_scale: f32,
    /// `FLASHATTN_MASK_*`.
    pub mask: i32,
    /// CUDA stream (cudaStream_t); null = the default stream.
    pub stream: *mut c_void,
    // ---- end of version 1 (FLASHATTN_OPTIONS_V1_SIZE) ----
    /// CPU worker threads; 0 = all hardware threads. Results do not depend on it.
    pub num_threads: i32,
    /// `FLASHATTN_PRECISION_*`; 0 = fp32-accurate.
    pub precision: i32,
    /// Nonzero: bitwise-reproducible backward on every backend (CUDA float16/bfloat16 then uses
    /// the split dQ + dK/dV passes instead of float atomics for dQ). CPU and CUDA float32 are
    /// always deterministic.
    pub deterministic: i32,
    /// Unused, never read: version-2 callers' struct_size (40) covers it as padding, so it can
    /// carry nothing.
    pub reserved0: i32,
    // ---- end of version 2 (FLASHATTN_OPTIONS_V2_SIZE) ----
    /// Sliding window (FlashAttention's `window_size = (window_left, window_right)`), read only
    /// when `sliding_window` is nonzero: key j is visible to query i when
    /// i + Skv - Sq - window_left <= j <= i + Skv - Sq + window_right; -1 leaves that side
    /// unbounded, other negative values are invalid. Intersected with `mask`.
    pub window_left: i64,
    pub window_right: i64,
    /// Logit softcap: 0 = none; > 0: each score s becomes softcap * tanh(s / softcap) before the
    /// softmax (and before the ALiBi bias); must be finite.
    pub softcap: f32,
    /// Nonzero: `window_left` / `window_right` apply.
    pub sliding_window: i32,
    /// ALiBi slopes: null = none; else a float32 tensor, ndim 1 `[Hq]` or 2 `[B, Hq]`, on q's
    /// device, adding -slope[b, h] * |i + Skv - Sq - j| to score (i, j) of query head h (after
    /// the softcap). Read-only; outputs must not overlap it.
    pub alibi_slopes: *const flashattn_tensor,
    // ---- end of version 3 (FLASHATTN_OPTIONS_V3_SIZE) ----
    /// 0 = no bound; else a call of more FLOPs (the dense count: 4 B Hq Sq Skv D forward, 2.5x
    /// backward) fails with `FLASHATTN_ERROR_INVALID_ARGUMENT` before anything is written.
    pub max_flops: f64,
    /// None = no cancellation; else called with `cancel_arg` before the call and, from the CPU
    /// backend's worker threads (thread-safe), before every task: nonzero stops the call with
    /// `FLASHATTN_ERROR_CANCELLED` (outputs partly written).
    pub cancel: Option<unsafe extern "C" fn(cancel_arg: *mut c_void) -> c_int>,
    pub cancel_arg: *mut c_void,
    // ---- end of version 4 (FLASHATTN_OPTIONS_V4_SIZE) ----
    /// The caller's CUDA scratch: null = the library's pool; else `workspace_bytes` bytes of the
    /// call's device, 256-byte aligned, overlapping no tensor. Ignored by CPU calls.
    pub workspace: *mut c_void,
    pub workspace_bytes: u64,
    /// Non-null: the call only validates and stores the scratch bytes it needs (0 on the CPU).
    pub workspace_query: *mut u64,
}

/// Size of the version 1 `flashattn_options` (up to and including `stream`).
pub const FLASHATTN_OPTIONS_V1_SIZE: u32 = 24;
/// Size of the version 2 `flashattn_options` (up to and including `reserved0`).
pub const FLASHATTN_OPTIONS_V2_SIZE: u32 = 40;
/// Size of the version 3 `flashattn_options` (up to and including `alibi_slopes`).
pub const FLASHATTN_OPTIONS_V3_SIZE: u32 = 72;
/// Size of the version 4 `flashattn_options` (up to and including `cancel_arg`).
pub const FLASHATTN_OPTIONS_V4_SIZE: u32 = 96;

/// Packed variable-length batches (`flashattn_forward_varlen`): see flashattn.h.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct flashattn_varlen {
    /// `sizeof(flashattn_varlen)` as the caller knows it.
    pub struct_size: u32,
    /// int32 [B + 1] prefix sums of the query lengths, on q's device.
    pub cu_seqlens_q: *const flashattn_tensor,
    /// int32 [B + 1] prefix sums of the key lengths.
    pub cu_seqlens_k: *const flashattn_tensor,
    /// Optional int32 [B]: keys attended per sequence (null: all).
    pub seqused_k: *const flashattn_tensor,
    pub max_seqlen_q: i64,
    pub max_seqlen_k: i64,
}

/// KV-cache attention (`flashattn_forward_kvcache`, FlashAttention 2's
/// `flash_attn_with_kvcache`): see flashattn.h for the layouts ([B, S, H, D] order) and the
/// rules. Fill it with `flashattn_kvcache_init` (which sets `rotary_interleaved = 1`) or set
/// every field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct flashattn_kvcache {
    /// `sizeof(flashattn_kvcache)` as the caller knows it.
    pub struct_size: u32,
    /// `[B, S_new, Hkv, D]`, appended in place at `cache_seqlens[b]`; null: no append (then
    /// `v_new` null too).
    pub k_new: *const flashattn_tensor,
    pub v_new: *const flashattn_tensor,
    /// int32 `[B]`: valid cache rows before the append; null: the whole cache (no append).
    pub cache_seqlens: *const flashattn_tensor,
    /// int32 `[B]`: the cache batch row of each sequence; null: row b.
    pub cache_batch_idx: *const flashattn_tensor,
    /// int32 `[B]`: the first valid cache row of each sequence; null: 0.
    pub cache_leftpad: *const flashattn_tensor,
    /// int32 `[B, max_blocks]` (unit last stride): the pages of a paged cache; null: contiguous.
    pub block_table: *const flashattn_tensor,
    /// `[S_ro, rotary_dim / 2]` in q's dtype (with `rotary_sin`); null: no rotary embedding.
    pub rotary_cos: *const flashattn_tensor,
    pub rotary_sin: *const flashattn_tensor,
    /// Nonzero: GPT-J pairs (2i, 2i + 1); 0: GPT-NeoX halves (i, i + rotary_dim / 2).
    pub rotary_interleaved: i32,
    /// Split-KV CTAs along the cache on CUDA (0: the library's choice, 1: none, up to 128);
    /// ignored by the CPU backend. (Was `reserved0`, which had to be 0.)
    pub num_splits: i32,
}

extern "C" {
    /// Packed forward: q/out [total_q, Hq, D], k/v [total_k, Hkv, D], lse [Hq, total_q].
    pub fn flashattn_forward_varlen(
        q: *const flashattn_tensor,
        k: *const flashattn_tensor,
        v: *const flashattn_tensor,
        out: *const flashattn_tensor,
        lse: *const flashattn_tensor,
        varlen: *const flashattn_varlen,
        opts: *const flashattn_options,
    ) -> c_int;

    /// Packed backward (the packed layouts of `flashattn_forward_varlen`).
    pub fn flashattn_backward_varlen(
        q: *const flashattn_tensor,
        k: *const flashattn_tensor,
        v: *const flashattn_tensor,
        out: *const flashattn_tensor,
        dout: *const flashattn_tensor,
        lse: *const flashattn_tensor,
        dq: *const flashattn_tensor,
        dk: *const flashattn_tensor,
        dv: *const flashattn_tensor,
        varlen: *const flashattn_varlen,
        opts: *const flashattn_options,
    ) -> c_int;

    /// Fills `*kv` with defaults: struct_size = sizeof, every tensor null, rotary_interleaved = 1.
    pub fn flashattn_kvcache_init(kv: *mut flashattn_kvcache);

    /// KV-cache forward: q/out `[B, Sq, Hq, D]`, caches `[B_cache, S_cache, Hkv, D]` or paged
    /// `[num_blocks, block_size, Hkv, D]`, lse `[B, Hq, Sq]`. Writes `k_new` / `v_new` into the
    /// caches when given (the one call that writes an input). CPU only for now.
    pub fn flashattn_forward_kvcache(
        q: *const flashattn_tensor,
        k_cache: *const flashattn_tensor,
        v_cache: *const flashattn_tensor,
        out: *const flashattn_tensor,
        lse: *const flashattn_tensor,
        kv: *const flashattn_kvcache,
        opts: *const flashattn_options,
    ) -> c_int;

    /// Fills `*opts` with defaults (struct_size = sizeof, everything else 0 / NULL).
    pub fn flashattn_options_init(opts: *mut flashattn_options);

    /// Forward: out [B,Hq,Sq,D] (dtype of q), lse [B,Hq,Sq] float32. `opts` may be null.
    pub fn flashattn_forward(
        q: *const flashattn_tensor,
        k: *const flashattn_tensor,
        v: *const flashattn_tensor,
        out: *const flashattn_tensor,
        lse: *const flashattn_tensor,
        opts: *const flashattn_options,
    ) -> c_int;

    /// Backward: from dout, out and lse computes dq, dk, dv (dk, dv summed over a kv group).
    pub fn flashattn_backward(
        q: *const flashattn_tensor,
        k: *const flashattn_tensor,
        v: *const flashattn_tensor,
        out: *const flashattn_tensor,
        dout: *const flashattn_tensor,
        lse: *const flashattn_tensor,
        dq: *const flashattn_tensor,
        dk: *const flashattn_tensor,
        dv: *const flashattn_tensor,
        opts: *const flashattn_options,
    ) -> c_int;

    /// Message of the last failed call on this thread; "" after a successful call. Never null.
    pub fn flashattn_last_error() -> *const c_char;

    /// Static name of a status code. Never null.
    pub fn flashattn_status_string(status: c_int) -> *const c_char;

    /// "major.minor.patch" of the library actually loaded.
    pub fn flashattn_version() -> *const c_char;

    /// 1 when this build has the CUDA backend and a usable CUDA device, else 0.
    pub fn flashattn_cuda_available() -> c_int;

    /// Waits for the device; stores (and resets) how many graph replays of packed or KV-cache
    /// calls found index arrays that break a rule (they wrote nothing).
    pub fn flashattn_cuda_take_check_failures(device: i32, failures: *mut i64) -> c_int;
}
