"""Sliding window, softcap and ALiBi with PyTorch tensors (CPU, and CUDA where available): the
low-level functions, flashattn.torch.attention (custom ops, eager and torch.compile) and
FlashAttnFunction, against the float64 reference (reference.py, the C++ suite's); gradcheck,
opcheck, the slopes' (absent) gradient and the errors.

Windows run on every backend; softcap and ALiBi need the backend that implements them (without it
those tests fail with NotImplementedError rather than skip, so that a missing kernel shows)."""

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import flashattn.torch as fat  # noqa: E402
from conftest import TOL  # noqa: E402
from torch_helpers import (  # noqa: E402
    DEVICES, DTYPE_NAMES, MASKS, attention_ref, reference64, rel_err, skip_unsupported)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# (name, mods): keyword arguments of the flashattn functions. "window" runs everywhere.
MODS = [
    ("window", dict(window_size=(7, 2))),
    ("softcap", dict(softcap=2.0)),
    ("alibi", dict(alibi_slopes="heads")),
    ("all", dict(window_size=(5, -1), softcap=3.0, alibi_slopes="batch")),
]
MOD_IDS = [m[0] for m in MODS]


def slopes(kind, b, hq, device):
    if kind == "heads":
        return (2.0 ** (-8.0 * torch.arange(1, hq + 1) / hq)).to(device, torch.float32)
    g = torch.Generator().manual_seed(99)
    return (torch.rand(b, hq, generator=g) * 1.5).to(device, torch.float32)


def resolve(mods, b, hq, device):
    """The mods with the slopes' kind replaced by a tensor on `device`."""
    mods = dict(mods)
    if isinstance(mods.get("alibi_slopes"), str):
        mods["alibi_slopes"] = slopes(mods["alibi_slopes"], b, hq, device)
    return mods


def ref_mods(mods):
    """flashattn keyword arguments -> reference64 / attention_ref ones."""
    return dict(window=mods.get("window_size", (-1, -1)), softcap=mods.get("softcap", 0.0),
                alibi=mods.get("alibi_slopes"))


def make(shape, dtype, device, layout, gen):
    b, h, s, d = shape
    if layout == "bhsd":
        return torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).to(device, dtype)
    x = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64).to(device, dtype)
    return x.transpose(1, 2)


def problem(cfg, dtype, device, layout="bshd", seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, sq, skv, d = cfg
    return (make((b, hq, sq, d), dtype, device, layout, gen),
            make((b, hkv, skv, d), dtype, device, layout, gen),
            make((b, hkv, skv, d), dtype, device, layout, gen),
            make((b, hq, sq, d), dtype, device, layout, gen))


def check(outs, q, k, v, dout, scale, mask, mods):
    """(out, lse, dq, dk, dv) against the reference: the CPU suite's tolerance on the CPU; on
    CUDA at most twice the error of plain attention in the same dtype (FlashAttention's
    criterion), with the CPU tolerance (and 5e-5 for float32) as floor."""
    dtype, device = q.dtype, q.device.type
    ref = reference64(q, k, v, dout, scale, mask, **ref_mods(mods))
    naive = [0.0] * 5
    if device == "cuda":
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out, lse = attention_ref(qq, kk, vv, scale, mask, dtype=dtype, **ref_mods(mods))
        out.backward(dout)
        naive = [rel_err(n, r) for n, r in
                 zip((out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad), ref)]
    for name, kind, got, r, ne in zip(("out", "lse", "dq", "dk", "dv"),
                                      ("out", "lse", "grad", "grad", "grad"), outs, ref, naive):
        tol = TOL[DTYPE_NAMES[dtype]][kind]
        if device == "cuda":
            tol = max(tol, 2 * ne, 5e-5 if dtype == torch.float32 else 0.0)
        err = rel_err(got, r)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} (naive {ne:.1e})"


# ---- low-level functions on torch tensors -------------------------------------------------------


@pytest.mark.parametrize("mods", [m[1] for m in MODS], ids=MOD_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", [(2, 4, 2, 17, 33, 64), (1, 6, 1, 97, 40, 40)],
                         ids=lambda c: "x".join(map(str, c)))
def test_low_level(cfg, device, dtype, mask, mods):
    skip_unsupported(device, dtype)
    q, k, v, dout = problem(cfg, dtype, device)
    mods = resolve(mods, cfg[0], cfg[1], device)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=device)
    flashattn.forward(q, k, v, mask=mask, out=out, lse=lse, **mods)
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    flashattn.backward(dout, q, k, v, out, lse, mask=mask, dq=grads[0], dk=grads[1],
                       dv=grads[2], **mods)
    check((out, lse, *grads), q, k, v, dout, None, mask, mods)


