"""Shared pieces of the PyTorch tests: devices, dtypes, the float64 reference on tensors, and
plain attention in PyTorch (the 'naive' baseline)."""

import pytest
import torch

import flashattn
import reference

MASKS = ("none", "causal_top_left", "causal_bottom_right")
DTYPE_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}

HAS_CUDA = torch.cuda.is_available() and flashattn.cuda_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def skip_unsupported(device, dtype):
    """Skips only what the library never serves: float64 on CUDA. CUDA float16/bfloat16 run
    (and fail, with the library's "not implemented" message, on a build without their
    kernels): a skip here would hide a missing or broken kernel on a GPU machine."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU-only")


def visible(sq, skv, mask, device, window=(-1, -1)):
    """[Sq, Skv] bool: the mask intersected with the window band (reference.visible's rule)."""
    return torch.from_numpy(reference.visible(sq, skv, mask, tuple(window))).to(device)


def abi_scale(scale, d):
    # The C ABI carries the softmax scale as float32 (see reference.py).
    return float(torch.tensor(d ** -0.5 if scale is None else scale, dtype=torch.float32))


def _host_slopes(alibi):
    return None if alibi is None else alibi.detach().to("cpu", torch.float32).numpy()


def reference64(q, k, v, dout, scale=None, mask="none", window=(-1, -1), softcap=0.0,
                alibi=None):
    """The float64 reference (reference.py: the C++ suite's, through libflashattn_reference) on
    [B, H, S, D] tensors of any dtype, device and strides: (out, lse, dq, dk, dv) as float64
    tensors on q's device. Inputs are converted to float64 exactly, so 16-bit values are used as
    stored; window / softcap / alibi (slopes tensor) as flashattn's."""
    host = [x.detach().to("cpu", torch.float64).numpy() for x in (q, k, v, dout)]
    mods = dict(window=tuple(window), softcap=softcap, alibi=_host_slopes(alibi))
    out, lse = reference.forward(*host[:3], scale, mask, **mods)
    grads = reference.backward(host[3], *host[:3], scale, mask, **mods)
    return tuple(torch.from_numpy(x).to(q.device) for x in (out, lse, *grads))


def attention_ref(q, k, v, scale=None, mask="none", dtype=torch.float64, window=(-1, -1),
                  softcap=0.0, alibi=None):
    """Plain attention in `dtype` on [B, H, S, D] tensors, differentiable by autograd; GQA by
    repeating kv heads; rows that see no key give 0 (not NaN). In a low precision it is the
    'naive' baseline of FlashAttention's test criterion (the yardstick is reference64)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = abi_scale(scale, q.shape[-1]) * (q @ k.transpose(-1, -2))
    sq, skv = q.shape[2], k.shape[2]
    if softcap:
        c = float(torch.tensor(softcap, dtype=torch.float32))
        s = c * torch.tanh(s / c)
    if alibi is not None:
        slopes = alibi.detach().to(q.device, torch.float32).to(dtype)
        slopes = slopes.expand(q.shape[0], q.shape[1])[:, :, None, None]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(skv, device=q.device)[None, :]
        s = s - slopes * (i + skv - sq - j).abs().to(dtype)
    vis = visible(sq, skv, mask, q.device, window)
    s = s.masked_fill(~vis, float("-inf"))
    dead = ~vis.any(dim=-1)[:, None]
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead | ~vis, 0.0)
    lse = torch.logsumexp(s, dim=-1)
    return p @ v, lse


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any(), "NaN in output"
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin), "non-finite entries differ from the reference"
    assert torch.equal(got[~fin], ref[~fin])
    if not fin.any():
        return 0.0
    # Floor of 1 on the scale (inputs are N(0, 1), so outputs and gradients are O(1)): some exact
    # gradients are 0 (a single visible key), leaving only rounding noise of the O(1) terms.

    return ((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1.0)).item()


def assert_cache_agrees(cached, uncached, variants):
    """An options cache against the validation it remembers: for every argument tuple, the same
    result, or the same exception type and message (refusals are never cached), from a cold
    cache and again from a warm one."""
    def outcome(fn, args):
        try:
            return ("ok", fn(*args))
        except Exception as e:  # noqa: BLE001 - the type and message are what is compared
            return (type(e), str(e))

    for _ in range(2):  # (the second round from a warm cache)
        for args in variants:
            assert outcome(cached, args) == outcome(uncached, args), args
