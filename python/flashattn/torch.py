"""PyTorch integration: differentiable attention, as custom ops that work under torch.compile.

    import flashattn.torch as fat
    out = fat.attention(q, k, v, mask="causal_bottom_right")       # [B, H, S, D]
    out.sum().backward()

Two ways in, the same kernels:

- ``attention(...)`` is, under torch.compile, the torch.library custom ops ``flashattn::fwd`` and
  ``flashattn::bwd`` (with fake implementations for tracing and a registered autograd formula),
  so torch.compile keeps them as opaque nodes in the graph instead of breaking it; eagerly, the
  same implementations and formula run without the dispatcher (``call_op``), which costs a
  fraction of the custom op's eager path.
  Where the package was built against the running torch (``pip install --no-build-isolation``),
  the eager path of attention(), attention_varlen() and the flash_attn functions (dense, packed,
  varlen) is the C++ ops ``flashattn_eager::*`` instead
  (python/src/torch_ops.cpp: its autograd node and the library calls in C++, about half the
  host time per call); ``use_eager_ops(False)`` or FLASHATTN_TORCH_OPS=0 keep the Python path.
- ``FlashAttnFunction`` is a plain torch.autograd.Function calling the extension directly (eager
  only).

The packed ops ``flashattn::qkvpacked_fwd/bwd`` and ``flashattn::kvpacked_fwd/bwd`` back the
FlashAttention-compatible functions (flashattn.flash_attn_interface): their backward writes the
gradients of q, k and v straight into one packed buffer laid out like the packed input.

The varlen ops ``flashattn::varlen_fwd/bwd`` take packed variable-length batches (q
[total_q, Hq, D], k and v [total_k, Hkv, D], int32 cu_seqlens; lse [Hq, total_q]); the sequence
arrays are plain inputs without gradient.

The log-sum-exp output is marked non-differentiable (requires_grad=False, as in FlashAttention):
gradients flow to q, k and v through out only. The ALiBi slopes are an input of every op but get
no gradient (None), as in FlashAttention.
"""

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _api, _ext

__all__ = ["attention", "attention_varlen", "FlashAttnFunction", "use_torch_threads", "torch_threads_in_use",
           "use_torch_allocator", "use_eager_ops", "eager_ops_available"]


_stream = _api.torch_stream


# Tensors cross into the extension as DLPack capsules: nanobind takes a capsule as it is, where a
# tensor costs a call of Tensor.__dlpack__ (Python code: 2.3 us each against 0.23 us for
# to_dlpack, measured on the CPU with torch 2.15 - and a backward passes nine tensors). to_dlpack
# also takes tensors that require grad, so no detach() is needed on the way.
_dl = torch.utils.dlpack.to_dlpack


def _dl_opt(t: Optional[Tensor]):
    return None if t is None else _dl(t)


def _threads(t: Tensor, num_threads: int) -> int:
    # On the CPU, follow torch's own thread setting unless told otherwise, so that flashattn and
    # torch's operators share the cores the same way.
    if num_threads == 0 and not t.is_cuda:
        return torch.get_num_threads()
    return num_threads


# ---- CPU threads shared with PyTorch ------------------------------------------------------------


def _torch_openmp_path():
    """The file of the OpenMP runtime PyTorch's CPU operators run on, as loaded in this process
    (Linux: from /proc/self/maps; the copy inside torch's own folder first), or None."""
    try:
        if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return None
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except (OSError, RuntimeError, IndexError):
        return None
    names = ("libgomp", "libomp", "libiomp5")
    found = sorted(p for p in paths if os.path.basename(p).startswith(names))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    found.sort(key=lambda p: not p.startswith(torch_dir))
    return found[0] if found else None


def use_torch_threads(enable: bool = True) -> bool:
    """CPU calls on PyTorch's own intra-op (OpenMP) threads (the default from `import
    flashattn.torch` on, where torch uses OpenMP; FLASHATTN_TORCH_THREADS=0 keeps the library's
    pools), or (enable=False) on the library's thread pools. torch's OpenMP workers keep spinning
    for a while after each operator, and a second set of threads competes with them for the cores
    (measured on 2 cores, B4 H4 S256 D64 causal: forward+backward 7.8 ms on the pools, 3.6 ms on
    torch's threads, SDPA 5.3 ms); as parallel regions of torch's runtime the library's tasks run on
    those very threads, torch.get_num_threads() of them. Applies to every CPU call of the library in
    this process; results are the same bits either way. Returns whether torch's threads are in use
    (False where torch does not use OpenMP)."""
    global _on_torch_threads
    if not enable:
        _ext.use_own_threads()
        _on_torch_threads = False
        return False
    path = _torch_openmp_path()
    _on_torch_threads = bool(path) and _ext.use_openmp_runtime(path)
    return _on_torch_threads


def torch_threads_in_use() -> bool:
    """Whether CPU calls currently run on PyTorch's threads (use_torch_threads): True after
    `import flashattn.torch` where torch uses OpenMP, unless FLASHATTN_TORCH_THREADS=0 or
    use_torch_threads(False)."""
    return _on_torch_threads


_on_torch_threads = False
if os.environ.get("FLASHATTN_TORCH_THREADS", "1") != "0":
    use_torch_threads(True)


def _unit_last(t: Tensor) -> Tensor:
    # The library reads any strides but needs a contiguous head dimension; autograd hands out
    # gradients such as expanded scalars whose last stride is 0.
    return t if t.stride(-1) == 1 or t.size(-1) == 1 else t.contiguous()


