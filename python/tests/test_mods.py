"""Sliding window, logit softcap and ALiBi through flashattn.forward / flashattn.backward on NumPy
arrays, against the float64 reference (reference.py: the C++ suite's, through its _ex functions).

The reference binding is itself checked first, against attention written out here in NumPy from
the definitions (flashattn.h) and by finite differences, so that a wrong field in the
flashattn_ref_mods struct cannot let both sides agree on the wrong answer.

Windows are served by every backend; softcap and ALiBi need the backend that implements them (on a
build without it those tests fail with NotImplementedError, as they should: a skip would hide it).
"""

import numpy as np
import pytest

import flashattn
import reference as ref
from conftest import TOL, assert_close

MASKS = ref.MASK_NAMES

# (B, Hq, Hkv, Sq, Skv, D): MHA, GQA, MQA, Sq != Skv both ways, single row / key, odd sizes.
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 4, 2, 17, 17, 16),
    (1, 6, 2, 17, 97, 32),
    (2, 3, 1, 97, 33, 40),
    (1, 2, 2, 1, 97, 64),
]

# (left, right): unbounded on one side, a band around the diagonal, a zero-width diagonal, a
# window wider than any sequence here.
WINDOWS = [(-1, -1), (4, -1), (-1, 3), (8, 0), (0, 0), (3, 5), (1000, 1000)]


def slopes_for(rng, b, hq, kind):
    """ALiBi slopes as float32: the geometric series of the ALiBi paper per head ([Hq]), or
    random per (batch, head) ([B, Hq]), with one negative slope (the bias formula has no sign
    restriction)."""
    if kind == "heads":
        return (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)).astype(np.float32)
    s = rng.uniform(0.0, 1.5, (b, hq)).astype(np.float32)
    s[0, 0] = -0.25
    return s


def problem(rng, cfg, dtype, layout="bhsd"):
    b, hq, hkv, sq, skv, d = cfg

    def make(h, s):
        if layout == "bhsd":
            return rng.standard_normal((b, h, s, d)).astype(dtype)
        return rng.standard_normal((b, s, h, d)).astype(dtype).transpose(0, 2, 1, 3)

    return make(hq, sq), make(hkv, skv), make(hkv, skv), make(hq, sq)


