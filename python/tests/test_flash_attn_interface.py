"""FlashAttention-2-compatible functions (flash_attn_func, flash_attn_qkvpacked_func,
flash_attn_kvpacked_func): layouts, causal alignment, GQA, return values, autograd, packed
gradients, sliding window / softcap / ALiBi with flash_attn's conventions, unsupported arguments,
torch.compile — against the float64 reference."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func)
from flashattn.flash_attn_interface import flash_attn_func as flash_attn_func_2  # noqa: E402
from conftest import TOL  # noqa: E402
from torch_helpers import (DEVICES, DTYPE_NAMES, assert_cache_agrees, reference64, rel_err,  # noqa: E402
                           skip_unsupported)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def bhsd(x):
    return x.transpose(1, 2)


def ref_bshd(q, k, v, dout, scale, causal, **mods):
    """float64 reference on (batch, seqlen, nheads, headdim) tensors: out, lse, dq, dk, dv. mods:
    window / softcap / alibi in the library's meaning (not flash_attn's conventions)."""
    out, lse, dq, dk, dv = reference64(bhsd(q), bhsd(k), bhsd(v), bhsd(dout), scale,
                                       "causal_bottom_right" if causal else "none", **mods)
    return bhsd(out), lse, bhsd(dq), bhsd(dk), bhsd(dv)


def tol(dtype, device, kind):
    t = TOL[DTYPE_NAMES[dtype]][kind]
    if device == "cuda":
        # The naive-in-same-precision criterion lives in test_torch.py; here a generous multiple.
        t = max(t, {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}.get(DTYPE_NAMES[dtype], t))
    return t


def assert_ok(name, got, ref, dtype, device, kind):
    err = rel_err(got, ref)
    t = tol(dtype, device, kind)
    assert err <= t, f"{name}: relative error {err:.3e} > {t:.1e}"


def test_signatures_match_flash_attn_2():
    expected_tail = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                     "softcap=0.0, alibi_slopes=None, deterministic=False, "
                     "return_attn_probs=False)")
    assert str(inspect.signature(flash_attn_func)) == "(q, k, v, " + expected_tail
    assert str(inspect.signature(flash_attn_qkvpacked_func)) == "(qkv, " + expected_tail
    assert str(inspect.signature(flash_attn_kvpacked_func)) == "(q, kv, " + expected_tail
    assert flash_attn_func is flash_attn_func_2
    assert flashattn.flash_attn_interface.flash_attn_func is flash_attn_func


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 64), (1, 70, 30, 6, 1, 40),
                                   (3, 1, 1, 2, 2, 8), (1, 128, 128, 8, 8, 128)],
                         ids=lambda s: "x".join(map(str, s)))
def test_flash_attn_func(shape, device, dtype, causal):
    skip_unsupported(device, dtype)
    b, sq, skv, hq, hkv, d = shape
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa
    q, k, v = mk(b, sq, hq, d), mk(b, skv, hkv, d), mk(b, skv, hkv, d)
    dout = mk(b, sq, hq, d)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, probs = flash_attn_func(qq, kk, vv, causal=causal, return_attn_probs=True)
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and probs is None
    out.backward(dout)
    r = ref_bshd(q, k, v, dout, None, causal)
    for name, kind, got, rr in zip(("out", "lse", "dq", "dk", "dv"),
                                   ("out", "lse", "grad", "grad", "grad"),
                                   (out.detach(), lse, qq.grad, kk.grad, vv.grad), r):
        assert_ok(name, got, rr, dtype, device, kind)
    # Gradients come back in the inputs' (batch, seqlen, nheads, headdim) layout.
    assert qq.grad.shape == q.shape and kk.grad.shape == k.shape


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked(device, dtype, causal):
    skip_unsupported(device, dtype)
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(2, 45, 3, 4, 32, generator=g, dtype=torch.float64).to(device, dtype)
    dout = torch.randn(2, 45, 4, 32, generator=g, dtype=torch.float64).to(device, dtype)
    x = qkv.clone().requires_grad_()
    out = flash_attn_qkvpacked_func(x, causal=causal, softmax_scale=0.3)
    assert out.shape == (2, 45, 4, 32)
    out.backward(dout)
    assert x.grad.shape == qkv.shape
    r = ref_bshd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dout, 0.3, causal)
    assert_ok("out", out.detach(), r[0], dtype, device, "out")
    for i in range(3):
        assert_ok("dqkv", x.grad[:, :, i], r[2 + i], dtype, device, "grad")


def test_qkvpacked_backward_is_one_packed_op():
    """The packed backward computes dqkv in one op (no per-slice zero-filled buffers summed by
    autograd): the graph holds a single flashattn backward node feeding qkv."""
    qkv = torch.randn(1, 16, 3, 2, 16, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv)
    names = []
    fn = out.grad_fn
    while fn is not None:
        names.append(type(fn).__name__)
        fn = fn.next_functions[0][0] if fn.next_functions else None
    assert not any("Select" in n or "Slice" in n for n in names), names
    out.sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_kvpacked_gqa(device, causal):
    dtype = torch.float32
    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 33, 6, 64, generator=g).to(device)
    kv = torch.randn(2, 50, 2, 2, 64, generator=g).to(device)
    dout = torch.randn(2, 33, 6, 64, generator=g).to(device)
    qq, kvv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse, none = flash_attn_kvpacked_func(qq, kvv, causal=causal, return_attn_probs=True)
    assert none is None and lse.shape == (2, 6, 33)
    out.backward(dout)
    r = ref_bshd(q, kv[:, :, 0], kv[:, :, 1], dout, None, causal)
    assert_ok("out", out.detach(), r[0], dtype, device, "out")
    assert_ok("lse", lse, r[1], dtype, device, "lse")
    assert_ok("dq", qq.grad, r[2], dtype, device, "grad")
    assert_ok("dk", kvv.grad[:, :, 0], r[3], dtype, device, "grad")
    assert_ok("dv", kvv.grad[:, :, 1], r[4], dtype, device, "grad")


def test_causal_is_bottom_right_aligned():
    # Sq < Skv: with bottom-right alignment the last query sees every key; top-left would hide
    # all but the first Sq keys from it.
    q = torch.randn(1, 4, 2, 16)
    k = torch.randn(1, 10, 2, 16)
    v = torch.randn(1, 10, 2, 16)
    out = flash_attn_func(q, k, v, causal=True)
    full = flash_attn_func(q[:, -1:], k, v, causal=False)
    torch.testing.assert_close(out[:, -1:], full, rtol=1e-5, atol=1e-6)
    # Sq > Skv: the first Sq - Skv rows see no key: zeros, lse = -inf, never NaN.
    out, lse, _ = flash_attn_func(k, q, q, causal=True, return_attn_probs=True)
    assert (out[:, :6] == 0).all() and torch.isneginf(lse[:, :, :6]).all()


def test_non_contiguous_inputs_are_read_in_place():
    q = torch.randn(2, 20, 4, 64)[:, ::2]  # every other sequence position
    k = torch.randn(2, 10, 8, 64)[:, :, ::2]  # every other head
    v = torch.randn(2, 10, 4, 96)[..., 16:80]  # a head-dim window (unit stride kept)
    out = flash_attn_func(q, k, v)
    r = ref_bshd(q, k, v, torch.zeros_like(q), None, False)
    assert rel_err(out, r[0]) <= 2e-5


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
def test_dropout_raises(fn):
    q = torch.randn(1, 8, 2, 16)
    call = {
        "func": lambda **kw: flash_attn_func(q, q, q, **kw),
        "qkvpacked": lambda **kw: flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), **kw),
        "kvpacked": lambda **kw: flash_attn_kvpacked_func(q, torch.stack([q] * 2, 2), **kw),
    }[fn]
    with pytest.raises(NotImplementedError, match="dropout_p=0.1"):
        call(dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout_p=0.5"):
        call(dropout_p=0.5, window_size=(2, 2), softcap=1.0)


def test_accepted_arguments():
    q = torch.randn(1, 8, 2, 16)
    a = flash_attn_func(q, q, q, deterministic=True, window_size=[-1, -1], dropout_p=0.0)
    b = flash_attn_func(q, q, q, deterministic=False)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"deterministic = 'yes' is not a bool"):
        flash_attn_func(q, q, q, deterministic="yes")


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
def test_deterministic_reaches_the_backward(monkeypatch, python_eager_path, fn):
    """flash_attn's deterministic=True selects the reproducible backward (on CUDA 16-bit: no dq
    atomics); that shows only on a GPU, so check that it arrives at the library's backward."""
    from flashattn import _ext
    seen, real = [], _ext.backward

    def spy(*args, **kw):
        assert len(args) == 19 and type(args[14]) is bool, args[9:]
        seen.append(args[14])
        return real(*args, **kw)

    monkeypatch.setattr(_ext, "backward", spy)
    g = torch.Generator().manual_seed(15)
    q = torch.randn(2, 9, 4, 16, generator=g)
    call = {
        "func": lambda x, **kw: flash_attn_func(x, x, x, causal=True, **kw),
        "qkvpacked": lambda x, **kw: flash_attn_qkvpacked_func(torch.stack([x] * 3, 2), **kw),
        "kvpacked": lambda x, **kw: flash_attn_kvpacked_func(x, torch.stack([x] * 2, 2), **kw),
    }[fn]
    for kw in ({"deterministic": True}, {"deterministic": False}, {}):
        x = q.clone().requires_grad_()
        call(x, **kw).sum().backward()
        assert torch.isfinite(x.grad).all()
    assert seen == [True, False, False]


