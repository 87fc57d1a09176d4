"""flashattn.torch's C++ eager ops (python/src/torch_ops.cpp: flashattn_eager::fwd, qkvpacked_fwd,
kvpacked_fwd, varlen_fwd - an autograd node and the library calls in C++): the same results as
the Python autograd path, bit for bit, for every option (a window, softcap, slopes or scale lost
on the way to the backward changes the gradients), every layout (flash_attn_func's [B, S, H, D],
attention()'s [B, H, S, D] views, packed qkv / kv with their gradients in one buffer, packed
variable-length batches with seqused_k), the same exceptions, and the no-grad / inference paths. Runs where the ops were built for this torch
(scripts/test requires it: FLASHATTN_TEST_REQUIRE_TORCH_OPS=1); the float64 reference checks of
the other test files run through them too, since they are the default eager path."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn.torch as fat  # noqa: E402
from flashattn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,  # noqa: E402
                       flash_attn_varlen_func)
from torch_helpers import DEVICES, assert_cache_agrees  # noqa: E402

pytestmark = pytest.mark.skipif(not fat.eager_ops_available(),
                                reason="flashattn.torch's C++ eager ops are not built for this torch")

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "causal-window-softcap": dict(causal=True, window_size=(5, -1), softcap=2.5),
    "alibi-h": dict(alibi="h"),
    "alibi-bh-scale": dict(alibi="bh", softmax_scale=0.3),
    "deterministic": dict(causal=True, deterministic=True),
}


def _both_paths(fn):
    """fn() through the C++ ops, then through the Python path."""
    results = []
    for on in (True, False):
        prev = fat.use_eager_ops(on)
        try:
            results.append(fn())
        finally:
            fat.use_eager_ops(prev)
    return results


def _same_on_both_paths(run, finite=True):
    """run() through both paths: every result finite (finite=False: free of NaN, as where an empty
    sequence's lse is -inf) and bit for bit the same."""
    cpp, py = _both_paths(run)
    for i, (a, b) in enumerate(zip(cpp, py)):
        assert torch.isfinite(a).all() if finite else not torch.isnan(a).any(), f"result {i}"
        assert torch.equal(a, b), f"result {i}"


def _inputs(device, dtype, b=2, sq=13, skv=17, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, skv, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    return q, k, v


def _slopes(kind, b, hq, device):
    if kind is None:
        return None
    s = torch.linspace(0.05, 0.5, hq)
    return (s if kind == "h" else torch.stack([s * (i + 1) for i in range(b)])).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_flash_attn_func_same_as_python_path(device, dtype, case):
    kw = dict(CASES[case])
    q0, k0, v0 = _inputs(device, dtype)
    kw["alibi_slopes"] = _slopes(kw.pop("alibi", None), q0.shape[0], q0.shape[2], device)
    dout = torch.randn(q0.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)

    def run():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
        assert not lse.requires_grad
        out.backward(dout)
        return out.detach(), lse, q.grad, k.grad, v.grad

    _same_on_both_paths(run)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_views_same_as_python_path(device):
    """attention() on transposed views of [B, S, H, D] tensors ([B, H, S, D] strides that are not
    contiguous), with a gradient of stride 0 (out.sum()) and SDPA's names."""
    q0, k0, v0 = _inputs(device, torch.float32, sq=9, skv=9)

    def run():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = fat.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                            window_size=(2, 0), softcap=1.5)
        out.sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    _same_on_both_paths(run)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["qkvpacked", "kvpacked"])
@pytest.mark.parametrize("case", ["plain", "causal-window-softcap", "alibi-bh-scale"])
def test_packed_same_as_python_path(device, fn, case):
    kw = dict(CASES[case])
    b, s, hq, hkv, d = 2, 11, 4, (4 if fn == "qkvpacked" else 2), 16
    kw["alibi_slopes"] = _slopes(kw.pop("alibi", None), b, hq, device)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(b, s, 3, hq, d, generator=g).to(device) if fn == "qkvpacked" else \
        (torch.randn(b, s, hq, d, generator=g).to(device), torch.randn(b, s + 4, 2, hkv, d, generator=g).to(device))
    dout = torch.randn(b, s, hq, d, generator=g).to(device)

    def run():
        if fn == "qkvpacked":
            qkv = x0.clone().requires_grad_()
            out, lse, _ = flash_attn_qkvpacked_func(qkv, return_attn_probs=True, **kw)
            out.backward(dout)
            return out.detach(), lse, qkv.grad
        q, kv = (x.clone().requires_grad_() for x in x0)
        out, lse, _ = flash_attn_kvpacked_func(q, kv, return_attn_probs=True, **kw)
        out.backward(dout)
        return out.detach(), lse, q.grad, kv.grad

    _same_on_both_paths(run)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("used", [False, True], ids=["all-keys", "seqused_k"])