def naive(q, k, v, scale, mask="none", window=(-1, -1), softcap=0.0, alibi=None):
    """Attention written out in NumPy float64 from flashattn.h's semantics: (out, lse)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, sq, _ = q.shape
    skv = k.shape[2]
    group = hq // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = float(np.float32(scale)) * np.einsum("bhid,bhjd->bhij", q, k)
    if softcap:
        c = float(np.float32(softcap))
        s = c * np.tanh(s / c)
    if alibi is not None:
        slopes = np.broadcast_to(np.asarray(alibi, np.float32).astype(np.float64), (b, hq))
        i = np.arange(sq)[:, None]
        j = np.arange(skv)[None, :]
        s = s - slopes[:, :, None, None] * np.abs(i + skv - sq - j)
    vis = ref.visible(sq, skv, mask, window)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    with np.errstate(divide="ignore"):
        lse = (np.log(den) + m)[..., 0]
    return p @ v, lse


def check(q, k, v, dout, dtype, scale=None, mask="none", **mods):
    """forward + backward from NaN-poisoned caller outputs, every element written, against the
    reference; returns the library's (out, lse, dq, dk, dv)."""
    out = np.full(q.shape, np.nan, q.dtype)
    lse = np.full(q.shape[:3], np.nan, np.float32)
    flashattn.forward(q, k, v, softmax_scale=scale, mask=mask, out=out, lse=lse, **mods)
    rmods = dict(window=mods.get("window_size", (-1, -1)), softcap=mods.get("softcap", 0.0),
                 alibi=mods.get("alibi_slopes"))
    r_out, r_lse = ref.forward(q, k, v, scale, mask, **rmods)
    tol = TOL[dtype]
    assert_close("out", out, r_out, tol["out"])
    assert_close("lse", lse, r_lse, tol["lse"])
    grads = [np.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    flashattn.backward(dout, q, k, v, out, lse, softmax_scale=scale, mask=mask,
                       dq=grads[0], dk=grads[1], dv=grads[2], **mods)
    for name, g, r in zip(("dq", "dk", "dv"), grads,
                          ref.backward(dout, q, k, v, scale, mask, **rmods)):
        assert_close(name, g, r, tol["grad"])
    return (out, lse, *grads)


# ---- the reference binding itself -----------------------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("window", [(-1, -1), (2, -1), (-1, 1), (3, 0), (0, 2), (1, 1)])
def test_reference_matches_naive_numpy(rng, mask, window):
    """Every field of flashattn_ref_mods reaches the reference: window, softcap and both slope
    shapes, against attention written out above (rows that see no key included)."""
    for cfg in [(2, 4, 2, 7, 11, 5), (1, 3, 1, 12, 5, 4)]:
        q, k, v, _ = problem(rng, cfg, np.float64)
        b, hq = cfg[:2]
        for softcap, alibi in [(0.0, None), (1.5, None), (0.0, slopes_for(rng, b, hq, "heads")),
                               (0.7, slopes_for(rng, b, hq, "batch"))]:
            want_out, want_lse = naive(q, k, v, 0.9, mask, window, softcap, alibi)
            got_out, got_lse = ref.forward(q, k, v, 0.9, mask, window=window, softcap=softcap,
                                           alibi=alibi)
            np.testing.assert_allclose(got_out, want_out, rtol=1e-12, atol=1e-12)
            np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
            fin = np.isfinite(want_lse)
            np.testing.assert_allclose(got_lse[fin], want_lse[fin], rtol=1e-12, atol=1e-12)
    # The mods change the answer (the comparison above is not vacuous).
    assert not np.allclose(naive(q, k, v, 0.9, softcap=1.5)[0], naive(q, k, v, 0.9)[0])
    assert not np.allclose(naive(q, k, v, 0.9, alibi=np.ones(3))[0], naive(q, k, v, 0.9)[0])


def test_reference_mods_gradients_by_finite_differences(rng):
    """The reference backward with window, softcap and ALiBi agrees with central differences of
    its forward (the softcap's 1 - tanh^2 factor included; the slopes are constants)."""
    q, k, v, dout = problem(rng, (1, 4, 2, 5, 7, 3), np.float64)
    cases = [dict(window=(2, 1)), dict(softcap=0.8), dict(alibi=np.array([0.5, 0.1, 1.0, -0.2])),
             dict(window=(1, 0), softcap=1.3, alibi=np.array([[0.3, 0.0, 0.7, 0.2]]))]
    for mods in cases:
        for mask in ("none", "causal_top_left"):
            grads = ref.backward(dout, q, k, v, 0.7, mask, **mods)
            for x, g in zip((q, k, v), grads):
                num = np.zeros_like(x)
                for idx in np.ndindex(x.shape):
                    orig = x[idx]
                    x[idx] = orig + 1e-6
                    fp = (ref.forward(q, k, v, 0.7, mask, **mods)[0] * dout).sum()
                    x[idx] = orig - 1e-6
                    fm = (ref.forward(q, k, v, 0.7, mask, **mods)[0] * dout).sum()
                    x[idx] = orig
                    num[idx] = (fp - fm) / 2e-6
                np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8, err_msg=str(mods))


# ---- sliding window (served by every backend) ---------------------------------------------------


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_window(rng, cfg, dtype, window, mask):
    q, k, v, dout = problem(rng, cfg, dtype, "bshd")
    check(q, k, v, dout, dtype, mask=mask, window_size=window)


def test_window_changes_the_result_and_minus_one_is_none(rng):
    q, k, v, dout = problem(rng, (1, 2, 2, 20, 20, 16), "float32")
    plain, plain_lse = flashattn.forward(q, k, v)
    same, same_lse = flashattn.forward(q, k, v, window_size=(-1, -1))
    wide, _ = flashattn.forward(q, k, v, window_size=[100, np.int64(100)])
    assert plain.tobytes() == same.tobytes() and plain_lse.tobytes() == same_lse.tobytes()
    np.testing.assert_allclose(wide, plain, rtol=0, atol=1e-6)
    local, _ = flashattn.forward(q, k, v, window_size=(2, 2))
    assert np.abs(local - plain).max() > 0.05


