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

Not implemented yet, each raising NotImplementedError that names the argument rather than being
ignored: dropout_p != 0, window_size != (-1, -1), softcap != 0, alibi_slopes.
"""

import torch

from . import _api
from . import torch as _ops  # noqa: F401  (registers torch.ops.flashattn.*)

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]


def _check_unsupported(dropout_p, window_size, softcap, alibi_slopes):
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"flashattn: dropout_p={dropout_p} is not implemented (only dropout_p=0.0)"
        )
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(
            f"flashattn: window_size={tuple(window_size)} (local attention) is not implemented "
            "(only window_size=(-1, -1))"
        )
    if softcap != 0.0:
        raise NotImplementedError(
            f"flashattn: softcap={softcap} is not implemented (only softcap=0.0)"
        )
    if alibi_slopes is not None:
        raise NotImplementedError("flashattn: alibi_slopes is not implemented (only None)")


def _codes(softmax_scale, causal, deterministic):
    mask = _api.MASKS["causal_bottom_right" if causal else "none"]
    return (_api.scale_value(softmax_scale), mask, _api.PRECISIONS["fp32"], 0,
            _api.flag_value(deterministic))


def _check_ndim(x, name, want, layout):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__qualname__}")
    if x.dim() != want:
        raise ValueError(f"{name}.shape = {tuple(x.shape)}, expected {want} dimensions {layout}")


def _result(out, lse, return_attn_probs):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    softmax_scale defaults to 1/sqrt(headdim). Returns out (batch, seqlen_q, nheads, headdim),
    or (out, softmax_lse, None) when return_attn_probs."""
    _check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_ndim(x, name, 4, "(batch, seqlen, nheads, headdim)")

    out, lse = torch.ops.flashattn.fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       *_codes(softmax_scale, causal, deterministic))
    return _result(out.transpose(1, 2), lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim). Returns out (batch, seqlen, nheads, headdim),
    or (out, softmax_lse, None) when return_attn_probs. The gradient of qkv is computed into one
    packed buffer (no per-slice accumulation)."""
    _check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    _check_ndim(qkv, "qkv", 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv.shape = {tuple(qkv.shape)}: dimension 2 must be 3 (q, k, v)")

    out, lse = torch.ops.flashattn.qkvpacked_fwd(qkv,
                                                 *_codes(softmax_scale, causal, deterministic))
    return _result(out, lse, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim).
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse, None) when
    return_attn_probs."""
    _check_unsupported(dropout_p, window_size, softcap, alibi_slopes)
    _check_ndim(q, "q", 4, "(batch, seqlen, nheads, headdim)")
    _check_ndim(kv, "kv", 5, "(batch, seqlen_k, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"kv.shape = {tuple(kv.shape)}: dimension 2 must be 2 (k, v)")

    out, lse = torch.ops.flashattn.kvpacked_fwd(q, kv,
                                                *_codes(softmax_scale, causal, deterministic))
    return _result(out, lse, return_attn_probs)
