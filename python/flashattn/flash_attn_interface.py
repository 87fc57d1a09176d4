"""FlashAttention 2's Python API, so existing training code switches by changing its import:

    from flashattn import flash_attn_func            # instead of: from flash_attn import ...

Same signatures, layouts and return values as flash_attn 2.x:

- q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim) with
  nheads_k dividing nheads (GQA/MQA); qkv: (batch, seqlen, 3, nheads, headdim);
  kv: (batch, seqlen_k, 2, nheads_k, headdim). Any strides with a contiguous head dimension are
  read in place (no copies; other strides are made contiguous first).
- causal=True aligns the mask to the bottom-right corner (key j visible to query i when
  j <= i + seqlen_k - seqlen_q), as flash_attn >= 2.1 does.
- Returns out (batch, seqlen_q, nheads, headdim); with return_attn_probs=True,
  (out, softmax_lse, None): softmax_lse is (batch, nheads, seqlen_q) float32, the natural log of
  each row's softmax denominator (scaled scores); the third item, which flash_attn fills with the
  attention probabilities only when dropout_p > 0 (testing only), is None because dropout is not
  implemented.
- Differentiable with respect to q, k, v (qkv, kv), on CPU and CUDA tensors, float32, float16,
  bfloat16 (and float64 on the CPU); the packed functions' backward writes one packed gradient.

- deterministic=True, as in flash_attn, makes the backward bitwise reproducible. The CPU and
  CUDA float32 backward are deterministic either way; CUDA float16/bfloat16 by default
  accumulate dq with float atomics (the fast path) and with deterministic=True use separate dq
  and dk/dv passes instead.
- window_size=(left, right): sliding window (local) attention, key j visible to query i when
  i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, with flash_attn's
  conventions: a negative side is unbounded, a side >= seqlen_k is unbounded too, and
  causal=True sets right to 0 (whatever was given).
- softcap: anything > 0 caps the scores with softcap * tanh(scores / softcap) before the
  softmax; 0 or below means none (as in flash_attn). Unlike flash_attn, a NaN or infinite
  softcap is a ValueError rather than silently none or NaN outputs.
- alibi_slopes: None, or float32 (nheads,) or (batch, nheads) on the inputs' device: adds
  -slope * |i + seqlen_k - seqlen_q - j| to score (i, j). No gradient flows to the slopes.
  flash_attn's kernels for causal attention without a left window add slope * j instead (the
  same softmax, a per-row constant apart), so the softmax_lse they return is larger by
  slope * (i + seqlen_k - seqlen_q); return_attn_probs=True returns that value here too.

Packed variable-length batches (flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
flash_attn_varlen_kvpacked_func): q (total_q, nheads, headdim), k, v (total_k, nheads_k,
headdim), qkv (total, 3, nheads, headdim), kv (total_k, 2, nheads_k, headdim); cu_seqlens int32
(batch + 1,) on the inputs' device; each sequence attends within itself, with causal, the window
and ALiBi relative to its own lengths. softmax_lse is (nheads, total_q); the window sides are
normalised against max_seqlen_k, as flash_attn does, and the ALiBi softmax_lse shift above is
applied per sequence with that sequence's lengths.

KV cache (flash_attn_with_kvcache, forward only, for decoding and chunked prefill): q
(batch, seqlen_q, nheads, headdim); k_cache, v_cache (batch_cache, seqlen_cache, nheads_k,
headdim), or pages (num_blocks, page_block_size, nheads_k, headdim) with block_table; k, v (batch,
seqlen_new, nheads_k, headdim) are appended in place at cache_seqlens (rotated first when
rotary_cos / rotary_sin are given), then q attends every valid cache row. causal is bottom-right
against each sequence's own key count; the window sides are normalised against the cache
capacity, as flash_attn does (which also decides whether the query rows advance in rotary
position), and the ALiBi softmax_lse shift above applies per sequence. Unlike flash_attn, an int
cache_seqlens is broadcast to (batch,) (the batch of q, so paged caches and cache_batch_idx work
with it too), repeated rows in cache_batch_idx are an error when appending (flash_attn lets one
of the writes win) and CUDA tensors raise NotImplementedError (the CPU serves the call).

Not implemented: dropout_p != 0 raises NotImplementedError rather than being ignored; so does a
block_table (paged KV cache) for flash_attn_varlen_func.
"""