def test_varlen_same_as_python_path(device, used):
    lens_q, lens_k = [3, 0, 7, 1], [5, 2, 7, 4]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    seqused = torch.tensor([4, 2, 5, 4], dtype=torch.int32, device=device) if used else None
    g = torch.Generator().manual_seed(4)
    q0 = torch.randn(sum(lens_q), 4, 16, generator=g).to(device)
    k0, v0 = (torch.randn(sum(lens_k), 2, 16, generator=g).to(device) for _ in range(2))
    dout = torch.randn(q0.shape, generator=g).to(device)
    slopes = torch.linspace(0.1, 0.4, 4).to(device)

    def run():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        mods = dict(window_size=(3, 0), softcap=2.0, alibi_slopes=slopes)
        if used:  # (flash_attn 2.x's varlen function has no seqused_k)
            out, lse = fat.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seqused_k=seqused,
                                            mask="causal", return_lse=True, **mods)
        else:
            out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                 return_attn_probs=True, **mods)
        out.backward(dout)
        return out.detach(), lse, q.grad, k.grad, v.grad

    _same_on_both_paths(run, finite=False)


@pytest.mark.parametrize("fn", ["func", "qkvpacked", "varlen"])
def test_compiled_same_as_python_path(fn):
    """Under torch.compile the custom ops flashattn::* run; their implementations call the C++
    ops (no autograd of their own) where loaded: the same results as their Python path."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    q0, k0, v0 = (torch.randn(2, 7, 2, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)

    def f(q, k, v):
        if fn == "func":
            return flash_attn_func(q, k, v, causal=True, softcap=1.5)
        if fn == "qkvpacked":
            return flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), window_size=(2, 1))
        return flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 7, 7, causal=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)

    def run():
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = compiled(q, k, v)
        out.square().sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    _same_on_both_paths(run)


class _Spy:
    """Counts the calls of module.name (a module-level function the code under test looks up at
    call time); with refuse (a message) a call fails the test instead."""

    def __init__(self, module, name, refuse=None):
        self.module, self.name, self.refuse, self.calls = module, name, refuse, 0

    def __enter__(self):
        self.saved = getattr(self.module, self.name)

        def spy(*a, **kw):
            assert self.refuse is None, self.refuse
            self.calls += 1
            return self.saved(*a, **kw)
        setattr(self.module, self.name, spy)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.saved)


def _no_python_impl():
    """With the custom ops' C++ kernels on, the dispatcher runs those: a custom op's Python
    implementation calling the C++ op (flashattn.torch._cpp) fails the test."""
    return _Spy(fat, "_cpp", refuse="a custom op's Python implementation ran")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["func", "qkvpacked", "kvpacked", "varlen", "attention"])
def test_compiled_graph_runs_the_custom_ops_cpp_kernels(fn, device):
    """A compiled training step's op calls (flashattn::* forward and backward) run the C++ kernels
    registered for the custom ops, not their Python implementations; with the eager ops off
    (use_eager_ops(False)) the Python implementations serve them (their library calls are
    counted), with the same results bit for bit."""
    g = torch.Generator().manual_seed(9)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q0, k0, v0 = (torch.randn(2, 7, 2, 16, generator=g).to(device, dtype) for _ in range(3))
    cu = torch.tensor([0, 7, 14], dtype=torch.int32, device=device)
    calls = {
        "func": lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(3, 0)),
        "qkvpacked": lambda q, k, v: flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), softcap=2.0),
        "kvpacked": lambda q, k, v: flash_attn_kvpacked_func(q, torch.stack([k, v], 2), deterministic=True),
        "varlen": lambda q, k, v: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                                         cu, cu, 7, 7, causal=True),
        "attention": lambda q, k, v: fat.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True),
    }

    def run(eager_on):
        torch._dynamo.reset()
        prev = fat.use_eager_ops(eager_on)
        try:
            compiled = torch.compile(calls[fn], backend="aot_eager", fullgraph=True)
            res = []
            for _ in range(2):  # (the first call compiles)
                q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
                out = compiled(q, k, v)
                out.square().sum().backward()
                res += [out.detach(), q.grad, k.grad, v.grad]
            return res
        finally:
            fat.use_eager_ops(prev)

    with _no_python_impl():
        cpp = run(True)
    with _Spy(fat, "_call_fwd") as dense, _Spy(fat, "_call_fwd_varlen") as varlen:
        python = run(False)
    assert dense.calls + varlen.calls >= 2  # (the two compiled steps' forwards, through the Python implementation)
    for i, (a, b) in enumerate(zip(cpp, python)):
        assert torch.isfinite(a).all(), f"result {i}"
        assert torch.equal(a, b), f"result {i}"


def _autograd_kernel_source(op):
    """Where the op's active Autograd kernel was registered (the dispatcher's own account)."""
    for line in torch._C._dispatch_dump(op).splitlines():
        if line.startswith("Autograd[alias]:"):
            return line
    return ""


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 9),
                    reason="the C++ Autograd kernel needs torch >= 2.9 (the dispatcher's computed kernels)")
def test_custom_ops_autograd_kernel_in_cpp():
    """With the eager ops on, every flashattn:: custom op's Autograd key runs the C++ kernel of
    python/src/torch_ops.cpp (the Python one only for calls that need a gradient); with them off,
    the custom op machinery's Python kernel again."""
    names = ["fwd", "bwd", "bshd_fwd", "bshd_bwd", "qkvpacked_fwd", "qkvpacked_bwd", "kvpacked_fwd",
             "kvpacked_bwd", "varlen_fwd", "varlen_bwd"]
    for n in names:
        assert "torch_ops.cpp" in _autograd_kernel_source("flashattn::" + n), n
    prev = fat.use_eager_ops(False)
    try:
        for n in names:
            src = _autograd_kernel_source("flashattn::" + n)
            assert src and "torch_ops.cpp" not in src, (n, src)
    finally:
        fat.use_eager_ops(prev)
    assert "torch_ops.cpp" in _autograd_kernel_source("flashattn::fwd")


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_called_directly_as_with_the_python_kernels(device):
    """torch.ops.flashattn.* called directly: without a gradient (no_grad, or inputs that need
    none) the C++ Autograd kernel runs the op below autograd; with one it hands the call to the
    custom op's Python kernel - the outputs, the gradients (through the registered backward) and
    the error of the backward op's missing derivative are those of the Python kernels (eager ops
    off), bit for bit."""
    g = torch.Generator().manual_seed(21)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q0, k0, v0, do = (torch.randn(2, 9, 3, 16, generator=g).to(device, dtype) for _ in range(4))
    opts = dict(deterministic=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None)

    def run():
        res = []
        with torch.no_grad():
            res += list(torch.ops.flashattn.bshd_fwd(q0, k0, v0, 0.0, 2, 0, 0, **opts))
        res += list(torch.ops.flashattn.bshd_fwd(q0, k0, v0, 0.0, 2, 0, 0, **opts))  # (nothing needs grad)
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out, lse = torch.ops.flashattn.bshd_fwd(q, k, v, 0.0, 2, 0, 0, **opts)
        assert out.grad_fn is not None
        out.backward(do)
        res += [out.detach(), lse.detach(), q.grad, k.grad, v.grad]
        # The backward op has no derivative: with an input that needs a gradient, backward through
        # its outputs fails (the custom op machinery's error).
        dq, _, _ = torch.ops.flashattn.bshd_bwd(do.clone().requires_grad_(), q0, k0, v0, res[0], res[1],
                                                 0.0, 2, 0, 0, **opts)
        with pytest.raises(RuntimeError) as e:
            dq.sum().backward()
        return res, type(e.value), str(e.value)

    cpp, cpp_exc, cpp_msg = run()
    prev = fat.use_eager_ops(False)
    try:
        py, py_exc, py_msg = run()
    finally:
        fat.use_eager_ops(prev)
    assert cpp_exc is py_exc and cpp_msg == py_msg
    for i, (a, b) in enumerate(zip(cpp, py)):
        assert torch.isfinite(a.float()).all(), f"result {i}"
        assert torch.equal(a, b), f"result {i}"


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_not_contiguous(device):
    """A q whose head dim has stride != 1 (a transposed leaf) is made contiguous for the library in
    the forward and again in the backward (the node saves the inputs as given)."""
    g = torch.Generator().manual_seed(8)
    q0 = torch.randn(1, 2, 16, 9, generator=g).to(device)  # [B, H, D, S]: q = q0.transpose(-1, -2)
    k0, v0 = (torch.randn(1, 2, 9, 16, generator=g).to(device) for _ in range(2))

    def run():
        qt, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = fat.attention(qt.transpose(-1, -2), k, v, mask="causal")
        out.sum().backward()
        return out.detach(), qt.grad, k.grad, v.grad

    _same_on_both_paths(run)


