"""flashattn with PyTorch tensors (CPU, and CUDA where available) against the float64 reference
(reference.py, the C++ suite's): the low-level functions, flashattn.torch.attention (custom ops,
also under torch.compile), FlashAttnFunction, gradcheck, bfloat16, streams and errors."""

import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import flashattn.torch as fat  # noqa: E402
from conftest import TOL  # noqa: E402
from torch_helpers import (  # noqa: E402
    DEVICES, DTYPE_NAMES, HAS_CUDA, MASKS, attention_ref, reference64, rel_err, skip_unsupported)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# (B, Hq, Hkv, Sq, Skv, D)
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 4, 2, 17, 33, 64),
    (1, 6, 1, 97, 64, 40),
    (2, 2, 2, 70, 9, 128),
    (1, 8, 4, 128, 255, 111),
]


def make(shape, dtype, device, layout, gen):
    b, h, s, d = shape
    if layout == "bhsd":
        return torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).to(device, dtype)
    x = torch.randn(b, s, h, d, generator=gen, dtype=torch.float64).to(device, dtype)
    return x.transpose(1, 2)


def problem(cfg, dtype, device, layout="bhsd", seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, sq, skv, d = cfg
    return (make((b, hq, sq, d), dtype, device, layout, gen),
            make((b, hkv, skv, d), dtype, device, layout, gen),
            make((b, hkv, skv, d), dtype, device, layout, gen),
            make((b, hq, sq, d), dtype, device, layout, gen))


def tolerance(dtype, device, naive_err, kind):
    """The C++ suite's tolerance on the CPU. On CUDA (float32 via split TF32 products, and the
    low-precision kernels), FlashAttention's criterion: at most twice the error of plain attention
    computed by PyTorch in the same dtype (naive_err), with a floor: the CPU tolerance, and for
    float32 the CUDA suite's measured bound for the fp32 mode (5e-5, tests/cuda). The kernels'
    accuracy is that suite's business; here a wrong stride, mask or stream would show as O(1)."""
    tol = TOL[DTYPE_NAMES[dtype]][kind]
    if device == "cuda":
        tol = max(tol, 2 * naive_err, 5e-5 if dtype == torch.float32 else 0.0)
    return tol


def reference_and_naive(q, k, v, dout, scale, mask):
    """The float64 reference (out, lse, dq, dk, dv), and the errors of plain attention in q's
    dtype (PyTorch, autograd) against it."""
    ref = reference64(q, k, v, dout, scale, mask)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with _no_tf32():
        out, lse = attention_ref(qq, kk, vv, scale, mask, dtype=q.dtype)
        out.backward(dout)
    naive = (out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad)
    return ref, [rel_err(n, r) for n, r in zip(naive, ref)]


class _no_tf32:
    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *a):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def check(outs, ref, naive_errs, dtype, device):
    names = ("out", "lse", "dq", "dk", "dv")
    kinds = ("out", "lse", "grad", "grad", "grad")
    for name, kind, got, r, ne in zip(names, kinds, outs, ref, naive_errs):
        err = rel_err(got, r)
        tol = tolerance(dtype, device, ne, kind)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} (naive {ne:.1e})"


