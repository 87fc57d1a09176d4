"""FlashAttention-2-compatible functions (flash_attn_func, flash_attn_qkvpacked_func,
flash_attn_kvpacked_func): layouts, causal alignment, GQA, return values, autograd, packed
gradients, unsupported arguments, torch.compile — against the float64 reference."""

import inspect

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (flash_attn_func, flash_attn_kvpacked_func,  # noqa: E402
                       flash_attn_qkvpacked_func)
from flashattn.flash_attn_interface import flash_attn_func as flash_attn_func_2  # noqa: E402
from conftest import TOL  # noqa: E402
from torch_helpers import (DEVICES, DTYPE_NAMES, reference64, rel_err,  # noqa: E402
                           skip_unsupported)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def bhsd(x):
    return x.transpose(1, 2)


def ref_bshd(q, k, v, dout, scale, causal):
    """float64 reference on (batch, seqlen, nheads, headdim) tensors: out, lse, dq, dk, dv."""
    out, lse, dq, dk, dv = reference64(bhsd(q), bhsd(k), bhsd(v), bhsd(dout), scale,
                                       "causal_bottom_right" if causal else "none")
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
@pytest.mark.parametrize("arg,value,needle", [
    ("dropout_p", 0.1, "dropout_p=0.1"),
    ("window_size", (4, 0), r"window_size=\(4, 0\)"),
    ("softcap", 30.0, "softcap=30.0"),
    ("alibi_slopes", "slopes", "alibi_slopes"),
])
def test_unsupported_arguments_raise(fn, arg, value, needle):
    q = torch.randn(1, 8, 2, 16)
    if value == "slopes":
        value = torch.ones(2)
    call = {
        "func": lambda **kw: flash_attn_func(q, q, q, **kw),
        "qkvpacked": lambda **kw: flash_attn_qkvpacked_func(torch.stack([q] * 3, 2), **kw),
        "kvpacked": lambda **kw: flash_attn_kvpacked_func(q, torch.stack([q] * 2, 2), **kw),
    }[fn]
    with pytest.raises(NotImplementedError, match=needle):
        call(**{arg: value})


def test_accepted_arguments():
    q = torch.randn(1, 8, 2, 16)
    a = flash_attn_func(q, q, q, deterministic=True, window_size=[-1, -1], dropout_p=0.0)
    b = flash_attn_func(q, q, q, deterministic=False)
    assert torch.equal(a, b)
    with pytest.raises(TypeError, match=r"deterministic = 'yes' is not a bool"):
        flash_attn_func(q, q, q, deterministic="yes")


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked"])
def test_deterministic_reaches_the_backward(monkeypatch, fn):
    """flash_attn's deterministic=True selects the reproducible backward (on CUDA 16-bit: no dq
    atomics); that shows only on a GPU, so check that it arrives at the library's backward."""
    from flashattn import _ext
    seen, real = [], _ext.backward

    def spy(*args):
        assert len(args) == 19 and type(args[14]) is bool, args[9:]
        seen.append(args[14])
        return real(*args)

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