# ---- CUDA scratch from PyTorch's caching allocator --------------------------------------------
# A CUDA call's scratch (the backward's D rows and dQ accumulator, packed calls' tensor maps, ...)
# comes from torch's caching allocator, so torch.cuda.memory_allocated / max_memory_allocated and
# set_per_process_memory_fraction see it: the library is asked for the size once per call
# signature (its query validates only; the size depends on shapes, strides, alignment, dtype and
# options, never on data) and given a uint8 tensor of that many bytes on the call's stream, freed
# back to the cache after the call in stream order. use_torch_allocator(False) leaves the scratch
# to the library's own pool. (The backward runs on torch's autograd thread, which may have no
# CUDA context bound when the call allocates nothing: the library binds the device's primary
# context itself, C++ test CudaWorkspace32.CallerMemoryFromAFreshThread.)
_WS_SIZES = {}
_WS_TORCH = os.environ.get("FLASHATTN_TORCH_ALLOCATOR", "1") != "0"


def use_torch_allocator(enable: bool = True) -> bool:
    """CUDA scratch from PyTorch's caching allocator (the default), or (False) from the
    library's own stream-ordered pool, outside torch's memory statistics. Returns the previous
    setting."""
    global _WS_TORCH
    prev, _WS_TORCH = _WS_TORCH, bool(enable)
    _sync_custom_kernels()
    return prev


def _ws_key(tensors, scalars):
    return tuple((t.shape, t.stride(), t.dtype, t.data_ptr() % 256) for t in tensors if t is not None) + scalars


def _with_scratch(kind, call, tensors, scalars):
    """call() on the CPU; on CUDA with its scratch from torch (see above). call(**kw) makes the
    extension call (fresh DLPack capsules each time: a capsule is consumed by one call)."""
    q = tensors[0]
    if not (_WS_TORCH and q.is_cuda):
        return call()
    key = (kind,) + _ws_key(tensors, scalars)
    need = _WS_SIZES.get(key)
    if need is None:
        need = call(query=True)
        if len(_WS_SIZES) > 4096:
            _WS_SIZES.clear()
        _WS_SIZES[key] = need
    if need == 0:
        return call()
    buf = torch.empty(need + 255, dtype=torch.uint8, device=q.device)
    return call(workspace=(buf.data_ptr() + 255) // 256 * 256, workspace_bytes=need)


# bshd=True: the 4-d tensors are FlashAttention's [B, S, H, D] (the extension swaps dims 1 and 2
# of their views: no transposed torch views to make).
def _call_fwd(q, k, v, out, lse, scale, mask, precision, num_threads, deterministic,
              window_left, window_right, softcap, alibi_slopes, bshd=False):
    _with_scratch("fwd", lambda **kw: _ext.forward(
        _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), scale, mask, precision, _threads(q, num_threads), _stream(q),
        deterministic, window_left, window_right, softcap, _dl_opt(alibi_slopes), bshd=bshd, **kw),
        (q, k, v, out, lse, alibi_slopes),
        (scale, mask, precision, deterministic, window_left, window_right, softcap, bshd))


def _call_bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, mask, precision, num_threads,
              deterministic, window_left, window_right, softcap, alibi_slopes, bshd=False):
    _with_scratch("bwd", lambda **kw: _ext.backward(
        _dl(dout), _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), _dl(dq), _dl(dk), _dl(dv), scale, mask, precision,
        _threads(q, num_threads), _stream(q), deterministic, window_left, window_right, softcap,
        _dl_opt(alibi_slopes), bshd=bshd, **kw),
        (q, k, v, out, dout, lse, dq, dk, dv, alibi_slopes),
        (scale, mask, precision, deterministic, window_left, window_right, softcap, bshd))


def _lse_like(q: Tensor, bhs) -> Tensor:
    return torch.empty(bhs, dtype=torch.float32, device=q.device)


# ---- [B, H, S, D] ops ---------------------------------------------------------------------------


# Every op takes the options as trailing arguments: softmax_scale, mask, precision, num_threads,
# then, with defaults so that callers written before them still work, deterministic,
# window_left, window_right, softcap and alibi_slopes. The forward ops take deterministic too,
# although the forward is deterministic anyway: autograd hands the backward only what the
# forward received. Each forward op's autograd formula returns, after the gradients of its
# tensors, one None per option (the slopes included: they get no gradient, as in FlashAttention).
_OPTION_COUNT = 9


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, mask: int, precision: int,
         num_threads: int, deterministic: bool = False, window_left: int = -1,
         window_right: int = -1, softcap: float = 0.0,
         alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("fwd", q, k, v, softmax_scale, mask, precision, num_threads, deterministic,
                    window_left, window_right, softcap, alibi_slopes)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    out = torch.empty_like(q)
    lse = _lse_like(q, q.shape[:3])
    _call_fwd(q, k, v, out, lse, softmax_scale, mask, precision, num_threads, deterministic,
              window_left, window_right, softcap, alibi_slopes)
    return out, lse


_fwd = torch.library.custom_op("flashattn::fwd", _fwd_impl, mutates_args=())


@_fwd.register_fake
def _(q, k, v, softmax_scale, mask, precision, num_threads, deterministic=False, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), _lse_like(q, q.shape[:3])


def _grads(dout, q, k, v, out, lse, options, bshd):
    """dq, dk, dv of the unpacked ops, [B, H, S, D] or (bshd) [B, S, H, D] alike: laid out as q,
    k and v."""
    dout, q, k, v = _unit_last(dout), _unit_last(q), _unit_last(k), _unit_last(v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call_bwd(dout, q, k, v, out, lse, dq, dk, dv, *options, bshd=bshd)
    return dq, dk, dv


def _bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         softmax_scale: float, mask: int, precision: int, num_threads: int,
         deterministic: bool = False, window_left: int = -1, window_right: int = -1,
         softcap: float = 0.0,
         alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("bwd", dout, q, k, v, out, lse, softmax_scale, mask, precision, num_threads,
                    deterministic, window_left, window_right, softcap, alibi_slopes)
    return _grads(dout, q, k, v, out, lse, (softmax_scale, mask, precision, num_threads, deterministic,
                                            window_left, window_right, softcap, alibi_slopes), False)


_bwd = torch.library.custom_op("flashattn::bwd", _bwd_impl, mutates_args=())


@_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, mask, precision, num_threads, deterministic=False,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, tensors, options, output):
    """Saves the op's tensors, its (out, lse) and the ALiBi slopes (the last option) for the
    backward; the other options ride along as plain values. The dispatcher fills in defaults, so
    every option is there."""
    out, lse = output
    *scalars, slopes = options
    ctx.save_for_backward(*tensors, out, lse, slopes)
    ctx.args = tuple(scalars)
    ctx.mark_non_differentiable(lse)