# ---- low-level functions on torch tensors -------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_low_level(cfg, device, dtype, mask, layout):
    skip_unsupported(device, dtype)
    q, k, v, dout = problem(cfg, dtype, device, layout)
    out, lse = flashattn.forward(q, k, v, mask=mask)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == dtype
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3] and lse.device == q.device
    assert out.stride() == torch.empty_like(q).stride()  # laid out like q
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, mask=mask)
    for g, x in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == x.shape and g.dtype == dtype and g.device == x.device
    ref, naive = reference_and_naive(q, k, v, dout, None, mask)
    check((out, lse, dq, dk, dv), ref, naive, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
def test_low_level_given_outputs_and_requires_grad_inputs(device):
    q, k, v, dout = problem((2, 4, 2, 33, 40, 32), torch.float32, device)
    q.requires_grad_()
    out = torch.full_like(q, float("nan")).requires_grad_(False)
    lse = torch.full(q.shape[:3], float("nan"), device=device)
    r_out, r_lse = flashattn.forward(q, k, v, out=out, lse=lse, mask="causal_bottom_right")
    assert r_out is out and r_lse is lse and not out.requires_grad
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    r = flashattn.backward(dout, q, k, v, out, lse, mask="causal_bottom_right",
                           dq=grads[0], dk=grads[1], dv=grads[2])
    assert all(a is b for a, b in zip(r, grads))
    ref, naive = reference_and_naive(q, k, v, dout, None, "causal_bottom_right")
    check((out, lse, *grads), ref, naive, torch.float32, device)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and flashattn's CUDA backend")
def test_cuda_runs_on_torchs_current_stream():
    """Inputs produced on a side stream and consumed right away: only correct if flashattn's
    kernels are queued on that same stream (PyTorch's current stream)."""
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so a wrong stream would race
        q, k, v, dout = problem((4, 8, 8, 512, 512, 64), torch.float32, "cuda")
        q, k, v = q * 1.0, k * 1.0, v * 1.0  # produced by kernels on s
        out, lse = flashattn.forward(q, k, v)
        dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse)
    s.synchronize()
    ref, naive = reference_and_naive(q, k, v, dout, None, "none")
    check((out, lse, dq, dk, dv), ref, naive, torch.float32, "cuda")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and flashattn's CUDA backend")
def test_cuda_tf32_precision():
    q, k, v, dout = problem((2, 4, 4, 256, 256, 64), torch.float32, "cuda")
    out, lse = flashattn.forward(q, k, v, precision="tf32")
    dq, dk, dv = flashattn.backward(dout, q, k, v, out, lse, precision="tf32")
    ref, _ = reference_and_naive(q, k, v, dout, None, "none")
    for name, got, r in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        err = rel_err(got, r)
        assert err <= 2e-2, f"{name}: tf32 relative error {err:.3e}"


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and flashattn's CUDA backend")
def test_cuda_errors():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    # Valid, but not served on CUDA: NotImplementedError with the library's message.
    with pytest.raises(NotImplementedError, match=r"float64 is supported on the CPU only"):
        x = q.double()
        flashattn.forward(x, x, x)
    with pytest.raises(ValueError, match=r"different devices"):
        flashattn.forward(q, q.cpu(), q)


def test_torch_errors():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(TypeError, match=r"q\.dtype = int64 is not supported"):
        flashattn.forward(q.long(), q, q)
    with pytest.raises(TypeError, match=r"k\.dtype: float16"):
        flashattn.forward(q, q.half(), q)
    with pytest.raises(ValueError, match=r"k\.shape\[3\] \(head_dim\) = 8"):
        fat.attention(q, q[..., :8], q)
    with pytest.raises(ValueError, match=r"mask = 'upper' is unknown"):
        fat.attention(q, q, q, mask="upper")
    with pytest.raises(ValueError, match=r"output out aliases input q"):
        flashattn.forward(q, q.clone(), q.clone(), out=q)


# ---- differentiable: custom op and autograd.Function --------------------------------------------


