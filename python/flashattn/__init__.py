"""flashattn: exact, memory-efficient attention (FlashAttention) for training.

Low-level functions over any DLPack tensor, in the library's logical [B, H, S, D] order:

    out, lse = flashattn.forward(q, k, v, mask="causal_bottom_right")
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, mask="causal_bottom_right")

PyTorch (imported on first use, so NumPy-only users need no torch):

    flashattn.torch.attention(q, k, v, mask=...)          # differentiable, torch.compile-able
    from flashattn import flash_attn_func                  # FlashAttention 2's API and layouts
    from flashattn import flash_attn_with_kvcache          # its KV-cache call (CPU)

KV-cache attention over any DLPack tensor (FlashAttention's [B, S, H, D] order, forward only):

    out, lse = flashattn.forward_kvcache(q, k_cache, v_cache, k_new=k, v_new=v, cache_seqlens=n)
"""

from ._api import (MASKS, PRECISIONS, backward, backward_varlen, build_info, cuda_available,
                   cuda_take_check_failures, forward, forward_kvcache, forward_varlen)
from ._ext import version as _lib_version

__version__ = _lib_version()

__all__ = [
    "forward",
    "backward",
    "forward_varlen",
    "backward_varlen",
    "forward_kvcache",
    "MASKS",
    "PRECISIONS",
    "cuda_available",
    "cuda_take_check_failures",
    "build_info",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
]

_FLASH_ATTN_NAMES = ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                     "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                     "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache")


def __getattr__(name):
    # Lazy so that `import flashattn` never imports PyTorch.
    if name in _FLASH_ATTN_NAMES:
        from . import flash_attn_interface

        return getattr(flash_attn_interface, name)
    if name in ("torch", "flash_attn_interface"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
