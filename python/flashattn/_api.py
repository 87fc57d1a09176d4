"""Low-level functions over any DLPack tensor, in the library's logical [B, H, S, D] order
(forward_kvcache: FlashAttention's [B, S, H, D] order, as the C ABI's KV-cache call).

The extension (_ext) only converts DLPack tensors into views and calls the C ABI. This module
decides everything that depends on the caller's framework: how outputs are allocated (with the
input's own framework, so the caller gets its kind of tensor back), which CUDA stream the kernels
are queued on, and how arguments given as Python values map to the ABI's codes.
"""

import math
import numbers
import sys

import numpy as np

from . import _ext

__all__ = ["forward", "backward", "forward_varlen", "backward_varlen", "forward_kvcache", "MASKS",
           "PRECISIONS", "cuda_available", "cuda_take_check_failures", "build_info"]

MASKS = {
    "none": _ext.MASK_NONE,
    "causal_top_left": _ext.MASK_CAUSAL_TOP_LEFT,  # key j visible to query i when j <= i
    "causal_bottom_right": _ext.MASK_CAUSAL_BOTTOM_RIGHT,  # when j <= i + Skv - Sq
}
PRECISIONS = {
    "fp32": _ext.PRECISION_FP32,  # as accurate as plain float32 arithmetic (default)
    "tf32": _ext.PRECISION_TF32,  # CUDA float32 only: TF32 tensor cores, ~1e-3 relative error
}

_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def cuda_available():
    """True when this build has the CUDA backend and a CUDA device is usable."""
    return _ext.cuda_available()


def cuda_take_check_failures(device=0):
    """Graph replays of packed (varlen) or KV-cache calls whose index arrays broke a rule, since the
    last call on this device (the count is then reset). Called eagerly such a call raises
    ValueError and writes nothing; captured into a CUDA graph its check runs at every replay, where
    nothing can raise: the replay writes nothing and is counted here. Waits for the device."""
    return _ext.cuda_take_check_failures(int(device))


def build_info():
    """Backends, CPU features and kernels of the loaded libflashattn."""
    return _ext.build_info()


# ---- argument codes -----------------------------------------------------------------------------


def _code(name, value, table):
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(
        f"{name} = {value!r} is unknown; expected one of "
        + ", ".join(repr(k) for k in table)
    )


def mask_code(mask):
    return _code("mask", mask, MASKS)


def precision_code(precision):
    return _code("precision", precision, PRECISIONS)


def scale_value(softmax_scale):
    """None -> 0.0, which the library reads as 1/sqrt(head_dim)."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    if scale == 0.0:
        # 0 is the ABI's "default" marker: passing it through would silently mean 1/sqrt(D).
        raise ValueError("softmax_scale = 0 is not supported (None means 1/sqrt(head_dim))")
    if np.float32(scale) == 0.0:
        # The library takes the scale as float32: one that rounds to 0 there would also read as
        # the default.
        raise ValueError(f"softmax_scale = {scale!r} rounds to 0 in float32 (None means 1/sqrt(head_dim))")
    return scale


def flag_value(value, name="deterministic"):
    """A flag (deterministic, rotary_interleaved) as a bool. Only bools and integers are taken:
    the string "false" or a tensor would otherwise read as True."""
    if isinstance(value, (bool, int, np.bool_, np.integer)):
        return bool(value)
    raise TypeError(f"{name} = {value!r} is not a bool")


def _is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def window_value(window_size):
    """window_size = (left, right) as two Python ints. Key j is visible to query i when
    i + Skv - Sq - left <= j <= i + Skv - Sq + right; -1 leaves a side unbounded, so (-1, -1)
    (the default) is no window."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size = {window_size!r} is not a pair (left, right) of ints "
                        "(-1 for an unbounded side)") from None
    if not (_is_int(left) and _is_int(right)):
        raise TypeError(f"window_size = {window_size!r}: left and right must be ints, got "
                        f"{type(left).__name__} and {type(right).__name__}")
    left, right = int(left), int(right)
    for side, w in (("left", left), ("right", right)):
        if w < -1:
            raise ValueError(f"window_size = {(left, right)}: {side} = {w} is invalid (a window "
                             "side is >= 0, or -1 for unbounded)")
        if w >= 2**63:
            raise ValueError(f"window_size = {(left, right)}: {side} = {w} does not fit in int64")
    return left, right