def test_bad_shapes():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"qkv\.shape = \(1, 8, 2, 2, 16\): dimension 2 must be 3"):
        flash_attn_qkvpacked_func(torch.stack([q] * 2, 2))
    with pytest.raises(ValueError, match=r"kv\.shape = .* dimension 2 must be 2"):
        flash_attn_kvpacked_func(q, torch.stack([q] * 3, 2))
    with pytest.raises(ValueError, match=r"q\.shape = \(8, 2, 16\), expected 4 dimensions"):
        flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match=r"does not divide"):
        flash_attn_func(q, torch.randn(1, 8, 3, 16), torch.randn(1, 8, 3, 16))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        flash_attn_func(q.numpy(), q, q)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_under_torch_compile(device):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(14)
    qkv = torch.randn(2, 24, 3, 4, 32, generator=g).to(device)
    q = torch.randn(2, 24, 4, 32, generator=g).to(device)
    kv = torch.randn(2, 30, 2, 2, 32, generator=g).to(device)

    def f(qkv, q, kv):
        a = flash_attn_qkvpacked_func(qkv, causal=True)
        b = flash_attn_kvpacked_func(q, kv, causal=True)
        c = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1])
        return (a * b + c).sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    grads = []
    for fn in (f, compiled):
        xs = [x.clone().requires_grad_() for x in (qkv, q, kv)]
        fn(*xs).backward()
        grads.append([x.grad for x in xs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


# ---- sliding window, softcap and ALiBi -----------------------------------------------------------


def packed_call(fn, q, k, v, **kw):
    """flash_attn_func / _kvpacked / _qkvpacked on the same (unpacked) inputs; differentiable
    with respect to q, k and v in every case."""
    if fn == "func":
        return flash_attn_func(q, k, v, **kw)
    if fn == "kvpacked":
        return flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kw)
    return flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw)


