"""flashattn's CUDA float16/bfloat16 kernels through PyTorch (flashattn.torch.attention and
flash_attn_func), forward and backward in both backward designs, with FlashAttention's accuracy
criterion: on the same 16-bit inputs,

    max|got - ref64| <= 2 x max|naive - ref64|   (out)
    max|got - ref64| <= 3 x max|naive - ref64|   (dq, dk, dv)

where ref64 is the float64 reference (reference.py: the C++ suite's, on the same 16-bit inputs)
and naive plain PyTorch attention in the 16-bit dtype (torch_helpers.attention_ref,
differentiated by autograd; float32 accumulation in its matmuls).
The floors and the lse tolerance are those of tests/cuda/test_cuda16.cpp, which explains them;
that suite covers the shape grid, this one the Python paths (custom op, autograd, layouts,
streams, the deterministic flag). Skipped without CUDA PyTorch and flashattn's CUDA backend."""

import pytest

torch = pytest.importorskip("torch")

import flashattn.torch as fat  # noqa: E402
from flashattn import flash_attn_func  # noqa: E402
from torch_helpers import HAS_CUDA, attention_ref, reference64, visible  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_CUDA,
                                reason="needs CUDA PyTorch and flashattn's CUDA backend")

DTYPES = [torch.bfloat16, torch.float16]
NAMES = ("out", "lse", "dq", "dk", "dv")
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}
LSE_TOL = 1e-3
# (deterministic, FLASHATTN_CUDA_BWD): deterministic=True as a user gets it (on sm_90a the single
# pass with dq added in a fixed key-block order, elsewhere the split passes), the split passes, and
# the single pass with atomic dq.
DESIGNS = {"deterministic": (True, None), "split": (True, "split"), "atomic": (False, "atomic")}

# (B, Hq, Hkv, Sq, Skv, D, mask): GQA and MQA, Sq != Skv both ways, a 1000+ sequence, compiled
# (64, 96, 128, 256) and padded (59, 1) head dims, fully masked rows (bottom-right, Sq > Skv),
# keys no query sees (top-left, Skv > Sq), a single key.
SHAPES = [
    (2, 4, 2, 97, 128, 64, "none"),
    (1, 6, 1, 1031, 257, 128, "causal_top_left"),
    (1, 2, 2, 17, 1031, 256, "causal_top_left"),
    (2, 4, 1, 300, 17, 96, "causal_bottom_right"),
    (1, 3, 3, 128, 128, 59, "causal_bottom_right"),
    (3, 2, 1, 33, 1, 1, "none"),
]


def shape_id(s):
    return "x".join(map(str, s[:6])) + "_" + s[6]


def make(b, h, s, d, dtype, layout, gen):
    """[B, H, S, D] view of N(0, 1) values rounded to dtype, laid out as BHSD or BSHD."""
    if layout == "bhsd":
        return torch.randn(b, h, s, d, generator=gen, dtype=torch.float64).to("cuda", dtype)
    return torch.randn(b, s, h, d, generator=gen, dtype=torch.float64).to("cuda", dtype) \
        .transpose(1, 2)


def inputs(shape, dtype, layout, seed):
    b, hq, hkv, sq, skv, d, _ = shape
    gen = torch.Generator().manual_seed(seed)
    return (make(b, hq, sq, d, dtype, layout, gen), make(b, hkv, skv, d, dtype, layout, gen),
            make(b, hkv, skv, d, dtype, layout, gen), make(b, hq, sq, d, dtype, layout, gen))


class _fp32_accumulation:
    """Naive matmuls accumulate in float32 throughout (cuBLAS may otherwise reduce split-K
    partial sums in 16 bits, a worse baseline than the one the criterion means)."""

    def __enter__(self):
        m = torch.backends.cuda.matmul
        self.saved = (m.allow_fp16_reduced_precision_reduction,
                      m.allow_bf16_reduced_precision_reduction)
        m.allow_fp16_reduced_precision_reduction = False
        m.allow_bf16_reduced_precision_reduction = False

    def __exit__(self, *a):
        m = torch.backends.cuda.matmul
        (m.allow_fp16_reduced_precision_reduction,
         m.allow_bf16_reduced_precision_reduction) = self.saved