_FLOAT32_OVERFLOW = (2.0 - 2.0**-24) * 2.0**127


def softcap_value(softcap):
    """softcap as a float: 0 means none; else finite and > 0, representable in float32 (the C
    ABI's type) without rounding to 0 or overflowing."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap = {softcap!r} is not a real number (0.0 means no softcap)")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0.0:
        raise ValueError(f"softcap = {cap!r} is invalid (0.0 for none, or a finite value > 0)")
    # Plain float comparisons (no NumPy): torch.compile traces this. Below 2^-150 a value rounds
    # to 0 in float32; from the midpoint between FLT_MAX and 2^128 on, to inf.
    if cap != 0.0 and not (2.0**-150 < cap < _FLOAT32_OVERFLOW):
        raise ValueError(f"softcap = {cap!r} is not representable in float32 (the library's type)")
    return cap


def threads_value(num_threads):
    if num_threads is None:
        return 0
    n = int(num_threads)
    if n < 0:
        raise ValueError(f"num_threads = {n} is negative (None or 0 means all hardware threads)")
    return n


# ---- frameworks ---------------------------------------------------------------------------------


def _module_if_loaded(name):
    # Only frameworks the caller already imported can own its tensors: never import one here.
    return sys.modules.get(name)


def framework(x, name="tensor"):
    """'torch', 'numpy', 'cupy', 'jax' or 'dlpack' (any other object with __dlpack__)."""
    torch = _module_if_loaded("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    if isinstance(x, np.ndarray):
        return "numpy"
    cupy = _module_if_loaded("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    jax = _module_if_loaded("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "dlpack"
    raise TypeError(
        f"{name}: expected a tensor that supports DLPack (NumPy, PyTorch, CuPy, JAX, ...), "
        f"got {type(x).__module__}.{type(x).__qualname__}"
    )


def _ndim(x):
    nd = getattr(x, "ndim", None)
    return nd if nd is not None else len(x.shape)


def _is_cuda(x, fw):
    if fw == "torch":
        return x.is_cuda
    if fw == "numpy":
        return False
    if fw == "cupy":
        return True
    dev_type, _ = x.__dlpack_device__()
    return dev_type in _DLPACK_CUDA


def torch_stream(t):
    """The handle of PyTorch's current stream on the device of torch tensor t (0 on the CPU),
    without building a torch.cuda.Stream object (a few microseconds per call) where this torch
    has the raw accessor."""
    if not t.is_cuda:
        return 0
    torch = _module_if_loaded("torch")
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(t.get_device()) if raw is not None else torch.cuda.current_stream(t.device).cuda_stream


class _Launch:
    """Where and how one call runs: the stream, and how outputs are allocated and returned.

    Outputs are allocated by the framework that owns q (numpy.empty_like, torch.empty_like,
    cupy.empty_like), laid out like the tensor they mirror. JAX arrays are immutable and a bare
    DLPack producer has no allocator we know, so for those the outputs are allocated by a
    "host" framework (NumPy on the CPU; CuPy, else PyTorch, on CUDA) over a zero-copy DLPack
    view of the input, and JAX callers get JAX arrays back.
    """

    def __init__(self, q):
        self.fw = framework(q, "q")
        self.cuda = _is_cuda(q, self.fw)
        self.stream = 0  # NULL: the legacy default stream
        self.host = self.fw
        if self.fw == "torch":
            if self.cuda:
                # Queue the kernels behind whatever PyTorch queued on its current stream.
                self.stream = torch_stream(q)
        elif self.fw == "cupy":
            import cupy

            self.stream = cupy.cuda.get_current_stream().ptr
        elif self.fw in ("jax", "dlpack"):
            if not self.cuda:
                self.host = "numpy"
            elif _try_import("cupy"):
                self.host = "cupy"
            elif _try_import("torch"):
                self.host = "torch"
            else:
                raise TypeError(
                    "flashattn needs CuPy or PyTorch to allocate CUDA outputs for "
                    f"{type(q).__module__}.{type(q).__qualname__} inputs"
                )

    def arg(self, x):
        """An input as handed to the extension."""
        if self.fw == "torch":
            # A DLPack capsule, which the extension takes as it is: Tensor.__dlpack__ (Python
            # code) costs ~2.3 us per tensor, to_dlpack ~0.23 us, and takes tensors that require
            # grad (the kernels record no autograd history; flashattn.torch provides the
            # differentiable versions).
            torch = _module_if_loaded("torch")
            return torch.utils.dlpack.to_dlpack(x) if isinstance(x, torch.Tensor) else x
        if self.fw == "jax" and hasattr(x, "block_until_ready"):
            x.block_until_ready()  # JAX dispatches asynchronously, on the CPU too
        return x

    def view(self, x):
        if self.host == self.fw:
            return x
        if self.host == "numpy":
            return np.from_dlpack(self.arg(x))
        if self.host == "cupy":
            import cupy

            return cupy.from_dlpack(self.arg(x))
        import torch

        return torch.from_dlpack(self.arg(x))

    def empty_like(self, x):
        """An output with x's shape, dtype and device, laid out like x where possible."""
        x = self.view(x)
        if self.host == "torch":
            import torch

            return torch.empty_like(x, memory_format=torch.preserve_format)
        if self.host == "numpy":
            return np.empty_like(x, order="K")
        import cupy

        with x.device:
            return cupy.empty_like(x, order="K")

    def empty_lse(self, q, shape=None):
        """float32 [B, H, Sq] (or the given shape) on q's device."""
        q = self.view(q)
        shape = tuple(q.shape[:3]) if shape is None else tuple(shape)
        if self.host == "torch":
            import torch

            return torch.empty(shape, dtype=torch.float32, device=q.device)
        if self.host == "numpy":
            return np.empty(shape, dtype=np.float32)
        import cupy

        with q.device:
            return cupy.empty(shape, dtype=cupy.float32)

    def result(self, x, allocated):
        """Hands an allocated output back as the caller's kind of tensor."""
        if not allocated or self.fw != "jax":
            return x
        import jax

        if self.cuda:
            # JAX reads the buffer on its own stream: the kernels must be done by then.
            if self.host == "cupy":
                import cupy

                cupy.cuda.get_current_stream().synchronize()
            else:
                import torch

                torch.cuda.synchronize(x.device)
        return jax.dlpack.from_dlpack(x)

    def check_output(self, x, name):
        if x is None:
            return
        if framework(x, name) == "jax":
            raise TypeError(
                f"{name}: JAX arrays are immutable and cannot be written in place; "
                f"omit {name}= and use the returned array"
            )