def fa2_slopes(kind, b, h, device):
    if kind is None:
        return None
    if kind == "heads":
        return (2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).to(device, torch.float32)
    g = torch.Generator().manual_seed(21)
    return (torch.rand(b, h, generator=g) * 1.5).to(device, torch.float32)


def check_mods(fn, device, dtype, b, sq, skv, hq, hkv, d, causal, fa2, lib, seed=31):
    """One flash_attn call with the FlashAttention arguments `fa2` against the reference with the
    library's equivalent `lib`: out, lse and the gradients of q, k and v."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa
    q, k, v = mk(b, sq, hq, d), mk(b, skv, hkv, d), mk(b, skv, hkv, d)
    dout = mk(b, sq, hq, d)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = packed_call(fn, qq, kk, vv, causal=causal, return_attn_probs=True, **fa2)
    out.backward(dout)
    r = list(ref_bshd(q, k, v, dout, fa2.get("softmax_scale"), causal, **lib))
    # flash_attn's causal kernels (no left window; right side 0) add slope * j where the library
    # adds -slope * |i + skv - sq - j|: the softmax_lse flash_attn returns is larger by
    # slope * (i + skv - sq), and so is the one returned here.
    left, right = fa2.get("window_size", (-1, -1))
    left = left if 0 <= left < skv else -1
    right = 0 if causal else (right if 0 <= right < skv else -1)
    slopes = fa2.get("alibi_slopes")
    if slopes is not None and left == -1 and right == 0:
        sl = slopes.double().cpu()
        sl = sl[None, :, None] if sl.dim() == 1 else sl[:, :, None]
        r[1] = r[1] + (sl * (torch.arange(sq, dtype=torch.float64) + (skv - sq))).to(r[1].device)
    for name, kind, got, rr in zip(("out", "lse", "dq", "dk", "dv"),
                                   ("out", "lse", "grad", "grad", "grad"),
                                   (out.detach(), lse, qq.grad, kk.grad, vv.grad), r):
        assert_ok(name, got, rr, dtype, device, kind)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(4, 0), (3, 5), (-1, 2), (6, -1), (0, 0)],
                         ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(2, 37, 53, 4, 2, 64), (1, 70, 30, 6, 1, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_window(shape, device, window, causal):
    """flash_attn's window: causal=True sets the right side to 0, so causal + (left, right) is
    the library's bottom-right causal mask with (left, -1)."""
    b, sq, skv, hq, hkv, d = shape
    lib_window = (window[0], -1) if causal else window
    for fn in ("func", "kvpacked"):
        check_mods(fn, device, torch.float32, b, sq, skv, hq, hkv, d, causal,
                   dict(window_size=window), dict(window=lib_window))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_window_qkvpacked(device, causal):
    check_mods("qkvpacked", device, torch.float32, 2, 45, 45, 4, 4, 32, causal,
               dict(window_size=(5, 3)), dict(window=(5, -1 if causal else 3)))


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
def test_window_conventions_of_flash_attn(fn):
    """flash_attn reads any negative side as unbounded, a side >= seqlen_k as unbounded, and
    with causal=True ignores the right side (sets it to 0): each spelling gives the same bits as
    its plain equivalent; windows are taken as a tuple or list, with NumPy or Python ints."""
    g = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(2, 12, 4, 16, generator=g) for _ in range(3))

    def run(**kw):
        return packed_call(fn, q, k, v, return_attn_probs=True, **kw)[:2]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    assert same(run(window_size=(-5, -1)), run())
    assert same(run(window_size=(-1, -100)), run())
    assert same(run(window_size=[-3, 2]), run(window_size=(-1, 2)))
    assert same(run(window_size=(12, 3)), run(window_size=(-1, 3)))
    assert same(run(window_size=(2, 12)), run(window_size=(2, -1)))
    assert same(run(window_size=(2, 100)), run(window_size=(2, -1)))
    assert same(run(window_size=(3, 7), causal=True), run(window_size=(3, 0), causal=True))
    assert same(run(window_size=(3, 0), causal=True), run(window_size=(3, 0)))
    assert same(run(window_size=(-1, 5), causal=True), run(causal=True))
    assert same(run(window_size=(np.int64(3), 1)), run(window_size=(3, 1)))
    assert not same(run(window_size=(3, 1)), run())