def ref_and_naive(q, k, v, dout, scale, mask):
    """(out, lse, dq, dk, dv) of the float64 reference and of PyTorch attention in q's dtype."""
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with _fp32_accumulation():
        out, lse = attention_ref(qq, kk, vv, scale, mask, dtype=q.dtype)
        out.backward(dout)
    naive = [t.double() for t in (out.detach(), lse.detach(), qq.grad, kk.grad, vv.grad)]
    return list(reference64(q, k, v, dout, scale, mask)), naive


def max_abs_err(got, ref, name):
    """max|got - ref| over the reference's finite entries; NaN never passes, and non-finite
    entries (-inf lse of a fully masked row) must match exactly."""
    got, ref = got.double(), ref.double()
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert not torch.isnan(got).any(), f"{name}: NaN"
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin), f"{name}: non-finite entries differ"
    assert torch.equal(got[~fin], ref[~fin]), f"{name}: infinite entries differ"
    return (got[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0


def max_ref(ref):
    fin = torch.isfinite(ref)
    return ref[fin].abs().max().item() if fin.any() else 0.0


def check(got, ref, naive, dtype, which, label):
    """FlashAttention's criterion on the tensors `which` (indices into NAMES)."""
    grad_scale = max(max_ref(ref[i]) for i in (2, 3, 4))
    lines, failures = [], []
    for i in which:
        err = max_abs_err(got[i], ref[i], NAMES[i])
        if i == 1:
            bound = LSE_TOL * max(1.0, max_ref(ref[1]))
            nerr = None
        else:
            nerr = max_abs_err(naive[i], ref[i], "naive " + NAMES[i])
            floor = max_ref(ref[i]) * 2.0 ** -SIGNIFICAND_BITS[dtype]
            if i >= 2:
                floor += grad_scale * 2.0 ** -16
            bound = (2.0 if i == 0 else 3.0) * max(nerr, floor)
        lines.append(f"{NAMES[i]} {err:.3e} <= {bound:.3e}" +
                     ("" if nerr is None else f" (naive {nerr:.3e})"))
        if not err <= bound:
            failures.append(NAMES[i])
    assert not failures, f"{label}: {', '.join(failures)} over the bound: " + "; ".join(lines)


def check_masked_zeros(got, shape, which, label):
    """out = dq = 0 exactly on rows that see no key, dk = dv = 0 on keys nobody sees."""
    sq, skv, mask = shape[3], shape[4], shape[6]
    vis = visible(sq, skv, mask, "cuda")
    dead_rows, unseen_keys = ~vis.any(dim=1), ~vis.any(dim=0)
    for i in which:
        sel = dead_rows if i in (0, 2) else unseen_keys if i in (3, 4) else None
        if sel is not None and sel.any():
            assert (got[i][:, :, sel] == 0).all(), f"{label}: {NAMES[i]} not exactly 0 where masked"


def run_attention(q, k, v, dout, mask, deterministic):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fat.attention(qq, kk, vv, mask=mask, deterministic=deterministic, return_lse=True)
    out.backward(dout)
    return [out.detach(), lse, qq.grad, kk.grad, vv.grad]


@pytest.mark.parametrize("design", list(DESIGNS))
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_attention(shape, dtype, layout, design, monkeypatch):
    deterministic, env = DESIGNS[design]
    if env:
        monkeypatch.setenv("FLASHATTN_CUDA_BWD", env)
    else:
        monkeypatch.delenv("FLASHATTN_CUDA_BWD", raising=False)
    q, k, v, dout = inputs(shape, dtype, layout, seed=SHAPES.index(shape))
    got = run_attention(q, k, v, dout, shape[6], deterministic)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    ref, naive = ref_and_naive(q, k, v, dout, None, shape[6])
    label = f"{shape_id(shape)} {dtype} {layout} {design}"
    check(got, ref, naive, dtype, range(5), label)
    check_masked_zeros(got, shape, range(5), label)


@pytest.mark.parametrize("design", list(DESIGNS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("cfg", [(2, 97, 130, 4, 2, 64), (1, 1031, 1031, 6, 1, 128),
                                 (2, 200, 77, 4, 4, 256)], ids=lambda c: "x".join(map(str, c)))
def test_flash_attn_func(cfg, dtype, causal, design, monkeypatch):
    """FlashAttention 2's API: (batch, seqlen, nheads, headdim), causal = bottom-right."""
    deterministic, env = DESIGNS[design]
    if env:
        monkeypatch.setenv("FLASHATTN_CUDA_BWD", env)
    else:
        monkeypatch.delenv("FLASHATTN_CUDA_BWD", raising=False)
    b, sq, skv, hq, hkv, d = cfg
    gen = torch.Generator().manual_seed(7)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to("cuda", dtype)  # noqa
    q, k, v, dout = mk(b, sq, hq, d), mk(b, skv, hkv, d), mk(b, skv, hkv, d), mk(b, sq, hq, d)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse, _ = flash_attn_func(qq, kk, vv, causal=causal, deterministic=deterministic,
                                  return_attn_probs=True)
    out.backward(dout)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    mask = "causal_bottom_right" if causal else "none"
    got = [t(out.detach()), lse, t(qq.grad), t(kk.grad), t(vv.grad)]
    ref, naive = ref_and_naive(t(q), t(k), t(v), t(dout), None, mask)
    check(got, ref, naive, dtype, range(5), f"{cfg} {dtype} causal={causal} {design}")
    check_masked_zeros(got, (b, hq, hkv, sq, skv, d, mask), range(5), str(cfg))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_deterministic_is_bitwise_reproducible(dtype, monkeypatch):
    """deterministic=True: identical bits run to run (dq of a 1031-long GQA problem sums 17 key
    blocks), even with FLASHATTN_CUDA_BWD=atomic set; the forward is identical too."""
    q, k, v, dout = inputs((1, 4, 2, 1031, 1031, 128, "causal_bottom_right"), dtype, "bshd", 3)
    runs = []
    for env in (None, None, "atomic"):
        if env:
            monkeypatch.setenv("FLASHATTN_CUDA_BWD", env)
        else:
            monkeypatch.delenv("FLASHATTN_CUDA_BWD", raising=False)
        runs.append(run_attention(q, k, v, dout, "causal_bottom_right", True))
    assert all(torch.isfinite(x).all() for x in runs[0])
    for r, other in enumerate(runs[1:], 1):
        for name, a, b in zip(NAMES, runs[0], other):
            assert torch.equal(a, b), f"run {r}: {name} differs from run 0"


@pytest.mark.parametrize("design", list(DESIGNS))
def test_runs_on_torchs_current_stream(design, monkeypatch):
    """Inputs produced on a side stream and consumed right away: only correct if every kernel
    (forward, both backward designs, including any zero-fill of the atomic dq accumulator) is
    queued on PyTorch's current stream."""
    deterministic, env = DESIGNS[design]
    if env:
        monkeypatch.setenv("FLASHATTN_CUDA_BWD", env)
    else:
        monkeypatch.delenv("FLASHATTN_CUDA_BWD", raising=False)
    shape = (2, 8, 2, 512, 512, 128, "causal_top_left")
    q0, k0, v0, dout0 = inputs(shape, torch.bfloat16, "bshd", 11)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so a wrong stream would race
        q, k, v, dout = q0 * 1, k0 * 1, v0 * 1, dout0 * 1  # produced by kernels on s
        got = run_attention(q, k, v, dout, shape[6], deterministic)
    s.synchronize()
    ref, naive = ref_and_naive(q0, k0, v0, dout0, None, shape[6])
    check(got, ref, naive, torch.bfloat16, range(5), f"side stream, {design}")