def _fwd_setup(ctx, inputs, output):
    _save(ctx, inputs[:3], inputs[3:], output)


def _unpacked_formula(bwd_name):
    """The autograd formula of an unpacked forward op (fwd, bshd_fwd): its backward op on the saved
    q, k, v, out, lse and options."""
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        dq, dk, dv = _op(ctx, bwd_name)(dout, q, k, v, out, lse, *ctx.args, slopes)
        return (dq, dk, dv) + (None,) * _OPTION_COUNT
    return backward


_fwd_backward = _unpacked_formula("bwd")


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ---- packed FlashAttention layouts: qkv [B, S, 3, H, D], kv [B, S, 2, Hkv, D] ---------------------


def _empty_bshd_like(t: Tensor, b, s, h, d) -> Tensor:
    return torch.empty((b, s, h, d), dtype=t.dtype, device=t.device)


def _qkvpacked_fwd_impl(qkv: Tensor, softmax_scale: float, mask: int, precision: int,
                   num_threads: int, deterministic: bool = False, window_left: int = -1,
                   window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("qkvpacked_fwd", qkv, softmax_scale, mask, precision, num_threads,
                    deterministic, window_left, window_right, softcap, alibi_slopes)
    qkv = _unit_last(qkv)
    b, s, _, h, d = qkv.shape
    out = _empty_bshd_like(qkv, b, s, h, d)
    lse = _lse_like(qkv, (b, h, s))
    _call_fwd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, lse, softmax_scale, mask, precision,
              num_threads, deterministic, window_left, window_right, softcap, alibi_slopes,
              bshd=True)
    return out, lse


_qkvpacked_fwd = torch.library.custom_op("flashattn::qkvpacked_fwd", _qkvpacked_fwd_impl, mutates_args=())


@_qkvpacked_fwd.register_fake
def _(qkv, softmax_scale, mask, precision, num_threads, deterministic=False, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None):
    b, s, _, h, d = qkv.shape
    return _empty_bshd_like(qkv, b, s, h, d), _lse_like(qkv, (b, h, s))


def _qkvpacked_bwd_impl(dout: Tensor, qkv: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
                   mask: int, precision: int, num_threads: int, deterministic: bool = False,
                   window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: Optional[Tensor] = None) -> Tensor:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("qkvpacked_bwd", dout, qkv, out, lse, softmax_scale, mask, precision,
                    num_threads, deterministic, window_left, window_right, softcap, alibi_slopes)
    dout, qkv = _unit_last(dout), _unit_last(qkv)
    dqkv = torch.empty_like(qkv)
    # dq, dk and dv are interleaved, non-overlapping views of the one packed buffer.
    _call_bwd(dout, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out, lse, dqkv[:, :, 0],
              dqkv[:, :, 1], dqkv[:, :, 2], softmax_scale, mask, precision, num_threads,
              deterministic, window_left, window_right, softcap, alibi_slopes, bshd=True)
    return dqkv


_qkvpacked_bwd = torch.library.custom_op("flashattn::qkvpacked_bwd", _qkvpacked_bwd_impl, mutates_args=())


