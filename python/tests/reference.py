"""A deliberately plain float64 attention in NumPy (explicit S, P, dP, dS), for the tests.

Logical [B, H, S, D] arrays; GQA by repeating kv heads; the library's three masks; a row that
sees no key gives out = 0, lse = -inf and no gradient. test_numpy.py checks its gradients against
central finite differences of its own forward, so it is not trusted on faith.
"""

import numpy as np

MASK_NAMES = ("none", "causal_top_left", "causal_bottom_right")


def visible(sq, skv, mask):
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    if mask == "none":
        return np.ones((sq, skv), dtype=bool)
    if mask == "causal_top_left":
        return j <= i
    if mask == "causal_bottom_right":
        return j <= i + skv - sq
    raise ValueError(mask)


def _expand(kv, group):
    return np.repeat(kv, group, axis=1)


def _probs(q, k, scale, mask):
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    vis = visible(q.shape[2], k.shape[2], mask)
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(m)  # rows with no visible key
    m = np.where(dead, 0.0, m)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    p = np.where(dead, 0.0, e / np.where(dead, 1.0, l))
    lse = np.where(dead, -np.inf, m + np.log(np.where(dead, 1.0, l)))[..., 0]
    return p, lse


def abi_scale(scale, head_dim):
    # The C ABI carries the softmax scale as a float32 (flashattn_options.softmax_scale), so that
    # is the scale every computation, float64 included, really uses.
    return float(np.float32(1.0 / np.sqrt(head_dim) if scale is None else scale))


def forward(q, k, v, scale=None, mask="none"):
    """float64 (out, lse)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    scale = abi_scale(scale, q.shape[-1])
    group = q.shape[1] // k.shape[1]
    p, lse = _probs(q, _expand(k, group), scale, mask)
    return np.einsum("bhij,bhjd->bhid", p, _expand(v, group)), lse


def backward(dout, q, k, v, scale=None, mask="none"):
    """float64 (dq, dk, dv); dk and dv summed over the query heads of each kv group."""
    dout, q, k, v = (np.asarray(x, dtype=np.float64) for x in (dout, q, k, v))
    scale = abi_scale(scale, q.shape[-1])
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = hq // hkv
    ke, ve = _expand(k, group), _expand(v, group)
    p, _ = _probs(q, ke, scale, mask)
    dv_e = np.einsum("bhij,bhid->bhjd", p, dout)
    dp = np.einsum("bhid,bhjd->bhij", dout, ve)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, ke)
    dk_e = scale * np.einsum("bhij,bhid->bhjd", ds, q)
    dk = dk_e.reshape(b, hkv, group, skv, d).sum(axis=2)
    dv = dv_e.reshape(b, hkv, group, skv, d).sum(axis=2)
    return dq, dk, dv