import numbers

import torch

from . import _api
from . import torch as _ops  # also registers torch.ops.flashattn.*

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache"]


def _check_unsupported(dropout_p):
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"flashattn: dropout_p={dropout_p} is not implemented (only dropout_p=0.0)"
        )


def _window(window_size, causal, seqlen_k):
    """flash_attn's window normalisation: (left, right) with -1 for an unbounded side, as the
    library takes it."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size = {window_size!r} is not a pair (left, right) of ints "
                        "(-1 for an unbounded side)") from None
    for w in (left, right):
        if not _api._is_int(w):
            raise TypeError(f"window_size = {window_size!r}: left and right must be ints, got "
                            f"{type(left).__name__} and {type(right).__name__}")
    # A negative side, or one that reaches past every key, is unbounded.
    left, right = (-1 if w < 0 or w >= seqlen_k else int(w) for w in (left, right))
    if causal:
        # The causal mask (bottom-right) bounds the right side at 0 already.
        right = -1
    return left, right


def _softcap(softcap):
    if isinstance(softcap, numbers.Real) and not isinstance(softcap, bool) and softcap < 0:
        return 0.0  # flash_attn: only softcap > 0 activates the softcap
    return softcap


def _codes_uncached(softmax_scale, causal, deterministic, window_size, softcap, seqlen_k):
    mask = "causal_bottom_right" if causal else "none"
    return _ops._codes(softmax_scale, mask, "fp32", None, deterministic,
                       _window(window_size, causal, seqlen_k), _softcap(softcap))


# The validated options of recent calls (a model calls with the same few every step): validating
# them each time cost ~5 us per call (CPU, torch 2.15), a third of the eager forward's host time.
# Keys carry each value's type, so 1 and True (equal, same hash) are told apart and an argument
# refused once is refused again (refusals are never stored).
_CODES_CACHE = {}


def _codes(softmax_scale, causal, deterministic, window_size, softcap, seqlen_k):
    if torch.compiler.is_compiling():
        return _codes_uncached(softmax_scale, causal, deterministic, window_size, softcap, seqlen_k)
    try:
        # (The pair unpacked into the key: validation reads only its two values; a list gives
        # the same key as a tuple.)
        left, right = window_size
        key = (softmax_scale, causal, deterministic, left, right, softcap, seqlen_k, type(softmax_scale),
               type(causal), type(deterministic), type(left), type(right), type(softcap))
        hit = _CODES_CACHE.get(key)
    except (TypeError, ValueError):  # unhashable, or not a pair: validate (and refuse) as usual
        return _codes_uncached(softmax_scale, causal, deterministic, window_size, softcap, seqlen_k)
    if hit is None:
        hit = _codes_uncached(softmax_scale, causal, deterministic, window_size, softcap, seqlen_k)
        if len(_CODES_CACHE) >= 256:
            _CODES_CACHE.clear()
        _CODES_CACHE[key] = hit
    return hit


def _check_ndims(q, k, v, layout):
    """_check_ndim(x, name, 4, layout) for q, k and v, in one test where all three are fine."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_ndim(x, name, 4, layout)


def _check_ndim(x, name, want, layout):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__qualname__}")
    if x.dim() != want:
        raise ValueError(f"{name}.shape = {tuple(x.shape)}, expected {want} dimensions {layout}")


def _result(out, lse, return_attn_probs, fa2_shift=None):
    if not return_attn_probs:
        return out
    if fa2_shift is not None:
        lse = lse + fa2_shift
    return (out, lse, None)


