"""ctypes bindings of flashattn's C ABI (include/flashattn/flashattn.h) for the benchmark and
profiling scripts that call the library on torch tensors' memory without the Python package
(bench/gpu.py: --via ctypes and --suite fp32; ab_cuda_fp32.py, kernel_times.py, profile_case.py): flashattn_tensor,
flashattn_options (struct_size versioning) and the forward/backward calls. Options travel as the
tuple (mask, precision, deterministic[, mods]) where mods is a dict with any of window=(left,
right), softcap=float, alibi=a float32 CUDA tensor of slopes; the stream is torch's current one
on the tensors' device."""
import ctypes
import os

MASK_NONE, MASK_CAUSAL_TOP_LEFT, MASK_CAUSAL_BOTTOM_RIGHT = 0, 1, 2


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * 4),
                ("stride", ctypes.c_int64 * 4)]


class Options(ctypes.Structure):
    # include/flashattn/flashattn.h; struct_size tells the library which fields we have.
    _fields_ = [("struct_size", ctypes.c_uint32), ("softmax_scale", ctypes.c_float),
                ("mask", ctypes.c_int32), ("stream", ctypes.c_void_p),
                ("num_threads", ctypes.c_int32), ("precision", ctypes.c_int32),
                ("deterministic", ctypes.c_int32), ("reserved0", ctypes.c_int32),
                ("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64),
                ("softcap", ctypes.c_float), ("sliding_window", ctypes.c_int32),
                ("alibi_slopes", ctypes.POINTER(Tensor))]


class Varlen(ctypes.Structure):
    # flashattn_varlen (include/flashattn/flashattn.h)
    _fields_ = [("struct_size", ctypes.c_uint32), ("cu_seqlens_q", ctypes.POINTER(Tensor)),
                ("cu_seqlens_k", ctypes.POINTER(Tensor)), ("seqused_k", ctypes.POINTER(Tensor)),
                ("max_seqlen_q", ctypes.c_int64), ("max_seqlen_k", ctypes.c_int64)]


class KvCache(ctypes.Structure):
    # flashattn_kvcache (include/flashattn/flashattn.h)
    _fields_ = [("struct_size", ctypes.c_uint32)] + [
        (n, ctypes.POINTER(Tensor)) for n in ("k_new", "v_new", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
                                              "block_table", "rotary_cos", "rotary_sin")] + [
        ("rotary_interleaved", ctypes.c_int32), ("num_splits", ctypes.c_int32)]


class CtypesLib:
    """The C ABI of one libflashattn, on torch tensors (device pointers, torch's stream)."""

    UNSUPPORTED = 2

    def __init__(self, path, torch):
        self.path = path
        self.torch = torch
        self.lib = ctypes.CDLL(path)
        self.lib.flashattn_last_error.restype = ctypes.c_char_p
        self.lib.flashattn_version.restype = ctypes.c_char_p
        p = ctypes.POINTER(Tensor)
        self.lib.flashattn_forward.argtypes = [p] * 5 + [ctypes.POINTER(Options)]
        self.lib.flashattn_backward.argtypes = [p] * 9 + [ctypes.POINTER(Options)]
        t = torch
        self.codes = {t.float32: 0, t.float16: 1, t.bfloat16: 2, t.float64: 3, t.int32: 4}
        vp = ctypes.POINTER(Varlen)
        self.lib.flashattn_forward_varlen.argtypes = [p] * 5 + [vp, ctypes.POINTER(Options)]
        self.lib.flashattn_backward_varlen.argtypes = [p] * 9 + [vp, ctypes.POINTER(Options)]
        self.lib.flashattn_forward_kvcache.argtypes = [p] * 5 + [ctypes.POINTER(KvCache), ctypes.POINTER(Options)]
        _LOADED.append(self.lib)

    def version(self):
        return self.lib.flashattn_version().decode()

    @staticmethod
    def options(causal, precision=0, deterministic=False):
        """The options tuple: causal (top-left) or no mask; precision 0 = fp32, 1 = tf32."""
        return (MASK_CAUSAL_TOP_LEFT if causal else MASK_NONE, precision, deterministic)

    def cuda_available(self):
        return bool(self.lib.flashattn_cuda_available())

    def _view(self, x):
        v = Tensor()
        v.data = x.data_ptr()
        v.dtype = self.codes[x.dtype]
        v.device = (x.device.index or 0) if x.is_cuda else -1
        v.ndim = x.dim()
        for i in range(x.dim()):
            v.shape[i] = x.shape[i]
            v.stride[i] = x.stride(i)
        return v

    def _options(self, q, mask, precision, deterministic, mods=None):
        o = Options()
        mods = mods or {}
        if mods.get("window") is not None:
            o.sliding_window = 1
            o.window_left, o.window_right = mods["window"]
        o.softcap = float(mods.get("softcap", 0.0))
        if mods.get("alibi") is not None:
            o.keep_alibi = self._view(mods["alibi"])  # alive as long as the options
            o.alibi_slopes = ctypes.pointer(o.keep_alibi)
        o.struct_size = ctypes.sizeof(Options)
        o.mask = mask
        o.stream = self.torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else None
        o.num_threads = 0 if q.is_cuda else self.torch.get_num_threads()
        o.precision = precision
        o.deterministic = int(deterministic)
        return o

    def _check(self, rc):
        if rc != 0:
            msg = self.lib.flashattn_last_error().decode()
            raise (NotImplementedError if rc == self.UNSUPPORTED else RuntimeError)(msg)

    def forward(self, q, k, v, out, lse, opts):
        self.bind_forward(q, k, v, out, lse, opts)()

    def backward(self, q, k, v, out, dout, lse, dq, dk, dv, opts):
        self.bind_backward(q, k, v, out, dout, lse, dq, dk, dv, opts)()

    # The same calls with their argument structures built once: a callable that only crosses into
    # the library (and checks the status). Benchmarks time these because filling nine tensor
    # structures in Python took ~60 us per backward call (measured on an H200 host), time that is
    # not the library's; the tensors must stay alive and in place, and torch's current stream at
    # bind time is the one used.
    def bind_forward(self, q, k, v, out, lse, opts):
        args = [self._view(x) for x in (q, k, v, out, lse)] + [self._options(q, *opts)]
        refs = [ctypes.byref(x) for x in args]  # (each keeps its structure alive)
        fn = self.lib.flashattn_forward
        return lambda: self._check(fn(*refs))

    def bind_backward(self, q, k, v, out, dout, lse, dq, dk, dv, opts):
        args = [self._view(x) for x in (q, k, v, out, dout, lse, dq, dk, dv)] + [self._options(q, *opts)]
        refs = [ctypes.byref(x) for x in args]
        fn = self.lib.flashattn_backward
        return lambda: self._check(fn(*refs))


    def _varlen(self, cu_q, cu_k, max_q, max_k):
        vl = Varlen()
        vl.keep = [self._view(cu_q), self._view(cu_k)]  # alive as long as the structure
        vl.struct_size = ctypes.sizeof(Varlen)
        vl.cu_seqlens_q = ctypes.pointer(vl.keep[0])
        vl.cu_seqlens_k = ctypes.pointer(vl.keep[1])
        vl.max_seqlen_q, vl.max_seqlen_k = max_q, max_k
        return vl

    # Packed batches (flashattn_forward_varlen / _backward_varlen): q/k/v/out/... [total, H, D],
    # lse [Hq, total_q], cu_q / cu_k int32 CUDA tensors [B + 1]; bound as above.
    def bind_forward_varlen(self, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, opts):
        args = [self._view(x) for x in (q, k, v, out, lse)] + [self._varlen(cu_q, cu_k, max_q, max_k),
                                                               self._options(q, *opts)]
        refs = [ctypes.byref(x) for x in args]
        fn = self.lib.flashattn_forward_varlen
        return lambda: self._check(fn(*refs))

    def bind_backward_varlen(self, q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, opts):
        args = [self._view(x) for x in (q, k, v, out, dout, lse, dq, dk, dv)] + [
            self._varlen(cu_q, cu_k, max_q, max_k), self._options(q, *opts)]
        refs = [ctypes.byref(x) for x in args]
        fn = self.lib.flashattn_backward_varlen
        return lambda: self._check(fn(*refs))

    # KV-cache attention (flashattn_forward_kvcache): q/out [B, Sq, Hq, D], caches [B, S, Hkv, D]
    # (or pages with block_table), lse [B, Hq, Sq]; kv: a dict of the optional tensors (k_new,
    # v_new, cache_seqlens, block_table, rotary_cos, rotary_sin) and num_splits.
    def bind_forward_kvcache(self, q, k_cache, v_cache, out, lse, kv, opts):
        c = KvCache()
        c.struct_size = ctypes.sizeof(KvCache)
        c.rotary_interleaved = 1
        c.num_splits = int(kv.get("num_splits", 0))
        c.keep = {}
        for name in ("k_new", "v_new", "cache_seqlens", "block_table", "rotary_cos", "rotary_sin"):
            if kv.get(name) is not None:
                c.keep[name] = self._view(kv[name])
                setattr(c, name, ctypes.pointer(c.keep[name]))
        args = [self._view(x) for x in (q, k_cache, v_cache, out, lse)] + [c, self._options(q, *opts)]
        refs = [ctypes.byref(x) for x in args]
        fn = self.lib.flashattn_forward_kvcache
        return lambda: self._check(fn(*refs))


def issue_problem(torch, s, d, dtype):
    """The issue benchmarks' shape on CUDA (16k tokens per batch: B = 16384 / S; hidden 2048:
    H = 2048 / D; Sq = Skv = S): random q, k, v, dout and empty out, lse, dq, dk, dv, as a dict
    with b and h (profile_case.py, kernel_times.py)."""
    b, h = max(1, 16384 // s), max(1, 2048 // d)
    t = {n: torch.randn(b, h, s, d, device="cuda", dtype=dtype) for n in ("q", "k", "v", "do")}
    t.update(out=torch.empty_like(t["q"]), lse=torch.empty(b, h, s, device="cuda"),
             dq=torch.empty_like(t["q"]), dk=torch.empty_like(t["k"]), dv=torch.empty_like(t["v"]), b=b, h=h)
    return t


# Every library loaded through CtypesLib: EnvSettings sets its overrides in each.
_LOADED = []


def set_override(lib, name, value):
    """One kernel-selection knob (FLASHATTN_CUDA_*, src/cuda/host/overrides.hpp) of a loaded
    libflashattn; value None: back to the library's choice. The library reads the environment once,
    so a benchmark that compares variants in one process sets them through this call, which only
    developer builds (FLASHATTN_DEV_OVERRIDES, e.g. scripts/gpu-check's) export."""
    fn = getattr(lib, "flashattn_dev_set_override", None)
    if fn is None:
        raise RuntimeError(f"{name}: this libflashattn has no kernel-selection overrides "
                           "(build it with -DFLASHATTN_DEV_OVERRIDES=ON)")
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    if fn(name.encode(), None if value is None else str(value).encode()) != 0:
        lib.flashattn_last_error.restype = ctypes.c_char_p
        raise ValueError(lib.flashattn_last_error().decode())


class EnvSettings:
    """Kernel-selection overrides (FLASHATTN_CUDA_* = value; None: the library's choice) for the
    duration of a with-block in every library loaded through CtypesLib, back to the library's
    choice after it."""

    def __init__(self, settings):
        self.settings = dict(settings)

    @staticmethod
    def _libs():
        # (A build without the knobs loaded beside a developer build - e.g. a change's base in an
        # A/B - is left alone; with none that has them, set_override says so.)
        with_knobs = [lib for lib in _LOADED if hasattr(lib, "flashattn_dev_set_override")]
        return with_knobs or _LOADED

    def _set(self, name, value):
        # A knob newer than one of the builds (a change's base in an A/B) is left to the builds
        # that know it; one that no build knows is an error.
        libs, errors = self._libs(), []
        for lib in libs:
            try:
                set_override(lib, name, value)
            except ValueError as e:
                errors.append(e)
        if errors and len(errors) == len(libs):
            raise errors[0]

    def __enter__(self):
        for k, v in self.settings.items():
            self._set(k, v)
        return self

    def __exit__(self, *exc):
        for k in self.settings:
            self._set(k, None)