def test_num_threads_beyond_int32():
    q, k, v = _inputs("cpu", torch.float32)
    for on in (True, False):
        prev = fat.use_eager_ops(on)
        try:
            with pytest.raises((ValueError, TypeError, OverflowError)):
                fat.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), num_threads=2 ** 32)
        finally:
            fat.use_eager_ops(prev)


def test_no_grad_and_inference_mode():
    q, k, v = (x.requires_grad_() for x in _inputs("cpu", torch.float32))
    ref = flash_attn_func(q, k, v, causal=True)
    assert ref.grad_fn is not None
    with torch.no_grad():
        a = flash_attn_func(q, k, v, causal=True)
    with torch.inference_mode():
        b = flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
    assert a.grad_fn is None and b.grad_fn is None
    assert torch.equal(a, ref.detach()) and torch.equal(b, ref.detach())


def test_only_some_inputs_require_grad():
    q, k, v = _inputs("cpu", torch.float32)
    k.requires_grad_()
    flash_attn_func(q, k, v).sum().backward()
    assert q.grad is None and v.grad is None and torch.isfinite(k.grad).all()


def test_varlen_errors_as_python_path():
    q = torch.randn(5, 2, 8)
    c = torch.tensor([0, 2, 5], dtype=torch.int32)

    def run():
        msgs = []
        for bad, exc in ((c.long(), TypeError), (torch.tensor([0, 3, 2], dtype=torch.int32), ValueError)):
            with pytest.raises(exc) as e:
                flash_attn_varlen_func(q.clone().requires_grad_(), q, q, bad, c, 3, 3)
            msgs.append(str(e.value))
        return msgs

    cpp, py = _both_paths(run)
    assert cpp == py