@pytest.mark.parametrize("impl", ["custom_op", "function"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("device", DEVICES)
def test_autograd(impl, device, mask):
    dtype = torch.float32
    q, k, v, dout = problem((2, 6, 2, 45, 38, 64), dtype, device, "bshd", seed=3)
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    if impl == "custom_op":
        out, lse = fat.attention(qq, kk, vv, mask=mask, return_lse=True)
    else:
        out, lse = fat.FlashAttnFunction.apply(qq, kk, vv, None, mask)
    assert out.requires_grad and not lse.requires_grad
    out.backward(dout)
    ref, naive = reference_and_naive(q, k, v, dout, None, mask)
    check((out.detach(), lse, qq.grad, kk.grad, vv.grad), ref, naive, dtype, device)


@pytest.mark.parametrize("impl", ["custom_op", "function"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("cfg", [(1, 2, 2, 5, 7, 4), (2, 4, 2, 6, 3, 8), (1, 3, 1, 9, 9, 3)],
                         ids=lambda c: "x".join(map(str, c)))
def test_gradcheck_float64_cpu(impl, mask, cfg):
    q, k, v, _ = problem(cfg, torch.float64, "cpu", "bshd", seed=5)
    inputs = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    if impl == "custom_op":
        fn = lambda q, k, v: fat.attention(q, k, v, mask=mask, softmax_scale=0.8)  # noqa: E731
    else:
        fn = lambda q, k, v: fat.FlashAttnFunction.apply(q, k, v, 0.8, mask)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("det", [(), (True,)], ids=["deterministic_default", "deterministic"])
def test_opcheck_custom_ops(det):
    """torch.library.opcheck: schema, fake (meta) implementations, autograd registration; with
    deterministic left to its default (callers written before it) and given."""
    q, k, v, dout = problem((1, 4, 2, 9, 11, 16), torch.float32, "cpu", "bshd")
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    args = (0.0, 2, 0, 0, *det)
    torch.library.opcheck(torch.ops.flashattn.fwd.default, (q, k, v, *args))
    out, lse = torch.ops.flashattn.fwd(q, k, v, *args)
    torch.library.opcheck(torch.ops.flashattn.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, *args))
    qkv = torch.randn(2, 7, 3, 4, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.flashattn.qkvpacked_fwd.default, (qkv, *args))
    kv = torch.randn(2, 5, 2, 2, 16, requires_grad=True)
    qb = torch.randn(2, 7, 4, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.flashattn.kvpacked_fwd.default, (qb, kv, *args))
    # The [B, S, H, D] ops behind flash_attn_func (GQA: 4 query heads over 2 kv heads).
    kb, vb = torch.randn(2, 5, 2, 16, requires_grad=True), torch.randn(2, 5, 2, 16, requires_grad=True)
    torch.library.opcheck(torch.ops.flashattn.bshd_fwd.default, (qb, kb, vb, *args))
    ob, lb = torch.ops.flashattn.bshd_fwd(qb, kb, vb, *args)
    torch.library.opcheck(torch.ops.flashattn.bshd_bwd.default,
                          (torch.randn_like(ob), qb.detach(), kb.detach(), vb.detach(), ob.detach(), lb, *args))


def spy_backward(monkeypatch):
    """Records the deterministic flag of every _ext.backward call (the positional argument after
    the stream, before the window, softcap and slopes; checked to be a real bool, since the
    stream before it is an int and 0 == False)."""
    from flashattn import _ext
    seen, real = [], _ext.backward

    def call(*args, **kw):
        assert len(args) == 19 and type(args[14]) is bool, args[9:]
        seen.append(args[14])
        return real(*args, **kw)

    monkeypatch.setattr(_ext, "backward", call)
    return seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_deterministic_reaches_the_backward(monkeypatch, python_eager_path, compiled):
    """Its effect shows only on CUDA float16/bfloat16 (the split backward instead of dq atomics),
    so check that autograd hands it to the library's backward: custom op (eager and under
    torch.compile) and autograd.Function, given and left to its default."""
    seen = spy_backward(monkeypatch)
    torch._dynamo.reset()
    q, k, v, dout = problem((1, 2, 2, 6, 7, 8), torch.float32, "cpu", "bshd")

    def op(q, k, v, **kw):
        return fat.attention(q, k, v, mask="causal_top_left", **kw)

    op = torch.compile(op, backend="aot_eager", fullgraph=True) if compiled else op
    calls = [lambda q, k, v: op(q, k, v, deterministic=True),
             lambda q, k, v: op(q, k, v, deterministic=False),
             lambda q, k, v: op(q, k, v),
             lambda q, k, v: fat.FlashAttnFunction.apply(q, k, v, None, "none", "fp32", None,
                                                         True)[0],
             lambda q, k, v: fat.FlashAttnFunction.apply(q, k, v)[0]]
    for fn in calls:
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        fn(qq, kk, vv).backward(dout)
        assert torch.isfinite(qq.grad).all()
    assert seen == [True, False, False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_backward_is_bitwise_reproducible(device, dtype):
    """deterministic=True: the same gradients, bit for bit, run after run (on CUDA
    float16/bfloat16 this is the split dq + dk/dv backward), and they are right. On the CPU
    the default is deterministic too."""
    q, k, v, dout = problem((2, 4, 2, 200, 170, 64), dtype, device, "bshd", seed=9)
    modes = (True, False) if device == "cpu" else (True,)
    runs = []
    for det in modes:
        for _ in range(3):
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out, lse = fat.attention(qq, kk, vv, mask="causal_bottom_right", deterministic=det,
                                     return_lse=True)
            out.backward(dout)
            runs.append((out.detach(), lse, qq.grad, kk.grad, vv.grad))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref, naive = reference_and_naive(q, k, v, dout, None, "causal_bottom_right")
    check(runs[0], ref, naive, dtype, device)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile(device, backend):
    if backend == "inductor" and device == "cpu" and not _has_cxx():
        pytest.skip("inductor on the CPU needs a C++ compiler")
    torch._dynamo.reset()
    q, k, v, dout = problem((2, 4, 2, 40, 52, 32), torch.float32, device, "bshd", seed=7)

    def f(q, k, v):
        out = fat.attention(q * 1.5, k, v, mask="causal_bottom_right")
        return torch.sin(out) * 2

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    runs = []
    for fn in (f, compiled):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        y = fn(qq, kk, vv)
        y.backward(dout)
        runs.append((y.detach(), qq.grad, kk.grad, vv.grad))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _has_cxx():
    import shutil
    return shutil.which("g++") is not None or shutil.which("c++") is not None


def test_cpu_uses_torch_thread_count_and_is_deterministic():
    q, k, v, dout = problem((2, 4, 2, 130, 140, 64), torch.float32, "cpu", "bshd")
    saved = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = fat.attention(qq, kk, vv, mask="causal_top_left")
            out.backward(dout)
            results.append([out.detach(), qq.grad, kk.grad, vv.grad])
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_sdpa_agrees_with_the_reference():
    """The float64 reference and the plain PyTorch attention behind the naive baseline, both
    against PyTorch's F.scaled_dot_product_attention, an implementation independent of both, for
    all three masks (rows that see a key): out, and dq, dk, dv by autograd through SDPA."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    q, k, v, dout = problem((2, 4, 2, 12, 20, 16), torch.float64, "cpu")
    for mask, kw in (("none", {}), ("causal_top_left", {"is_causal": True}),
                     ("causal_bottom_right", {"attn_mask": causal_lower_right(12, 20)})):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        theirs = F.scaled_dot_product_attention(qq, kk.repeat_interleave(2, 1),
                                                vv.repeat_interleave(2, 1), **kw)
        theirs.backward(dout)
        ref = reference64(q, k, v, dout, None, mask)
        for name, a, b in zip(("out", "dq", "dk", "dv"), (ref[0], *ref[2:]),
                              (theirs.detach(), qq.grad, kk.grad, vv.grad)):
            # SDPA takes the scale 1/sqrt(D) in float64, the reference its float32 rounding.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{mask} {name}")
        naive, _ = attention_ref(q, k, v, None, mask)
        torch.testing.assert_close(naive, theirs.detach(), rtol=1e-6, atol=1e-6)


def test_sdpa_spellings():
    """attention() takes SDPA's is_causal / scale / enable_gqa, and mask="causal": each gives the
    bits of its library spelling, against SDPA itself for the SDPA ones."""
    g = torch.Generator().manual_seed(41)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k = torch.randn(2, 2, 13, 16, generator=g)
    v = torch.randn(2, 2, 13, 16, generator=g)
    same = torch.equal
    assert same(fat.attention(q, k, v, is_causal=True), fat.attention(q, k, v, mask="causal_top_left"))
    assert same(fat.attention(q, k, v, mask="causal"), fat.attention(q, k, v, mask="causal_bottom_right"))
    assert same(fat.attention(q, k, v, scale=0.3), fat.attention(q, k, v, softmax_scale=0.3))
    assert same(fat.attention(q, k, v, enable_gqa=True), fat.attention(q, k, v))
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True, scale=0.3)
    got = fat.attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        fat.attention(q, k, v, enable_gqa=False)
    with pytest.raises(TypeError, match="not both"):
        fat.attention(q, k, v, scale=0.3, softmax_scale=0.3)
    with pytest.raises(TypeError, match="give one of them"):
        fat.attention(q, k, v, is_causal=True, mask="causal_bottom_right")
    with pytest.raises(TypeError, match="is_causal"):
        fat.attention(q, k, v, is_causal=1)


@pytest.mark.parametrize("sq,skv", [(0, 7), (5, 0), (0, 0)])
def test_empty_sequences_as_sdpa(sq, skv):
    """Sq = 0 or Skv = 0: the values and gradients SDPA gives (empty, or zeros)."""
    g = torch.Generator().manual_seed(43)
    q = torch.randn(2, 4, sq, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, skv, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, skv, 16, generator=g, requires_grad=True)
    out, lse = fat.attention(q, k, v, return_lse=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
    assert out.shape == ref.shape == (2, 4, sq, 16)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(ref, torch.zeros_like(ref))
    assert lse.shape == (2, 4, sq) and bool((lse == float("-inf")).all())
    (out.sum() + 1.0).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    with pytest.raises(ValueError, match="Hkv"):
        fat.attention(q, torch.zeros(2, 3, skv, 16), torch.zeros(2, 3, skv, 16))


def test_first_eager_call_imports_no_dynamo():
    """import flashattn.torch and a first forward+backward leave torch._dynamo unimported (its
    import made the first call take ~2 s where SDPA's takes milliseconds)."""
    import subprocess
    import sys

    code = ("import sys, torch, flashattn.torch as fat\n"
            "q = torch.randn(1, 2, 33, 16, requires_grad=True)\n"
            "fat.attention(q, q, q, mask='causal').sum().backward()\n"
            "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", r.stdout


# ---- CPU threads shared with PyTorch -------------------------------------------------------------


def test_cpu_calls_run_on_torch_threads_by_default():
    """`import flashattn.torch` puts the library's CPU calls on torch's OpenMP threads where torch
    uses OpenMP (its spinning workers and a second pool would compete for the cores);
    FLASHATTN_TORCH_THREADS=0 keeps the library's own pools."""
    import os
    import subprocess
    import sys
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("this torch does not run its CPU operators on OpenMP")
    # (The library's own report and the package's getter must agree.)
    code = ("import flashattn, flashattn.torch as fat; "
            "on = \"caller's thread team\" in flashattn.build_info(); "
            "assert on == fat.torch_threads_in_use(), on; print(on)")
    for env_value, want in ((None, "True"), ("0", "False"), ("1", "True")):
        env = dict(os.environ)
        env.pop("FLASHATTN_TORCH_THREADS", None)
        if env_value is not None:
            env["FLASHATTN_TORCH_THREADS"] = env_value
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, (env_value, r.stdout, r.stderr)


def test_cpu_calls_on_torch_threads_are_bitwise_the_same():
    """With torch's OpenMP runtime (the default at import where torch uses OpenMP) and with the
    library's own pools, a CPU forward and backward give the same bits (the work is handed out
    dynamically either way; each output has one writer and a fixed order)."""
    import flashattn
    import flashattn.torch as fat
    on = fat.use_torch_threads(True)
    if not on:
        pytest.skip("this torch does not run its CPU operators on OpenMP (or not on Linux)")
    assert "caller's thread team" in flashattn.build_info()
    assert fat.torch_threads_in_use()
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, 4, 97, 40, generator=g) for _ in range(4))

    def run():
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = fat.attention(qq, kk, vv, mask="causal_bottom_right", num_threads=2)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    try:
        shared = run()
        fat.use_torch_threads(False)
        assert "thread pools" in flashattn.build_info()
        assert not fat.torch_threads_in_use()
        own = run()
    finally:
        fat.use_torch_threads(True)
    for a, b in zip(shared, own):
        assert torch.equal(a, b)
