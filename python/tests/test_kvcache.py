"""KV-cache attention from Python: flash_attn_with_kvcache (flash_attn 2.x's signature, defaults
and return values) and the low-level flashattn.forward_kvcache, on the CPU, against the float64
reference one sequence at a time (reference.kvcache: the C++ reference_kvcache, which appends
and rotates from the definitions). Each case also checks the in-place append: the new rows hold
k / v (k rotated when the rotary tables are given) and every other cache element is untouched.
"""

import inspect
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
import reference  # noqa: E402
from conftest import TOL  # noqa: E402
from flashattn import flash_attn_with_kvcache  # noqa: E402
from torch_helpers import DTYPE_NAMES, rel_err  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


@dataclass
class Case:
    dtype: torch.dtype = torch.float32
    B: int = 2
    Sq: int = 1
    Hq: int = 8
    Hkv: int = 2
    D: int = 64
    s_new: int = 1                              # 0: nothing appended
    seqlens: Union[Sequence[int], int, None] = (17, 40)  # before the append; int: broadcast
    S_cache: int = 97                           # contiguous cache length
    block_size: int = 0                         # > 0: paged, max_blocks pages per sequence
    max_blocks: int = 0
    batch_idx: bool = False                     # sequence b in cache row B - b (B_cache = B + 1)
    leftpad: Optional[Sequence[int]] = None
    rotary_dim: int = 0
    interleaved: bool = True
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: Optional[str] = None                 # "h": slopes [Hq]; "bh": [B, Hq]
    seed: int = 0
    kwargs: dict = field(default_factory=dict)  # extra arguments (num_splits, ...)

    @property
    def capacity(self):
        return self.block_size * self.max_blocks if self.block_size else self.S_cache

    def seqlen(self, b):
        if self.seqlens is None:
            return self.capacity
        return self.seqlens if isinstance(self.seqlens, int) else self.seqlens[b]