# ---- differentiable: custom op and autograd.Function --------------------------------------------


def run_autograd(impl, q, k, v, dout, scale, mask, mods):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    if impl == "custom_op":
        out, lse = fat.attention(qq, kk, vv, softmax_scale=scale, mask=mask, return_lse=True,
                                 **mods)
    else:
        out, lse = fat.FlashAttnFunction.apply(
            qq, kk, vv, scale, mask, "fp32", None, False, mods.get("window_size", (-1, -1)),
            mods.get("softcap", 0.0), mods.get("alibi_slopes"))
    assert out.requires_grad and not lse.requires_grad
    out.backward(dout)
    return out.detach(), lse, qq.grad, kk.grad, vv.grad


@pytest.mark.parametrize("impl", ["custom_op", "function"])
@pytest.mark.parametrize("mods", [m[1] for m in MODS], ids=MOD_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("device", DEVICES)
def test_autograd(impl, device, mask, mods):
    q, k, v, dout = problem((2, 6, 2, 45, 38, 64), torch.float32, device, seed=3)
    mods = resolve(mods, 2, 6, device)
    outs = run_autograd(impl, q, k, v, dout, None, mask, mods)
    check(outs, q, k, v, dout, None, mask, mods)


@pytest.mark.parametrize("impl", ["custom_op", "function"])
@pytest.mark.parametrize("mods", [m[1] for m in MODS], ids=MOD_IDS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("cfg", [(1, 2, 2, 5, 7, 4), (2, 4, 2, 6, 3, 8)],
                         ids=lambda c: "x".join(map(str, c)))
def test_gradcheck_float64_cpu(impl, mask, cfg, mods):
    q, k, v, _ = problem(cfg, torch.float64, "cpu", seed=5)
    mods = resolve(mods, cfg[0], cfg[1], "cpu")
    mods.setdefault("window_size", (2, 1))  # a window that cuts rows on both sides
    inputs = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))

    def fn(q, k, v):
        if impl == "custom_op":
            return fat.attention(q, k, v, mask=mask, softmax_scale=0.8, **mods)
        return fat.FlashAttnFunction.apply(q, k, v, 0.8, mask, "fp32", None, False,
                                           mods["window_size"], mods.get("softcap", 0.0),
                                           mods.get("alibi_slopes"))[0]

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["custom_op", "function"])
def test_slopes_get_no_gradient(impl):
    """As in FlashAttention the slopes are constants: a slopes tensor that requires grad is
    accepted, gets no gradient, and the inputs' gradients are those of the detached slopes."""
    q, k, v, dout = problem((2, 4, 2, 19, 23, 16), torch.float32, "cpu", seed=8)
    learnable = slopes("batch", 2, 4, "cpu").requires_grad_()
    mods = dict(alibi_slopes=learnable, window_size=(6, 3))
    outs = run_autograd(impl, q, k, v, dout, None, "none", mods)
    assert learnable.grad is None
    check(outs, q, k, v, dout, None, "none", mods)