@_qkvpacked_bwd.register_fake
def _(dout, qkv, out, lse, softmax_scale, mask, precision, num_threads, deterministic=False,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(qkv)


def _qkvpacked_setup(ctx, inputs, output):
    _save(ctx, inputs[:1], inputs[1:], output)


def _qkvpacked_backward(ctx, dout, dlse):
    qkv, out, lse, slopes = ctx.saved_tensors
    dqkv = _op(ctx, "qkvpacked_bwd")(dout, qkv, out, lse, *ctx.args, slopes)
    return (dqkv,) + (None,) * _OPTION_COUNT


_qkvpacked_fwd.register_autograd(_qkvpacked_backward, setup_context=_qkvpacked_setup)


def _kvpacked_fwd_impl(q: Tensor, kv: Tensor, softmax_scale: float, mask: int, precision: int,
                  num_threads: int, deterministic: bool = False, window_left: int = -1,
                  window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("kvpacked_fwd", q, kv, softmax_scale, mask, precision, num_threads,
                    deterministic, window_left, window_right, softcap, alibi_slopes)
    q, kv = _unit_last(q), _unit_last(kv)
    b, s, h, d = q.shape
    out = _empty_bshd_like(q, b, s, h, d)
    lse = _lse_like(q, (b, h, s))
    _call_fwd(q, kv[:, :, 0], kv[:, :, 1], out, lse, softmax_scale, mask, precision, num_threads,
              deterministic, window_left, window_right, softcap, alibi_slopes, bshd=True)
    return out, lse


_kvpacked_fwd = torch.library.custom_op("flashattn::kvpacked_fwd", _kvpacked_fwd_impl, mutates_args=())


@_kvpacked_fwd.register_fake
def _(q, kv, softmax_scale, mask, precision, num_threads, deterministic=False, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None):
    b, s, h, d = q.shape
    return _empty_bshd_like(q, b, s, h, d), _lse_like(q, (b, h, s))


def _kvpacked_bwd_impl(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor,
                  softmax_scale: float, mask: int, precision: int, num_threads: int,
                  deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                  softcap: float = 0.0,
                  alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("kvpacked_bwd", dout, q, kv, out, lse, softmax_scale, mask, precision,
                    num_threads, deterministic, window_left, window_right, softcap, alibi_slopes)
    dout, q, kv = _unit_last(dout), _unit_last(q), _unit_last(kv)
    dq, dkv = torch.empty_like(q), torch.empty_like(kv)
    _call_bwd(dout, q, kv[:, :, 0], kv[:, :, 1], out, lse, dq, dkv[:, :, 0], dkv[:, :, 1],
              softmax_scale, mask, precision, num_threads, deterministic, window_left,
              window_right, softcap, alibi_slopes, bshd=True)
    return dq, dkv


_kvpacked_bwd = torch.library.custom_op("flashattn::kvpacked_bwd", _kvpacked_bwd_impl, mutates_args=())


@_kvpacked_bwd.register_fake
def _(dout, q, kv, out, lse, softmax_scale, mask, precision, num_threads, deterministic=False,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(kv)


def _kvpacked_setup(ctx, inputs, output):
    _save(ctx, inputs[:2], inputs[2:], output)


def _kvpacked_backward(ctx, dout, dlse):
    q, kv, out, lse, slopes = ctx.saved_tensors
    dq, dkv = _op(ctx, "kvpacked_bwd")(dout, q, kv, out, lse, *ctx.args, slopes)
    return (dq, dkv) + (None,) * _OPTION_COUNT


_kvpacked_fwd.register_autograd(_kvpacked_backward, setup_context=_kvpacked_setup)


# ---- FlashAttention's unpacked layout: q [B, Sq, Hq, D], k, v [B, Skv, Hkv, D] ------------------
# The same kernels on [B, S, H, D] tensors (the extension reads them as [B, H, S, D]: bshd=True),
# so a flash_attn_func call adds no view nodes to the autograd graph: four transposes outside the
# op (q, k, v in, out back) cost the eager backward four more graph nodes, ~35 us per forward and
# backward on the CPU (torch 2.15), a quarter of what SDPA's whole call costs there.


def _bshd_fwd_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, mask: int, precision: int,
                   num_threads: int, deterministic: bool = False, window_left: int = -1,
                   window_right: int = -1, softcap: float = 0.0,
                   alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("bshd_fwd", q, k, v, softmax_scale, mask, precision, num_threads, deterministic,
                    window_left, window_right, softcap, alibi_slopes)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    b, s, h, d = q.shape
    out = _empty_bshd_like(q, b, s, h, d)
    lse = _lse_like(q, (b, h, s))
    _call_fwd(q, k, v, out, lse, softmax_scale, mask, precision, num_threads, deterministic,
              window_left, window_right, softcap, alibi_slopes, bshd=True)
    return out, lse


_bshd_fwd = torch.library.custom_op("flashattn::bshd_fwd", _bshd_fwd_impl, mutates_args=())


@_bshd_fwd.register_fake
def _(q, k, v, softmax_scale, mask, precision, num_threads, deterministic=False, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None):
    b, s, h, d = q.shape
    return _empty_bshd_like(q, b, s, h, d), _lse_like(q, (b, h, s))


def _bshd_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   softmax_scale: float, mask: int, precision: int, num_threads: int,
                   deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                   softcap: float = 0.0,
                   alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("bshd_bwd", dout, q, k, v, out, lse, softmax_scale, mask, precision,
                    num_threads, deterministic, window_left, window_right, softcap, alibi_slopes)
    return _grads(dout, q, k, v, out, lse, (softmax_scale, mask, precision, num_threads, deterministic,
                                            window_left, window_right, softcap, alibi_slopes), True)


_bshd_bwd = torch.library.custom_op("flashattn::bshd_bwd", _bshd_bwd_impl, mutates_args=())


@_bshd_bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, mask, precision, num_threads, deterministic=False,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_bshd_backward = _unpacked_formula("bshd_bwd")


_bshd_fwd.register_autograd(_bshd_backward, setup_context=_fwd_setup)


# ---- packed variable-length batches: q [total_q, Hq, D], k, v [total_k, Hkv, D] -----------------


# The sequence arguments (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k) come
# right after the tensors, before the options; they get no gradient either.
_VARLEN_ARG_COUNT = 5


def _call_fwd_varlen(q, k, v, out, lse, cu_q, cu_k, used_k, max_q, max_k, scale, mask, precision,
                     num_threads, deterministic, window_left, window_right, softcap,
                     alibi_slopes):
    _with_scratch("fwd_varlen", lambda **kw: _ext.forward_varlen(
        _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), _dl(cu_q), _dl(cu_k), _dl_opt(used_k), max_q, max_k, scale, mask,
        precision, _threads(q, num_threads), _stream(q), deterministic, window_left, window_right, softcap,
        _dl_opt(alibi_slopes), **kw),
        (q, k, v, out, lse, cu_q, cu_k, used_k, alibi_slopes),
        (max_q, max_k, scale, mask, precision, deterministic, window_left, window_right, softcap))


def _call_bwd_varlen(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, used_k, max_q, max_k, scale,
                     mask, precision, num_threads, deterministic, window_left, window_right,
                     softcap, alibi_slopes):
    _with_scratch("bwd_varlen", lambda **kw: _ext.backward_varlen(
        _dl(dout), _dl(q), _dl(k), _dl(v), _dl(out), _dl(lse), _dl(dq), _dl(dk), _dl(dv), _dl(cu_q), _dl(cu_k),
        _dl_opt(used_k), max_q, max_k, scale, mask, precision, _threads(q, num_threads), _stream(q),
        deterministic, window_left, window_right, softcap, _dl_opt(alibi_slopes), **kw),
        (q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k, used_k, alibi_slopes),
        (max_q, max_k, scale, mask, precision, deterministic, window_left, window_right, softcap))


def _packed_lse_like(q: Tensor) -> Tensor:
    return _lse_like(q, (q.shape[1], q.shape[0]))


def _varlen_fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
                softmax_scale: float, mask: int, precision: int, num_threads: int,
                deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                softcap: float = 0.0,
                alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                    max_seqlen_k, softmax_scale, mask, precision, num_threads, deterministic,
                    window_left, window_right, softcap, alibi_slopes)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    out = torch.empty_like(q)
    lse = _packed_lse_like(q)
    _call_fwd_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, mask, precision, num_threads, deterministic,
                     window_left, window_right, softcap, alibi_slopes)
    return out, lse


_varlen_fwd = torch.library.custom_op("flashattn::varlen_fwd", _varlen_fwd_impl, mutates_args=())


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      mask, precision, num_threads, deterministic=False, window_left=-1, window_right=-1,
      softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), _packed_lse_like(q)


