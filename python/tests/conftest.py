import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # reference.py
# JAX would otherwise reserve 75% of the GPU's memory on first use, starving PyTorch in the same
# process (and the other pytest-xdist workers).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The torch tests skip where PyTorch is absent. scripts/test (so CI) installs it and sets
# FLASHATTN_TEST_REQUIRE_TORCH=1, so that a torch that does not import stops the session with its
# ImportError instead of turning every torch test into a skip.
if os.environ.get("FLASHATTN_TEST_REQUIRE_TORCH") == "1":
    import torch  # noqa: F401

# Tolerances on max|got - ref| / max|ref| per tensor, the C++ grid test's (tests/test_cpu_grid.cpp
# explains each): the reference sees exactly the rounded inputs the kernel sees, so what is left is
# float32 accumulation (float32) or the rounding of each output to the storage type (fp16/bf16).
# lse is float32 for every dtype. (The float64 backward does not recompute P from that rounded lse:
# the CPU backend recomputes each row's log-sum-exp in double, so float64 gradients are exact.)
TOL = {
    "float64": dict(out=1e-10, lse=2e-7, grad=1e-10),
    "float32": dict(out=2e-5, lse=2e-5, grad=2e-5),
    "float16": dict(out=2e-3, lse=2e-5, grad=2e-3),
    "bfloat16": dict(out=1e-2, lse=2e-5, grad=1e-2),
}


def rel_error(got, ref):
    """max|got - ref| / max|ref| over finite reference entries; -inf must match exactly and no
    NaN may appear anywhere."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert not np.isnan(got).any(), "NaN in output"
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin), "non-finite entries differ from the reference"
    assert (got[~fin] == ref[~fin]).all(), "infinite entries differ from the reference"
    if not fin.any():
        return 0.0
    # Floor of 1 on the scale (inputs are N(0, 1), so outputs and gradients are O(1)): some exact
    # gradients are 0 (a single visible key), leaving only rounding noise of the O(1) terms.
    scale = max(np.abs(ref[fin]).max(), 1.0)
    return float(np.abs(got[fin] - ref[fin]).max() / scale)


def assert_close(name, got, ref, tol):
    err = rel_error(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > tolerance {tol:.1e}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# flashattn.torch's C++ eager ops (python/src/torch_ops.cpp): scripts/test builds them against the
# torch it installs and sets FLASHATTN_TEST_REQUIRE_TORCH_OPS=1, so that a build that lost them
# fails here instead of quietly testing the Python path twice.
if os.environ.get("FLASHATTN_TEST_REQUIRE_TORCH_OPS") == "1":
    import flashattn.torch as _fat

    assert _fat.eager_ops_available(), (
        "FLASHATTN_TEST_REQUIRE_TORCH_OPS=1 but flashattn.torch's C++ eager ops are not loaded "
        "(not built, or built for another torch: see _torch_ops.txt beside the package)")


@pytest.fixture
def python_eager_path():
    """flashattn.torch's Python autograd path for the test: spies on flashattn._ext see only that
    path (the C++ eager ops call the library directly; test_torch_eager_ops.py checks they give
    the same results)."""
    fat = pytest.importorskip("flashattn.torch")
    prev = fat.use_eager_ops(False)
    yield
    fat.use_eager_ops(prev)