def _try_import(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def _check_ndim(x, name, want):
    nd = _ndim(x)
    if nd != want:
        layout = "[B, H, S, D]" if want == 4 else "[B, H, Sq]"
        raise ValueError(f"{name}.ndim = {nd}, expected {want} ({layout})")


def slopes_arg(alibi_slopes):
    """The ALiBi slopes as handed to the extension: None, or a DLPack tensor (float32 [Hq] or
    [B, Hq] on q's device: checked by the library). They get no gradient."""
    if alibi_slopes is None:
        return None
    fw = framework(alibi_slopes, "alibi_slopes")
    if fw == "torch":
        return _module_if_loaded("torch").utils.dlpack.to_dlpack(alibi_slopes)  # as _Launch.arg
    if fw == "jax" and hasattr(alibi_slopes, "block_until_ready"):
        alibi_slopes.block_until_ready()
    return alibi_slopes


# ---- public functions ---------------------------------------------------------------------------


def _call_options(launch, softmax_scale, mask, window_size, softcap, alibi_slopes, precision,
                  num_threads, deterministic):
    """The extension's arguments after the tensors (and sequence arrays), in its order, each
    validated (in the order the errors are documented to come: scale, mask, window, softcap,
    precision, threads, deterministic, slopes), shared by the dense and varlen calls."""
    scale, mask_c = scale_value(softmax_scale), mask_code(mask)
    (wl, wr), cap = window_value(window_size), softcap_value(softcap)
    prec, nthreads = precision_code(precision), threads_value(num_threads)
    det = flag_value(deterministic)
    slopes = slopes_arg(alibi_slopes)
    return scale, mask_c, prec, nthreads, launch.stream, det, wl, wr, cap, slopes


def forward(q, k, v, *, softmax_scale=None, mask="none", window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, out=None, lse=None, precision="fp32", num_threads=None,
            deterministic=False):
    """Attention forward in the logical [B, H, S, D] order: returns (out, lse).

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Skv, D] with Hkv dividing Hq (GQA: query head h reads kv
    head h // (Hq // Hkv)); any strides with a unit head_dim stride, so a [B, S, H, D] tensor
    passed as ``x.transpose(1, 2)`` (or numpy's ``x.transpose(0, 2, 1, 3)``) needs no copy.
    Any DLPack tensor works (NumPy, PyTorch CPU/CUDA, CuPy, JAX); outputs come back as the same
    kind of tensor, on the same device.

    softmax_scale: None means 1/sqrt(D). mask: "none", "causal_top_left" (key j visible to
    query i when j <= i) or "causal_bottom_right" (j <= i + Skv - Sq, FlashAttention's causal).
    window_size: (left, right), FlashAttention's sliding window: key j is visible to query i
    when i + Skv - Sq - left <= j <= i + Skv - Sq + right; -1 leaves a side unbounded, (-1, -1)
    is no window; intersected with the mask. softcap: 0.0 for none, else c > 0 turns each score
    s = softmax_scale * q.k into c * tanh(s / c) before the softmax. alibi_slopes: None, or a
    float32 tensor [Hq] or [B, Hq] on q's device (any DLPack tensor) adding
    -slope[b, h] * |i + Skv - Sq - j| to each (softcapped) score; the slopes get no gradient.
    out: [B, Hq, Sq, D] like q (allocated, laid out like q, when None); lse: [B, Hq, Sq] float32,
    the natural log of each row's softmax denominator (-inf for a row that sees no key).
    precision: "fp32" (default) or "tf32" (CUDA float32 only). num_threads: CPU threads
    (None: all hardware threads; results do not depend on it). deterministic: see backward()
    (accepted here so that one set of options serves both passes; the forward is always
    deterministic).

    Runs on PyTorch's current CUDA stream for torch CUDA tensors (CuPy's current stream for
    CuPy arrays). Raises ValueError for invalid arguments, TypeError for dtypes flashattn never
    takes or that do not match, NotImplementedError for valid calls this build or device cannot
    serve (float64 on CUDA, head_dim > 256, ...), RuntimeError for backend failures; messages
    are the library's.
    """
    launch = _Launch(q)
    _check_ndim(launch.view(q), "q", 4)
    launch.check_output(out, "out")
    launch.check_output(lse, "lse")
    opts = _call_options(launch, softmax_scale, mask, window_size, softcap, alibi_slopes,
                         precision, num_threads, deterministic)
    out_alloc, lse_alloc = out is None, lse is None
    if out_alloc:
        out = launch.empty_like(q)
    if lse_alloc:
        lse = launch.empty_lse(q)
    _ext.forward(launch.arg(q), launch.arg(k), launch.arg(v), launch.arg(out), launch.arg(lse),
                 *opts)
    return launch.result(out, out_alloc), launch.result(lse, lse_alloc)


def backward(dout, q, k, v, out, lse, *, softmax_scale=None, mask="none", window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, dq=None, dk=None, dv=None, precision="fp32",
             num_threads=None, deterministic=False):
    """Attention backward: returns (dq, dk, dv) from dout, the forward's inputs and its (out, lse).

    Shapes as in forward(); dq is laid out like q, dk like k, dv like v when allocated. dk and dv
    are summed over the query heads that share a kv head (GQA). softmax_scale, mask, window_size,
    softcap, alibi_slopes and precision must be the forward's (the slopes get no gradient).
    Outputs may be non-overlapping interleaved views of one buffer (e.g. the q, k and v slices of
    a packed gradient); they must not overlap the inputs (the slopes included).

    deterministic=True asks for bitwise-reproducible gradients. The CPU and CUDA float32 always
    give them; CUDA float16/bfloat16 by default accumulate dq with float atomics (faster, with a
    run-to-run order) and with deterministic=True use separate dq and dk/dv passes instead.
    """
    launch = _Launch(q)
    _check_ndim(launch.view(q), "q", 4)
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        launch.check_output(x, name)
    opts = _call_options(launch, softmax_scale, mask, window_size, softcap, alibi_slopes,
                         precision, num_threads, deterministic)
    allocated = (dq is None, dk is None, dv is None)
    dq, dk, dv = (launch.empty_like(x) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv)))
    a = launch.arg
    _ext.backward(a(dout), a(q), a(k), a(v), a(out), a(lse), a(dq), a(dk), a(dv),
                  *opts)
    return tuple(launch.result(x, al) for x, al in zip((dq, dk, dv), allocated))