def _varlen_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor],
                max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, mask: int,
                precision: int, num_threads: int, deterministic: bool = False,
                window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    if _EAGER_ON:  # (under torch.compile: the C++ op without autograd)
        return _cpp("varlen_bwd", dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    max_seqlen_q, max_seqlen_k, softmax_scale, mask, precision, num_threads,
                    deterministic, window_left, window_right, softcap, alibi_slopes)
    dout, q, k, v = _unit_last(dout), _unit_last(q), _unit_last(k), _unit_last(v)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _call_bwd_varlen(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, mask, precision, num_threads,
                     deterministic, window_left, window_right, softcap, alibi_slopes)
    return dq, dk, dv


_varlen_bwd = torch.library.custom_op("flashattn::varlen_bwd", _varlen_bwd_impl, mutates_args=())


@_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, mask, precision, num_threads, deterministic=False, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    out, lse = output
    q, k, v, cu_q, cu_k, used_k, max_q, max_k, *options = inputs
    *scalars, slopes = options
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_k, slopes)
    ctx.args = (max_q, max_k, *scalars)
    ctx.mark_non_differentiable(lse)


def _varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used_k, slopes = ctx.saved_tensors
    max_q, max_k, *scalars = ctx.args
    dq, dk, dv = _op(ctx, "varlen_bwd")(dout, q, k, v, out, lse, cu_q, cu_k, used_k,
                                                max_q, max_k, *scalars, slopes)
    return (dq, dk, dv) + (None,) * (_VARLEN_ARG_COUNT + _OPTION_COUNT)


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# ---- KV cache (flash_attn_with_kvcache): forward only, appends into the caches in place -----------


def _kvcache_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor],
                  v_new: Optional[Tensor], cache_seqlens: Optional[Tensor],
                  cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                  block_table: Optional[Tensor], rotary_cos: Optional[Tensor],
                  rotary_sin: Optional[Tensor], rotary_interleaved: bool,
                  softmax_scale: Optional[float], mask: str, window_left: int, window_right: int,
                  softcap: float, alibi_slopes: Optional[Tensor],
                  num_threads: int, num_splits: int = 0) -> Tuple[Tensor, Tensor]:
    return _api.forward_kvcache(
        q, k_cache, v_cache, k_new=k_new, v_new=v_new, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        softmax_scale=softmax_scale, mask=mask, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, num_threads=_threads(q, num_threads),
        num_splits=num_splits)


# (The caches are declared mutated whether or not the call appends: a conservative schema.)
_kvcache = torch.library.custom_op("flashattn::kvcache", _kvcache_impl, mutates_args=("k_cache", "v_cache"))


@_kvcache.register_fake
def _(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
      rotary_cos, rotary_sin, rotary_interleaved, softmax_scale, mask, window_left, window_right,
      softcap, alibi_slopes, num_threads, num_splits=0):
    return torch.empty_like(q), _lse_like(q, (q.shape[0], q.shape[2], q.shape[1]))


def kvcache_op(*args):
    """torch.ops.flashattn.kvcache(*args) under torch.compile (traceable, the caches marked as
    mutated); eagerly the implementation itself (no dispatcher, no autograd: not differentiable)."""
    if torch.compiler.is_compiling():
        return torch.ops.flashattn.kvcache(*args)
    return _kvcache_impl(*args)


# ---- eager calls without the dispatcher ---------------------------------------------------------
# The custom ops above are what torch.compile traces. Eagerly, call_op runs the same
# implementation and the same autograd formula through one torch.autograd.Function (or, with no
# gradient wanted, the implementation alone): the custom op's eager path (dispatcher, argument
# defaults, its autograd wrapper) cost ~45 us per forward and backward (CPU, torch 2.15), several
# times what SDPA's whole call costs, and its first call imports torch._dynamo (~2 s).
_IMPLS = {"fwd": _fwd_impl, "bwd": _bwd_impl, "qkvpacked_fwd": _qkvpacked_fwd_impl,
          "qkvpacked_bwd": _qkvpacked_bwd_impl, "kvpacked_fwd": _kvpacked_fwd_impl,
          "kvpacked_bwd": _kvpacked_bwd_impl, "bshd_fwd": _bshd_fwd_impl, "bshd_bwd": _bshd_bwd_impl,
          "varlen_fwd": _varlen_fwd_impl,
          "varlen_bwd": _varlen_bwd_impl}
# forward op -> (setup_context, backward formula), as registered with torch.library above.
_FORMULAS = {"fwd": (_fwd_setup, _fwd_backward), "qkvpacked_fwd": (_qkvpacked_setup, _qkvpacked_backward),
             "kvpacked_fwd": (_kvpacked_setup, _kvpacked_backward), "bshd_fwd": (_fwd_setup, _bshd_backward),
             "varlen_fwd": (_varlen_setup, _varlen_backward)}


