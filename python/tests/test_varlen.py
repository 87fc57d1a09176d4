"""Packed variable-length batches: flashattn.forward_varlen / backward_varlen (any DLPack tensor),
flashattn.torch.attention_varlen and the flash_attn 2.x varlen functions, against the float64
reference applied to each sequence's slice; the sequence arrays' validation.

The CPU tests run everywhere; the CUDA ones (test_flash_attn_varlen_func_cuda) skip without a
CUDA device."""

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flashattn  # noqa: E402
from flashattn import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,  # noqa: E402
                       flash_attn_varlen_qkvpacked_func)
from conftest import TOL  # noqa: E402
from torch_helpers import DTYPE_NAMES, reference64, rel_err  # noqa: E402

POISON = float("nan")


def run_backend(fn, *args, **kwargs):
    """Calls fn; a NotImplementedError (a backend without the varlen path) becomes a clear failure."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as e:
        pytest.fail(f"the backend does not run varlen calls: {e}")


# ---- batches and the per-sequence reference -----------------------------------------------------


def cu(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


def make_batch(lens_q, lens_k, hq, hkv, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    tq, tk = int(sum(lens_q)), int(sum(lens_k))
    return mk(tq, hq, d), mk(tk, hkv, d), mk(tk, hkv, d), mk(tq, hq, d)


def ref_varlen(q, k, v, dout, lens_q, lens_k, used=None, scale=None, mask="none",
               window=(-1, -1), softcap=0.0, alibi=None):
    """float64 (out, lse, dq, dk, dv) in the packed layouts: the reference on each sequence
    (keys cut to seqused_k), zeros for rows without any key and lse -inf there; dk, dv 0 for keys
    past seqused_k."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(k.shape, dtype=torch.float64)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    q0 = k0 = 0
    for b, (sq, skv) in enumerate(zip(lens_q, lens_k)):
        n = skv if used is None else int(used[b])
        if sq > 0 and n > 0:
            bhsd = lambda x: x.transpose(0, 1)[None]  # noqa: E731  [S, H, D] -> [1, H, S, D]
            slopes = None
            if alibi is not None:
                slopes = alibi if alibi.dim() == 1 else alibi[b]
            r = reference64(bhsd(q[q0:q0 + sq]), bhsd(k[k0:k0 + n]), bhsd(v[k0:k0 + n]),
                            bhsd(dout[q0:q0 + sq]), scale, mask, window, softcap, slopes)
            o, l_, gq, gk, gv = (x[0] for x in r)
            out[q0:q0 + sq] = o.transpose(0, 1)
            lse[:, q0:q0 + sq] = l_
            dq[q0:q0 + sq] = gq.transpose(0, 1)
            dk[k0:k0 + n] = gk.transpose(0, 1)
            dv[k0:k0 + n] = gv.transpose(0, 1)
        q0 += sq
        k0 += skv
    return out, lse, dq, dk, dv


def tol(dtype, kind):
    return TOL[DTYPE_NAMES[dtype]][kind]


def check(name, got, ref, dtype, kind):
    err = rel_err(got.cpu(), ref)
    assert err <= tol(dtype, kind), f"{name}: relative error {err:.3e} > {tol(dtype, kind):.1e}"


# Lengths with empty sequences on either side, single rows, odd sizes and one long sequence.
LENGTHS = {
    "self": ([0, 1, 17, 97, 300], [0, 1, 17, 97, 300]),
    "cross": ([5, 0, 33, 1, 64, 7], [9, 3, 20, 0, 64, 130]),
    "one": ([1], [1]),
}


# ---- low level: flashattn.forward_varlen / backward_varlen --------------------------------------