# ---- packed variable-length batches -------------------------------------------------------------


def seqlen_value(value, name):
    """max_seqlen_q / _k as a Python int (the library checks >= 1 and every sequence against it)."""
    if not _is_int(value):
        raise TypeError(f"{name} = {value!r} is not an int")
    value = int(value)
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} = {value} does not fit in int64")
    return value


def _index_arg(launch, x, name):
    # The sequence arrays are read by the library (int32, 1-D, on q's device: checked there).
    if x is None:
        return None
    framework(x, name)
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()
    return x


def _varlen_args(launch, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k):
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise TypeError("cu_seqlens_q and cu_seqlens_k are required (int32 [batch + 1])")
    return (_index_arg(launch, cu_seqlens_q, "cu_seqlens_q"),
            _index_arg(launch, cu_seqlens_k, "cu_seqlens_k"),
            _index_arg(launch, seqused_k, "seqused_k"),
            seqlen_value(max_seqlen_q, "max_seqlen_q"), seqlen_value(max_seqlen_k, "max_seqlen_k"))


def _check_packed(launch, q):
    nd = _ndim(launch.view(q))
    if nd != 3:
        raise ValueError(f"q.ndim = {nd}, expected 3 for a varlen call ([total_q, Hq, D])")


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   seqused_k=None, softmax_scale=None, mask="none", window_size=(-1, -1),
                   softcap=0.0, alibi_slopes=None, out=None, lse=None, precision="fp32",
                   num_threads=None, deterministic=False):
    """Attention over a packed batch of variable-length sequences (FlashAttention's varlen
    layout): returns (out, lse).

    q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; sequence b owns query rows
    [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1])
    and attends only within itself. cu_seqlens_q / _k: int32 [B + 1] on q's device, prefix sums
    from 0 ending at total_q / total_k (zero-length sequences allowed). max_seqlen_q / _k: ints
    bounding every sequence's length. seqused_k: None, or int32 [B]: only the first seqused_k[b]
    keys of sequence b are attended.

    Every option is forward()'s, applied per sequence with that sequence's own Sq and Skv (the
    bottom-right causal mask, the window band and the ALiBi distance). out: [total_q, Hq, D] like
    q; lse: float32 [Hq, total_q] (-inf for a row that sees no key). The sequence arrays are
    checked before anything is written: on the host when they are host memory; on CUDA by a small
    kernel ahead of the call's kernels, which then write nothing if it fails - the call returns
    (or raises the same error) once that check has run, without stopping the GPU.
    """
    launch = _Launch(q)
    _check_packed(launch, q)
    launch.check_output(out, "out")
    launch.check_output(lse, "lse")
    idx = _varlen_args(launch, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    opts = _call_options(launch, softmax_scale, mask, window_size, softcap, alibi_slopes,
                         precision, num_threads, deterministic)
    out_alloc, lse_alloc = out is None, lse is None
    if out_alloc:
        out = launch.empty_like(q)
    if lse_alloc:
        qv = launch.view(q)
        lse = launch.empty_lse(q, (qv.shape[1], qv.shape[0]))
    _ext.forward_varlen(launch.arg(q), launch.arg(k), launch.arg(v), launch.arg(out),
                        launch.arg(lse), *idx, *opts)
    return launch.result(out, out_alloc), launch.result(lse, lse_alloc)


def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, *, seqused_k=None, softmax_scale=None, mask="none",
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dq=None, dk=None,
                    dv=None, precision="fp32", num_threads=None, deterministic=False):
    """Backward of forward_varlen(): returns (dq, dk, dv) ([total_q, Hq, D], [total_k, Hkv, D]
    twice). The sequence arrays and every option must be the forward's; the rest as backward()."""
    launch = _Launch(q)
    _check_packed(launch, q)
    for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
        launch.check_output(x, name)
    idx = _varlen_args(launch, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k)
    opts = _call_options(launch, softmax_scale, mask, window_size, softcap, alibi_slopes,
                         precision, num_threads, deterministic)
    allocated = (dq is None, dk is None, dv is None)
    dq, dk, dv = (launch.empty_like(x) if g is None else g for x, g in ((q, dq), (k, dk), (v, dv)))
    a = launch.arg
    _ext.backward_varlen(a(dout), a(q), a(k), a(v), a(out), a(lse), a(dq), a(dk), a(dv), *idx,
                         *opts)
    return tuple(launch.result(x, al) for x, al in zip((dq, dk, dv), allocated))