@pytest.mark.parametrize("bad, exc, match", [
    (lambda q, k, v: (q.double(), k, v), TypeError, "dtype"),
    (lambda q, k, v: (q[..., :8], k, v), ValueError, "head_dim"),
    (lambda q, k, v: (q, k[:, :, :1], v), ValueError, "k"),
])
def test_errors_as_python_path(bad, exc, match):
    q, k, v = bad(*_inputs("cpu", torch.float32))

    def run():
        with pytest.raises(exc, match=match) as e:
            flash_attn_func(q.requires_grad_(), k, v)
        return str(e.value)

    cpp, py = _both_paths(run)
    assert cpp == py


def test_option_errors_as_python_path():
    q, k, v = _inputs("cpu", torch.float32)

    def run():
        msgs = []
        with pytest.raises(ValueError) as e:
            flash_attn_func(q, k, v, softmax_scale=1e-50)  # underflows to 0 in float32
        msgs.append(str(e.value))
        with pytest.raises(ValueError) as e:
            fat.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), num_threads=5000)
        msgs.append(str(e.value))
        return msgs

    cpp, py = _both_paths(run)
    assert cpp == py


def test_use_eager_ops_switch():
    prev = fat.use_eager_ops(False)
    try:
        assert fat.use_eager_ops(True) is False
        assert fat.use_eager_ops(prev) is True
    finally:
        fat.use_eager_ops(prev)


