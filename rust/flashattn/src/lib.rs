//! Safe Rust API for flashattn: exact, memory-efficient attention (FlashAttention), forward and
//! backward, over the library's C ABI.
//!
//! Tensors are borrowed views ([`Tensor`] for inputs, [`TensorMut`] for outputs) with a logical
//! shape and per-dimension strides in elements, so the `[B, H, S, D]` and `[B, S, H, D]` memory
//! layouts both work without copies:
//!
//! - q, out, dout, dq: logical `[B, Hq, Sq, D]`; k, v, dk, dv: `[B, Hkv, Skv, D]`, where Hkv
//!   divides Hq (query head h reads kv head h / (Hq / Hkv)); lse: `[B, Hq, Sq]`, always f32.
//! - Element types: `f32`, `f64` (CPU only), [`F16`], [`Bf16`].
//!
//! This crate checks only that each slice covers its view; every other check (shapes agreeing,
//! head_dim stride 1, dtypes, devices, ...) is the library's, and its message comes back in
//! [`Error`].
//!
//! ```
//! use flashattn::{forward, backward, Mask, Options, Tensor, TensorMut};
//! let (b, h, s, d) = (1, 2, 5, 8);
//! let q = vec![0.1f32; b * h * s * d];
//! let k = vec![0.2f32; b * h * s * d];
//! let v = vec![0.3f32; b * h * s * d];
//! let mut out = vec![0f32; b * h * s * d];
//! let mut lse = vec![0f32; b * h * s];
//! let opts = Options { mask: Mask::CausalBottomRight, ..Options::default() };
//! let (qt, kt, vt) = (
//!     Tensor::bhsd(&q, [b, h, s, d])?,
//!     Tensor::bhsd(&k, [b, h, s, d])?,
//!     Tensor::bhsd(&v, [b, h, s, d])?,
//! );
//! let mut ot = TensorMut::bhsd(&mut out, [b, h, s, d])?;
//! let mut lt = TensorMut::contiguous(&mut lse, &[b, h, s])?;
//! forward(&qt, &kt, &vt, &mut ot, &mut lt, &opts)?;
//!
//! let dout = vec![1f32; b * h * s * d];
//! let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
//! backward(
//!     &qt, &kt, &vt, &ot.as_tensor(), &Tensor::bhsd(&dout, [b, h, s, d])?, &lt.as_tensor(),
//!     &mut TensorMut::bhsd(&mut dq, [b, h, s, d])?,
//!     &mut TensorMut::bhsd(&mut dk, [b, h, s, d])?,
//!     &mut TensorMut::bhsd(&mut dv, [b, h, s, d])?,
//!     &opts,
//! )?;
//! # Ok::<(), flashattn::Error>(())
//! ```
#![deny(unsafe_op_in_unsafe_fn)]

mod error;
mod half;
mod kvcache;
mod options;
mod tensor;
mod varlen;

use core::ffi::CStr;

pub use error::{status_string, Error, ErrorKind};
pub use flashattn_sys as sys;
pub use half::{Bf16, F16};
pub use kvcache::KvCache;
pub use options::{CudaStream, Mask, Options, Precision, Window};
pub use tensor::{DType, Device, Element, Tensor, TensorMut};
pub use varlen::Varlen;

/// Attention forward: `out = softmax(scores, masked) v` with `scores = scale * q k^T` (softcapped
/// and with the ALiBi bias when the options say so; masked by the mask and the window), and the
/// natural-log `lse` of each row. Outputs are overwritten; on error nothing is written.
pub fn forward<T: Element>(
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut TensorMut<'_, f32>,
    options: &Options<'_>,
) -> Result<(), Error> {
    let slopes = options.alibi_slopes.map(|t| t.raw());
    let opts = options.raw(slopes.as_ref())?;
    let (q, k, v, out, lse) = (q.raw(), k.raw(), v.raw(), out.raw(), lse.raw());
    // SAFETY: every view covers memory valid for its lifetime (checked slices or an unsafe
    // constructor's promise); outputs are exclusively borrowed; the structs (the slopes' view
    // that opts points to included) outlive the call.
    let status = unsafe { sys::flashattn_forward(&q, &k, &v, &out, &lse, &opts) };
    Error::check(status)
}

