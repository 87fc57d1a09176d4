"""CUDA scratch from PyTorch's caching allocator (framework integration): flashattn.torch hands
each CUDA call a workspace from torch's allocator, so torch.cuda's memory statistics see it - the
peak of a backward that needs scratch is higher by at least that scratch than with the library's
own pool - and the results are bit for bit those of the pool (deterministic backward). The size
comes from the library's query (options.workspace_query), which validates and writes nothing.
Skipped without CUDA PyTorch and flashattn's CUDA backend."""

import pytest

torch = pytest.importorskip("torch")

import flashattn.torch as fat  # noqa: E402
from flashattn import _ext  # noqa: E402
from torch_helpers import HAS_CUDA  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA PyTorch and flashattn's CUDA backend")


def _step(q, k, v, do, deterministic):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fat.attention(q, k, v, mask="causal", deterministic=deterministic)
    out.backward(do)
    torch.cuda.synchronize()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("deterministic", [True, False])
def test_scratch_is_torch_memory(deterministic):
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    # The backward's scratch, as the library states it (a query writes nothing).
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    out, lse = fat.attention(q, k, v, mask="causal", return_lse=True)
    dl = torch.utils.dlpack.to_dlpack
    need = _ext.backward(dl(do), dl(q), dl(k), dl(v), dl(out), dl(lse), dl(dq), dl(dk), dl(dv), 0.0, 2, 0, 0,
                         torch.cuda.current_stream().cuda_stream, deterministic, -1, -1, 0.0, None, query=True)
    torch.cuda.synchronize()
    assert need >= 2 * 8 * 1024 * 4, "D: a float per query row"
    assert torch.isnan(dq).all() and torch.isnan(dk).all(), "the query wrote gradients"

    peaks, results = [], []
    for torch_alloc in (True, False):
        prev = fat.use_torch_allocator(torch_alloc)
        try:
            _step(q, k, v, do, deterministic)  # (warm: sizes cached, pools grown)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            results.append(_step(q, k, v, do, deterministic))
            peaks.append(torch.cuda.max_memory_allocated() - base)
        finally:
            fat.use_torch_allocator(prev)
    assert peaks[0] - peaks[1] >= need, f"torch saw {peaks[0]} vs {peaks[1]} bytes at the peak; scratch {need}"
    if deterministic:
        for a, b in zip(*results):
            assert torch.equal(a, b)
    else:
        for a, b in zip(*results):
            assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)



@pytest.mark.parametrize("shape", [(3, 1, 1, 2, 2, 8), (2, 37, 53, 4, 2, 64), (1, 70, 30, 6, 1, 40)])
def test_float32_scratch_on_the_autograd_thread(shape):
    # float32 calls whose sm_90a kernels encode tensor maps over the scratch; the backward runs on
    # torch's autograd thread, which had no CUDA context bound when the call allocated nothing
    # (the driver's encoder then failed): torch's scratch gives the pool's results bit for bit.
    from flashattn import flash_attn_func

    b, sq, skv, hq, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(5)
    q, do = (torch.randn(b, sq, hq, d, device="cuda", generator=g) for _ in range(2))
    k, v = (torch.randn(b, skv, hkv, d, device="cuda", generator=g) for _ in range(2))
    results = []
    for torch_alloc in (True, False):
        prev = fat.use_torch_allocator(torch_alloc)
        try:
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            out = flash_attn_func(qq, kk, vv, deterministic=True)
            out.backward(do)
            torch.cuda.synchronize()
            results.append((out.detach(), qq.grad, kk.grad, vv.grad))
        finally:
            fat.use_torch_allocator(prev)
    for a, c in zip(*results):
        assert torch.isfinite(a).all()
        assert torch.equal(a, c)
