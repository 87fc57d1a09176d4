#!/usr/bin/env python3
"""flashattn next to PyTorch SDPA's backends on a CUDA GPU: same process, identical inputs.

Backends: flashattn (precision fp32 and, for float32, tf32) through flashattn.torch.attention,
and F.scaled_dot_product_attention pinned to each of its backends: flash (FlashAttention 2),
cudnn, efficient (memory-efficient) and math. A backend that cannot serve a case (e.g. SDPA's
flash and cuDNN backends take no float32; math at long sequences would need tens of GB for the
S x S matrices) is listed as skipped with the reason.

Shapes (the CUDA issues): 16k tokens per batch (B = tokens / S), hidden 2048 (H = 2048 / D),
S in {1k, 4k, 16k} (--bf16-seqs adds 512..16k for bf16/fp16), D in {64, 128}, causal and not.
TFLOP/s with FLOPs = 4*B*H*S*S*D (halved when causal), backward 2.5x, both 3.5x; CUDA-event
medians after warm-up, inputs rotated among --sets independent sets (each set is far larger than
L2). Training mode: requires_grad inputs, backward through autograd (bench/attn_harness.py).

usage: python bench/gpu.py --out out/bench-gpu [--dtypes float32,bfloat16,float16] [--quick]
writes OUT/gpu.csv, OUT/gpu.md (table) and OUT/gpu.png (TFLOP/s vs sequence length).
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
SDPA = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-math": SDPBackend.MATH,
}
# The math backend materialises S (and P, dP, dS) per head: cap its scratch.
MATH_MAX_BYTES = 12 << 30


def sdpa_fn(causal):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def flashattn_fn(precision, causal):
    mask = "causal_top_left" if causal else "none"  # equal to bottom-right for Sq == Skv

    def f(q, k, v):
        return fat.attention(q, k, v, mask=mask, precision=precision)
    return f


def context(name):
    # The backend is pinned once around a whole measurement, not inside the timed calls.
    return sdpa_kernel(SDPA[name]) if name in SDPA else contextlib.nullcontext()


def supported(name, fn, dtype, d, device):
    """Runs one tiny forward+backward; returns None or the reason it failed."""
    q = torch.randn(1, 2, 128, d, device=device, dtype=dtype, requires_grad=True)
    try:
        with context(name):
            out = fn(q, q, q)
        out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return str(e).strip().splitlines()[0][:160]


def peak_extra_mib(fn, inputs):
    """Memory one forward+backward allocates beyond its inputs (outputs, saved tensors,
    workspace, gradients), in MiB."""
    q, k, v, dout = inputs
    if not q.is_cuda:
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    del out, grads
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def empty_cache(dev):
    if dev == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu.csv, gpu.md and gpu.png")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--bf16-seqs", default="512,1024,2048,4096,8192,16384",
                    help="sequence lengths for bfloat16/float16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / S)")
    ap.add_argument("--hidden", type=int, default=2048, help="H = hidden / D")
    ap.add_argument("--backends", default="flashattn,flashattn-tf32," + ",".join(SDPA))
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated between calls")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget", type=float, default=1.5, help="seconds per measurement, at most")
    ap.add_argument("--quick", action="store_true", help="3 reps, 1 warm-up, 0.5 s budget")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' runs the same script on the CPU (a smoke test of the script)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup, args.budget = 3, 1, 0.5
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device")
    if dev == "cuda" and not flashattn.cuda_available():
        sys.exit("this flashattn build has no usable CUDA backend (flashattn.build_info())")
    H.ensure_dir(args.out)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 peers stay float32-accurate
    torch.backends.cudnn.allow_tf32 = False

    dev_name = torch.cuda.get_device_name() if dev == "cuda" else platform.machine() + " CPU"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = (f"{stamp}; {dev_name}; torch {torch.__version__}; flashattn {flashattn.__version__}; "
              f"python {platform.python_version()}; command: {' '.join(sys.argv)}")
    print(header, flush=True)
    wanted = args.backends.split(",")
    timer = H.Timer(cuda=dev == "cuda")
    rows, notes = [], []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        seqs = args.seqs if dtype == torch.float32 else args.bf16_seqs
        causals = [bool(int(c)) for c in args.causal.split(",")]
        for d in map(int, args.head_dims.split(",")):
            fns, skip = {}, {}
            for causal in causals:
                for name in wanted:
                    if name == "flashattn":
                        fn = flashattn_fn("fp32", causal)
                    elif name == "flashattn-tf32":
                        if dtype != torch.float32:
                            continue
                        fn = flashattn_fn("tf32", causal)
                    else:
                        fn = sdpa_fn(causal)
                    fns[name, causal] = fn
                    why = supported(name, fn, dtype, d, dev)
                    if why:
                        skip[name, causal] = why
                        notes.append(f"{name} {dname} D={d}{' causal' if causal else ''}: "
                                     f"skipped ({why})")
            for s in map(int, seqs.split(",")):
                b, h = max(1, args.tokens // s), args.hidden // d
                sets = H.make_sets(args.sets, b, h, s, d, dtype, dev)
                for causal in causals:
                    for name in wanted:
                        if (name, causal) not in fns or (name, causal) in skip:
                            continue
                        fn = fns[name, causal]
                        if name == "sdpa-math" and 4 * b * h * s * s * 4 > MATH_MAX_BYTES:
                            notes.append(f"sdpa-math {dname} D={d} S={s}: skipped (S x S "
                                         f"matrices need > {MATH_MAX_BYTES >> 30} GiB)")
                            continue
                        try:
                            with context(name):
                                ms = H.measure(fn, sets, timer, args.warmup, args.reps,
                                               args.budget)
                                peak = peak_extra_mib(fn, sets[0])
                        except torch.cuda.OutOfMemoryError:
                            empty_cache(dev)
                            notes.append(f"{name} {dname} D={d} S={s}: out of memory")
                            continue
                        except RuntimeError as e:
                            notes.append(f"{name} {dname} D={d} S={s}: failed "
                                         f"({str(e).strip().splitlines()[0][:160]})")
                            continue
                        row = dict(dtype=dname, causal=causal, head_dim=d, seq=s, batch=b,
                                   heads=h, backend=name, fwd_bwd_peak_extra_mib=round(peak, 1))
                        for p in H.PASSES:
                            row[f"{p}_ms"] = round(ms[p], 4)
                            row[f"{p}_flops_per_s"] = H.flops(b, h, s, d, causal, p) / (ms[p] * 1e-3)
                        rows.append(row)
                        print(f"{dname:9s} D={d:3d} S={s:5d} causal={int(causal)} {name:15s} "
                              + "  ".join(f"{p} {row[p + '_flops_per_s'] / 1e12:6.1f}"
                                          for p in H.PASSES)
                              + f"  TFLOP/s  (peak +{peak:.0f} MiB)", flush=True)
                del sets
                empty_cache(dev)
    if not rows:
        sys.exit("nothing was measured")
    H.write_csv(os.path.join(args.out, "gpu.csv"), rows)
    ours = [b for b in ("flashattn", "flashattn-tf32") if b in wanted]
    peers = [b for b in SDPA if b in wanted]
    md = header + "\n\n" + H.table(rows, ours, peers)
    if notes:
        md += "\n\nNotes:\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes))
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md, flush=True)
    H.chart(rows, os.path.join(args.out, "gpu.png"),
            f"flashattn vs PyTorch SDPA, {dev_name}, fwd / bwd / fwd+bwd (training mode)")
    print(f"\nwrote {args.out}/gpu.csv, gpu.md, gpu.png")


if __name__ == "__main__":
    main()