def test_attention_codes_cache_agrees_with_validation():
    """attention() remembers validated options by value and type: every variant gives what the
    uncached validation gives, refusals included, whatever was cached before."""
    variants = [(None, "none", "fp32", None, False, (-1, -1), 0.0),
                (None, "none", "fp32", None, 1, (-1, -1), 0.0),
                (None, "none", "fp32", None, True, [-1, -1], 0.0),
                (0.5, "causal_bottom_right", "tf32", 2, True, (3, 0), 1.5),
                (0.5, "causal_bottom_right", "tf32", 2.0, True, (3, 0), 1.5),
                (0.5, "causal_bottom_right", "tf32", 2, True, (3.0, 0), 1.5),
                (float("nan"), "none", "fp32", None, False, (-1, -1), 0.0),
                (None, "bogus", "fp32", None, False, (-1, -1), 0.0)]
    assert_cache_agrees(fat._codes_cached, fat._codes, variants)


# ---- the ops' direct entry (python/src/torch_fastcall.cpp) against the dispatcher ---------------


class _OpCalls:
    """Counts the C++ ops called through the dispatcher (flashattn.torch._cpp's fallback); with
    refuse=True a dispatcher call fails the test instead."""

    def __init__(self, refuse=False):
        self.calls, self.refuse, self.saved = 0, refuse, None

    def __enter__(self):
        self.saved = dict(fat._EAGER_OPS)

        def spy(op):
            def call(*a):
                assert not self.refuse, "the op was called through the dispatcher"
                self.calls += 1
                return op(*a)
            return call

        for name, (op, extra) in self.saved.items():
            fat._EAGER_OPS[name] = (spy(op), extra)
        return self

    def __exit__(self, *exc):
        fat._EAGER_OPS.update(self.saved)


def _without_direct_entry(fn):
    """fn() with no direct entry (neither the ops' nor the public functions'): every forward
    through the Python glue and the dispatcher."""
    prev = fat._FAST_FORWARD, fat._FAST_FLASH, fat._FAST_ATTENTION
    fat._FAST_FORWARD = fat._FAST_FLASH = fat._FAST_ATTENTION = None
    try:
        return fn()
    finally:
        fat._FAST_FORWARD, fat._FAST_FLASH, fat._FAST_ATTENTION = prev


def _every_forward_kind(device, dtype):
    """One training step per forward op kind (fwd via attention(), bshd_fwd, qkvpacked, kvpacked,
    varlen): out, lse where returned, and the gradients."""
    q0, k0, v0 = _inputs(device, dtype, hq=2, hkv=2)
    dout = torch.randn(q0.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    slopes = _slopes("h", q0.shape[0], q0.shape[2], device)
    cu = torch.tensor([0, 13, 26], dtype=torch.int32, device=device)
    cuk = torch.tensor([0, 17, 34], dtype=torch.int32, device=device)

    def leaf(x):
        return x.clone().requires_grad_()

    def step(call, *inputs):
        leaves = [leaf(x) for x in inputs]
        out = call(*leaves)
        res = list(out) if isinstance(out, tuple) else [out]
        res[0].backward(dout.reshape(res[0].shape) if res[0].shape != dout.shape else dout)
        return [r for r in res if r is not None] + [x.grad for x in leaves]

    r = []
    r += step(lambda q, k, v: fat.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                            mask="causal").transpose(1, 2), q0, k0, v0)
    r += step(lambda q, k, v: flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=2.0,
                                              alibi_slopes=slopes, return_attn_probs=True), q0, k0, v0)
    r += step(lambda qkv: flash_attn_qkvpacked_func(qkv, softmax_scale=0.3),
              torch.stack([q0, q0.flip(1), q0.flip(2)], dim=2))
    r += step(lambda q, kv: flash_attn_kvpacked_func(q, kv, deterministic=True), q0, torch.stack([k0, v0], dim=2))
    r += step(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cuk, 13, 17, causal=True),
              q0.reshape(-1, *q0.shape[2:]), k0.reshape(-1, *k0.shape[2:]), v0.reshape(-1, *v0.shape[2:]))
    return r