/// Attention backward: from `dout` and the forward's `out` and `lse` (same options), computes
/// `dq`, `dk` and `dv` (dk and dv summed over the query heads sharing a kv head). Outputs are
/// overwritten; on error nothing is written.
///
/// # Argument order
///
/// `(q, k, v, out, dout, lse, dq, dk, dv, options)`: the C ABI's (`flashattn_backward`) and the
/// C++ API's order, which this crate follows argument for argument. Python's
/// `flashattn.backward(dout, q, k, v, out, lse, ...)` puts `dout` first instead, as flash_attn
/// 2.x's backward does, so that code written for it ports unchanged. The difference is
/// deliberate: `q`, `out` and `dout` have one type (`&Tensor<T>`), so switching this crate to
/// Python's order would still compile in every existing caller and silently give wrong
/// gradients. Porting a Python call: move `dout` from first to just after `out`.
/// [`backward_varlen`] has the same order.
#[allow(clippy::too_many_arguments)]
pub fn backward<T: Element>(
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    dout: &Tensor<'_, T>,
    lse: &Tensor<'_, f32>,
    dq: &mut TensorMut<'_, T>,
    dk: &mut TensorMut<'_, T>,
    dv: &mut TensorMut<'_, T>,
    options: &Options<'_>,
) -> Result<(), Error> {
    let slopes = options.alibi_slopes.map(|t| t.raw());
    let opts = options.raw(slopes.as_ref())?;
    let (q, k, v, out, dout, lse) = (q.raw(), k.raw(), v.raw(), out.raw(), dout.raw(), lse.raw());
    let (dq, dk, dv) = (dq.raw(), dk.raw(), dv.raw());
    // SAFETY: as in forward.
    let status =
        unsafe { sys::flashattn_backward(&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, &opts) };
    Error::check(status)
}

/// [`forward`] over a packed variable-length batch: B sequences of different lengths stored back
/// to back without padding, split by `varlen` ([`Varlen`]). Each sequence attends only within
/// itself, with every option applied per sequence (bottom-right causal, windows and ALiBi
/// relative to that sequence's own lengths; `[B, Hq]` slopes per sequence).
///
/// Layouts: q and out logical `[total_q, Hq, D]`, k and v `[total_k, Hkv, D]` (ndim 3, any
/// strides with a unit head_dim stride, e.g. `Tensor::contiguous(&q, &[total_q, hq, d])`); lse
/// f32 `[Hq, total_q]` (FlashAttention 2's varlen layout). A query row that sees no key (a
/// sequence with no keys included) gets out = 0 and lse = -inf. Outputs are overwritten; on
/// error nothing is written. The CPU backend implements it; CUDA answers
/// [`ErrorKind::Unsupported`] for now.
pub fn forward_varlen<T: Element>(
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut TensorMut<'_, f32>,
    varlen: &Varlen<'_>,
    options: &Options<'_>,
) -> Result<(), Error> {
    let slopes = options.alibi_slopes.map(|t| t.raw());
    let opts = options.raw(slopes.as_ref())?;
    let indices = varlen.indices()?;
    let vl = indices.raw();
    let (q, k, v, out, lse) = (q.raw(), k.raw(), v.raw(), out.raw(), lse.raw());
    // SAFETY: as in forward; the index vectors are shared borrows (or an unsafe constructor's
    // promise) and `indices`, which vl points into, outlives the call.
    let status = unsafe { sys::flashattn_forward_varlen(&q, &k, &v, &out, &lse, &vl, &opts) };
    Error::check(status)
}

/// [`backward`] over a packed variable-length batch: the layouts of [`forward_varlen`] (dout and
/// dq like q, dk and dv like k, lse `[Hq, total_q]`), the same `varlen` and options as the
/// forward. Keys beyond `seqused_k` and keys no query sees get dk = dv = 0. Outputs are
/// overwritten; on error nothing is written.
///
/// Arguments in the C ABI's order, as [`backward`] (Python's `backward_varlen` puts `dout`
/// first; see [`backward`]'s "Argument order").
#[allow(clippy::too_many_arguments)]
pub fn backward_varlen<T: Element>(
    q: &Tensor<'_, T>,
    k: &Tensor<'_, T>,
    v: &Tensor<'_, T>,
    out: &Tensor<'_, T>,
    dout: &Tensor<'_, T>,
    lse: &Tensor<'_, f32>,
    dq: &mut TensorMut<'_, T>,
    dk: &mut TensorMut<'_, T>,
    dv: &mut TensorMut<'_, T>,
    varlen: &Varlen<'_>,
    options: &Options<'_>,
) -> Result<(), Error> {
    let slopes = options.alibi_slopes.map(|t| t.raw());
    let opts = options.raw(slopes.as_ref())?;
    let indices = varlen.indices()?;
    let vl = indices.raw();
    let (q, k, v, out, dout, lse) = (q.raw(), k.raw(), v.raw(), out.raw(), dout.raw(), lse.raw());
    let (dq, dk, dv) = (dq.raw(), dk.raw(), dv.raw());
    // SAFETY: as in forward_varlen.
    let status = unsafe {
        sys::flashattn_backward_varlen(&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, &vl, &opts)
    };
    Error::check(status)
}