class Setup:
    """The tensors of one call (caches kept as they were before it) and its arguments."""

    def __init__(self, c: Case):
        self.c = c
        g = torch.Generator().manual_seed(c.seed)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(c.dtype)  # noqa: E731
        self.q = rand(c.B, c.Sq, c.Hq, c.D)
        if c.block_size:
            num_blocks = c.B * c.max_blocks + 3
            cache_shape = (num_blocks, c.block_size, c.Hkv, c.D)
            # Pages in a scrambled order, three of them owned by no sequence.
            perm = torch.randperm(num_blocks, generator=g)[:c.B * c.max_blocks]
            self.block_table = perm.view(c.B, c.max_blocks).to(torch.int32)
        else:
            cache_shape = (c.B + 1 if c.batch_idx else c.B, c.S_cache, c.Hkv, c.D)
            self.block_table = None
        self.k_cache, self.v_cache = rand(*cache_shape), rand(*cache_shape)
        self.k0, self.v0 = self.k_cache.clone(), self.v_cache.clone()
        self.k = rand(c.B, c.s_new, c.Hkv, c.D) if c.s_new else None
        self.v = rand(c.B, c.s_new, c.Hkv, c.D) if c.s_new else None
        self.batch_idx = (torch.tensor([c.B - b for b in range(c.B)], dtype=torch.int32)
                          if c.batch_idx else None)
        self.leftpad = None if c.leftpad is None else torch.tensor(c.leftpad, dtype=torch.int32)
        if c.seqlens is None or isinstance(c.seqlens, int):
            self.seqlens_arg = c.seqlens
        else:
            self.seqlens_arg = torch.tensor(c.seqlens, dtype=torch.int32)
        self.cos = self.sin = None
        if c.rotary_dim:
            # Standard RoPE tables (angle p * 10000^(-2i / rotary_dim)) in the call's dtype.
            pos = torch.arange(c.capacity + c.Sq, dtype=torch.float64)[:, None]
            inv = 10000.0 ** (-torch.arange(0, c.rotary_dim, 2, dtype=torch.float64) / c.rotary_dim)
            self.cos, self.sin = (f(pos * inv).to(c.dtype) for f in (torch.cos, torch.sin))
        self.alibi = None
        if c.alibi:
            slopes = 2.0 ** (-8.0 * torch.arange(1, c.Hq + 1) / c.Hq)
            self.alibi = (slopes if c.alibi == "h" else
                          slopes[None, :] * (1 + 0.5 * torch.arange(c.B)[:, None])).float()

    def call(self, **override):
        c = self.c
        args = dict(k=self.k, v=self.v, rotary_cos=self.cos, rotary_sin=self.sin,
                    cache_seqlens=self.seqlens_arg, cache_batch_idx=self.batch_idx,
                    cache_leftpad=self.leftpad, block_table=self.block_table, causal=c.causal,
                    window_size=c.window, softcap=c.softcap, rotary_interleaved=c.interleaved,
                    alibi_slopes=self.alibi, return_softmax_lse=True, **c.kwargs)
        args.update(override)
        return flash_attn_with_kvcache(self.q, self.k_cache, self.v_cache, **args)

    def where(self, b, r):
        """(cache row, row) of sequence b's absolute cache row r: an index into the caches."""
        c = self.c
        if c.block_size:
            return int(self.block_table[b, r // c.block_size]), r % c.block_size
        return (c.B - b if c.batch_idx else b), r

    def rows(self, cache, b, r0, r1):
        """Rows [r0, r1) of sequence b, [Hkv, r1 - r0, D] as float64 numpy."""
        x = torch.stack([cache[self.where(b, r)] for r in range(r0, r1)]) if r1 > r0 else \
            cache.new_zeros((0, self.c.Hkv, self.c.D))
        return x.transpose(0, 1).double().numpy()


def f64(x):
    return x.double().numpy()


def normalized_window(c: Case):
    """flash_attn's window (a side >= the cache capacity is unbounded) in the library's meaning
    (a causal mask bounds the right side itself), and whether it is a window at all."""
    left, right = (-1 if w < 0 or w >= c.capacity else w for w in c.window)
    if c.causal:
        right = -1
    return (left, right), left >= 0 or right >= 0


def check(c: Case):
    s = Setup(c)
    out, lse = s.call()
    assert out.shape == s.q.shape and out.dtype == c.dtype
    assert lse.shape == (c.B, c.Hq, c.Sq) and lse.dtype == torch.float32
    name = DTYPE_NAMES[c.dtype]
    window, has_window = normalized_window(c)
    mask = "causal_bottom_right" if c.causal else "none"
    rotary = None if not c.rotary_dim else (f64(s.cos), f64(s.sin), c.interleaved, name)
    written = torch.zeros(s.k_cache.shape[:2], dtype=torch.bool)
    for b in range(c.B):
        pos0 = c.seqlen(b)
        start = 0 if c.leftpad is None else c.leftpad[b]
        alibi = None if s.alibi is None else f64(s.alibi if s.alibi.dim() == 1 else s.alibi[b])
        ref_out, ref_lse, k_app = reference.kvcache(
            f64(s.q[b].transpose(0, 1)), s.rows(s.k0, b, start, pos0),
            s.rows(s.v0, b, start, pos0),
            None if s.k is None else f64(s.k[b].transpose(0, 1)),
            None if s.v is None else f64(s.v[b].transpose(0, 1)), pos0, None, mask,
            q_advances=c.causal or has_window, rotary=rotary, window=window, softcap=c.softcap,
            alibi=alibi)
        err = rel_err(out[b].transpose(0, 1), torch.from_numpy(ref_out))
        assert err <= TOL[name]["out"], f"sequence {b} out: relative error {err:.3e}"
        if c.alibi is None or not (c.causal and window[0] == -1):
            # (flash_attn's causal ALiBi lse is shifted: test_alibi_softmax_lse_shift.)
            err = rel_err(lse[b], torch.from_numpy(ref_lse))
            assert err <= TOL[name]["lse"], f"sequence {b} lse: relative error {err:.3e}"
        # The append: v exactly; k exactly where it is not rotated, else as the reference
        # rotates it (one rounding of the dtype apart at most: float32 vs exact rotation).
        for j in range(c.s_new):
            at = s.where(b, pos0 + j)
            written[at] = True
            assert torch.equal(s.v_cache[at], s.v[b, j]), f"v_cache row {pos0 + j} of sequence {b}"
            got = s.k_cache[at]
            assert torch.equal(got[:, c.rotary_dim:], s.k[b, j, :, c.rotary_dim:])
            want = torch.from_numpy(k_app[:, j])
            step = {"float32": 2e-7, "bfloat16": 8e-3, "float16": 1e-3, "float64": 1e-15}[name]
            assert (got.double() - want).abs().max() <= step * max(want.abs().max().item(), 1.0)
    # Every other cache row untouched, bit for bit.
    assert torch.equal(s.k_cache[~written], s.k0[~written]), "k_cache rows outside the append changed"
    assert torch.equal(s.v_cache[~written], s.v0[~written]), "v_cache rows outside the append changed"
    return s, out, lse


DTYPES = [torch.float32, torch.bfloat16]
dtype_ids = lambda d: DTYPE_NAMES[d]  # noqa: E731


# ---- results against the reference --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("seqlens", [(17, 40), 23], ids=["tensor", "int"])
def test_decode(dtype, seqlens):
    """Sq = 1 with one new token per sequence (GQA 8 / 2), cache_seqlens as int32 [B] or int."""
    check(Case(dtype=dtype, seqlens=seqlens))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(17, 40), (97, 64)], ids=["S17_D40", "S97_D64"])
