"""flashattn.forward / flashattn.backward on NumPy arrays against the float64 NumPy reference.

Runs everywhere (CI included): needs only NumPy. Covers every public low-level function, the
NumPy dtypes (float64, float32, float16; bfloat16 is tested through PyTorch), every mask, GQA/MQA,
both memory layouts, odd sizes, caller-provided and interleaved outputs, determinism, and every
class of bad input with the exception type and the library's message.
"""

import numpy as np
import pytest

import flashattn
import reference as ref
from conftest import TOL, assert_close

MASKS = ref.MASK_NAMES

# (B, Hq, Hkv, Sq, Skv, D): plain MHA, GQA, MQA, Sq != Skv both ways (bottom-right causal with
# Sq > Skv leaves fully masked rows), single rows/keys, odd lengths and head dims.
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 4, 4, 17, 17, 8),
    (1, 8, 2, 64, 97, 32),
    (3, 6, 1, 97, 64, 40),
    (1, 2, 2, 128, 255, 111),
    (2, 4, 2, 33, 5, 64),
    (1, 2, 1, 2, 130, 128),
    (1, 1, 1, 70, 70, 256),
]


def make(rng, shape, dtype, layout="bhsd"):
    """Random [B, H, S, D] logical array of `dtype` in memory layout `layout` (a view, no copy
    afterwards): 'bshd' is FlashAttention's (batch, seq, heads, dim) memory order."""
    b, h, s, d = shape
    if layout == "bhsd":
        return rng.standard_normal((b, h, s, d)).astype(dtype)
    return rng.standard_normal((b, s, h, d)).astype(dtype).transpose(0, 2, 1, 3)


def problem(rng, cfg, dtype, layout):
    b, hq, hkv, sq, skv, d = cfg
    q = make(rng, (b, hq, sq, d), dtype, layout)
    k = make(rng, (b, hkv, skv, d), dtype, layout)
    v = make(rng, (b, hkv, skv, d), dtype, layout)
    dout = make(rng, (b, hq, sq, d), dtype, layout)
    return q, k, v, dout


def check_against_reference(q, k, v, dout, mask, dtype, scale=None, **kw):
    out, lse = flashattn.forward(q, k, v, mask=mask, softmax_scale=scale, **kw)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:3]
    ref_out, ref_lse = ref.forward(q, k, v, scale, mask)
    tol = TOL[dtype]
    assert_close("out", out, ref_out, tol["out"])
    assert_close("lse", lse, ref_lse, tol["lse"])
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, mask=mask, softmax_scale=scale, **kw)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert isinstance(g, np.ndarray) and g.dtype == x.dtype and g.shape == x.shape
    # The reference backward uses the kernel's own (rounded) out only through dout and P, so it
    # is computed from the inputs alone; see TOL for why the difference stays within bounds.
    rdq, rdk, rdv = ref.backward(dout, q, k, v, scale, mask)
    assert_close("dq", dq, rdq, tol["grad"])
    assert_close("dk", dk, rdk, tol["grad"])
    assert_close("dv", dv, rdv, tol["grad"])
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_grid(rng, cfg, dtype, mask, layout):
    q, k, v, dout = problem(rng, cfg, dtype, layout)
    out, _, dq, dk, dv = check_against_reference(q, k, v, dout, mask, dtype)
    # Allocated outputs mirror their input's layout (numpy.empty_like(order="K")).
    for g, x in ((out, q), (dq, q), (dk, k), (dv, v)):
        live = [i for i in range(4) if x.shape[i] > 1]
        order = lambda a: sorted(live, key=lambda i: a.strides[i])  # noqa: E731
        assert order(g) == order(x)


def test_fully_masked_rows_are_zero_not_nan(rng):
    # Bottom-right causal with Sq > Skv: the first Sq - Skv query rows see no key.
    q, k, v, dout = problem(rng, (1, 2, 2, 9, 4, 16), "float32", "bhsd")
    out, lse = flashattn.forward(q, k, v, mask="causal_bottom_right")
    assert (out[:, :, :5] == 0).all() and np.isneginf(lse[:, :, :5]).all()
    assert np.isfinite(out).all() and np.isfinite(lse[:, :, 5:]).all()
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, mask="causal_bottom_right")
    assert (dq[:, :, :5] == 0).all()
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))