# ---- KV cache (decoding, chunked prefill) -------------------------------------------------------


def forward_kvcache(q, k_cache, v_cache, *, k_new=None, v_new=None, cache_seqlens=None,
                    cache_batch_idx=None, cache_leftpad=None, block_table=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved=True, softmax_scale=None, mask="none",
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, out=None, lse=None,
                    precision="fp32", num_threads=None, num_splits=0):
    """Attention against a key/value cache (FlashAttention's flash_attn_with_kvcache), forward
    only: returns (out, lse). Layouts are FlashAttention's [B, S, H, D] order (not forward()'s
    [B, H, S, D]), any strides with a unit head_dim stride:

    q: [B, Sq, Hq, D]; k_cache, v_cache: [B_cache, S_cache, Hkv, D] with B_cache >= B, or, with a
    block_table, pages [num_blocks, block_size, Hkv, D] (block_size a multiple of 16);
    k_new, v_new: None, or [B, S_new, Hkv, D], written into cache rows
    [cache_seqlens[b], cache_seqlens[b] + S_new) of sequence b *in place* (k_new rotated when
    the rotary tables are given) before attending; the caches must be writable then.
    cache_seqlens: int32 [B], the valid rows of each sequence's cache before the append (None:
    the whole cache is valid, and nothing can be appended). cache_batch_idx: int32 [B], the cache
    row of each sequence (default b; without repeats when appending). cache_leftpad: int32 [B],
    the first valid row (keys before it are not attended). block_table: int32 [B, max_blocks],
    the pages of each sequence (row r in page block_table[b, r // block_size]); not with
    cache_batch_idx or cache_leftpad. rotary_cos / rotary_sin: None, or [S_ro, rotary_dim / 2]
    in q's dtype: the rotary embedding of q and k_new (GPT-J pairs when rotary_interleaved, else
    GPT-NeoX halves); new key j sits at position cache_seqlens[b] + j, query row i at
    cache_seqlens[b] + i under a causal mask or a window, else at cache_seqlens[b]. All on q's
    device; their contents are checked before anything is written (on CUDA with cache_seqlens in
    device memory by a kernel on the stream; captured into a CUDA graph, a replay with broken
    arrays writes nothing and is counted: cuda_take_check_failures).

    Sequence b attends Sk_b = cache_seqlens[b] + S_new - cache_leftpad[b] keys, with forward()'s
    softmax_scale, mask (FlashAttention's causal is "causal_bottom_right"), window_size, softcap
    and alibi_slopes relative to that Sk_b. out: [B, Sq, Hq, D] like q (allocated when None); lse:
    float32 [B, Hq, Sq]. num_splits: on CUDA, CTAs per (sequence, kv head) along the cache
    (split-KV: 0 the library's choice, 1 none, up to 128); the CPU ignores it. Errors as
    forward(); CUDA serves float16/bfloat16 (float32 raises NotImplementedError there).
    """
    launch = _Launch(q)
    nd = _ndim(launch.view(q))
    if nd != 4:
        raise ValueError(f"q.ndim = {nd}, expected 4 ([B, Sq, Hq, D])")
    launch.check_output(out, "out")
    launch.check_output(lse, "lse")
    if k_new is not None:
        # The append writes into the caches.
        launch.check_output(k_cache, "k_cache")
        launch.check_output(v_cache, "v_cache")
    idx = [_index_arg(launch, x, name) for x, name in (
        (cache_seqlens, "cache_seqlens"), (cache_batch_idx, "cache_batch_idx"),
        (cache_leftpad, "cache_leftpad"), (block_table, "block_table"))]
    interleaved = flag_value(rotary_interleaved, "rotary_interleaved")
    opts = _call_options(launch, softmax_scale, mask, window_size, softcap, alibi_slopes,
                         precision, num_threads, False)
    out_alloc, lse_alloc = out is None, lse is None
    if out_alloc:
        out = launch.empty_like(q)
    if lse_alloc:
        qv = launch.view(q)
        lse = launch.empty_lse(q, (qv.shape[0], qv.shape[2], qv.shape[1]))
    a = launch.arg
    k_new, v_new, rotary_cos, rotary_sin = (None if x is None else a(x)
                                            for x in (k_new, v_new, rotary_cos, rotary_sin))
    _ext.forward_kvcache(a(q), a(k_cache), a(v_cache), a(out), a(lse), k_new, v_new, *idx,
                         rotary_cos, rotary_sin, interleaved, *opts, num_splits=int(num_splits))
    return launch.result(out, out_alloc), launch.result(lse, lse_alloc)
