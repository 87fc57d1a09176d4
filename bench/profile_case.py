#!/usr/bin/env python3
"""One flashattn call on CUDA for a profiler to capture (scripts/gpu-profile runs it under ncu).

Builds the issue benchmarks' shape (B = 16384 / S, H = 2048 / D, Sq = Skv = S), runs the pass
once to warm up, then once more between torch.cuda.profiler start/stop marks (ncu's
--profile-from-start off captures only that call's kernels). The C ABI is called through ctypes
on torch tensors' device pointers, as bench/gpu.py's ctypes path does.

usage: profile_case.py --lib build-gpu/src/libflashattn.so [--dtype bfloat16|float16|float32]
                       [--head-dim 128] [--seq 4096] [--causal] [--pass fwd|bwd]
                       [--precision fp32|tf32] [--deterministic]
                       [--window LEFT,RIGHT] [--softcap C] [--alibi]
                       [--peer sdpa-cudnn|sdpa-flash]
--peer profiles PyTorch SDPA's kernels with that backend on the same tensors instead (plain and
causal only; the backward: the graph built before the profiled region, only its backward inside).
(--alibi: bench/mods.py's slopes, 2^(-8 (h + 1) / H) per head.)
"""
import argparse
import sys

import torch

from cabi import MASK_CAUSAL_TOP_LEFT, MASK_NONE, CtypesLib, issue_problem
from mods import alibi_slopes


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pass", dest="which", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32"))
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--window", default=None, help="LEFT,RIGHT (FlashAttention's window_size)")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--alibi", action="store_true")
    ap.add_argument("--peer", default=None, choices=("sdpa-cudnn", "sdpa-flash"))
    a = ap.parse_args()
    if a.peer and (a.window or a.softcap or a.alibi or a.dtype == "float32"):
        ap.error("--peer: 16-bit plain or causal cases only")
    lib = CtypesLib(a.lib, torch)
    dt = DTYPES[a.dtype]
    s, d = a.seq, a.head_dim
    prob = issue_problem(torch, s, d, dt)
    b, h = prob["b"], prob["h"]
    q, k, v, do, out, lse, dq, dk, dv = (prob[n] for n in ("q", "k", "v", "do", "out", "lse", "dq", "dk", "dv"))
    mods = {"softcap": a.softcap}
    if a.window is not None:
        mods["window"] = tuple(int(x) for x in a.window.split(","))
    if a.alibi:
        mods["alibi"] = alibi_slopes(torch, h)
    o = (MASK_CAUSAL_TOP_LEFT if a.causal else MASK_NONE, 1 if a.precision == "tf32" else 0, a.deterministic,
         mods)

    def fwd():
        lib.forward(q, k, v, out, lse, o)

    def bwd():
        lib.backward(q, k, v, out, do, lse, dq, dk, dv, o)

    if a.peer:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}[a.peer]
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]  # ([B, H, S, D], as SDPA takes them)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd():  # noqa: F811 (the peer's)
            with sdpa_kernel(backend), torch.no_grad():
                sdpa(q, k, v, is_causal=a.causal)

        def bwd():  # noqa: F811
            with sdpa_kernel(backend):
                o_ = sdpa(*leaves, is_causal=a.causal)
            run_bwd = lambda: torch.autograd.grad(o_, leaves, do, retain_graph=True)  # noqa: E731
            run_bwd()
            return run_bwd

    fwd()
    run = fwd if a.which == "fwd" else (bwd() if a.peer else bwd)
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled: {a.which} {a.dtype} B={b} H={h} S={s} D={d} causal={a.causal} precision={a.precision} "
          f"window={a.window} softcap={a.softcap} alibi={a.alibi} peer={a.peer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