def test_chunked_prefill(dtype, causal, shape):
    """Sq = S_new > 1: a chunk of the prompt appended and attended at once."""
    s_cache, d = shape
    check(Case(dtype=dtype, Sq=5, s_new=5, seqlens=(0, 11), S_cache=s_cache, D=d, causal=causal,
               Hq=6, Hkv=3))


def test_no_append_whole_cache():
    """No k / v and no cache_seqlens: every row of the cache is attended, nothing written."""
    check(Case(Sq=3, s_new=0, seqlens=None, S_cache=17, D=40))


def test_no_append_with_seqlens():
    check(Case(Sq=2, s_new=0, seqlens=(1, 17), S_cache=17, causal=True, Hkv=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary(dtype, interleaved, causal, rotary_dim):
    """q and the new keys rotated at their positions (query rows advance only when causal)."""
    check(Case(dtype=dtype, Sq=3, s_new=3, seqlens=(9, 30), rotary_dim=rotary_dim,
               interleaved=interleaved, causal=causal))


def test_rotary_odd_head_dim():
    check(Case(Sq=2, s_new=2, D=40, rotary_dim=24, interleaved=False, seqlens=(0, 5), S_cache=17))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
@pytest.mark.parametrize("rotary", [False, True])
def test_paged(dtype, rotary):
    """block_table over scrambled pages of 16 rows; appends that cross a page boundary."""
    check(Case(dtype=dtype, Sq=4, s_new=4, seqlens=(14, 30, 0), B=3, block_size=16,
               max_blocks=3, rotary_dim=32 if rotary else 0, causal=True))


def test_paged_no_append():
    check(Case(Sq=1, s_new=0, seqlens=(48, 1), block_size=16, max_blocks=3, D=40))


@pytest.mark.parametrize("append", [True, False])
def test_cache_batch_idx(append):
    check(Case(Sq=2, s_new=2 if append else 0, seqlens=(5, 60), batch_idx=True, causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_cache_leftpad(dtype):
    """Keys before cache_leftpad[b] are not attended; an empty sequence (leftpad = seqlen, no new
    key) gives out = 0 and lse = -inf."""
    check(Case(dtype=dtype, Sq=3, s_new=3, seqlens=(10, 7, 4), leftpad=(3, 0, 4), B=3,
               causal=True, S_cache=17))
    s, out, lse = check(Case(dtype=dtype, Sq=2, s_new=0, seqlens=(6, 4), leftpad=(2, 4),
                             S_cache=17))
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(4, 0), (5, 2), (0, -1), (200, -1)])
def test_window(causal, window):
    """Sliding windows with rotary: whether there is a window (after flash_attn's normalisation
    against the capacity: (200, -1) is none) decides the query rows' positions too."""
    check(Case(Sq=4, s_new=4, seqlens=(20, 3), causal=causal, window=window, rotary_dim=16))


def test_mqa_float64():
    check(Case(dtype=torch.float64, Sq=3, s_new=2, Hq=4, Hkv=1, D=40, S_cache=17, seqlens=(2, 15),
               causal=True))


@pytest.mark.parametrize("alibi", ["h", "bh"])
def test_softcap_alibi(alibi):
    check(Case(Sq=3, s_new=1, seqlens=(7, 50), softcap=5.0, alibi=alibi, window=(6, 1)))


def test_alibi_softmax_lse_shift():
    """flash_attn's causal ALiBi kernels add slope * j, so its softmax_lse is larger by
    slope * (i + Sk_b - Sq) for each sequence's own key count Sk_b; out is unchanged."""
    c = Case(Sq=3, s_new=2, seqlens=(7, 50), leftpad=(2, 10), alibi="bh", causal=True)
    s, out, lse = check(c)
    for b in range(c.B):
        sk = c.seqlens[b] + c.s_new - c.leftpad[b]
        ref_out, ref_lse, _ = reference.kvcache(
            f64(s.q[b].transpose(0, 1)), s.rows(s.k0, b, c.leftpad[b], c.seqlens[b]),
            s.rows(s.v0, b, c.leftpad[b], c.seqlens[b]), f64(s.k[b].transpose(0, 1)),
            f64(s.v[b].transpose(0, 1)), c.seqlens[b], None, "causal_bottom_right",
            q_advances=True, alibi=f64(s.alibi[b]))
        shift = s.alibi[b].double()[:, None] * (torch.arange(c.Sq) + sk - c.Sq).double()[None, :]
        err = rel_err(lse[b].double() - shift, torch.from_numpy(ref_lse))
        assert err <= 2e-5, f"sequence {b}: lse shift, relative error {err:.3e}"


# ---- flash_attn's interface ---------------------------------------------------------------------


def test_signature_and_export():
    assert str(inspect.signature(flash_attn_with_kvcache)) == (
        "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, "
        "cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None, "
        "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
        "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)")
    assert flashattn.flash_attn_with_kvcache is flash_attn_with_kvcache
    assert flashattn.flash_attn_interface.flash_attn_with_kvcache is flash_attn_with_kvcache
    assert "flash_attn_with_kvcache" in flashattn.__all__
    assert "forward_kvcache" in flashattn.__all__


def test_return_values_and_num_splits():
    """out alone by default; num_splits (a CUDA performance hint in flash_attn) changes nothing."""
    c = Case(s_new=0, Sq=2)
    s = Setup(c)
    out = flash_attn_with_kvcache(s.q, s.k_cache, s.v_cache, cache_seqlens=s.seqlens_arg)
    assert isinstance(out, torch.Tensor)
    for splits in (1, 4):
        again, lse = s.call(num_splits=splits)
        assert torch.equal(again, out)
        assert isinstance(lse, torch.Tensor)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_torch_compile_traces_the_append(paged):
    """Under torch.compile (fullgraph: no graph break) the call is the custom op
    torch.ops.flashattn.kvcache with the caches marked as mutated: the same out, lse and cache
    contents as the eager call."""
    c = (Case(Sq=4, s_new=4, seqlens=(14, 30, 0), B=3, block_size=16, max_blocks=3, causal=True) if paged
         else Case(seqlens=(17, 40), causal=True, rotary_dim=32))
    eager, compiled = Setup(c), Setup(c)
    fn = torch.compile(lambda **kw: compiled.call(**kw), backend="aot_eager", fullgraph=True)
    out_e, lse_e = eager.call()
    out_c, lse_c = fn()
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    assert torch.equal(compiled.k_cache, eager.k_cache) and torch.equal(compiled.v_cache, eager.v_cache)
    assert not torch.equal(compiled.k_cache, compiled.k0), "the append did not reach the cache"


def test_softmax_scale_and_strided_q():
    """An explicit softmax_scale, and q read in place through a non-contiguous view."""
    c = Case(Sq=3, s_new=0, seqlens=(5, 9))
    s = Setup(c)
    wide = torch.randn(c.B, c.Sq, c.Hq, 2 * c.D)
    q = wide[..., :c.D]
    out, lse = flash_attn_with_kvcache(q, s.k_cache, s.v_cache, cache_seqlens=s.seqlens_arg,
                                       softmax_scale=0.3, return_softmax_lse=True)
    for b in range(c.B):
        ref_out, ref_lse, _ = reference.kvcache(
            f64(q[b].transpose(0, 1)), s.rows(s.k0, b, 0, c.seqlens[b]),
            s.rows(s.v0, b, 0, c.seqlens[b]), None, None, c.seqlens[b], 0.3)
        assert rel_err(out[b].transpose(0, 1), torch.from_numpy(ref_out)) <= TOL["float32"]["out"]
        assert rel_err(lse[b], torch.from_numpy(ref_lse)) <= TOL["float32"]["lse"]


def test_low_level_numpy():
    """flashattn.forward_kvcache on NumPy arrays ([B, S, H, D] order) gives the torch call's
    results bitwise and appends in place; a read-only cache cannot be appended to."""
    c = Case(Sq=2, s_new=2, seqlens=(3, 31), rotary_dim=32, causal=True)
    s = Setup(c)
    kc, vc = s.k_cache.numpy().copy(), s.v_cache.numpy().copy()
    out, lse = s.call()
    got_out, got_lse = flashattn.forward_kvcache(
        s.q.numpy(), kc, vc, k_new=s.k.numpy(), v_new=s.v.numpy(),
        cache_seqlens=s.seqlens_arg.numpy(), rotary_cos=s.cos.numpy(), rotary_sin=s.sin.numpy(),
        mask="causal_bottom_right", num_threads=1)
    assert isinstance(got_out, np.ndarray) and got_lse.shape == (c.B, c.Hq, c.Sq)
    assert np.array_equal(got_out, out.numpy()) and np.array_equal(got_lse, lse.numpy())
    assert np.array_equal(kc, s.k_cache.numpy()) and np.array_equal(vc, s.v_cache.numpy())
    kc.flags.writeable = False
    with pytest.raises(TypeError, match="k_cache: the .*ndarray is read-only"):
        flashattn.forward_kvcache(s.q.numpy(), kc, vc, k_new=s.k.numpy(), v_new=s.v.numpy(),
                                  cache_seqlens=s.seqlens_arg.numpy())
    # Without an append the caches are inputs only: read-only is fine.
    flashattn.forward_kvcache(s.q.numpy(), kc, vc, cache_seqlens=s.seqlens_arg.numpy())


# ---- refused inputs -----------------------------------------------------------------------------


BAD = {
    "k_without_v": (ValueError, r"k is given but v is None", dict(v=None)),
    "seqlens_past_capacity": (ValueError, r"cache_seqlens\[1\] \+ S_new = 97 \+ 1 = 98 exceeds",
                              dict(cache_seqlens=torch.tensor([3, 97], dtype=torch.int32))),
    "seqlens_int64": (TypeError, r"cache_seqlens\.dtype = int64, expected int32",
                      dict(cache_seqlens=torch.tensor([3, 4]))),
    "seqlens_list": (TypeError, r"cache_seqlens: expected a torch\.Tensor", dict(cache_seqlens=[3, 4])),
    "seqlens_negative": (ValueError, r"cache_seqlens\[0\] = -2 is negative", dict(cache_seqlens=-2)),
    "append_without_seqlens": (ValueError, r"cache_seqlens is NULL", dict(cache_seqlens=None)),
    "k_heads": (ValueError, r"k_new\.shape", dict(k=torch.zeros(2, 1, 4, 64), v=torch.zeros(2, 1, 4, 64))),
    "k_ndim": (ValueError, r"k\.shape = \(2, 64\), expected 4 dimensions",
               dict(k=torch.zeros(2, 64), v=torch.zeros(2, 64))),
    "rotary_without_sin": (ValueError, r"rotary_sin is NULL", dict(rotary_cos=torch.zeros(100, 8))),
    "rotary_dtype": (TypeError, r"rotary_cos\.dtype", dict(rotary_cos=torch.zeros(100, 8, dtype=torch.float64),
                                                           rotary_sin=torch.zeros(100, 8, dtype=torch.float64))),
    "batch_idx_out_of_range": (ValueError, r"cache_batch_idx\[1\] = 2 is outside \[0, 2\)",
                               dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))),
    "batch_idx_repeated": (ValueError, r"cache_batch_idx names cache row 1 for two sequences",
                           dict(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))),
    "leftpad_past_seqlen": (ValueError, r"cache_leftpad\[0\] = 18 is outside \[0, cache_seqlens",
                            dict(cache_leftpad=torch.tensor([18, 0], dtype=torch.int32))),
    "window": (TypeError, r"window_size", dict(window_size=3)),
    "rotary_interleaved": (TypeError, r"rotary_interleaved = 'no' is not a bool",
                           dict(rotary_interleaved="no")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    """Clear errors naming the argument (the package's error types: ValueError for values and
    shapes, TypeError for dtypes and types), and nothing written, the caches included."""
    exc, pattern, override = BAD[case]
    s = Setup(Case())
    with pytest.raises(exc, match=pattern):
        s.call(**override)
    assert torch.equal(s.k_cache, s.k0) and torch.equal(s.v_cache, s.v0)


def test_bad_block_table():
    c = Case(Sq=1, s_new=1, seqlens=(3, 20), block_size=16, max_blocks=2)
    s = Setup(c)
    with pytest.raises(ValueError, match=r"cache_batch_idx cannot be combined with block_table"):
        s.call(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\.shape = \(2, 2, 1\), expected 2 dimensions"):
        s.call(block_table=s.block_table[..., None])
    bad = s.block_table.clone()
    bad[1, 1] = 99
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 99 is outside"):
        s.call(block_table=bad)
    assert torch.equal(s.k_cache, s.k0) and torch.equal(s.v_cache, s.v0)


# ---- CUDA: float16 / bfloat16 ---------------------------------------------------------------------


def _to_cuda(s):
    """A Setup's tensors moved to the GPU (the CPU ones kept for the CPU call)."""
    g = Setup.__new__(Setup)
    g.__dict__.update({k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in s.__dict__.items()})
    return g


CUDA_CASES = {
    "decode": Case(dtype=torch.bfloat16, seqlens=(17, 300), S_cache=320),
    "decode-fp16-gqa8": Case(dtype=torch.float16, Hq=16, Hkv=2, seqlens=(100, 3), S_cache=128),
    "prefill-causal-rotary": Case(dtype=torch.bfloat16, Sq=9, s_new=9, seqlens=(0, 50), S_cache=64, causal=True,
                                  rotary_dim=32),
    "paged-halves": Case(dtype=torch.bfloat16, Sq=3, s_new=3, seqlens=(14, 60), block_size=16, max_blocks=5,
                         causal=True, rotary_dim=64, interleaved=False),
    "leftpad-batchidx": Case(dtype=torch.bfloat16, B=3, seqlens=(10, 20, 33), leftpad=(0, 7, 33), batch_idx=True,
                             S_cache=40, Sq=2, s_new=2, causal=True),
    "window-softcap-alibi": Case(dtype=torch.float16, seqlens=(90, 200), S_cache=256, Sq=3, s_new=3, causal=True,
                                 window=(40, 0), softcap=8.0, alibi="bh"),
    "split-7": Case(dtype=torch.bfloat16, seqlens=(2000, 70), S_cache=2048, kwargs=dict(num_splits=7)),
}


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("name", list(CUDA_CASES))
def test_cuda_matches_cpu(name):
    """The CUDA call (decode kernel, append + rotary pass, split-KV) against the CPU backend's on
    the same 16-bit inputs: out, lse and the caches after the append."""
    s = Setup(CUDA_CASES[name])
    g = _to_cuda(s)
    out_c, lse_c = s.call()
    out_g, lse_g = g.call()
    assert out_g.device.type == "cuda" and lse_g.dtype == torch.float32
    tol = 2e-2 if s.c.dtype == torch.bfloat16 else 4e-3
    assert rel_err(out_g.cpu(), out_c) <= tol
    finite = torch.isfinite(lse_c)
    assert torch.equal(finite, torch.isfinite(lse_g.cpu()))
    assert (lse_g.cpu()[finite] - lse_c[finite]).abs().max().item() <= 1e-3
    for cpu, gpu in ((s.k_cache, g.k_cache), (s.v_cache, g.v_cache)):
        assert (gpu.cpu().float() - cpu.float()).abs().max().item() <= 2 * tol


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_float32_unsupported():
    """float32 KV caches run on the CPU only: NotImplementedError on CUDA, the caches untouched."""
    s = Setup(Case())
    g = _to_cuda(s)
    with pytest.raises(NotImplementedError, match="float32"):
        g.call()
    assert torch.equal(g.k_cache.cpu(), s.k0) and torch.equal(g.v_cache.cpu(), s.v0)