def test_window_past_every_key_with_more_queries_than_keys():
    """With seqlen_q > seqlen_k a right side >= seqlen_k still hides keys by the library's
    formula; flash_attn treats it as unbounded, and so does this interface (both against the
    reference)."""
    g = torch.Generator().manual_seed(17)
    q = torch.randn(1, 20, 2, 16, generator=g)
    k, v = torch.randn(1, 5, 2, 16, generator=g), torch.randn(1, 5, 2, 16, generator=g)
    out = flash_attn_func(q, k, v, window_size=(1, 6))
    r = ref_bshd(q, k, v, torch.zeros_like(q), None, False, window=(1, -1))
    assert rel_err(out, r[0]) <= 2e-5
    low = flashattn.forward(bhsd(q), bhsd(k), bhsd(v), window_size=(1, 6))[0]
    assert torch.equal(bhsd(low)[:, :8], torch.zeros_like(q[:, :8]))  # rows 0..7 see no key
    assert not torch.equal(out[:, :8], torch.zeros_like(q[:, :8]))


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
def test_softcap_at_or_below_zero_is_none(fn):
    g = torch.Generator().manual_seed(18)
    q, k, v = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
    plain = packed_call(fn, q, k, v)
    for cap in (0.0, 0, -1.0, -30):
        assert torch.equal(packed_call(fn, q, k, v, softcap=cap), plain)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("slopes", [None, "heads", "batch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("device", DEVICES)
def test_softcap_and_alibi(device, dtype, slopes, causal):
    skip_unsupported(device, dtype)
    b, sq, skv, hq, hkv, d = 2, 37, 53, 4, 2, 64
    a = fa2_slopes(slopes, b, hq, device)
    for fn, cap in (("func", 5.0), ("kvpacked", 0.0), ("func", 0.0)):
        if cap == 0.0 and a is None:
            continue
        check_mods(fn, device, dtype, b, sq, skv, hq, hkv, d, causal,
                   dict(softcap=cap, alibi_slopes=a, softmax_scale=0.3),
                   dict(softcap=cap, alibi=a))


@pytest.mark.parametrize("device", DEVICES)
def test_alibi_lse_of_a_causal_window(device):
    """window_size=(-1, 0) without causal is causal to flash_attn, LSE convention included."""
    a = fa2_slopes("heads", 2, 4, device)
    check_mods("func", device, torch.float32, 2, 23, 41, 4, 2, 32, False,
               dict(window_size=(-1, 0), alibi_slopes=a), dict(window=(-1, 0), alibi=a))


@pytest.mark.parametrize("device", DEVICES)
def test_qkvpacked_softcap_alibi_window(device):
    a = fa2_slopes("batch", 2, 4, device)
    check_mods("qkvpacked", device, torch.float32, 2, 45, 45, 4, 4, 32, True,
               dict(window_size=(9, 9), softcap=2.0, alibi_slopes=a),
               dict(window=(9, -1), softcap=2.0, alibi=a))


def test_arguments_by_position():
    """flash_attn 2.x's positions: (q, k, v, dropout_p, softmax_scale, causal, window_size,
    softcap, alibi_slopes, deterministic, return_attn_probs)."""
    g = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(1, 10, 2, 16, generator=g) for _ in range(3))
    a = torch.tensor([0.5, 0.1])
    kw = dict(dropout_p=0.0, softmax_scale=0.4, causal=True, window_size=(3, 0), softcap=0.0,
              alibi_slopes=None, deterministic=True, return_attn_probs=True)
    by_pos = flash_attn_func(q, k, v, *kw.values())
    by_kw = flash_attn_func(q, k, v, **kw)
    assert len(by_pos) == 3 and by_pos[2] is None
    assert torch.equal(by_pos[0], by_kw[0]) and torch.equal(by_pos[1], by_kw[1])
    r = ref_bshd(q, k, v, torch.zeros_like(q), 0.4, True, window=(3, -1))
    assert rel_err(by_pos[0], r[0]) <= 2e-5
    # kv- and qkv-packed: the same positions after their packed inputs.
    pos = flash_attn_kvpacked_func(q, torch.stack([k, v], 2), *kw.values())
    assert torch.equal(pos[0], by_kw[0])
    qkv = torch.stack([q, k, v], 2)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, *kw.values())[0], by_kw[0])