def _op(ctx, name):
    """The backward op a formula calls: the implementation itself under _Eager, the custom op
    (traceable) under torch.compile's autograd."""
    return _IMPLS[name] if getattr(ctx, "eager", False) else getattr(torch.ops.flashattn, name)


class _Eager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, *inputs):
        output = _IMPLS[name](*inputs)
        ctx.eager, ctx.op = True, name
        _FORMULAS[name][0](ctx, inputs, output)
        # The lse gets no gradient: without this autograd would fill a zero tensor for it before
        # every backward (an allocation and, on CUDA, a fill kernel).
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None:  # (out unused by the loss: nothing flows back)
            return (None,) * (len(ctx.needs_input_grad))
        return (None,) + tuple(_FORMULAS[ctx.op][1](ctx, dout, dlse))


# ---- the eager ops in C++ (python/src/torch_ops.cpp) --------------------------------------------
# flashattn_eager::fwd / qkvpacked_fwd / kvpacked_fwd / varlen_fwd: the forward ops with their
# autograd node, the output allocations and the library calls in C++ (a Python node alone costs
# about what SDPA's whole call does at small shapes). Built against one torch version, recorded
# in _torch_ops.txt beside it; under another version, without the file, or with
# FLASHATTN_TORCH_OPS=0, the Python path below serves the same calls with the same results.


def _load_eager_ops():
    """{flashattn.torch op name: (the C++ op, its extra arguments before torch_scratch)}, or
    None. The forward ops run eagerly with their C++ autograd node (call_op); under
    torch.compile the custom ops flashattn::* keep their fake implementations and Python
    autograd formulas, and their implementations call these ops (no autograd) too."""
    if os.environ.get("FLASHATTN_TORCH_OPS", "1") == "0":
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        with open(os.path.join(here, "_torch_ops.txt")) as f:
            built_for = f.read().strip()
    except OSError:
        return None
    if built_for != torch.__version__:
        return None
    global _FAST_FORWARD, _FLASH_ENTRY, _ATTENTION_ENTRY
    try:
        # The import loads the library, which registers torch.ops.flashattn_eager.
        from . import _torch_ops
        _FAST_FORWARD = _torch_ops.forward
        _FLASH_ENTRY, _ATTENTION_ENTRY = _torch_ops.flash_attn, _torch_ops.attention
        ops = torch.ops.flashattn_eager
        # fwd and bshd_fwd: one op, the layout ([B, S, H, D] or not) as an argument.
        table = {"fwd": (ops.fwd.default, (False,)), "bshd_fwd": (ops.fwd.default, (True,)),
                 "bwd": (ops.bwd.default, (False,)), "bshd_bwd": (ops.bwd.default, (True,))}
        for name in ("qkvpacked", "kvpacked", "varlen"):
            for part in ("fwd", "bwd"):
                table[f"{name}_{part}"] = (getattr(ops, f"{name}_{part}").default, ())
        return table
    except (ImportError, OSError, RuntimeError, AttributeError):
        _FAST_FORWARD = _FLASH_ENTRY = _ATTENTION_ENTRY = None
        return None


# The C++ ops' direct entry (python/src/torch_fastcall.cpp): forward(kind, *inputs,
# torch_scratch) runs a forward op's Autograd-key work without the dispatcher, which at tiny
# shapes is a third of a call's host time, or returns None where the call needs the dispatcher
# (tensor subclasses, modes, inference mode, autocast, functorch); then call_op calls the op.
_FAST_FORWARD = None
_FAST_KIND = {"fwd": 0, "bshd_fwd": 1, "qkvpacked_fwd": 2, "kvpacked_fwd": 3, "varlen_fwd": 4}
# The public functions' own entries: flash_attn(kind, *data, <the function's arguments>,
# torch_scratch) takes flash_attn_func's (1), flash_attn_qkvpacked_func's (2),
# flash_attn_kvpacked_func's (3) and flash_attn_varlen_func's (4) own arguments, attention(q, k, v,
# <its arguments>,
# torch_scratch) attention()'s, and they return the function's result, or None where the Python
# function must serve the call (arguments that need conversion or raise): the Python glue around
# the op cost ~2.5-3 us of a 6-9 us CPU call. _FAST_FLASH / _FAST_ATTENTION are the entries
# while the eager ops are on, else None.
_FLASH_ENTRY = _ATTENTION_ENTRY = None
_EAGER_OPS = _load_eager_ops()
_EAGER_ON = _EAGER_OPS is not None
_FAST_FLASH, _FAST_ATTENTION = (_FLASH_ENTRY, _ATTENTION_ENTRY) if _EAGER_ON else (None, None)


def _sync_custom_kernels():
    """The custom ops' C++ kernels (CPU, CUDA) on while the eager ops are, with the scratch choice:
    a compiled graph's op calls then run the C++ op's work directly instead of the Python
    implementations above and a second dispatcher trip (python/src/torch_ops.cpp)."""
    if _FLASH_ENTRY is not None:
        from . import _torch_ops
        _torch_ops.set_custom_kernels(_EAGER_ON, _WS_TORCH)


_sync_custom_kernels()


def _cpp(name, *inputs):
    """The C++ op for flashattn.torch's op `name` (its inputs in the same order), through the
    dispatcher: the custom ops' implementations (no autograd) and the eager calls that the direct
    entry declines."""
    op, extra = _EAGER_OPS[name]
    return op(*inputs, *extra, _WS_TORCH)


def eager_ops_available() -> bool:
    """Whether the C++ eager ops were built for this torch and loaded."""
    return _EAGER_OPS is not None