def _alibi_shifts(alibi_slopes, causal, window_size, seqlen_k):
    """Whether flash_attn's softmax_lse differs from ours by the ALiBi shift (see below)."""
    if alibi_slopes is None or not isinstance(alibi_slopes, torch.Tensor):
        return False
    left, right = _window(window_size, causal, seqlen_k)
    return left == -1 and (causal or right == 0)


def _alibi_lse_shift(alibi_slopes, causal, window_size, seqlen_q, seqlen_k, lse, keys=None):
    """flash_attn's causal kernels (left side unbounded, right side 0 after its normalisation)
    add slope * j to the scores instead of -slope * |i + seqlen_k - seqlen_q - j|: the returned
    softmax_lse is larger by slope * (i + seqlen_k - seqlen_q). None where the two agree.
    keys: each sequence's own key count (a tensor (batch,)) where it is not seqlen_k (the KV
    cache, whose seqlen_k is the capacity that normalises the window)."""
    if not _alibi_shifts(alibi_slopes, causal, window_size, seqlen_k):
        return None
    rows = torch.arange(seqlen_q, device=lse.device, dtype=torch.float32) - seqlen_q
    if keys is None:
        rows = rows + seqlen_k
    else:  # (batch, 1, seqlen_q), against slopes (batch or 1, nheads, 1)
        rows = rows[None, None, :] + keys.to(device=lse.device, dtype=torch.float32)[:, None, None]
    slopes = alibi_slopes.to(device=lse.device, dtype=torch.float32)
    slopes = slopes[None, :, None] if slopes.dim() == 1 else slopes[:, :, None]
    return slopes * rows


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    softmax_scale defaults to 1/sqrt(headdim). Returns out (batch, seqlen_q, nheads, headdim),
    or (out, softmax_lse, None) when return_attn_probs."""
    fast = _ops._FAST_FLASH
    if fast is not None and not torch.compiler.is_compiling():
        r = fast(1, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, _ops._WS_TORCH)
        if r is not None:  # (None: arguments the C++ entry leaves to this function)
            return r
    _check_unsupported(dropout_p)
    _check_ndims(q, k, v, "(batch, seqlen, nheads, headdim)")

    codes = _codes(softmax_scale, causal, deterministic, window_size, softcap, k.shape[1])
    out, lse = _ops.call_op("bshd_fwd", q, k, v, *codes, _ops.slopes_value(alibi_slopes))
    shift = _alibi_lse_shift(alibi_slopes, causal, window_size, q.shape[1], k.shape[1], lse) if return_attn_probs else None
    return _result(out, lse, return_attn_probs, shift)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim). Returns out (batch, seqlen, nheads, headdim),
    or (out, softmax_lse, None) when return_attn_probs. The gradient of qkv is computed into one
    packed buffer (no per-slice accumulation)."""
    fast = _ops._FAST_FLASH
    if fast is not None and not torch.compiler.is_compiling():
        r = fast(2, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, _ops._WS_TORCH)
        if r is not None:  # (None: arguments the C++ entry leaves to this function)
            return r
    _check_unsupported(dropout_p)
    _check_ndim(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv.shape = {tuple(qkv.shape)}: dimension 2 must be 3 (q, k, v)")

    codes = _codes(softmax_scale, causal, deterministic, window_size, softcap, qkv.shape[1])
    out, lse = _ops.call_op("qkvpacked_fwd", qkv, *codes, _ops.slopes_value(alibi_slopes))
    shift = _alibi_lse_shift(alibi_slopes, causal, window_size, qkv.shape[1], qkv.shape[1], lse) if return_attn_probs else None
    return _result(out, lse, return_attn_probs, shift)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim).
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None) when
    return_attn_probs."""
    fast = _ops._FAST_FLASH
    if fast is not None and not torch.compiler.is_compiling():
        r = fast(3, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, _ops._WS_TORCH)
        if r is not None:  # (None: arguments the C++ entry leaves to this function)
            return r
    _check_unsupported(dropout_p)
    _check_ndim(q, "q", 4, "(batch, seqlen, nheads, headdim)")
    _check_ndim(kv, "kv", 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv.shape = {tuple(kv.shape)}: dimension 2 must be 2 (k, v)")

    codes = _codes(softmax_scale, causal, deterministic, window_size, softcap, kv.shape[1])
    out, lse = _ops.call_op("kvpacked_fwd", q, kv, *codes, _ops.slopes_value(alibi_slopes))
    shift = _alibi_lse_shift(alibi_slopes, causal, window_size, q.shape[1], kv.shape[1], lse) if return_attn_probs else None
    return _result(out, lse, return_attn_probs, shift)


# ---- packed variable-length batches -------------------------------------------------------------


def _alibi_lse_shift_varlen(alibi_slopes, causal, window_size, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_k, lse):
    """_alibi_lse_shift per sequence: row i of sequence b is larger by
    slope[b, h] * (i + seqlen_k[b] - seqlen_q[b]); (nheads, total_q) like softmax_lse, or None."""
    if not _alibi_shifts(alibi_slopes, causal, window_size, max_seqlen_k):
        return None
    cq = cu_seqlens_q.to(device=lse.device, dtype=torch.int64)
    ck = cu_seqlens_k.to(device=lse.device, dtype=torch.int64)
    len_q, len_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    seq = torch.repeat_interleave(torch.arange(len_q.numel(), device=lse.device), len_q)
    total_q = lse.shape[1]
    rows = (torch.arange(total_q, device=lse.device) - cq[seq] + len_k[seq] - len_q[seq])
    slopes = alibi_slopes.to(device=lse.device, dtype=torch.float32)
    slopes = slopes[:, None] if slopes.dim() == 1 else slopes[seq].transpose(0, 1)
    return slopes * rows.to(torch.float32)[None, :]


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs):
    seq = _ops.varlen_values(cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, max_seqlen_k)
    codes = _codes(softmax_scale, causal, deterministic, window_size, softcap, seq[4])
    out, lse = _ops.call_op("varlen_fwd", q, k, v, *seq, *codes,
                                              _ops.slopes_value(alibi_slopes))
    shift = None
    if return_attn_probs:
        shift = _alibi_lse_shift_varlen(alibi_slopes, causal, window_size, cu_seqlens_q,
                                        cu_seqlens_k, seq[4], lse)
    return _result(out, lse, return_attn_probs, shift)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q / _k: int32
    (batch + 1,). Returns out (total_q, nheads, headdim), or (out, softmax_lse, None) with
    softmax_lse (nheads, total_q) when return_attn_probs."""
    fast = _ops._FAST_FLASH
    if fast is not None and block_table is None and not torch.compiler.is_compiling():
        r = fast(4, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                 causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, _ops._WS_TORCH)
        if r is not None:  # (None: arguments the C++ entry leaves to this function)
            return r
    _check_unsupported(dropout_p)
    if block_table is not None:
        raise NotImplementedError("flashattn: block_table (paged KV cache) is not implemented "
                                  "(only block_table=None)")
    _check_ndim(q, "q", 3, "(total_q, nheads, headdim)")
    for name, x in (("k", k), ("v", v)):
        _check_ndim(x, name, 3, "(total_k, nheads_k, headdim)")
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim); cu_seqlens: int32 (batch + 1,). Returns out
    (total, nheads, headdim), or (out, softmax_lse, None) when return_attn_probs."""
    _check_unsupported(dropout_p)
    _check_ndim(qkv, "qkv", 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv.shape = {tuple(qkv.shape)}: dimension 1 must be 3 (q, k, v)")
    return _varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen,
                   max_seqlen, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim). Returns out
    (total_q, nheads, headdim), or (out, softmax_lse, None) when return_attn_probs."""
    _check_unsupported(dropout_p)
    _check_ndim(q, "q", 3, "(total_q, nheads, headdim)")
    _check_ndim(kv, "kv", 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"kv.shape = {tuple(kv.shape)}: dimension 1 must be 2 (k, v)")
    return _varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