def test_softcap_and_alibi_by_position():
    g = torch.Generator().manual_seed(20)
    q, k, v = (torch.randn(2, 10, 2, 16, generator=g) for _ in range(3))
    a = torch.tensor([0.5, 0.1])
    out, lse, _ = flash_attn_func(q, k, v, 0.0, 0.4, False, (2, 3), 1.5, a, False, True)
    r = ref_bshd(q, k, v, torch.zeros_like(q), 0.4, False, window=(2, 3), softcap=1.5, alibi=a)
    assert rel_err(out, r[0]) <= 2e-5 and rel_err(lse, r[1]) <= 2e-5


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
def test_mods_reach_the_library(monkeypatch, python_eager_path, fn):
    """The window (after flash_attn's conventions), softcap and slopes arrive at the extension's
    forward and backward, given by keyword or by position. The spies stand in for the library's
    softcap and ALiBi (the values are checked here, the results by the tests above)."""
    from flashattn import _ext
    seen = []
    real_fwd, real_bwd = _ext.forward, _ext.backward

    def tensor(x):  # the slopes arrive as a DLPack capsule (or None)
        return None if x is None else torch.utils.dlpack.from_dlpack(x)

    def fwd(*args, **kw):
        seen.append(("fwd", *args[11:14], tensor(args[14])))
        return real_fwd(*args[:13], 0.0, None, **kw)

    def bwd(*args, **kw):
        seen.append(("bwd", *args[15:18], tensor(args[18])))
        return real_bwd(*args[:17], 0.0, None, **kw)

    monkeypatch.setattr(_ext, "forward", fwd)
    monkeypatch.setattr(_ext, "backward", bwd)
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 10, 2, 16, generator=g).requires_grad_() for _ in range(3))
    a = torch.tensor([0.5, 0.1])
    packed_call(fn, q, k, v, window_size=(2, 30), softcap=3.5, alibi_slopes=a).sum().backward()
    packed_call(fn, q, k, v, causal=True, window_size=[4, 1], softcap=-2.0).sum().backward()
    assert [x[:4] for x in seen] == [("fwd", 2, -1, 3.5), ("bwd", 2, -1, 3.5),
                                     ("fwd", 4, -1, 0.0), ("bwd", 4, -1, 0.0)]
    assert torch.equal(seen[0][4], a) and torch.equal(seen[1][4], a)
    assert seen[2][4] is None and seen[3][4] is None
    seen.clear()
    if fn == "func":
        flash_attn_func(q, k, v, 0.0, None, False, (1, 2), 2.5, a)
        assert seen[0][1:4] == (1, 2, 2.5) and torch.equal(seen[0][4], a)


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(window_size=(1,)), TypeError, r"window_size = \(1,\) is not a pair"),
    (dict(window_size=None), TypeError, r"window_size = None is not a pair"),
    (dict(window_size=(1.5, 0)), TypeError, r"left and right must be ints, got float"),
    (dict(softcap=float("nan")), ValueError, r"softcap = nan is invalid"),
    (dict(softcap=float("inf")), ValueError, r"softcap = inf is invalid"),
    (dict(softcap="1"), TypeError, r"softcap = '1' is not a real number"),
    (dict(alibi_slopes=[0.5, 0.5]), TypeError, r"alibi_slopes: expected a torch\.Tensor"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError,
     r"alibi_slopes\.dtype = float64, expected float32"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes\.shape = \[3\] does not match"),
    (dict(alibi_slopes=torch.ones(1, 1, 2)), ValueError, r"alibi_slopes\.ndim = 3"),
], ids=["window1", "windowNone", "windowFloat", "softcapNan", "softcapInf", "softcapStr",
        "alibiList", "alibiF64", "alibiShape", "alibi3d"])