def test_nan_in_q_gives_nan_not_an_empty_row(rng):
    # A NaN in q makes every score of its row NaN: the row's out and lse are NaN (training must see
    # it), not the 0 and -inf of a row that sees no key, as they were; those rows (0-4 here) stay
    # exactly 0 / -inf, the float64 reference agrees, and the other rows are untouched.
    q, k, v, dout = problem(rng, (1, 2, 2, 9, 4, 16), "float32", "bhsd")
    q[0, 1, 7, 3] = np.nan
    out, lse = flashattn.forward(q, k, v, mask="causal_bottom_right")
    ref_out, ref_lse = ref.forward(q, k, v, None, "causal_bottom_right")
    assert np.isnan(out[0, 1, 7]).all() and np.isnan(lse[0, 1, 7])
    assert np.isnan(ref_out[0, 1, 7]).all() and np.isnan(ref_lse[0, 1, 7])
    assert (out[:, :, :5] == 0).all() and np.isneginf(lse[:, :, :5]).all()
    rest = np.ones(lse.shape, bool)
    rest[:, :, :5] = False
    rest[0, 1, 7] = False
    assert np.isfinite(out[rest]).all() and np.isfinite(lse[rest]).all()
    # Backward: the row's dq, and dk, dv of the keys it sees (0-2), are NaN; rows without keys
    # keep dq = 0 exactly.
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, mask="causal_bottom_right")
    assert np.isnan(dq[0, 1, 7]).all()
    assert np.isnan(dk[0, 1, :3]).all() and np.isnan(dv[0, 1, :3]).all()
    assert (dq[:, :, :5] == 0).all()


def test_softmax_scale(rng):
    q, k, v, dout = problem(rng, (2, 4, 2, 19, 23, 24), "float64", "bhsd")
    check_against_reference(q, k, v, dout, "causal_top_left", "float64", scale=0.37)
    out_default, _ = flashattn.forward(q, k, v)
    out_explicit, _ = flashattn.forward(q, k, v, softmax_scale=1 / np.sqrt(24))
    np.testing.assert_allclose(out_default, out_explicit, rtol=1e-12, atol=1e-12)
    out_other, _ = flashattn.forward(q, k, v, softmax_scale=0.37)
    assert not np.allclose(out_default, out_other)


def test_arbitrary_strides(rng):
    # Every-other-row slices of larger buffers (seq stride 2 rows) and a head dim slice.
    big = rng.standard_normal((2, 3, 40, 48)).astype(np.float32)
    q = big[:, :, ::2, :32]
    k = big[:, :, 1::2, 8:40]
    v = big[:, :, 5:25, 16:48]
    dout = rng.standard_normal(q.shape).astype(np.float32)[:, :, :, :]
    assert not q.flags.c_contiguous
    check_against_reference(q, k, v, dout, "none", "float32")


def test_forward_writes_given_outputs(rng):
    q, k, v, _ = problem(rng, (1, 4, 2, 16, 16, 32), "float32", "bhsd")
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full(q.shape[:3], np.nan, np.float32)
    r_out, r_lse = flashattn.forward(q, k, v, out=out, lse=lse)
    assert r_out is out and r_lse is lse
    e_out, e_lse = flashattn.forward(q, k, v)
    assert np.array_equal(out, e_out) and np.array_equal(lse, e_lse)
    # Only one of them given: the other is allocated.
    out2 = np.empty_like(q)
    r_out2, r_lse2 = flashattn.forward(q, k, v, out=out2)
    assert r_out2 is out2 and np.array_equal(r_lse2, e_lse)


def test_backward_writes_given_outputs(rng):
    q, k, v, dout = problem(rng, (2, 4, 2, 16, 20, 32), "float32", "bhsd")
    out, lse = flashattn.forward(q, k, v)
    grads = [np.full(x.shape, np.nan, np.float32) for x in (q, k, v)]
    r = flashattn.backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2])
    assert all(a is b for a, b in zip(r, grads))
    e = flashattn.backward(dout, q, k, v, out, lse)
    assert all(np.array_equal(a, b) for a, b in zip(grads, e))