def use_eager_ops(enable: bool = True) -> bool:
    """Eager calls of attention(), attention_varlen() and the flash_attn functions (dense, packed,
    varlen) through the C++ ops (the default where they are available), or (False) through the
    Python autograd path. Returns the previous setting. A setting for the process: it also adds
    or removes the custom ops' C++ kernels in PyTorch's dispatcher, so change it while no other
    thread runs flashattn ops."""
    global _EAGER_ON, _FAST_FLASH, _FAST_ATTENTION
    prev, _EAGER_ON = _EAGER_ON, bool(enable) and _EAGER_OPS is not None
    _FAST_FLASH, _FAST_ATTENTION = (_FLASH_ENTRY, _ATTENTION_ENTRY) if _EAGER_ON else (None, None)
    _sync_custom_kernels()
    return prev


def call_op(name, *inputs):
    """torch.ops.flashattn.<name>(*inputs) with every argument given: the custom op under
    torch.compile; eagerly the C++ op where it is loaded, else the same implementation and
    formula without the dispatcher."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.flashattn, name)(*inputs)
    if _EAGER_ON:
        # The forward ops' direct entry first (eager calls only: the custom ops' implementations
        # call _cpp, below autograd).
        if _FAST_FORWARD is not None:
            kind = _FAST_KIND.get(name)
            if kind is not None:
                r = _FAST_FORWARD(kind, *inputs, _WS_TORCH)
                if r is not None:
                    return r
        return _cpp(name, *inputs)
    if torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in inputs):
        return _Eager.apply(name, *inputs)
    return _IMPLS[name](*inputs)


def index_value(x, name, optional=False):
    """A sequence array for the varlen ops: a torch.Tensor (int32 [B + 1] or [B] on q's device,
    which the library checks), or None where optional."""
    if x is None and optional:
        return None
    if isinstance(x, torch.Tensor):
        return x
    raise TypeError(f"{name}: expected a torch.Tensor (int32), got "
                    f"{type(x).__module__}.{type(x).__qualname__}")


def varlen_values(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k):
    """The varlen ops' sequence arguments, checked, in their order."""
    return (index_value(cu_seqlens_q, "cu_seqlens_q"), index_value(cu_seqlens_k, "cu_seqlens_k"),
            index_value(seqused_k, "seqused_k", optional=True),
            _api.seqlen_value(max_seqlen_q, "max_seqlen_q"),
            _api.seqlen_value(max_seqlen_k, "max_seqlen_k"))


# ---- public API ---------------------------------------------------------------------------------


# The validated options of recent calls (a model calls with the same few every step), here and in
# flash_attn_interface: validating them each time cost ~3 us of attention()'s host time (CPU).
# Keys carry each value's type, so 1 and True are told apart; refusals are never stored.
_CODES_CACHE = {}


def _codes_cached(softmax_scale, mask, precision, num_threads, deterministic, window_size=(-1, -1),
                  softcap=0.0):
    """_codes, remembered by its arguments (validated afresh under torch.compile, and for
    arguments that cannot be keys)."""
    args = (softmax_scale, mask, precision, num_threads, deterministic, window_size, softcap)
    if torch.compiler.is_compiling():
        return _codes(*args)
    try:
        w = tuple(window_size)
        key = (softmax_scale, type(softmax_scale), mask, type(mask), precision, type(precision), num_threads,
               type(num_threads), deterministic, type(deterministic), w, tuple(map(type, w)), softcap,
               type(softcap))
        hit = _CODES_CACHE.get(key)
    except TypeError:  # unhashable or not iterable: validate (and refuse) as usual
        return _codes(*args)
    # (The store is written out as in flash_attn_interface._codes rather than shared through a
    # helper: the call and closure cost ~0.4 us of the ~0.7 this cache takes per call.)
    if hit is None:
        hit = _codes(*args)
        if len(_CODES_CACHE) >= 256:
            _CODES_CACHE.clear()
        _CODES_CACHE[key] = hit
    return hit


def _codes(softmax_scale, mask, precision, num_threads, deterministic, window_size=(-1, -1),
           softcap=0.0):
    """The ops' scalar options, validated, in their order (the slopes follow them)."""
    return (_api.scale_value(softmax_scale), _api.mask_code(mask),
            _api.precision_code(precision), _api.threads_value(num_threads),
            _api.flag_value(deterministic), *_api.window_value(window_size),
            _api.softcap_value(softcap))


def slopes_value(alibi_slopes):
    """None or a torch.Tensor (the ops take a Tensor; float32 [Hq] or [B, Hq] on q's device,
    which the library checks)."""
    if alibi_slopes is None or isinstance(alibi_slopes, torch.Tensor):
        return alibi_slopes
    raise TypeError(f"alibi_slopes: expected a torch.Tensor or None, got "
                    f"{type(alibi_slopes).__module__}.{type(alibi_slopes).__qualname__}")


def _sdpa_names(softmax_scale, mask, is_causal, scale, enable_gqa, q, k):
    """PyTorch SDPA's spellings, mapped onto the library's: is_causal=True is SDPA's causal mask
    (top-left: key j visible to query i when j <= i); scale is softmax_scale; enable_gqa is
    accepted (GQA always works here) and, when False, refuses differing head counts as SDPA does.
    mask="causal" is FlashAttention's causal (bottom-right), the library's default alignment."""
    if scale is not None:
        if softmax_scale is not None:
            raise TypeError("attention(): give softmax_scale or SDPA's scale, not both")
        softmax_scale = scale
    if is_causal is not None:
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__qualname__}")
        if is_causal:
            if mask != "none":
                raise TypeError(f"attention(): is_causal=True and mask={mask!r}: give one of them")
            mask = "causal_top_left"
    if mask == "causal":
        mask = "causal_bottom_right"
    if enable_gqa is False and q.dim() >= 2 and k.dim() >= 2 and q.shape[-3] != k.shape[-3]:
        raise ValueError(f"q has {q.shape[-3]} heads and k {k.shape[-3]}: differing head counts "
                         "need enable_gqa=True (as in scaled_dot_product_attention)")
    return softmax_scale, mask