def test_bad_mod_values(fn, kw, exc, pattern):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(exc, match=pattern):
        packed_call(fn, q, q, q, **kw)


def test_flash_attn_func_graph_has_no_view_nodes():
    """The [B, S, H, D] layout is read through views inside the op: out's autograd node leads
    straight to the leaves' gradient accumulators (no transpose nodes before or after it, each of
    which cost host time in every backward)."""
    q, k, v = (torch.randn(2, 9, 4, 16, requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    nexts = [type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None]
    assert nexts.count("AccumulateGrad") == 3, (type(out.grad_fn).__name__, nexts)
    out.sum().backward()
    assert q.grad.shape == q.shape and q.grad.is_contiguous()


def test_codes_cache_agrees_with_validation():
    """The flash_attn functions remember validated options by value and type: every variant gives
    what the uncached validation gives, refusals included, whatever was cached before (1 and True
    are equal keys but not the same option; a list window is the tuple's)."""
    from flashattn import flash_attn_interface as fi
    variants = [(None, False, False, (-1, -1), 0.0, 64), (None, 1, False, (-1, -1), 0.0, 64),
                (None, True, False, [-1, -1], 0.0, 64), (None, True, 1, (-1, -1), 0.0, 64),
                (0.5, True, True, (3, 0), 1.5, 64), (0.5, False, True, (3, 0), 1.5, 4),
                (0.5, False, True, (3.0, 0), 1.5, 64), (0.5, False, True, (np.int64(3), 0), 1.5, 64),
                (0.5, False, True, (3, 0, 1), 1.5, 64), (0.5, False, True, 3, 1.5, 64),
                (0.5, False, True, (3, 0), -1.0, 64), (float("nan"), False, False, (-1, -1), 0.0, 64),
                (None, False, False, (-1, -1), 0, 64), (1, False, False, (-1, -1), 0.0, 64)]
    assert_cache_agrees(fi._codes, fi._codes_uncached, variants)
