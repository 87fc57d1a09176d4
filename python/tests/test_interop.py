"""Other DLPack frameworks: JAX (CPU, and GPU where jax sees one) and CuPy (CUDA). Each gets its
own kind of array back, computed correctly; skipped where the framework is not installed."""

import numpy as np
import pytest

import flashattn
import reference as ref
from conftest import TOL, assert_close


def _problem(seed=0, shape=(2, 4, 2, 19, 23, 32)):
    rng = np.random.default_rng(seed)
    b, hq, hkv, sq, skv, d = shape
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, skv, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, skv, d)).astype(np.float32)
    dout = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    return q, k, v, dout


def _check(out, lse, grads, q, k, v, dout, mask):
    r_out, r_lse = ref.forward(q, k, v, None, mask)
    t = TOL["float32"]
    assert_close("out", np.asarray(out), r_out, t["out"])
    assert_close("lse", np.asarray(lse), r_lse, t["lse"])
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref.backward(dout, q, k, v, None, mask)):
        assert_close(name, np.asarray(g), r, t["grad"])


def _jax_devices(jax):
    devs = ["cpu"]
    try:
        if jax.devices("gpu") and flashattn.cuda_available():
            devs.append("gpu")
    except RuntimeError:
        pass
    return devs


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_jax(platform):
    jax = pytest.importorskip("jax")
    if platform not in _jax_devices(jax):
        pytest.skip(f"jax has no {platform} device here (or flashattn has no CUDA backend)")
    dev = jax.devices(platform)[0]
    q, k, v, dout = _problem(1)
    jq, jk, jv, jd = (jax.device_put(x, dev) for x in (q, k, v, dout))
    out, lse = flashattn.forward(jq, jk, jv, mask="causal_bottom_right")
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == np.float32 and lse.shape == q.shape[:3]
    assert list(out.devices())[0].platform == dev.platform
    grads = flashattn.backward(jd, jq, jk, jv, out, lse, mask="causal_bottom_right")
    assert all(isinstance(g, jax.Array) for g in grads)
    _check(out, lse, grads, q, k, v, dout, "causal_bottom_right")
    with pytest.raises(TypeError, match=r"JAX arrays are immutable"):
        flashattn.forward(jq, jk, jv, out=jq)


def test_cupy():
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError
    except Exception:
        pytest.skip("no CUDA device for CuPy")
    if not flashattn.cuda_available():
        pytest.skip("this build of flashattn has no CUDA backend")
    q, k, v, dout = _problem(2)
    cq, ck, cv, cd = (cupy.asarray(x) for x in (q, k, v, dout))
    # A non-default CuPy stream: flashattn must queue its kernels on CuPy's current stream.
    with cupy.cuda.Stream(non_blocking=True):
        out, lse = flashattn.forward(cq, ck, cv, mask="causal_top_left")
        grads = flashattn.backward(cd, cq, ck, cv, out, lse, mask="causal_top_left")
        cupy.cuda.get_current_stream().synchronize()
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert all(isinstance(g, cupy.ndarray) for g in grads)
    _check(cupy.asnumpy(out), cupy.asnumpy(lse), [cupy.asnumpy(g) for g in grads],
           q, k, v, dout, "causal_top_left")
    # BSHD views of CuPy arrays, read in place.
    qb = cupy.asarray(np.ascontiguousarray(q.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
    out_b, _ = flashattn.forward(qb, ck, cv)
    out_ref, _ = flashattn.forward(cq, ck, cv)
    assert cupy.allclose(out_b, out_ref, rtol=1e-6, atol=1e-6)