@pytest.mark.parametrize("device", DEVICES)
def test_direct_entry_serves_plain_calls_as_the_dispatcher(device):
    """A plain eager call of every forward kind never goes through the dispatcher, and gives what
    the op through the dispatcher gives, outputs and gradients, bit for bit."""
    with _OpCalls(refuse=True):
        direct = _every_forward_kind(device, torch.bfloat16 if device == "cuda" else torch.float32)
    with _OpCalls() as spy:
        via_op = _without_direct_entry(
            lambda: _every_forward_kind(device, torch.bfloat16 if device == "cuda" else torch.float32))
    assert spy.calls == 5
    assert len(direct) == len(via_op)
    for i, (a, b) in enumerate(zip(direct, via_op)):
        assert torch.isfinite(a).all(), f"result {i}"
        assert torch.equal(a, b), f"result {i}"


class _SeenOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # (vmap's fallback for ops without a rule)
def test_calls_that_need_the_dispatcher_get_it():
    """Dispatch and torch-function modes, inference mode, autocast, functorch and tensor subclasses
    act through the dispatcher: the direct entry declines them (the op runs, the mode sees it) and
    the results are the plain call's."""
    q, k, v = _inputs("cpu", torch.float32)
    ref = flash_attn_func(q, k, v, causal=True)

    with _OpCalls() as spy, _SeenOps() as seen:
        out = flash_attn_func(q, k, v, causal=True)
    assert spy.calls == 1 and "aten.empty.memory_format" in seen.names  # (the op's allocations)
    assert torch.equal(out, ref)

    class _Fn(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cases = {
        "torch function mode": lambda: _Fn(),
        "inference mode": lambda: torch.inference_mode(),
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=True),
    }
    for name, ctx in cases.items():
        with _OpCalls() as spy, ctx():
            out = flash_attn_func(q, k, v, causal=True)
        assert spy.calls == 1, name
        assert torch.equal(out, ref), name

    with _OpCalls() as spy:
        out = flash_attn_func(q.as_subclass(_Sub), k, v, causal=True)
    assert spy.calls == 1 and torch.equal(out.as_subclass(torch.Tensor), ref)

    with _OpCalls() as spy:  # vmap over a batch of 2 calls (functorch's batched tensors)
        outs = torch.func.vmap(lambda a: flash_attn_func(a, k, v, causal=True))(torch.stack([q, q]))
    assert spy.calls >= 1 and torch.equal(outs[0], ref) and torch.equal(outs[1], ref)


def _same_error_both_routes(call, exc, what=None):
    """call() raises exc with the same type and message with the direct entries and without them
    (the Python glue and the dispatcher)."""
    got = []
    for direct in (True, False):
        def run():
            with pytest.raises(exc) as e:
                call()
            return type(e.value), str(e.value)
        got.append(run() if direct else _without_direct_entry(run))
    assert got[0] == got[1], what


def test_direct_entry_errors_as_the_dispatcher():
    q, k, v = _inputs("cpu", torch.float32)
    bad = [((q.double(), k, v), {}, TypeError), ((q[..., :8], k, v), {}, ValueError),
           ((q, k[:, :, :1], v), {}, ValueError), ((q, k, v), dict(softmax_scale=1e-50), ValueError)]
    for args, kw, exc in bad:
        _same_error_both_routes(lambda: flash_attn_func(*args, **kw), exc, kw)


def test_direct_entry_is_seen_by_the_profiler():
    q, k, v = _inputs("cpu", torch.float32)
    with _OpCalls(refuse=True), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flash_attn_func(q, k, v)
    assert any(e.name == "flashattn_eager::fwd" for e in prof.events())


def _glue_calls(refuse=False):
    """Counts the flash_attn functions' Python glue (flash_attn_interface._codes, which every call
    the flash_attn entry leaves to Python reaches); refuse=True fails the test on one."""
    import flashattn.flash_attn_interface as fai
    return _Spy(fai, "_codes", refuse="the call went through the Python glue" if refuse else None)


