"""CUDA graph capture of flashattn's PyTorch entry points (framework integration): a training
step's attention - forward and backward - captured with torch.cuda.graph and replayed on new
values of its static inputs gives what the eager calls give on those values, bit for bit (both
run the same kernels on the same inputs; the deterministic backward, so dq has a fixed order too);
the same through torch.cuda.make_graphed_callables. Packed calls read their sequence arrays on the
host to validate them, which a capture cannot record: inside a capture they are refused with a
clear error raised before anything is enqueued, so the capture itself ends cleanly. Skipped
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


def test_packed_calls_inside_a_capture_are_refused_cleanly():
    q, k, v, _ = _inputs(6, (600, 4, 64))
    cu = torch.tensor([0, 100, 600], dtype=torch.int32, device="cuda")
    flash_attn_varlen_func(q, k, v, cu, cu, 500, 500)  # outside a capture: fine
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception, match="captured into a CUDA graph"):
        with torch.cuda.graph(graph):
            flash_attn_varlen_func(q, k, v, cu, cu, 500, 500)
    # The stream still works.
    out = flash_attn_varlen_func(q, k, v, cu, cu, 500, 500)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