@pytest.mark.parametrize("mods", [m[1] for m in MODS], ids=MOD_IDS)
def test_opcheck_custom_ops(mods):
    """torch.library.opcheck of every op with the mods (schema, fake implementations, autograd
    registration), the slopes as a Tensor argument."""
    q, k, v, dout = problem((1, 4, 2, 9, 11, 16), torch.float32, "cpu")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    mods = resolve(mods, 1, 4, "cpu")
    wl, wr = mods.get("window_size", (-1, -1))
    tail = (0.0, 2, 0, 0, False, wl, wr, mods.get("softcap", 0.0), mods.get("alibi_slopes"))
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (q, k, v, *tail))
    out, lse = torch.ops.flashattn.fwd(q, k, v, *tail)
    torch.library.opcheck(torch.ops.flashattn.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, *tail))
    qkv = torch.randn(2, 7, 3, 4, 16, requires_grad=True)
    s2 = None if tail[-1] is None else tail[-1].expand(2, 4).contiguous()
    torch.library.opcheck(torch.ops.flashattn.qkvpacked_fwd.default, (qkv, *tail[:-1], s2))
    kv = torch.randn(2, 5, 2, 2, 16, requires_grad=True)
    qb = torch.randn(2, 7, 4, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.flashattn.kvpacked_fwd.default, (qb, kv, *tail[:-1], s2))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_mods_reach_the_backward(monkeypatch, python_eager_path, compiled):
    """Autograd hands the forward's window, softcap and slopes to the library's backward: the
    custom op (eager and under torch.compile) and the autograd.Function."""
    from flashattn import _ext
    seen, real = [], _ext.backward

    def spy(*args, **kw):
        assert len(args) == 19, len(args)
        slopes = None if args[18] is None else torch.utils.dlpack.from_dlpack(args[18])  # a capsule
        seen.append((args[15], args[16], args[17], slopes))
        return real(*args[:17], 0.0, None, **kw)  # the values are checked here, not the results

    monkeypatch.setattr(_ext, "backward", spy)
    real_fwd = _ext.forward
    monkeypatch.setattr(_ext, "forward", lambda *a, **kw: real_fwd(*a[:13], 0.0, None, **kw))
    torch._dynamo.reset()
    q, k, v, dout = problem((1, 2, 2, 6, 7, 8), torch.float32, "cpu")
    s = torch.tensor([0.5, 0.25])

    def op(q, k, v):
        return fat.attention(q, k, v, window_size=(3, 1), softcap=2.5, alibi_slopes=s)

    op = torch.compile(op, backend="aot_eager", fullgraph=True) if compiled else op
    calls = [op,
             lambda q, k, v: fat.attention(q, k, v),
             lambda q, k, v: fat.FlashAttnFunction.apply(q, k, v, None, "none", "fp32", None,
                                                         False, (0, 4), 1.5, s)[0]]
    for fn in calls:
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        fn(qq, kk, vv).backward(dout)
        assert torch.isfinite(qq.grad).all()
    assert [x[:3] for x in seen] == [(3, 1, 2.5), (-1, -1, 0.0), (0, 4, 1.5)]
    assert torch.equal(seen[0][3], s) and seen[1][3] is None and torch.equal(seen[2][3], s)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_with_mods(device):
    torch._dynamo.reset()
    q, k, v, dout = problem((2, 4, 2, 40, 52, 32), torch.float32, device, seed=7)
    s = slopes("batch", 2, 4, device)

    def f(q, k, v):
        out = fat.attention(q * 1.5, k, v, mask="causal_bottom_right", window_size=(9, -1),
                            softcap=4.0, alibi_slopes=s)
        return torch.sin(out) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    runs = []
    for fn in (f, compiled):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        y = fn(qq, kk, vv)
        y.backward(dout)
        runs.append((y.detach(), qq.grad, kk.grad, vv.grad))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_window_only_under_torch_compile(device):
    """The same with a window alone (served by every backend)."""
    torch._dynamo.reset()
    q, k, v, dout = problem((2, 4, 2, 40, 52, 32), torch.float32, device, seed=7)

    def f(q, k, v):
        return fat.attention(q, k, v, window_size=(4, 4), mask="causal_top_left")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    outs = []
    for fn in (f, compiled):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = fn(qq, kk, vv)
        out.backward(dout)
        outs.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    _, lse = fat.attention(q, k, v, window_size=(4, 4), mask="causal_top_left", return_lse=True)
    check((outs[0][0], lse, *outs[0][1:]), q, k, v, dout, None, "causal_top_left",
          dict(window_size=(4, 4)))


# ---- errors ---------------------------------------------------------------------------------------


def test_errors():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match=r"alibi_slopes: expected a torch\.Tensor or None, got "
                                        r"builtins\.list"):
        fat.attention(q, q, q, alibi_slopes=[0.5, 0.5])
    with pytest.raises(TypeError, match=r"alibi_slopes: expected a torch\.Tensor"):
        fat.FlashAttnFunction.apply(q, q, q, None, "none", "fp32", None, False, (-1, -1), 0.0,
                                    (0.5, 0.5))
    with pytest.raises(TypeError, match=r"alibi_slopes\.dtype = float64, expected float32"):
        fat.attention(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"alibi_slopes\.dtype = bfloat16, expected float32"):
        flashattn.forward(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"alibi_slopes\.shape = \[3\] does not match q"):
        fat.attention(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match=r"window_size = \(-3, 0\): left = -3 is invalid"):
        fat.attention(q, q, q, window_size=(-3, 0))
    with pytest.raises(TypeError, match=r"window_size = 5 is not a pair"):
        fat.attention(q, q, q, window_size=5)
    with pytest.raises(ValueError, match=r"softcap = -2\.0 is invalid"):
        fat.FlashAttnFunction.apply(q, q, q, None, "none", "fp32", None, False, (-1, -1), -2.0)
    with pytest.raises(TypeError, match=r"softcap = .* is not a real number"):
        fat.attention(q, q, q, softcap=torch.tensor(2.0))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and flashattn's CUDA backend")
def test_cuda_slopes_on_another_device():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    with pytest.raises(ValueError, match=r"alibi_slopes.*device|devices"):
        fat.attention(q, q, q, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match=r"alibi_slopes.*device|devices"):
        flashattn.forward(q.cpu(), q.cpu(), q.cpu(), alibi_slopes=torch.ones(2, device="cuda"))
