"""CUDA graph capture of flashattn's PyTorch entry points (framework integration): a training
step's attention - forward and backward - captured with torch.cuda.graph and replayed on new
values of its static inputs gives what the eager calls give on those values, bit for bit (both
run the same kernels on the same inputs; the deterministic backward, so dq has a fixed order too);
the same through torch.cuda.make_graphed_callables. Packed and KV-cache calls check their index
arrays on the device; captured, that check is captured with their kernels, and a replay whose
arrays break a rule writes nothing and is counted (flashattn.cuda_take_check_failures). Skipped
without CUDA PyTorch and flashattn's CUDA backend."""

import pytest

torch = pytest.importorskip("torch")

import flashattn.torch as fat  # noqa: E402
from flashattn import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from torch_helpers import HAS_CUDA  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA PyTorch and flashattn's CUDA backend")


def _inputs(seed, shape=(2, 300, 4, 64), dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", dtype=dtype, generator=g) for _ in range(4)]


def _eager(q, k, v, do, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = flash_attn_func(q, k, v, **kw)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal", [False, True])
def test_graph_capture_of_forward_and_backward_replays_exactly(causal):
    kw = dict(causal=causal, deterministic=True)
    sq, sk, sv, sdo = (x.requires_grad_(i < 3) for i, x in enumerate(_inputs(0)))
    # Warm-up on a side stream (as torch.cuda.graph's documentation asks): workspaces, kernel
    # attributes and autograd's state are set up outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            out = flash_attn_func(sq, sk, sv, **kw)
            out.backward(sdo)
            for x in (sq, sk, sv):
                x.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_func(sq, sk, sv, **kw)
        out.backward(sdo)
    grads = (sq.grad, sk.grad, sv.grad)
    for seed in (1, 2):
        new = _inputs(seed)
        with torch.no_grad():
            for dst, src in zip((sq, sk, sv, sdo), new):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = _eager(*new, **kw)
        for name, got, ref in zip(("out", "dq", "dk", "dv"), (out,) + grads, want):
            assert torch.equal(got, ref), f"{name} after replay {seed} differs from the eager call"


def test_make_graphed_callables_of_a_module():
    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return fat.attention(q, k, v, is_causal=True, deterministic=True)

    shape = (2, 4, 257, 64)  # [B, H, S, D]
    q, k, v, do = _inputs(3, shape)
    args = tuple(x.clone().requires_grad_() for x in (q, k, v))
    graphed = torch.cuda.make_graphed_callables(Attn(), args)
    for seed in (4, 5):
        q, k, v, do = _inputs(seed, shape)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = graphed(*xs)
        out.backward(do)
        ys = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = fat.attention(*ys, is_causal=True, deterministic=True)
        ref.backward(do)
        assert torch.equal(out, ref)
        for a, b in zip(xs, ys):
            assert torch.equal(a.grad, b.grad)


def test_packed_calls_captured_and_replayed():
    import flashattn
    q, k, v, _ = _inputs(6, (600, 4, 64))
    cu = torch.tensor([0, 100, 600], dtype=torch.int32, device="cuda")
    flashattn.cuda_take_check_failures()  # (a clean count)
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 500, 500, causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_varlen_func(q, k, v, cu, cu, 500, 500, causal=True)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert flashattn.cuda_take_check_failures() == 0
    # Broken arrays (decreasing): the replay writes nothing and counts one failure.
    good = cu.clone()
    cu.copy_(torch.tensor([0, 700, 600], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    assert flashattn.cuda_take_check_failures() == 1
    assert torch.isnan(out).all()
    cu.copy_(good)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    # Eager calls with broken arrays still raise, writing nothing.
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attn_varlen_func(q, k, v, torch.tensor([0, 700, 600], dtype=torch.int32, device="cuda"), cu, 500, 500)


def test_kvcache_decode_step_captured_and_replayed():
    import flashattn
    from flashattn import flash_attn_with_kvcache
    g = torch.Generator(device="cuda").manual_seed(7)
    kc, vc = (torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    kn, vn = (torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    seqlens = torch.tensor([100, 37], dtype=torch.int32, device="cuda")
    kc0, vc0 = kc.clone(), vc.clone()
    ref = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc.copy_(kc0), vc.copy_(vc0)
    flashattn.cuda_take_check_failures()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True)
    kc.copy_(kc0), vc.copy_(vc0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert flashattn.cuda_take_check_failures() == 0
    # cache_seqlens + 1 past the capacity: nothing written (no cache row either), one failure.
    kc.copy_(kc0), vc.copy_(vc0)
    out.fill_(float("nan"))
    seqlens[1] = 256
    graph.replay()
    assert flashattn.cuda_take_check_failures() == 1
    assert torch.isnan(out).all() and torch.equal(kc, kc0) and torch.equal(vc, vc0)