# ---- KV cache -----------------------------------------------------------------------------------


def _cache_seqlens(cache_seqlens, batch, device):
    """cache_seqlens as the library takes it: None, or an int32 tensor (batch,); an int is the
    same length for every sequence."""
    if _api._is_int(cache_seqlens):
        return torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=device)
    return _ops.index_value(cache_seqlens, "cache_seqlens", optional=True)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q: (batch, seqlen_q, nheads, headdim); k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_k, headdim), or (num_blocks, page_block_size, nheads_k, headdim) with block_table
    (batch, max_num_blocks_per_seq) int32; k, v: None or (batch, seqlen_new, nheads_k, headdim),
    written into the caches in place at rows [cache_seqlens[b], cache_seqlens[b] + seqlen_new).
    rotary_cos / rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype, applied to q and k
    (GPT-J pairs when rotary_interleaved, else GPT-NeoX halves). cache_seqlens: int or int32
    (batch,); cache_batch_idx, cache_leftpad: int32 (batch,). num_splits: on CUDA, how many CTAs
    split each sequence's keys (0 or less: chosen from the GPU's size, 1: none, at most 128);
    it changes rounding only. The CPU ignores it.
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse) with softmax_lse
    (batch, nheads, seqlen_q) float32 when return_softmax_lse. Not differentiable."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_ndim(x, name, 4, "(batch, seqlen, nheads, headdim)")
    if (k is None) != (v is None):
        raise ValueError(f"k is {'None' if k is None else 'given'} but v is "
                         f"{'None' if v is None else 'given'}: pass both new keys and values, "
                         "or neither")
    if k is not None:
        for name, x in (("k", k), ("v", v)):
            _check_ndim(x, name, 4, "(batch, seqlen_new, nheads_k, headdim)")
    if block_table is not None:
        _check_ndim(block_table, "block_table", 2, "(batch, max_num_blocks_per_seq)")
    # The capacity of each sequence's cache: flash_attn's seqlen_k for the window normalisation.
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    seqlens = _cache_seqlens(cache_seqlens, q.shape[0], q.device)
    # flash_attn reads q, k, v and the rotary tables through a contiguous last dimension (copying
    # others); the caches are written in place, so they must have one already (the library says so).
    q, k, v, rotary_cos, rotary_sin = (None if x is None else _ops._unit_last(x)
                                       for x in (q, k, v, rotary_cos, rotary_sin))
    mask = "causal_bottom_right" if causal else "none"
    wl, wr = _window(window_size, causal, capacity)
    # (torch.ops.flashattn.kvcache under torch.compile: _ops.kvcache_op.)
    out, lse = _ops.kvcache_op(
        q, k_cache, v_cache, k, v, seqlens, cache_batch_idx, cache_leftpad, block_table,
        rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, mask, wl, wr, _softcap(softcap),
        _ops.slopes_value(alibi_slopes), 0, max(0, int(num_splits)))
    if not return_softmax_lse:
        return out
    if _alibi_shifts(alibi_slopes, causal, window_size, capacity):
        # Each sequence's key count after the append, for its lse shift.
        keys = (torch.full((q.shape[0],), capacity, device=lse.device) if seqlens is None
                else seqlens.to(lse.device, torch.int64))
        keys = keys + (0 if k is None else k.shape[1])
        if cache_leftpad is not None:
            keys = keys - cache_leftpad.to(lse.device, torch.int64)
        lse = lse + _alibi_lse_shift(alibi_slopes, causal, window_size, q.shape[1], capacity,
                                     lse, keys)
    return out, lse