def test_packed_qkv_and_packed_gradient(rng):
    """FlashAttention's packed (B, S, 3, H, D) layout: inputs as strided views, and dq/dk/dv
    written as interleaved, non-overlapping views of one packed gradient buffer."""
    b, s, h, d = 2, 37, 4, 16
    qkv = rng.standard_normal((b, s, 3, h, d)).astype(np.float32)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    dout = rng.standard_normal((b, s, h, d)).astype(np.float32).transpose(0, 2, 1, 3)
    out, lse = flashattn.forward(q, k, v, mask="causal_bottom_right")
    dqkv = np.full_like(qkv, np.nan)
    views = [dqkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]
    flashattn.backward(dout, q, k, v, out, lse, mask="causal_bottom_right",
                       dq=views[0], dk=views[1], dv=views[2])
    assert not np.isnan(dqkv).any()
    rdq, rdk, rdv = ref.backward(dout, q, k, v, None, "causal_bottom_right")
    for i, r in enumerate((rdq, rdk, rdv)):
        assert_close("dqkv", dqkv[:, :, i].transpose(0, 2, 1, 3), r, TOL["float32"]["grad"])


def test_gqa_matches_repeated_heads(rng):
    # GQA must equal MHA on explicitly repeated kv heads, with dk/dv summed over each group.
    q, k, v, dout = problem(rng, (2, 6, 2, 21, 18, 16), "float64", "bhsd")
    out, lse = flashattn.forward(q, k, v, mask="causal_top_left")
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    out_r, lse_r = flashattn.forward(q, kr, vr, mask="causal_top_left")
    np.testing.assert_allclose(out, out_r, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(lse, lse_r)
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, mask="causal_top_left")
    dq_r, dk_r, dv_r = flashattn.backward(dout, q, kr, vr, out_r, lse_r, mask="causal_top_left")
    np.testing.assert_allclose(dq, dq_r, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 18, 16).sum(2), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 18, 16).sum(2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_deterministic_across_runs_and_threads(rng, dtype):
    q, k, v, dout = problem(rng, (2, 4, 2, 150, 131, 64), dtype, "bshd")
    runs = []
    for threads in (1, 2, None, 1):
        out, lse = flashattn.forward(q, k, v, mask="causal_bottom_right", num_threads=threads)
        grads = flashattn.backward(dout, q, k, v, out, lse, mask="causal_bottom_right",
                                   num_threads=threads)
        runs.append([out, lse, *grads])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes(), "results depend on the thread count or the run"


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_deterministic_option_on_cpu(rng, dtype):
    """deterministic=True is accepted; the CPU backward is deterministic either way, so the
    results are bitwise those of the default (each run starts from NaN-filled outputs)."""
    q, k, v, dout = problem(rng, (2, 4, 2, 40, 33, 32), dtype, "bshd")
    runs = []
    for det in (False, True, np.bool_(True), 1):
        out, lse = np.full_like(q, np.nan), np.full(q.shape[:3], np.nan, np.float32)
        flashattn.forward(q, k, v, mask="causal_top_left", out=out, lse=lse, deterministic=det)
        grads = [np.full_like(x, np.nan) for x in (q, k, v)]
        flashattn.backward(dout, q, k, v, out, lse, mask="causal_top_left", deterministic=det,
                           dq=grads[0], dk=grads[1], dv=grads[2])
        runs.append([out, lse, *grads])
    assert all(np.isfinite(x).all() for x in runs[0])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes()


def test_deterministic_reaches_the_extension(rng, monkeypatch):
    """Its effect shows only on CUDA float16/bfloat16, so check the value the extension gets
    (the C ABI tests check what the library makes of the struct field)."""
    seen = []

    def spy(real, nargs):
        def call(*args, **kw):
            # Positional, right after the stream, a real bool (not the stream's int 0, which
            # == False); the window, softcap and slopes follow it.
            assert len(args) == nargs and not kw, (len(args), kw)
            seen.append(args[nargs - 5])
            return real(*args, **kw)
        return call

    from flashattn import _ext
    monkeypatch.setattr(_ext, "forward", spy(_ext.forward, 15))
    monkeypatch.setattr(_ext, "backward", spy(_ext.backward, 19))
    q, k, v, dout = problem(rng, (1, 2, 2, 5, 5, 8), "float32", "bhsd")
    for det in (True, False):
        out, lse = flashattn.forward(q, k, v, deterministic=det)
        flashattn.backward(dout, q, k, v, out, lse, deterministic=det)
    out, lse = flashattn.forward(q, k, v)
    flashattn.backward(dout, q, k, v, out, lse)
    assert [type(x) for x in seen] == [bool] * 6
    assert seen == [True, True, False, False, False, False]


def test_precision_tf32_is_accepted_on_cpu(rng):
    # The precision mode selects CUDA float32 kernels; the CPU ignores it (flashattn.h).
    q, k, v, _ = problem(rng, (1, 2, 2, 8, 8, 8), "float32", "bhsd")
    a, _ = flashattn.forward(q, k, v, precision="tf32")
    b, _ = flashattn.forward(q, k, v, precision="fp32")
    assert a.tobytes() == b.tobytes()


def test_reference_gradients_by_finite_differences(rng):
    """The reference backward agrees with central differences of the reference forward."""
    q, k, v, dout = problem(rng, (1, 4, 2, 5, 6, 3), "float64", "bhsd")
    for mask in MASKS:
        dq, dk, dv = ref.backward(dout, q, k, v, 0.7, mask)
        for x, g in ((q, dq), (k, dk), (v, dv)):
            num = np.zeros_like(x)
            it = np.nditer(x, flags=["multi_index"])
            for _ in it:
                idx = it.multi_index
                orig = x[idx]
                x[idx] = orig + 1e-6
                fp = (ref.forward(q, k, v, 0.7, mask)[0] * dout).sum()
                x[idx] = orig - 1e-6
                fm = (ref.forward(q, k, v, 0.7, mask)[0] * dout).sum()
                x[idx] = orig
                num[idx] = (fp - fm) / 2e-6
            np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


class _Capsule:
    """A bare DLPack producer (no NumPy type): flashattn must accept it and answer with NumPy."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_any_dlpack_producer(rng):
    q, k, v, dout = problem(rng, (1, 2, 1, 12, 9, 8), "float32", "bhsd")
    out, lse = flashattn.forward(_Capsule(q), _Capsule(k), _Capsule(v), mask="causal_top_left")
    assert isinstance(out, np.ndarray)
    e_out, e_lse = flashattn.forward(q, k, v, mask="causal_top_left")
    assert np.array_equal(out, e_out) and np.array_equal(lse, e_lse)
    dq, dk, dv = flashattn.backward(_Capsule(dout), _Capsule(q), _Capsule(k), _Capsule(v),
                                    _Capsule(out), _Capsule(lse), mask="causal_top_left")
    e = flashattn.backward(dout, q, k, v, out, lse, mask="causal_top_left")
    assert all(np.array_equal(a, b) for a, b in zip((dq, dk, dv), e))


def test_read_only_inputs_are_fine(rng):
    q, k, v, _ = problem(rng, (1, 2, 2, 6, 6, 8), "float32", "bhsd")
    for x in (q, k, v):
        x.flags.writeable = False
    out, _ = flashattn.forward(q, k, v)
    assert np.isfinite(out).all()


def test_module_surface():
    assert flashattn.__version__.count(".") == 2
    assert set(flashattn.MASKS) == set(MASKS)
    assert isinstance(flashattn.cuda_available(), bool)
    assert "cpu backend" in flashattn.build_info()


# ---- bad input --------------------------------------------------------------------------------


def _qkv(rng, dtype=np.float32, b=1, hq=4, hkv=2, sq=8, skv=8, d=16):
    return (rng.standard_normal((b, hq, sq, d)).astype(dtype),
            rng.standard_normal((b, hkv, skv, d)).astype(dtype),
            rng.standard_normal((b, hkv, skv, d)).astype(dtype))


def _raises(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match) as info:
        fn(*a, **kw)
    return info


BAD_FORWARD = [
    # (description, mutate(q, k, v) -> (q, k, v, kwargs), exception, message pattern)
    ("q ndim", lambda q, k, v: (q[0], k, v, {}), ValueError, r"q\.ndim = 3, expected 4"),
    ("k ndim", lambda q, k, v: (q, k[0], v, {}), ValueError, r"k\.ndim = 3"),
    ("head dims differ", lambda q, k, v: (q, k[..., :8], v, {}), ValueError,
     r"k\.shape\[3\] \(head_dim\) = 8 does not match q\.shape\[3\] = 16"),
    ("batch differs", lambda q, k, v: (q, np.concatenate([k, k]), v, {}), ValueError,
     r"k\.shape\[0\] \(batch\) = 2"),
    ("kv heads do not divide", lambda q, k, v: (q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1),
                                                {}), ValueError, r"does not divide"),
    ("v shape differs", lambda q, k, v: (q, k, v[:, :, :5], {}), ValueError,
     r"v\.shape\[2\] \(seq\) = 5 does not match k\.shape\[2\] = 8"),
    ("int dtype", lambda q, k, v: (q.astype(np.int32), k, v, {}), TypeError,
     r"q\.dtype = int32 is not supported"),
    ("complex dtype", lambda q, k, v: (q, k.astype(np.complex64), v, {}), TypeError,
     r"k\.dtype = complex64 is not supported"),
    ("mixed dtypes", lambda q, k, v: (q, k.astype(np.float64), v, {}), TypeError,
     r"same dtype.*q\.dtype: float32, k\.dtype: float64"),
    ("head dim stride", lambda q, k, v: (np.asfortranarray(q), k, v, {}), ValueError,
     r"q\.stride\[3\] \(head_dim\) = .* must be 1"),
    ("negative stride", lambda q, k, v: (q[:, :, ::-1], k, v, {}), ValueError,
     r"q\.stride = .* negative stride in dimension 2"),
    ("zero-size dim", lambda q, k, v: (q[:, :, :0], k, v, {}), ValueError,
     r"q\.shape = \[1, 4, 0, 16\] has a zero-size"),
    ("head dim too large", lambda q, k, v: (np.zeros((1, 1, 2, 300), np.float32),
                                            np.zeros((1, 1, 2, 300), np.float32),
                                            np.zeros((1, 1, 2, 300), np.float32), {}),
     NotImplementedError, r"head_dim\) = 300 is not supported"),
    ("mask name", lambda q, k, v: (q, k, v, {"mask": "causal"}), ValueError,
     r"mask = 'causal' is unknown"),
    ("mask int", lambda q, k, v: (q, k, v, {"mask": 1}), ValueError, r"mask = 1 is unknown"),
    ("precision", lambda q, k, v: (q, k, v, {"precision": "fp16"}), ValueError,
     r"precision = 'fp16' is unknown"),
    ("zero scale", lambda q, k, v: (q, k, v, {"softmax_scale": 0.0}), ValueError,
     r"softmax_scale = 0"),
    ("scale rounding to 0", lambda q, k, v: (q, k, v, {"softmax_scale": 1e-50}), ValueError,
     r"softmax_scale = 1e-50 rounds to 0 in float32"),
    ("nan scale", lambda q, k, v: (q, k, v, {"softmax_scale": float("nan")}), ValueError,
     r"softmax_scale = nan is not finite"),
    ("negative threads", lambda q, k, v: (q, k, v, {"num_threads": -1}), ValueError,
     r"num_threads = -1 is negative"),
    ("deterministic string", lambda q, k, v: (q, k, v, {"deterministic": "false"}), TypeError,
     r"deterministic = 'false' is not a bool"),
    ("deterministic array", lambda q, k, v: (q, k, v, {"deterministic": np.ones(2)}), TypeError,
     r"deterministic = .* is not a bool"),
    ("not a tensor", lambda q, k, v: (q.tolist(), k, v, {}), TypeError,
     r"q: expected a tensor that supports DLPack.*list"),
    ("k not a tensor", lambda q, k, v: (q, "k", v, {}), TypeError,
     r"k: expected a tensor that supports DLPack.*str"),
    ("out shape", lambda q, k, v: (q, k, v, {"out": np.empty((1, 4, 8, 8), np.float32)}),
     ValueError, r"out\.shape\[3\] \(head_dim\) = 8 does not match q\.shape\[3\] = 16"),
    ("out dtype", lambda q, k, v: (q, k, v, {"out": np.empty(q.shape, np.float64)}), TypeError,
     r"out\.dtype = float64 must equal q\.dtype = float32"),
    ("lse dtype", lambda q, k, v: (q, k, v, {"lse": np.empty(q.shape[:3], np.float64)}),
     TypeError, r"lse\.dtype = float64, expected float32"),
    ("lse ndim", lambda q, k, v: (q, k, v, {"lse": np.empty(q.shape, np.float32)}), ValueError,
     r"lse\.ndim = 4, expected 3"),
    ("out aliases q", lambda q, k, v: (q, k, v, {"out": q}), ValueError,
     r"output out aliases input q"),
    ("lse overlaps out", lambda q, k, v: (q, k, v, {"out": (o := np.empty_like(q)),
                                                    "lse": o[:, :, :, 0]}), ValueError,
     r"outputs out and lse overlap|lse.*(stride|overlap)"),
    ("broadcast output", lambda q, k, v: (q, k, v, {"out": np.broadcast_to(
        np.empty((1, 1, 1, 16), np.float32), q.shape)}), TypeError,
     r"out: the ndarray is read-only; outputs must be writable"),
    ("read-only output", lambda q, k, v: (q, k, v, {"out": _readonly(np.empty_like(q))}),
     TypeError, r"out: the ndarray is read-only"),
]


def _readonly(a):
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("case", BAD_FORWARD, ids=[c[0] for c in BAD_FORWARD])
def test_forward_bad_input(rng, case):
    _, mutate, exc, pattern = case
    q, k, v = _qkv(rng)
    q, k, v, kw = mutate(q, k, v)
    # Caller-provided outputs must stay untouched when the call fails.
    out = kw.get("out")
    before = None if out is None else out.copy()
    _raises(exc, pattern, flashattn.forward, q, k, v, **kw)
    if before is not None and out.flags.writeable:
        assert np.array_equal(before, out, equal_nan=True)


def test_failed_forward_writes_nothing(rng):
    q, k, v = _qkv(rng)
    out = np.full(q.shape, np.nan, np.float32)
    lse = np.full((1, 4, 8), np.nan, np.float64)  # wrong dtype: the call must fail before writing
    _raises(TypeError, r"lse\.dtype", flashattn.forward, q, k, v, out=out, lse=lse)
    assert np.isnan(out).all() and np.isnan(lse).all()


def test_backward_bad_input(rng):
    q, k, v = _qkv(rng)
    out, lse = flashattn.forward(q, k, v)
    dout = np.ones_like(out)
    _raises(ValueError, r"dout\.shape\[2\] \(seq\) = 4", flashattn.backward,
            dout[:, :, :4], q, k, v, out, lse)
    _raises(TypeError, r"dout\.dtype = float64 must equal q\.dtype = float32",
            flashattn.backward, dout.astype(np.float64), q, k, v, out, lse)
    _raises(ValueError, r"lse\.shape\[2\] \(seq_q\) = 7", flashattn.backward,
            dout, q, k, v, out, lse[:, :, :7])
    _raises(ValueError, r"output dq aliases input dout", flashattn.backward,
            dout, q, k, v, out, lse, dq=dout)
    dq = np.empty_like(q)
    _raises(ValueError, r"outputs dk and dv overlap", flashattn.backward,
            dout, q, k, v, out, lse, dk=(dk := np.empty_like(k)), dv=dk)
    _raises(TypeError, r"dk\.dtype = float16 must equal q\.dtype", flashattn.backward,
            dout, q, k, v, out, lse, dq=dq, dk=np.empty(k.shape, np.float16))
    _raises(ValueError, r"dv\.shape\[1\] \(heads\) = 4 does not match k\.shape\[1\] = 2",
            flashattn.backward, dout, q, k, v, out, lse, dv=np.empty(q.shape, np.float32))
    _raises(ValueError, r"mask = 'top_left' is unknown", flashattn.backward,
            dout, q, k, v, out, lse, mask="top_left")
    _raises(TypeError, r"dq: the ndarray is read-only", flashattn.backward,
            dout, q, k, v, out, lse, dq=_readonly(np.empty_like(q)))
    _raises(TypeError, r"lse: expected a tensor that supports DLPack", flashattn.backward,
            dout, q, k, v, out, [1.0])


def test_backward_float16_lse_must_be_float32(rng):
    q, k, v = _qkv(rng, np.float16)
    out, lse = flashattn.forward(q, k, v)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    _raises(TypeError, r"lse\.dtype = float16, expected float32", flashattn.backward,
            np.ones_like(out), q, k, v, out, lse.astype(np.float16))

