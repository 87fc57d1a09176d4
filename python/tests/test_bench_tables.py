"""The GPU benchmarks' row tables and grid, without a GPU: bench/gpu.py's table of flashattn rows
(labels, designs, knobs, which pass each times) and its dry run, which prints the grid, FLOPs and
scratch formulas for every row. bench/mods.py and the A/B tooling read the same table, so a table
change that breaks them shows here rather than on a GPU machine."""
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)

gpu = pytest.importorskip("gpu")


def test_every_row_has_a_label_and_its_pass():
    for name, row in gpu.OURS_TABLE.items():
        assert gpu.SHORT[name] == row.short
        assert row.only in (None, "bwd", "fwd"), name
        impl = gpu.Impl(name, ["fwd", "bwd", "both"])
        assert impl.ours and impl.overrides == gpu.knobs(name)
        assert impl.deterministic == row.deterministic
    assert set(gpu.DESIGNS) == {n for n, r in gpu.OURS_TABLE.items() if r.only == "bwd"}
    assert set(gpu.FWD_VARIANTS) == {n for n, r in gpu.OURS_TABLE.items() if r.only == "fwd"}
    assert gpu.knobs("flashattn") == {} and gpu.knobs("sdpa-cudnn") == {}
    assert gpu.knobs("flashattn-blocks") == {"FLASHATTN_CUDA_FWD_CTAS": "0"}
    # A copy: a caller that changes it leaves the table alone.
    gpu.knobs("flashattn-blocks")["X"] = "1"
    assert "X" not in gpu.knobs("flashattn-blocks")


def test_designs_time_the_backward_and_variants_the_forward():
    class Args:
        backends = ",".join(["sdpa-cudnn"] + list(gpu.OURS))
        quick = True
        base_lib = "base.so"
        passes = ["fwd", "bwd", "both"]

    impls = {i.name: i for i in gpu.impls_for("bfloat16", Args)}
    assert "flashattn-tf32" not in impls  # a float32 mode
    for n in gpu.DESIGNS:
        assert "fwd" not in impls[n].passes
    for n in gpu.FWD_VARIANTS:
        assert impls[n].passes == ["fwd"]
    names = list(impls)
    assert names.index("sdpa-cudnn") < names.index("flashattn")  # peers first


def test_dry_run_lists_every_row():
    rows = ",".join(["sdpa-flash", "sdpa-cudnn"] + [n for n in gpu.OURS if n != "flashattn-tf32"])
    r = subprocess.run([sys.executable, os.path.join(BENCH, "gpu.py"), "--dry-run", "--dtypes", "bfloat16",
                        "--kv-groups", "1,4", "--bf16-head-dims", "64,128", "--bf16-seqs", "1024",
                        "--backends", rows, "--base-lib", "base.so"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for n in rows.split(","):
        assert n in r.stdout, n