@pytest.mark.parametrize("lens", LENGTHS, ids=str)
@pytest.mark.parametrize("heads", [(3, 3), (4, 2), (4, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("mask", ["none", "causal_bottom_right", "causal_top_left"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda d: DTYPE_NAMES[d])
def test_low_level(lens, heads, mask, dtype):
    lens_q, lens_k = LENGTHS[lens]
    hq, hkv = heads
    q, k, v, dout = make_batch(lens_q, lens_k, hq, hkv, 24, dtype, seed=hq)
    cq, ck = cu(lens_q), cu(lens_k)
    mq, mk = max(max(lens_q), 1), max(max(lens_k), 1)
    # NumPy in, NumPy out: the DLPack path; outputs poisoned to catch unwritten entries.
    qn, kn, vn, dn = (x.numpy() for x in (q, k, v, dout))
    out = np.full(qn.shape, POISON, dtype=qn.dtype)
    lse = np.full((hq, qn.shape[0]), POISON, dtype=np.float32)
    o, l_ = run_backend(flashattn.forward_varlen, qn, kn, vn, cq.numpy(), ck.numpy(), mq, mk,
                        mask=mask, out=out, lse=lse)
    assert o is out and l_ is lse
    dq, dk, dv = (np.full(x.shape, POISON, dtype=x.dtype) for x in (qn, kn, vn))
    run_backend(flashattn.backward_varlen, dn, qn, kn, vn, out, lse, cq.numpy(), ck.numpy(), mq,
                mk, mask=mask, dq=dq, dk=dk, dv=dv)
    r = ref_varlen(q, k, v, dout, lens_q, lens_k, mask=mask)
    for name, kind, got, ref in zip(("out", "lse", "dq", "dk", "dv"),
                                    ("out", "lse", "grad", "grad", "grad"),
                                    (out, lse, dq, dk, dv), r):
        check(name, torch.from_numpy(got), ref, dtype, kind)


MODS = {
    "window": dict(window=(8, 0)),
    "window_both": dict(window=(3, 5)),
    "softcap": dict(softcap=2.5),
    "alibi_h": dict(alibi="h"),
    "alibi_bh": dict(alibi="bh"),
    "all": dict(window=(16, 4), softcap=4.0, alibi="bh"),
}


def slopes_for(kind, b, hq):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(5)
    shape = (hq,) if kind == "h" else (b, hq)
    return (torch.rand(*shape, generator=g) * 0.5).to(torch.float32)


@pytest.mark.parametrize("mods", MODS, ids=str)
@pytest.mark.parametrize("mask", ["none", "causal_bottom_right"])
@pytest.mark.parametrize("lens", ["self", "cross"], ids=str)
def test_low_level_mods(mods, mask, lens):
    lens_q, lens_k = LENGTHS[lens]
    hq, hkv = 4, 2
    m = dict(MODS[mods])
    alibi = slopes_for(m.pop("alibi", None), len(lens_q), hq)
    q, k, v, dout = make_batch(lens_q, lens_k, hq, hkv, 16, seed=7)
    cq, ck = cu(lens_q), cu(lens_k)
    kw = dict(mask=mask, window_size=m.get("window", (-1, -1)), softcap=m.get("softcap", 0.0),
              alibi_slopes=None if alibi is None else alibi.numpy())
    qn, kn, vn, dn = (x.numpy() for x in (q, k, v, dout))
    out, lse = run_backend(flashattn.forward_varlen, qn, kn, vn, cq.numpy(), ck.numpy(),
                           max(lens_q), max(lens_k), **kw)
    grads = run_backend(flashattn.backward_varlen, dn, qn, kn, vn, out, lse, cq.numpy(),
                        ck.numpy(), max(lens_q), max(lens_k), **kw)
    r = ref_varlen(q, k, v, dout, lens_q, lens_k, mask=mask, alibi=alibi, **m)
    for name, kind, got, ref in zip(("out", "lse", "dq", "dk", "dv"),
                                    ("out", "lse", "grad", "grad", "grad"),
                                    (out, lse, *grads), r):
        check(name, torch.from_numpy(got), ref, torch.float64, kind)


@pytest.mark.parametrize("mask", ["none", "causal_bottom_right"])
@pytest.mark.parametrize("window", [(-1, -1), (4, 2)])
def test_seqused_k(mask, window):
    lens_q, lens_k = [7, 0, 19, 3, 40], [12, 5, 19, 4, 90]
    used = [12, 0, 10, 0, 33]  # all, none (with and without queries), a prefix
    q, k, v, dout = make_batch(lens_q, lens_k, 2, 1, 8, seed=3)
    cq, ck, su = cu(lens_q), cu(lens_k), torch.tensor(used, dtype=torch.int32)
    kw = dict(seqused_k=su.numpy(), mask=mask, window_size=window)
    qn, kn, vn, dn = (x.numpy() for x in (q, k, v, dout))
    out, lse = run_backend(flashattn.forward_varlen, qn, kn, vn, cq.numpy(), ck.numpy(), 40, 90,
                           **kw)
    dq, dk, dv = (np.full(x.shape, POISON) for x in (qn, kn, vn))
    run_backend(flashattn.backward_varlen, dn, qn, kn, vn, out, lse, cq.numpy(), ck.numpy(), 40,
                90, dq=dq, dk=dk, dv=dv, **kw)
    r = ref_varlen(q, k, v, dout, lens_q, lens_k, used=used, mask=mask, window=window)
    for name, kind, got, ref in zip(("out", "lse", "dq", "dk", "dv"),
                                    ("out", "lse", "grad", "grad", "grad"),
                                    (out, lse, dq, dk, dv), r):
        check(name, torch.from_numpy(got), ref, torch.float64, kind)


def test_matches_dense_per_sequence():
    """A packed call equals the dense call on each sequence (the library against itself, on
    top of the reference checks): same kernels' numerics, so float32 agrees closely."""
    lens = [13, 64, 1]
    q, k, v, _ = make_batch(lens, lens, 2, 2, 32, torch.float32, seed=9)
    out, lse = run_backend(flashattn.forward_varlen, q, k, v, cu(lens), cu(lens), 64, 64,
                           mask="causal_bottom_right")
    s = 0
    for n in lens:
        bhsd = lambda x: x[s:s + n].transpose(0, 1)[None]  # noqa: E731
        o, l_ = flashattn.forward(bhsd(q), bhsd(k), bhsd(v), mask="causal_bottom_right")
        assert rel_err(out[s:s + n], o[0].transpose(0, 1)) <= 1e-5
        assert rel_err(lse[:, s:s + n], l_[0]) <= 1e-5
        s += n


# ---- torch: attention_varlen and the flash_attn 2.x functions ----------------------------------


def test_signatures_match_flash_attn_2():
    tail = ("dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
            "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False")
    assert str(inspect.signature(flash_attn_varlen_func)) == (
        "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, " + tail +
        ", block_table=None)")
    assert str(inspect.signature(flash_attn_varlen_qkvpacked_func)) == (
        "(qkv, cu_seqlens, max_seqlen, " + tail + ")")
    assert str(inspect.signature(flash_attn_varlen_kvpacked_func)) == (
        "(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, " + tail + ")")
    assert flashattn.flash_attn_varlen_func is flash_attn_varlen_func


def fa2_window(window, causal, max_k):
    """flash_attn's window normalisation in the library's terms (what the reference takes)."""
    left, right = (-1 if w < 0 or w >= max_k else w for w in window)
    return (left, 0 if causal and right == -1 else right) if causal else (left, right)


def check_varlen_func(device, causal, dtype, lens, mods, d, seed):
    """flash_attn_varlen_func on `device` (inputs, sequence arrays and slopes there) against the
    float64 reference per sequence, forward and backward."""
    lens_q, lens_k = LENGTHS[lens]
    hq, hkv = 6, 2
    m = dict(MODS.get(mods, {}))
    alibi = slopes_for(m.pop("alibi", None), len(lens_q), hq)
    window, softcap = m.get("window", (-1, -1)), m.get("softcap", 0.0)
    q, k, v, dout = make_batch(lens_q, lens_k, hq, hkv, d, dtype, seed=seed)
    qq, kk, vv = (x.to(device, copy=True).requires_grad_() for x in (q, k, v))
    mq, mk = max(lens_q), max(lens_k)
    out, lse, probs = run_backend(flash_attn_varlen_func, qq, kk, vv, cu(lens_q).to(device),
                                  cu(lens_k).to(device), mq, mk, causal=causal, window_size=window,
                                  softcap=softcap,
                                  alibi_slopes=None if alibi is None else alibi.to(device),
                                  return_attn_probs=True)
    assert out.device.type == device and out.shape == q.shape and out.dtype == dtype and probs is None
    assert lse.shape == (hq, q.shape[0]) and lse.dtype == torch.float32
    run_backend(out.backward, dout.to(device))
    mask = "causal_bottom_right" if causal else "none"
    r = ref_varlen(q, k, v, dout, lens_q, lens_k, mask=mask, alibi=alibi,
                   window=fa2_window(window, causal, mk), softcap=softcap)
    ref_lse = r[1]
    if alibi is not None and causal and fa2_window(window, causal, mk)[0] == -1:
        # flash_attn's causal ALiBi kernels add slope * j: lse larger by slope * (i + Sk - Sq).
        ref_lse = ref_lse + alibi_shift(alibi, lens_q, lens_k)
    for name, kind, got, ref in zip(("out", "lse", "dq", "dk", "dv"),
                                    ("out", "lse", "grad", "grad", "grad"),
                                    (out, lse, qq.grad, kk.grad, vv.grad),
                                    (r[0], ref_lse, *r[2:])):
        check(name, got.detach(), ref, dtype, kind)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("lens", ["self", "cross"], ids=str)
@pytest.mark.parametrize("mods", ["plain", "window", "softcap", "alibi_h", "alibi_bh", "all"])
def test_flash_attn_varlen_func(causal, dtype, lens, mods):
    check_varlen_func("cpu", causal, dtype, lens, mods, d=40, seed=1)


CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and flashattn.cuda_available()),
                          reason="no CUDA device (or a CPU-only build)")


@CUDA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: DTYPE_NAMES[d])
@pytest.mark.parametrize("lens", ["self", "cross"], ids=str)
@pytest.mark.parametrize("mods", ["plain", "all"])
def test_flash_attn_varlen_func_cuda(causal, dtype, lens, mods):
    """The same calls on CUDA tensors (sequence arrays on the device too)."""
    check_varlen_func("cuda", causal, dtype, lens, mods, d=64, seed=2)


def alibi_shift(alibi, lens_q, lens_k):
    """[Hq, total_q] float64, written out per row from the definition."""
    cols = []
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        s = (alibi if alibi.dim() == 1 else alibi[b]).double()
        for i in range(sq):
            cols.append(s * (i + sk - sq))
    return torch.stack(cols, dim=1) if cols else torch.zeros(alibi.shape[-1], 0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_qkvpacked(causal):
    lens = [3, 0, 50, 1, 17]
    hq, d = 3, 16
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lens), 3, hq, d, generator=g, dtype=torch.float64)
    dout = torch.randn(sum(lens), hq, d, generator=g, dtype=torch.float64)
    x = qkv.clone().requires_grad_()
    out = run_backend(flash_attn_varlen_qkvpacked_func, x, cu(lens), max(lens), causal=causal)
    run_backend(out.backward, dout)
    mask = "causal_bottom_right" if causal else "none"
    r = ref_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], dout, lens, lens, mask=mask)
    check("out", out.detach(), r[0], torch.float64, "out")
    check("dqkv", x.grad, torch.stack(r[2:], dim=1), torch.float64, "grad")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_kvpacked(causal):
    lens_q, lens_k = LENGTHS["cross"]
    hq, hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64)
    kv = torch.randn(sum(lens_k), 2, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(sum(lens_q), hq, d, generator=g, dtype=torch.float64)
    qq, kvv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse, _ = run_backend(flash_attn_varlen_kvpacked_func, qq, kvv, cu(lens_q), cu(lens_k),
                              max(lens_q), max(lens_k), causal=causal, return_attn_probs=True)
    run_backend(out.backward, dout)
    mask = "causal_bottom_right" if causal else "none"
    r = ref_varlen(q, kv[:, 0], kv[:, 1], dout, lens_q, lens_k, mask=mask)
    check("out", out.detach(), r[0], torch.float64, "out")
    check("lse", lse, r[1], torch.float64, "lse")
    check("dq", qq.grad, r[2], torch.float64, "grad")
    check("dkv", kvv.grad, torch.stack(r[3:], dim=1), torch.float64, "grad")


def test_attention_varlen_seqused_k():
    lens_q, lens_k, used = [4, 9], [6, 9], [2, 9]
    q, k, v, dout = make_batch(lens_q, lens_k, 2, 2, 8, seed=8)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    su = torch.tensor(used, dtype=torch.int32)
    out, lse = run_backend(flashattn.torch.attention_varlen, qq, kk, vv, cu(lens_q), cu(lens_k),
                           9, 9, seqused_k=su, mask="causal_bottom_right", return_lse=True)
    assert not lse.requires_grad
    run_backend(out.backward, dout)
    r = ref_varlen(q, k, v, dout, lens_q, lens_k, used=used, mask="causal_bottom_right")
    for name, kind, got, ref in zip(("out", "lse", "dq", "dk", "dv"),
                                    ("out", "lse", "grad", "grad", "grad"),
                                    (out, lse, qq.grad, kk.grad, vv.grad), r):
        check(name, got.detach(), ref, torch.float64, kind)


def test_alibi_shift_helper_per_sequence():
    """The interface's per-sequence ALiBi LSE shift against the row-by-row definition (pure
    PyTorch: runs without the backend)."""
    from flashattn.flash_attn_interface import _alibi_lse_shift_varlen

    lens_q, lens_k = [3, 0, 5, 1], [7, 2, 5, 0]
    for alibi in (torch.tensor([0.5, 0.25]), torch.rand(4, 2)):
        lse = torch.zeros(2, sum(lens_q))
        got = _alibi_lse_shift_varlen(alibi, True, (-1, -1), cu(lens_q), cu(lens_k), 7, lse)
        # float32 products (as softmax_lse) against float64 ones.
        assert torch.allclose(got.double(), alibi_shift(alibi, lens_q, lens_k), rtol=1e-6, atol=0)
        assert _alibi_lse_shift_varlen(alibi, True, (2, 0), cu(lens_q), cu(lens_k), 7, lse) is None
        assert _alibi_lse_shift_varlen(alibi, False, (-1, -1), cu(lens_q), cu(lens_k), 7,
                                       lse) is None


# ---- validation: before anything runs -----------------------------------------------------------


def small():
    lens = [3, 5]
    q, k, v, _ = make_batch(lens, lens, 2, 1, 8, torch.float32)
    return q.numpy(), k.numpy(), v.numpy(), cu(lens).numpy(), cu(lens).numpy()


def expect_untouched(exc, match, call):
    """call(out, lse) must raise exc matching `match` and leave out and lse as they were."""
    q = small()[0]
    out = np.full(q.shape, 7.0, dtype=np.float32)
    lse = np.full((q.shape[1], q.shape[0]), 7.0, dtype=np.float32)
    with pytest.raises(exc, match=match):
        call(out, lse)
    assert (out == 7.0).all() and (lse == 7.0).all()


@pytest.mark.parametrize("case, exc, match", [
    ("cq_start", ValueError, r"cu_seqlens_q\[0\]"),
    ("ck_decreasing", ValueError, "cu_seqlens_k is not non-decreasing"),
    ("cq_total", ValueError, r"cu_seqlens_q\[2\] = 9 does not match"),
    ("ck_len", ValueError, r"cu_seqlens_k\.shape"),
    ("max_q", ValueError, "max_seqlen_q"),
    ("max_zero", ValueError, "max_seqlen_k"),
    ("int64", TypeError, r"cu_seqlens_q\.dtype = int64"),
    ("ndim2", ValueError, r"cu_seqlens_k\.ndim = 2"),
    ("seqused", ValueError, r"seqused_k\[1\] = 6"),
    ("seqused_len", ValueError, r"seqused_k\.shape"),
    ("q4d", ValueError, r"q\.ndim = 4"),
    ("lse_shape", ValueError, r"lse\.shape"),
    ("max_float", TypeError, "max_seqlen_q = 5.0 is not an int"),
])
def test_validation(case, exc, match):
    q, k, v, cq, ck = small()
    kw = {}
    mq, mk = 5, 5
    if case == "cq_start":
        cq = np.array([1, 3, 8], dtype=np.int32)
    elif case == "ck_decreasing":
        ck = np.array([0, 5, 8], dtype=np.int32)
        ck[1] = 9  # 9 > 8
        mk = 10  # within every bound but the order
    elif case == "cq_total":
        cq = np.array([0, 3, 9], dtype=np.int32)
        mq = 10
    elif case == "ck_len":
        ck = np.array([0, 3, 5, 8], dtype=np.int32)
    elif case == "max_q":
        mq = 4
    elif case == "max_zero":
        mk = 0
    elif case == "int64":
        cq = cq.astype(np.int64)
    elif case == "ndim2":
        ck = ck[None]
    elif case == "seqused":
        kw["seqused_k"] = np.array([3, 6], dtype=np.int32)
    elif case == "seqused_len":
        kw["seqused_k"] = np.array([3], dtype=np.int32)
    elif case == "q4d":
        q = q[None]
    elif case == "max_float":
        mq = 5.0

    def call(out, lse):
        if case == "q4d":
            out = out[None]
        if case == "lse_shape":
            lse = np.full((q.shape[0], q.shape[1]), 7.0, dtype=np.float32)
        flashattn.forward_varlen(q, k, v, cq, ck, mq, mk, out=out, lse=lse, **kw)

    expect_untouched(exc, match, call)


def test_validation_backward():
    q, k, v, cq, ck = small()
    out = np.zeros_like(q)
    lse = np.zeros((q.shape[1], q.shape[0]), dtype=np.float32)
    dq = np.full_like(q, 7.0)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\]"):
        flashattn.backward_varlen(out, q, k, v, out, lse, np.array([2, 3, 8], dtype=np.int32),
                                  ck, 5, 5, dq=dq)
    assert (dq == 7.0).all()
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        flashattn.backward_varlen(out, q, k, v, out, lse, cq, [0, 3, 8], 5, 5)


def test_interface_unsupported_and_shapes():
    lens = [2, 3]
    q, k, v, _ = make_batch(lens, lens, 2, 2, 8)
    c = cu(lens)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(q, k, v, c, c, 3, 3, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(q, k, v, c, c, 3, 3, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), c, 3, dropout_p=0.5)
    with pytest.raises(ValueError, match=r"q.shape = \(1, 5, 2, 8\)"):
        flash_attn_varlen_func(q[None], k, v, c, c, 3, 3)
    with pytest.raises(ValueError, match="dimension 1 must be 3"):
        flash_attn_varlen_qkvpacked_func(torch.stack([q, k], 1), c, 3)
    with pytest.raises(ValueError, match="dimension 1 must be 2"):
        flash_attn_varlen_kvpacked_func(q, torch.stack([k, v, k], 1), c, c, 3, 3)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, [0, 2, 5], c, 3, 3)
    with pytest.raises(TypeError, match=r"cu_seqlens_k\.dtype = int64"):
        flash_attn_varlen_func(q, k, v, c, c.long(), 3, 3)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        flash_attn_varlen_func(q, k, v, c, c, 3, 2)