def _flash_calls(device, dtype, **kw):
    """flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func and
    flash_attn_varlen_func (two sequences of 13 queries, 17 keys) with the same arguments, each a
    training step: the results (out or (out, lse)) and the gradients."""
    q0, k0, v0 = _inputs(device, dtype, hq=2, hkv=2)
    cu_q = torch.tensor([0, 13, 26], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 17, 34], dtype=torch.int32, device=device)

    def varlen(q, k, v, **kw):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 17, **kw)

    res = []
    for fn, inputs in ((flash_attn_func, (q0, k0, v0)),
                       (flash_attn_qkvpacked_func, (torch.stack([q0, q0.flip(1), q0.flip(2)], dim=2),)),
                       (flash_attn_kvpacked_func, (q0, torch.stack([k0, v0], dim=2))),
                       (varlen, tuple(x.reshape(-1, *x.shape[2:]) for x in (q0, k0, v0)))):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves, **kw)
        outs = list(out) if isinstance(out, tuple) else [out]
        outs[0].sum().backward()
        res += [r for r in outs if r is not None] + [x.grad for x in leaves]
    return res


# (arguments, whether the C++ entry takes them): what it leaves to the Python function needs a
# conversion (numpy or int flags, an int scale), raises, or shifts the returned LSE (ALiBi).
FLASH_ARGS = [
    (dict(), True),
    (dict(causal=True, softmax_scale=0.25, window_size=(5, 0), softcap=3.0), True),
    (dict(window_size=[-7, 40], softcap=-1.0, deterministic=True, return_attn_probs=True), True),
    (dict(window_size=(2, 2), softcap=2, dropout_p=0), True),
    (dict(causal=True, window_size=(3, 9)), True),
    (dict(alibi_slopes="h", causal=True), True),
    (dict(alibi_slopes="h", causal=True, return_attn_probs=True), False),  # LSE shift
    (dict(deterministic=1), False),
    (dict(softmax_scale=1), False),
    (dict(window_size=(np.int64(3), -1)), False),
    (dict(causal=1), False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(FLASH_ARGS)))
def test_flash_entry_serves_plain_arguments_as_the_python_function(device, case):
    """The flash_attn functions' C++ entry (dense, packed qkv / kv, varlen) takes the calls whose
    arguments are plain (no Python glue runs) and gives the Python function's results bit for
    bit, outputs and gradients; the others it leaves to the Python function."""
    kw, taken = dict(FLASH_ARGS[case][0]), FLASH_ARGS[case][1]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = _slopes("h", 2, 2, device)
    with _glue_calls(refuse=taken) as glue:
        fast = _flash_calls(device, dtype, **kw)
    assert taken or glue.calls == 4
    python = _without_direct_entry(lambda: _flash_calls(device, dtype, **kw))
    assert len(fast) == len(python)
    for i, (a, b) in enumerate(zip(fast, python)):
        assert torch.isfinite(a).all(), f"result {i}"
        assert torch.equal(a, b), f"result {i}"


def test_flash_entry_leaves_bad_arguments_to_the_python_function():
    """Arguments that raise reach the Python function (the entry declines them before anything
    runs): the same exception and message as without the entry."""
    q, k, v = _inputs("cpu", torch.float32)
    bad = [dict(dropout_p=0.1), dict(softmax_scale=1e-50), dict(softmax_scale=0.0), dict(softcap=float("nan")),
           dict(softcap=1e300), dict(window_size=(1, 2, 3)), dict(window_size=(1.0, 2)), dict(window_size=(True, -1)),
           dict(alibi_slopes=[0.5, 0.25]), dict(deterministic="no")]
    for kw in bad:
        _same_error_both_routes(lambda: flash_attn_func(q, k, v, **kw), (TypeError, ValueError, NotImplementedError), kw)
    for x, name in ((q[0], "q"), (torch.stack([k, v], dim=2)[:, :, :1], "kv")):
        with pytest.raises(ValueError, match=name):
            flash_attn_func(x, k, v) if name == "q" else flash_attn_kvpacked_func(q, x)
    cu = torch.tensor([0, 13, 26], dtype=torch.int32)
    qp, kp, vp = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
    for args, exc in (((q, kp, vp, cu, cu, 13, 17), ValueError), ((qp, kp, vp, cu, [0, 17, 34], 13, 17), TypeError),
                      ((qp, kp, vp, cu, cu, 13.0, 17), TypeError)):
        _same_error_both_routes(lambda: flash_attn_varlen_func(*args), exc, args)