def test_window_equals_flash_attention_causal_local(rng):
    """Bottom-right causal with (left, -1) is window (left, 0) without a mask: both FlashAttention
    spellings of causal local attention give the same bits."""
    q, k, v, dout = problem(rng, (2, 4, 2, 23, 41, 32), "float32")
    a = flashattn.forward(q, k, v, mask="causal_bottom_right", window_size=(5, -1))
    b = flashattn.forward(q, k, v, window_size=(5, 0))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
    ga = flashattn.backward(dout, q, k, v, *a, mask="causal_bottom_right", window_size=(5, -1))
    gb = flashattn.backward(dout, q, k, v, *b, window_size=(5, 0))
    assert all(x.tobytes() == y.tobytes() for x, y in zip(ga, gb))


def test_window_rows_and_keys_that_see_nothing(rng):
    """A window that leaves query rows without keys (Sq > Skv, zero-width diagonal): out = 0,
    lse = -inf and dq = 0 there, and dk = dv = 0 for keys no query sees; never NaN."""
    q, k, v, dout = problem(rng, (1, 2, 1, 12, 5, 8), "float32")
    window = (0, 1)
    out, lse, dq, dk, dv = check(q, k, v, dout, "float32", window_size=window)
    vis = ref.visible(12, 5, "none", window)
    dead_rows, dead_keys = ~vis.any(axis=1), ~vis.any(axis=0)
    assert dead_rows.any()
    assert (out[:, :, dead_rows] == 0).all() and np.isneginf(lse[:, :, dead_rows]).all()
    assert (dq[:, :, dead_rows] == 0).all()
    assert np.isfinite(lse[:, :, ~dead_rows]).all()
    q2, k2, v2, dout2 = problem(rng, (1, 2, 1, 3, 12, 8), "float32")
    vis2 = ref.visible(3, 12, "none", (1, 0))
    _, _, _, dk2, dv2 = check(q2, k2, v2, dout2, "float32", window_size=(1, 0))
    assert (~vis2.any(axis=0)).any()
    assert (dk2[:, :, ~vis2.any(axis=0)] == 0).all() and (dv2[:, :, ~vis2.any(axis=0)] == 0).all()


def test_window_gqa_matches_repeated_heads(rng):
    q, k, v, dout = problem(rng, (2, 6, 2, 21, 18, 16), "float64")
    kw = dict(mask="causal_top_left", window_size=(3, 2))
    out, lse = flashattn.forward(q, k, v, **kw)
    kr, vr = np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1)
    out_r, lse_r = flashattn.forward(q, kr, vr, **kw)
    np.testing.assert_allclose(out, out_r, rtol=0, atol=1e-12)
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, **kw)
    dq_r, dk_r, dv_r = flashattn.backward(dout, q, kr, vr, out_r, lse_r, **kw)
    np.testing.assert_allclose(dq, dq_r, rtol=0, atol=1e-12)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 18, 16).sum(2), rtol=0, atol=1e-12)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 18, 16).sum(2), rtol=0, atol=1e-12)


def test_window_deterministic_across_threads(rng):
    q, k, v, dout = problem(rng, (2, 4, 2, 150, 131, 64), "float32", "bshd")
    runs = []
    for threads in (1, 2, None):
        kw = dict(window_size=(17, 3), num_threads=threads)
        out, lse = flashattn.forward(q, k, v, **kw)
        runs.append([out, lse, *flashattn.backward(dout, q, k, v, out, lse, **kw)])
    for other in runs[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(runs[0], other))


# ---- softcap and ALiBi (need a backend that implements them) -------------------------------------


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_softcap(rng, cfg, dtype, mask):
    q, k, v, dout = problem(rng, cfg, dtype, "bshd")
    # Scale 1 makes the scores O(sqrt(D)), so a softcap of 3 bends most of them.
    check(q, k, v, dout, dtype, scale=1.0, mask=mask, softcap=3.0)


