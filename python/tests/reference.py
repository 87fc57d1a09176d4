"""The float64 reference attention for the Python tests: the C++ suite's own reference
(src/testing/reference.cpp), called through its C ABI (src/testing/reference_c.h) in
libflashattn_reference, a shared library built with the C++ tests (FLASHATTN_BUILD_TESTS=ON).
One implementation judges every suite; the C++ suite checks it by finite differences, and
test_numpy.py does so again through this binding.

Where the library is looked for, in order:
  1. FLASHATTN_REFERENCE_LIB: the path of the .so;
  2. the repository's CMake build folders (src/testing/ of build*/ or build*/*/): build/ first,
     then the others, newest first; sanitizer builds are skipped (their library needs the ASan
     runtime loaded first).
A test that needs the reference fails, saying what to do, when it is in none of them.

Arrays are logical [B, H, S, D] (any strides, any float dtype: converted to float64 first, so
16-bit inputs are used exactly as stored); GQA when Hkv divides Hq; the library's three masks;
a row that sees no key gives out = 0, lse = -inf and no gradient.

kvcache() is one sequence of the KV-cache call (flashattn_ref_kvcache): the caller gathers that
sequence's cache rows, the reference appends and rotates from the definitions.

The sliding window, softcap and ALiBi slopes (flashattn_ref_forward_ex / _backward_ex) are
keyword arguments with the library's meanings: window=(left, right) with -1 for an unbounded
side, softcap 0 for none, alibi None or slopes [Hq] / [B, Hq]. The softcap and slopes are used
as the float32 values the C ABI carries.
"""

import ctypes
import glob
import os

import numpy as np

MASK_NAMES = ("none", "causal_top_left", "causal_bottom_right")

_ENV = "FLASHATTN_REFERENCE_LIB"
_NAME = "libflashattn_reference.so"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Shape(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64)
                for n in ("batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim")]


