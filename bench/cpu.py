#!/usr/bin/env python3
"""flashattn next to PyTorch's CPU attention at equal thread counts: same process, same inputs.

Backends: flashattn (flashattn.torch.attention, num_threads = torch's thread count; on request
flashattn-split / flashattn-fused, its backward's two designs forced, and flashattn-pools, its CPU
calls on the library's own thread pools instead of torch's OpenMP threads) and
F.scaled_dot_product_attention pinned to PyTorch's CPU flash-attention kernel (sdpa-flash) and to
its math backend (sdpa-math). Each thread count in --threads (default 1, 2 and all cores) is set
with torch.set_num_threads for both sides.

Shapes: B=1, H=8, S in {512, 1024, 2048}, D in {64, 128}, causal and not, float32 (bfloat16 on
request). GFLOP/s by the FLOP model of attn_harness.flops (stated in docs/PERF.md);
wall-clock medians after warm-up, inputs rotated among --sets sets, training mode (requires_grad
inputs, autograd backward: bench/attn_harness.py).

usage: python bench/cpu.py --out out/bench-cpu [--threads 1,2,0] [--dtypes float32,bfloat16]
writes OUT/cpu.csv, OUT/cpu.md and OUT/cpu.png.
"""

import argparse
import contextlib
import datetime
import os
import platform
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_harness as H  # noqa: E402

import flashattn  # noqa: E402
import flashattn.torch as fat  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SDPA = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-math": SDPBackend.MATH}


# flashattn with the backward's design fixed (FLASHATTN_CPU_BWD, read per call): both designs give
# the same bits, so these rows time the library's own choice (the "flashattn" rows) against each.
DESIGNS = {"flashattn-split": "split", "flashattn-fused": "fused"}


@contextlib.contextmanager
def backward_design(design):
    old = os.environ.get("FLASHATTN_CPU_BWD")
    os.environ["FLASHATTN_CPU_BWD"] = design
    try:
        yield
    finally:
        if old is None:
            del os.environ["FLASHATTN_CPU_BWD"]
        else:
            os.environ["FLASHATTN_CPU_BWD"] = old


@contextlib.contextmanager
def own_pools():
    # flashattn.torch runs CPU calls on torch's OpenMP threads by default; this row times the
    # library's own thread pools instead.
    was = fat.torch_threads_in_use()
    fat.use_torch_threads(False)
    try:
        yield
    finally:
        if was:
            fat.use_torch_threads(True)


def context(name):
    if name == "flashattn-pools":
        return own_pools()
    if name in DESIGNS:
        return backward_design(DESIGNS[name])
    return sdpa_kernel(SDPA[name]) if name in SDPA else contextlib.nullcontext()


def make_fn(name, causal):
    if name in ("flashattn", "flashattn-pools") or name in DESIGNS:
        mask = "causal_top_left" if causal else "none"
        return lambda q, k, v: fat.attention(q, k, v, mask=mask)
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for cpu.csv, cpu.md and cpu.png")
    ap.add_argument("--threads", default="1,2,0", help="thread counts; 0 = all cores")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--seqs", default="512,1024,2048")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--backends", default="flashattn," + ",".join(SDPA))
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per measurement, at most")
    args = ap.parse_args()
    H.ensure_dir(args.out)
    cores = os.cpu_count() or 1
    threads = sorted({cores if int(t) == 0 else int(t) for t in args.threads.split(",")})
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"{stamp}; {platform.processor() or platform.machine()}, {cores} cores; "
              f"torch {torch.__version__}; flashattn {flashattn.__version__}; "
              f"command: {' '.join(sys.argv)}")
    print(header, flush=True)
    print(flashattn.build_info().strip(), flush=True)
    timer = H.Timer(cuda=False)
    saved_threads = torch.get_num_threads()
    rows, notes = [], []
    wanted = args.backends.split(",")
    try:
        for nt in threads:
            torch.set_num_threads(nt)
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                for d in map(int, args.head_dims.split(",")):
                    for causal in (bool(int(c)) for c in args.causal.split(",")):
                        for s in map(int, args.seqs.split(",")):
                            sets = H.make_sets(args.sets, args.batch, args.heads, s, d, dtype,
                                               "cpu")
                            for name in wanted:
                                fn = make_fn(name, causal)
                                try:
                                    with context(name):
                                        ms = H.measure(fn, sets, timer, args.warmup, args.reps,
                                                       args.budget)
                                except RuntimeError as e:
                                    notes.append(f"{name} {dname} D={d} S={s}: failed "
                                                 f"({str(e).strip().splitlines()[0][:160]})")
                                    continue
                                row = dict(threads=nt, dtype=f"{dname} {nt}t", causal=causal,
                                           head_dim=d, seq=s, batch=args.batch,
                                           heads=args.heads, backend=name)
                                for p in H.PASSES:
                                    row[f"{p}_ms"] = round(ms[p], 3)
                                    row[f"{p}_flops_per_s"] = (
                                        H.flops(args.batch, args.heads, s, d, causal, p)
                                        / (ms[p] * 1e-3))
                                rows.append(row)
                                print(f"{nt}t {dname:9s} D={d:3d} S={s:5d} causal={int(causal)} "
                                      f"{name:11s} "
                                      + "  ".join(f"{p} {row[p + '_flops_per_s'] / 1e9:6.1f}"
                                                  for p in H.PASSES) + "  GFLOP/s", flush=True)
    finally:
        torch.set_num_threads(saved_threads)
    if not rows:
        sys.exit("nothing was measured")
    H.write_csv(os.path.join(args.out, "cpu.csv"), rows)
    peers = [b for b in SDPA if b in wanted]
    ours = ["flashattn"] + [b for b in ("flashattn-pools", *DESIGNS) if b in wanted]
    md = header + "\n\n" + H.table(rows, ours, peers, unit="GFLOP/s", scale=1e9)
    if notes:
        md += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in notes)
    with open(os.path.join(args.out, "cpu.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md, flush=True)
    H.chart(rows, os.path.join(args.out, "cpu.png"),
            f"flashattn vs PyTorch CPU SDPA at equal threads ({cores} cores)", scale=1e9,
            unit="GFLOP/s")
    print(f"\nwrote {args.out}/cpu.csv, cpu.md" + (", cpu.png" if os.path.exists(os.path.join(args.out, "cpu.png")) else ""))


if __name__ == "__main__":
    main()