@pytest.mark.parametrize("kind", ["heads", "batch"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_alibi(rng, cfg, dtype, mask, kind):
    q, k, v, dout = problem(rng, cfg, dtype, "bshd")
    slopes = slopes_for(rng, cfg[0], cfg[1], kind)
    check(q, k, v, dout, dtype, mask=mask, alibi_slopes=slopes)


@pytest.mark.parametrize("window", [(-1, -1), (6, 0), (3, 4)], ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("cfg", SHAPES[1:], ids=lambda c: "x".join(map(str, c)))
def test_window_softcap_alibi_together(rng, cfg, dtype, window):
    q, k, v, dout = problem(rng, cfg, dtype)
    slopes = slopes_for(rng, cfg[0], cfg[1], "batch")
    for mask in ("none", "causal_bottom_right"):
        check(q, k, v, dout, dtype, scale=0.5, mask=mask, window_size=window, softcap=2.5,
              alibi_slopes=slopes)


def test_softcap_and_alibi_change_the_result(rng):
    q, k, v, _ = problem(rng, (1, 4, 2, 16, 24, 32), "float32")
    plain, _ = flashattn.forward(q, k, v, softmax_scale=1.0)
    capped, _ = flashattn.forward(q, k, v, softmax_scale=1.0, softcap=2.0)
    biased, _ = flashattn.forward(q, k, v, softmax_scale=1.0, alibi_slopes=np.ones(4, np.float32))
    assert np.abs(capped - plain).max() > 0.05 and np.abs(biased - plain).max() > 0.05
    # A softcap far above every score is (nearly) no softcap; zero slopes are exactly no bias.
    loose, _ = flashattn.forward(q, k, v, softmax_scale=1.0, softcap=1e4)
    np.testing.assert_allclose(loose, plain, rtol=0, atol=1e-4)
    zero, _ = flashattn.forward(q, k, v, softmax_scale=1.0, alibi_slopes=np.zeros(4, np.float32))
    np.testing.assert_allclose(zero, plain, rtol=0, atol=1e-6)


def test_alibi_strided_slopes_and_batch_broadcast(rng):
    """[Hq] slopes mean the same for every batch entry as [B, Hq] repeated; strided slopes (every
    other element of a buffer) are read in place."""
    q, k, v, dout = problem(rng, (3, 4, 2, 19, 26, 16), "float32")
    base = slopes_for(rng, 3, 4, "heads")
    strided = np.zeros(8, np.float32)
    strided[::2] = base
    rep = np.ascontiguousarray(np.broadcast_to(base, (3, 4)))
    a = check(q, k, v, dout, "float32", alibi_slopes=strided[::2])
    b = check(q, k, v, dout, "float32", alibi_slopes=rep)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))
    wide = np.zeros((3, 9), np.float32)
    wide[:, 1::2] = rep
    check(q, k, v, dout, "float32", alibi_slopes=wide[:, 1::2])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mods_deterministic_across_threads(rng, dtype):
    q, k, v, dout = problem(rng, (2, 4, 2, 150, 131, 64), dtype, "bshd")
    slopes = slopes_for(rng, 2, 4, "batch")
    runs = []
    for threads in (1, 2, None):
        kw = dict(window_size=(40, 7), softcap=4.0, alibi_slopes=slopes, num_threads=threads,
                  mask="causal_bottom_right")
        out, lse = flashattn.forward(q, k, v, **kw)
        runs.append([out, lse, *flashattn.backward(dout, q, k, v, out, lse, **kw)])
    # Sq > Skv with the bottom-right mask: the first 19 rows see no key (lse = -inf there).
    assert not any(np.isnan(x).any() for x in runs[0])
    assert np.isneginf(runs[0][1][:, :, :19]).all() and np.isfinite(runs[0][1][:, :, 19:]).all()
    for other in runs[1:]:
        assert all(a.tobytes() == b.tobytes() for a, b in zip(runs[0], other))


def test_mods_with_any_dlpack_producer(rng):
    """Slopes from another framework than q's (here a bare DLPack producer) are read in place."""

    class Capsule:
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    q, k, v, dout = problem(rng, (1, 2, 1, 12, 9, 8), "float32")
    slopes = np.array([0.5, 0.25], np.float32)
    a = flashattn.forward(q, k, v, alibi_slopes=Capsule(slopes), softcap=5.0)
    b = flashattn.forward(q, k, v, alibi_slopes=slopes, softcap=5.0)
    assert all(x.tobytes() == y.tobytes() for x, y in zip(a, b))


# ---- plumbing ------------------------------------------------------------------------------------


def test_mods_reach_the_extension(rng, monkeypatch):
    """Window, softcap and slopes arrive at the extension as its trailing positional arguments
    (after deterministic): Python ints, a Python float, the caller's tensor itself. The spies
    stand in for the extension (the library's handling is the business of the other tests)."""
    from flashattn import _ext
    seen = []

    def spy(nargs):
        def call(*args, **kw):
            assert len(args) == nargs and not kw, (len(args), kw)
            seen.append(args[-4:])
        return call

    monkeypatch.setattr(_ext, "forward", spy(15))
    monkeypatch.setattr(_ext, "backward", spy(19))
    q, k, v, dout = problem(rng, (1, 2, 2, 5, 5, 8), "float32")
    slopes = np.ones(2, np.float32)
    kw = dict(window_size=(np.int32(3), 2), softcap=np.float32(1.5), alibi_slopes=slopes)
    out, lse = flashattn.forward(q, k, v, **kw)
    flashattn.backward(dout, q, k, v, out, lse, **kw)
    out, lse = flashattn.forward(q, k, v)
    flashattn.backward(dout, q, k, v, out, lse)
    assert [tuple(map(type, s[:3])) for s in seen] == [(int, int, float)] * 4
    assert [s[:3] for s in seen] == [(3, 2, 1.5)] * 2 + [(-1, -1, 0.0)] * 2
    assert seen[0][3] is slopes and seen[1][3] is slopes
    assert seen[2][3] is None and seen[3][3] is None


def test_options_reach_the_c_abi(rng):
    """The library itself judges the values the extension puts in flashattn_options (the Python
    layer would refuse them first): a window side of -2, a negative or NaN softcap, and the
    sliding_window flag (a window of (-1, 0) hides the future, (-1, -1) hides nothing)."""
    from flashattn import _ext
    q, k, v, _ = problem(rng, (1, 2, 2, 6, 6, 8), "float32")
    out, lse = np.empty_like(q), np.empty(q.shape[:3], np.float32)

    def call(**kw):
        _ext.forward(q, k, v, out, lse, 0.0, 0, 0, 0, 0, False, kw.get("wl", -1), kw.get("wr", -1),
                     kw.get("cap", 0.0), kw.get("alibi"))
        return out.copy()

    with pytest.raises(ValueError, match=r"options\.window_left = -2 is invalid"):
        call(wl=-2)
    with pytest.raises(ValueError, match=r"options\.window_right = -7 is invalid"):
        call(wr=-7)
    with pytest.raises(ValueError, match=r"options\.softcap = -1 is invalid"):
        call(cap=-1.0)
    with pytest.raises(ValueError, match=r"options\.softcap = nan is invalid"):
        call(cap=float("nan"))
    with pytest.raises(ValueError, match=r"softcap = 1e-60 underflows to 0 in float32"):
        call(cap=1e-60)
    with pytest.raises(ValueError, match=r"alibi_slopes\.shape = \[3\] does not match q"):
        call(alibi=np.ones(3, np.float32))
    none = call()
    causal = call(wr=0)
    np.testing.assert_allclose(causal, flashattn.forward(q, k, v, mask="causal_top_left")[0],
                               rtol=0, atol=0)
    assert not np.allclose(causal, none)


# ---- bad input -----------------------------------------------------------------------------------


def _qkv(rng, dtype=np.float32):
    return (rng.standard_normal((2, 4, 8, 16)).astype(dtype),
            rng.standard_normal((2, 2, 8, 16)).astype(dtype),
            rng.standard_normal((2, 2, 8, 16)).astype(dtype))


BAD_MODS = [
    # (description, kwargs or a function of q giving them, exception, message pattern)
    ("window not a pair", {"window_size": 4}, TypeError, r"window_size = 4 is not a pair"),
    ("window of three", {"window_size": (1, 2, 3)}, TypeError,
     r"window_size = \(1, 2, 3\) is not a pair"),
    ("window None", {"window_size": None}, TypeError, r"window_size = None is not a pair"),
    ("window float", {"window_size": (2.0, 1)}, TypeError,
     r"window_size = \(2\.0, 1\): left and right must be ints, got float and int"),
    ("window bool", {"window_size": (True, 1)}, TypeError, r"must be ints, got bool"),
    ("window left < -1", {"window_size": (-2, 1)}, ValueError,
     r"window_size = \(-2, 1\): left = -2 is invalid"),
    ("window right < -1", {"window_size": (0, -5)}, ValueError,
     r"window_size = \(0, -5\): right = -5 is invalid"),
    ("window too large", {"window_size": (2**63, 0)}, ValueError, r"does not fit in int64"),
    ("softcap negative", {"softcap": -1.0}, ValueError, r"softcap = -1\.0 is invalid"),
    ("softcap nan", {"softcap": float("nan")}, ValueError, r"softcap = nan is invalid"),
    ("softcap inf", {"softcap": float("inf")}, ValueError, r"softcap = inf is invalid"),
    ("softcap string", {"softcap": "30"}, TypeError, r"softcap = '30' is not a real number"),
    ("softcap None", {"softcap": None}, TypeError, r"softcap = None is not a real number"),
    ("softcap bool", {"softcap": True}, TypeError, r"softcap = True is not a real number"),
    ("softcap underflow", {"softcap": 1e-50}, ValueError,
     r"softcap = 1e-50 is not representable in float32"),
    ("softcap overflow", {"softcap": 1e39}, ValueError,
     r"softcap = 1e\+39 is not representable in float32"),
    ("alibi list", {"alibi_slopes": [0.5] * 4}, TypeError,
     r"alibi_slopes: expected a tensor that supports DLPack.*list"),
    ("alibi float64", {"alibi_slopes": np.ones(4)}, TypeError,
     r"alibi_slopes\.dtype = float64, expected float32"),
    ("alibi float16", {"alibi_slopes": np.ones(4, np.float16)}, TypeError,
     r"alibi_slopes\.dtype = float16, expected float32"),
    ("alibi int", {"alibi_slopes": np.ones(4, np.int32)}, TypeError,
     r"alibi_slopes\.dtype = int32, expected float32"),
    ("alibi 0-d", {"alibi_slopes": np.ones((), np.float32)}, ValueError,
     r"alibi_slopes\.ndim = 0, expected 1 \(\[Hq\]\) or 2 \(\[B, Hq\]\)"),
    ("alibi 3-d", {"alibi_slopes": np.ones((2, 4, 1), np.float32)}, ValueError,
     r"alibi_slopes\.ndim = 3, expected 1 \(\[Hq\]\) or 2 \(\[B, Hq\]\)"),
    ("alibi kv heads", {"alibi_slopes": np.ones(2, np.float32)}, ValueError,
     r"alibi_slopes\.shape = \[2\] does not match q: expected \[4\] or \[2, 4\]"),
    ("alibi batch", {"alibi_slopes": np.ones((3, 4), np.float32)}, ValueError,
     r"alibi_slopes\.shape = \[3, 4\] does not match q"),
    ("alibi transposed", {"alibi_slopes": np.ones((4, 2), np.float32)}, ValueError,
     r"alibi_slopes\.shape = \[4, 2\] does not match q"),
    ("alibi negative stride", {"alibi_slopes": np.ones(4, np.float32)[::-1]}, ValueError,
     r"alibi_slopes\.stride = .* negative"),
    ("alibi overlaps out", lambda q: {"out": (o := np.empty_like(q)),
                                      "alibi_slopes": o.reshape(-1)[:4]}, ValueError,
     r"output out aliases input alibi_slopes|out.*alibi_slopes.*overlap"),
]


@pytest.mark.parametrize("case", BAD_MODS, ids=[c[0] for c in BAD_MODS])
def test_forward_bad_mods(rng, case):
    _, kw, exc, pattern = case
    q, k, v = _qkv(rng)
    kw = kw(q) if callable(kw) else kw
    lse = np.full(q.shape[:3], np.nan, np.float32)
    with pytest.raises(exc, match=pattern):
        flashattn.forward(q, k, v, lse=lse, **kw)
    assert np.isnan(lse).all(), "a failed call wrote lse"


@pytest.mark.parametrize("case", [c for c in BAD_MODS if not callable(c[1])],
                         ids=[c[0] for c in BAD_MODS if not callable(c[1])])
def test_backward_bad_mods(rng, case):
    _, kw, exc, pattern = case
    q, k, v = _qkv(rng)
    out, lse = flashattn.forward(q, k, v)
    grads = [np.full(x.shape, np.nan, np.float32) for x in (q, k, v)]
    with pytest.raises(exc, match=pattern):
        flashattn.backward(np.ones_like(out), q, k, v, out, lse, dq=grads[0], dk=grads[1],
                           dv=grads[2], **kw)
    assert all(np.isnan(g).all() for g in grads), "a failed call wrote a gradient"


def test_backward_gradient_must_not_overlap_the_slopes(rng):
    q, k, v = _qkv(rng)
    out, lse = flashattn.forward(q, k, v)
    dq = np.full_like(q, np.nan)
    with pytest.raises(ValueError, match=r"alibi_slopes"):
        flashattn.backward(np.ones_like(out), q, k, v, out, lse, dq=dq,
                           alibi_slopes=dq.reshape(-1)[8:12])