def test_flash_entry_off_with_the_eager_ops():
    """use_eager_ops(False) turns the flash_attn functions' entry off with the ops (the Python
    autograd path serves every call), and back on."""
    q, k, v = _inputs("cpu", torch.float32)
    prev = fat.use_eager_ops(False)
    try:
        assert fat._FAST_FLASH is None and fat._FAST_ATTENTION is None
        with _glue_calls() as glue:
            flash_attn_func(q, k, v)
        assert glue.calls == 1
    finally:
        fat.use_eager_ops(prev)
    assert fat._FAST_FLASH is not None and fat._FAST_ATTENTION is not None
    with _glue_calls(refuse=True):
        flash_attn_func(q, k, v)


def _attention_glue(refuse=False):
    """Counts attention()'s Python glue (flashattn.torch._sdpa_names, which every call the C++
    entry leaves to Python reaches); refuse=True fails the test on one."""
    return _Spy(fat, "_sdpa_names", refuse="the call went through the Python glue" if refuse else None)


# (arguments, whether the C++ entry takes them), as FLASH_ARGS for attention().
ATTENTION_ARGS = [
    (dict(), True),
    (dict(mask="causal", softmax_scale=0.25, window_size=(5, 0), softcap=3.0, return_lse=True), True),
    (dict(mask="causal_top_left", window_size=[-1, 4], deterministic=True, num_threads=1), True),
    (dict(is_causal=True, scale=0.5, enable_gqa=True), True),
    (dict(is_causal=False, mask="causal_bottom_right", softcap=2, enable_gqa=True), True),
    (dict(alibi_slopes="h", mask="causal", return_lse=True), True),
    (dict(precision="tf32"), True),  # (float32 on the CPU: the same arithmetic)
    (dict(deterministic=1), False),
    (dict(softmax_scale=1), False),
    (dict(num_threads=np.int64(1)), False),
    (dict(window_size=(np.int64(3), -1)), False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(len(ATTENTION_ARGS)))
def test_attention_entry_serves_plain_arguments_as_the_python_function(device, case):
    """attention()'s C++ entry takes the calls whose arguments are plain (no Python glue runs) and
    gives the Python function's results bit for bit, outputs and gradients ([B, H, S, D] views of
    [B, S, H, D] tensors, GQA); the others it leaves to the Python function."""
    kw, taken = dict(ATTENTION_ARGS[case][0]), ATTENTION_ARGS[case][1]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = _slopes("h", 2, 4, device)
    if kw.get("precision") == "tf32" and device == "cuda":
        dtype = torch.float32

    def run():
        q0, k0, v0 = _inputs(device, dtype)  # Hq 4, Hkv 2
        leaves = [x.clone().requires_grad_() for x in (q0, k0, v0)]
        out = fat.attention(*(x.transpose(1, 2) for x in leaves), **kw)
        outs = list(out) if isinstance(out, tuple) else [out]
        outs[0].sum().backward()
        return outs + [x.grad for x in leaves]

    with _attention_glue(refuse=taken) as glue:
        fast = run()
    assert taken or glue.calls == 1
    python = _without_direct_entry(run)
    assert len(fast) == len(python)
    for i, (a, b) in enumerate(zip(fast, python)):
        assert not torch.isnan(a).any(), f"result {i}"
        assert torch.equal(a, b), f"result {i}"


def test_attention_entry_leaves_bad_arguments_and_empty_sequences_to_the_python_function():
    """Arguments that raise reach the Python function: the same exception and message as without
    the entry; an empty sequence gets the Python function's SDPA-like result."""
    q, k, v = (x.transpose(1, 2) for x in _inputs("cpu", torch.float32))
    bad = [dict(softmax_scale=0.5, scale=0.5), dict(is_causal=True, mask="causal"), dict(enable_gqa=False),
           dict(mask="diagonal"), dict(precision="fp16"), dict(window_size=(-2, 0)), dict(softcap=-1.0),
           dict(softcap=float("inf")), dict(num_threads=-1), dict(is_causal=1), dict(softmax_scale=1e-50),
           dict(alibi_slopes=(0.5, 0.5, 0.5, 0.5)), dict(deterministic="yes")]
    for kw in bad:
        _same_error_both_routes(lambda: fat.attention(q, k, v, **kw), (TypeError, ValueError), kw)
    with _attention_glue() as glue:
        out, lse = fat.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert glue.calls == 1 and torch.equal(out, torch.zeros_like(q)) and bool((lse == float("-inf")).all())