/// Attention against a key/value cache (FlashAttention 2's `flash_attn_with_kvcache`; Python's
/// `flashattn.forward_kvcache`), forward only: decoding (`Sq = 1`) and chunked prefill.
///
/// Layouts are FlashAttention's `[B, S, H, D]` order as the logical shape: q and out
/// `[B, Sq, Hq, D]` (view contiguous memory with `Tensor::contiguous(&q, &[b, sq, hq, d])`, not
/// `Tensor::bshd`), lse f32 `[B, Hq, Sq]`. `cache` ([`KvCache`]) holds the caches, the optional
/// new keys and values, the index vectors (`cache_seqlens`, `cache_batch_idx`, `cache_leftpad`,
/// `block_table`) and the rotary tables; see it for what each means.
///
/// **In-place append**: when `cache` was made with [`KvCache::append`], the call writes k_new
/// and v_new (k_new rotated when rotary tables are given) into the caches at rows
/// `cache_seqlens[b]..cache_seqlens[b] + S_new`, then attends; this is the one call of the
/// library that writes into an input. The caller advances its own `cache_seqlens` by S_new
/// afterwards.
///
/// Sequence b attends `Sk_b = cache_seqlens[b] + S_new - cache_leftpad[b]` keys, with the
/// options' mask, window, softcap and ALiBi applied relative to `Sk_b`
/// ([`Mask::CausalBottomRight`] is FlashAttention's `causal=True`); a query row that sees no key
/// gets out = 0 and lse = -inf. Outputs are overwritten; on error nothing is written, the caches
/// included. The CPU backend implements it; CUDA answers [`ErrorKind::Unsupported`] for now.
pub fn forward_kvcache<T: Element>(
    q: &Tensor<'_, T>,
    cache: &mut KvCache<'_, T>,
    out: &mut TensorMut<'_, T>,
    lse: &mut TensorMut<'_, f32>,
    options: &Options<'_>,
) -> Result<(), Error> {
    let slopes = options.alibi_slopes.map(|t| t.raw());
    let opts = options.raw(slopes.as_ref())?;
    let parts = cache.raw_parts()?;
    let kv = parts.raw();
    let (k_cache, v_cache) = cache.caches();
    let (q, out, lse) = (q.raw(), out.raw(), lse.raw());
    // SAFETY: as in forward; the caches are exclusive borrows when the call appends (KvCache::
    // append takes them from TensorMut views held mutably for the KvCache's lifetime, and `cache`
    // is borrowed mutably here), shared ones otherwise (the library then only reads them);
    // `parts`, which kv points into, outlives the call.
    let status =
        unsafe { sys::flashattn_forward_kvcache(&q, &k_cache, &v_cache, &out, &lse, &kv, &opts) };
    Error::check(status)
}

/// "major.minor.patch" of the library actually loaded.
pub fn version() -> &'static str {
    // SAFETY: a static string owned by the library, never null.
    unsafe { CStr::from_ptr(sys::flashattn_version()) }.to_str().unwrap_or("?")
}

/// Whether this build of the library has the CUDA backend and a usable CUDA device.
pub fn cuda_available() -> bool {
    // SAFETY: no arguments; never fails.
    unsafe { sys::flashattn_cuda_available() != 0 }
}

/// Packed (varlen) and KV-cache calls check their index arrays on the device. Called eagerly, a
/// call whose arrays break a rule returns an error and writes nothing; captured into a CUDA graph,
/// the check runs at every replay, where nothing can return an error: such a replay writes nothing
/// and is counted. Waits for the device, returns the count since the last call and resets it.
pub fn cuda_take_check_failures(device: i32) -> Result<i64, Error> {
    let mut n: i64 = 0;
    // SAFETY: `n` outlives the call, which writes one i64 through the pointer.
    Error::check(unsafe { sys::flashattn_cuda_take_check_failures(device, &mut n) })?;
    Ok(n)
}