class _EmptyAttention(torch.autograd.Function):
    """Attention with no query rows or no keys, as scaled_dot_product_attention gives it: an empty
    out (Sq = 0) or zeros (Skv = 0: every row sees no key, lse = -inf), and zero gradients. The
    library takes no zero-size dimension, so these never reach it."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        out = q.new_zeros(q.shape[:-1] + v.shape[-1:])
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _empty_attention(q, k, v):
    """(out, lse) through _EmptyAttention after the shape checks a real call would make, or None
    when neither sequence is empty."""
    try:  # (the common case first: two non-empty sequences; anything odd is the library's to refuse)
        if q.shape[2] != 0 and k.shape[2] != 0:
            return None
    except (AttributeError, IndexError, TypeError):
        return None
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k, v)):
        return None
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or \
            k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q.shape = {tuple(q.shape)}, k.shape = {tuple(k.shape)}, v.shape = "
                         f"{tuple(v.shape)}: expected [B, Hq, Sq, D], [B, Hkv, Skv, D] twice with Hkv "
                         "dividing Hq")
    return _EmptyAttention.apply(q, k, v)


def attention(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale=None, mask="none",
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, precision="fp32",
              num_threads=None, deterministic=False, return_lse=False, is_causal=None,
              scale=None, enable_gqa=None):
    """Differentiable attention on [B, H, S, D] tensors (any strides, e.g. ``x.transpose(1, 2)``
    of a [B, S, H, D] tensor): returns out, or (out, lse) when return_lse.

    Sq = 0 or Skv = 0 give what SDPA gives: an empty out, or zeros (lse = -inf), and zero
    gradients. SDPA's names work too: is_causal=True (SDPA's top-left causal mask), scale (= softmax_scale),
    enable_gqa (GQA always works; False refuses differing head counts as SDPA does); and
    mask="causal" is FlashAttention's causal (bottom-right; equal to top-left when Sq = Skv).

    Arguments as flashattn.forward: window_size=(left, right) is FlashAttention's sliding window
    (-1 = unbounded side), intersected with the mask; softcap > 0 caps the scores with
    softcap * tanh(s / softcap); alibi_slopes is None or a float32 tensor [Hq] or [B, Hq] on q's
    device (no gradient flows to it). deterministic=True makes the backward bitwise reproducible
    (see flashattn.backward). Gradients flow to q, k and v (not through lse). Works under
    torch.compile (custom ops with fake implementations) and on CPU and CUDA tensors; on the CPU
    it uses torch.get_num_threads() threads unless num_threads is given.
    """
    fast = _FAST_ATTENTION
    if fast is not None and not torch.compiler.is_compiling():
        r = fast(q, k, v, softmax_scale, mask, window_size, softcap, alibi_slopes, precision, num_threads,
                 deterministic, return_lse, is_causal, scale, enable_gqa, _WS_TORCH)
        if r is not None:  # (None: arguments the C++ entry leaves to this function)
            return r
    softmax_scale, mask = _sdpa_names(softmax_scale, mask, is_causal, scale, enable_gqa, q, k)
    empty = _empty_attention(q, k, v)
    if empty is not None:  # Sq = 0 or Skv = 0, as SDPA: empty or zero results, zero gradients
        return empty if return_lse else empty[0]
    # (call_op: the custom op under torch.compile, eagerly the same code without the dispatcher.)
    codes = _codes_cached(softmax_scale, mask, precision, num_threads, deterministic, window_size, softcap)
    out, lse = call_op("fwd", q, k, v, *codes, slopes_value(alibi_slopes))
    return (out, lse) if return_lse else out


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, seqused_k=None,
                     softmax_scale=None, mask="none", window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, precision="fp32", num_threads=None, deterministic=False,
                     return_lse=False):
    """Differentiable attention over a packed variable-length batch (flashattn.forward_varlen's
    layouts and arguments): q [total_q, Hq, D], k, v [total_k, Hkv, D], int32 cu_seqlens_q / _k
    [B + 1] and optional seqused_k [B] on q's device. Returns out [total_q, Hq, D], or (out, lse)
    with lse float32 [Hq, total_q] when return_lse. Gradients flow to q, k and v only.
    mask="causal" is FlashAttention's causal (bottom-right per sequence), as in attention()."""
    if mask == "causal":
        mask = "causal_bottom_right"
    out, lse = call_op(
        "varlen_fwd", q, k, v, *varlen_values(cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                max_seqlen_k),
        *_codes(softmax_scale, mask, precision, num_threads, deterministic, window_size, softcap),
        slopes_value(alibi_slopes))
    return (out, lse) if return_lse else out


class FlashAttnFunction(torch.autograd.Function):
    """torch.autograd.Function over the extension (eager mode; use attention() under
    torch.compile). apply(q, k, v, softmax_scale=None, mask="none", precision="fp32",
    num_threads=None, deterministic=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None) -> (out, lse), [B, H, S, D] tensors; lse is not differentiable, nor are
    the slopes."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale=None, mask="none", precision="fp32",
                num_threads=None, deterministic=False, window_size=(-1, -1), softcap=0.0,
                alibi_slopes=None):
        args = _codes(softmax_scale, mask, precision, num_threads, deterministic, window_size,
                      softcap)
        slopes = slopes_value(alibi_slopes)
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        out = torch.empty_like(q)
        lse = _lse_like(q, q.shape[:3])
        _call_fwd(q, k, v, out, lse, *args, slopes)
        ctx.save_for_backward(q, k, v, out, lse, slopes)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, slopes = ctx.saved_tensors
        dout = _unit_last(dout)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_bwd(dout, q, k, v, out, lse, dq, dk, dv, *ctx.args, slopes)
        return (dq, dk, dv) + (None,) * 8