class _Mods(ctypes.Structure):
    _fields_ = [("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64),
                ("softcap", ctypes.c_double), ("alibi", ctypes.c_void_p)]


def _sanitizer_build(build_dir):
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            return any(line.startswith("FLASHATTN_SANITIZE:") and
                       line.strip().split("=", 1)[1].upper() in ("ON", "1", "TRUE", "YES")
                       for line in f)
    except OSError:
        return False


def _candidates():
    if os.environ.get(_ENV):
        return [os.environ[_ENV]]
    # CMake build folders directly under build*/ (build/, build-gpu/, ...) or one level below
    # (build-python/reference/, which scripts/gpu-python makes).
    dirs = [d for pattern in ("build*", os.path.join("build*", "*"))
            for d in glob.glob(os.path.join(_REPO, pattern))
            if os.path.isfile(os.path.join(d, "src", "testing", _NAME))]
    dirs.sort(key=lambda d: (os.path.relpath(d, _REPO) != "build", -os.path.getmtime(d)))
    return [os.path.join(d, "src", "testing", _NAME) for d in dirs if not _sanitizer_build(d)]


_lib = None
_error = None  # why the library cannot be used, once known


def library():
    """The loaded libflashattn_reference (ctypes.CDLL); raises RuntimeError, saying what to do,
    when it cannot be found or loaded."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise RuntimeError(_error)
    paths = _candidates()
    if not paths:
        _error = (
            f"the float64 reference library {_NAME} was not found: build it with the C++ tests "
            f"(cmake -S . -B build -DFLASHATTN_BUILD_TESTS=ON && cmake --build build --target "
            f"flashattn_reference, from the repository root {_REPO}) or set {_ENV} to its path")
        raise RuntimeError(_error)
    path = paths[0]
    try:
        lib = ctypes.CDLL(path)
        fwd, bwd, err = (lib.flashattn_ref_forward_ex, lib.flashattn_ref_backward_ex,
                         lib.flashattn_ref_last_error)
    except (OSError, AttributeError) as e:
        _error = (f"cannot use the float64 reference library {path} ({e}); rebuild it (target "
                  f"flashattn_reference) or set {_ENV}")
        raise RuntimeError(_error) from e
    arr = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]  # data, strides
    shape = [ctypes.POINTER(_Shape)]
    scale_mask_mods = [ctypes.c_double, ctypes.c_int32, ctypes.POINTER(_Mods)]
    fwd.argtypes = shape + arr * 3 + scale_mask_mods + arr * 2
    bwd.argtypes = shape + arr * 4 + scale_mask_mods + arr * 3
    fwd.restype = bwd.restype = ctypes.c_int
    err.argtypes, err.restype = [], ctypes.c_char_p
    _lib = lib
    return lib


def abi_scale(scale, head_dim):
    # The C ABI carries the softmax scale as a float32 (flashattn_options.softmax_scale), so that
    # is the scale every computation, float64 included, really uses.
    return float(np.float32(1.0 / np.sqrt(head_dim) if scale is None else scale))


def _arg(x):
    """([data pointer, strides in elements], array) for a float64 view of x; the array keeps the
    memory alive. A float64 array is used in place, whatever its strides (outputs included)."""
    a = np.asarray(x, dtype=np.float64)
    if any(s % a.itemsize for s in a.strides):
        a = np.ascontiguousarray(a)
    strides = (ctypes.c_int64 * a.ndim)(*(s // a.itemsize for s in a.strides))
    return [ctypes.c_void_p(a.ctypes.data), strides], a


def _shape(q, k, v, dout=None):
    """The C ABI reads every array with q's and k's sizes: they must agree."""
    ok = (q.ndim == 4 and k.ndim == 4 and k.shape == v.shape and
          (q.shape[0], q.shape[3]) == (k.shape[0], k.shape[3]) and
          (dout is None or dout.shape == q.shape))
    if not ok:
        raise ValueError(f"the reference takes [B, H, S, D] arrays of matching sizes, got q "
                         f"{q.shape}, k {k.shape}, v {v.shape}" +
                         ("" if dout is None else f", dout {dout.shape}"))
    return _Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])


def _check(lib, rc):
    if rc != 0:
        raise ValueError("float64 reference: " + lib.flashattn_ref_last_error().decode())


def _mods(q, window, softcap, alibi):
    """(flashattn_ref_mods, the slopes array it points to): slopes rounded to float32 as the
    library stores them, [Hq] repeated over the batch, laid out as [B * Hq]."""
    left, right = (int(w) for w in window)
    slopes = None
    if alibi is not None:
        a = np.asarray(alibi).astype(np.float32).astype(np.float64)
        b, hq = q.shape[:2]
        if a.shape not in ((hq,), (b, hq)):
            raise ValueError(f"alibi slopes of shape {a.shape} do not match q {q.shape}: "
                             f"expected ({hq},) or ({b}, {hq})")
        slopes = np.ascontiguousarray(np.broadcast_to(a, (b, hq)))
    mods = _Mods(left, right, float(np.float32(softcap)),
                 None if slopes is None else slopes.ctypes.data)
    return mods, slopes


def forward(q, k, v, scale=None, mask="none", *, window=(-1, -1), softcap=0.0, alibi=None):
    """float64 (out, lse)."""
    lib = library()
    (qa, q), (ka, k), (va, v) = _arg(q), _arg(k), _arg(v)
    shape = _shape(q, k, v)
    mods, _slopes = _mods(q, window, softcap, alibi)
    out, lse = np.empty(q.shape), np.empty(q.shape[:3])
    (oa, _), (la, _) = _arg(out), _arg(lse)
    _check(lib, lib.flashattn_ref_forward_ex(ctypes.byref(shape), *qa, *ka, *va,
                                             abi_scale(scale, q.shape[-1]),
                                             MASK_NAMES.index(mask), ctypes.byref(mods),
                                             *oa, *la))
    return out, lse


def backward(dout, q, k, v, scale=None, mask="none", *, window=(-1, -1), softcap=0.0,
             alibi=None):
    """float64 (dq, dk, dv); dk and dv summed over the query heads of each kv group."""
    lib = library()
    (da, dout), (qa, q), (ka, k), (va, v) = _arg(dout), _arg(q), _arg(k), _arg(v)
    shape = _shape(q, k, v, dout)
    mods, _slopes = _mods(q, window, softcap, alibi)
    dq, dk, dv = np.empty(q.shape), np.empty(k.shape), np.empty(v.shape)
    (dqa, _), (dka, _), (dva, _) = _arg(dq), _arg(dk), _arg(dv)
    _check(lib, lib.flashattn_ref_backward_ex(ctypes.byref(shape), *qa, *ka, *va, *da,
                                              abi_scale(scale, q.shape[-1]),
                                              MASK_NAMES.index(mask), ctypes.byref(mods),
                                              *dqa, *dka, *dva))
    return dq, dk, dv


class _KvcacheSeq(ctypes.Structure):
    _fields_ = [("heads_q", ctypes.c_int64), ("heads_kv", ctypes.c_int64),
                ("seq_q", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("len_old", ctypes.c_int64), ("seq_new", ctypes.c_int64),
                ("pos0", ctypes.c_int64), ("q_advances", ctypes.c_int32),
                ("rotary_interleaved", ctypes.c_int32), ("rotary_dim", ctypes.c_int64),
                ("rotary_rows", ctypes.c_int64), ("round_to", ctypes.c_int32)]


ROUND_TO = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}  # flashattn.h's dtype codes


def kvcache(q, k_old, v_old, k_new, v_new, pos0, scale=None, mask="none", *, q_advances=False,
            rotary=None, window=(-1, -1), softcap=0.0, alibi=None):
    """KV-cache attention of one sequence (flashattn_ref_kvcache): float64 (out [Hq, Sq, D],
    lse [Hq, Sq], k_appended [Hkv, S_new, D]).

    q [Hq, Sq, D]; k_old, v_old [Hkv, L, D]: the attended cache rows before the append; k_new,
    v_new [Hkv, S_new, D] or None; pos0: cache_seqlens of the sequence (position of the first new
    key). rotary: None or (cos, sin, interleaved, dtype name the rotated values are rounded to),
    cos / sin [rows, rotary_dim / 2]. alibi: None or this sequence's Hq slopes."""
    lib = library()
    try:
        fn = lib.flashattn_ref_kvcache
    except AttributeError as e:
        raise RuntimeError(f"the reference library has no flashattn_ref_kvcache ({e}): rebuild "
                           "it (target flashattn_reference)") from e
    f64 = lambda x: np.ascontiguousarray(x, dtype=np.float64)  # noqa: E731
    q, k_old, v_old = f64(q), f64(k_old), f64(v_old)
    hq, sq, d = q.shape
    hkv, length = k_old.shape[:2]
    s_new = 0 if k_new is None else k_new.shape[1]
    if s_new:
        k_new, v_new = f64(k_new), f64(v_new)
    cos = sin = None
    seq = _KvcacheSeq(hq, hkv, sq, d, length, s_new, pos0, int(q_advances), 1, 0, 0, 3)
    if rotary is not None:
        cos, sin, interleaved, round_to = rotary
        cos, sin = f64(cos), f64(sin)
        seq.rotary_interleaved, seq.rotary_dim = int(interleaved), 2 * cos.shape[1]
        seq.rotary_rows, seq.round_to = cos.shape[0], ROUND_TO[round_to]
    slopes = None if alibi is None else f64(np.asarray(alibi).astype(np.float32))
    mods = _Mods(int(window[0]), int(window[1]), float(np.float32(softcap)),
                 None if slopes is None else slopes.ctypes.data)
    out, lse, k_app = np.empty((hq, sq, d)), np.empty((hq, sq)), np.empty((hkv, s_new, d))
    ptr = lambda x: None if x is None or x.size == 0 else x.ctypes.data  # noqa: E731
    fn.argtypes = ([ctypes.POINTER(_KvcacheSeq)] + [ctypes.c_void_p] * 7 +
                   [ctypes.c_double, ctypes.c_int32, ctypes.POINTER(_Mods)] +
                   [ctypes.c_void_p] * 3)
    fn.restype = ctypes.c_int
    _check(lib, fn(ctypes.byref(seq), ptr(q), ptr(k_old), ptr(v_old), ptr(k_new), ptr(v_new),
                   ptr(cos), ptr(sin), abi_scale(scale, d), MASK_NAMES.index(mask),
                   ctypes.byref(mods), ptr(out), ptr(lse), ptr(k_app)))
    return out, lse, k_app


def visible(sq, skv, mask="none", window=(-1, -1)):
    """[Sq, Skv] bool: which keys each query sees, written out from the definitions (mask, then
    the window band, intersected)."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    vis = np.ones((sq, skv), dtype=bool)
    if mask == "causal_top_left":
        vis &= j <= i
    elif mask == "causal_bottom_right":
        vis &= j <= i + skv - sq
    left, right = window
    if left >= 0:
        vis &= j >= i + skv - sq - left
    if right >= 0:
        vis &= j <= i + skv - sq + right
    return vis
