#!/usr/bin/env python3
"""float32 attention on CUDA: flashattn (precision fp32 = 3xTF32, and tf32) against PyTorch SDPA's
memory-efficient backend in float32, same process, same inputs.

Shapes (issue 3): 16k tokens per batch (B = 16384 / S), hidden 2048 (H = 2048 / D),
S in {1k, 4k, 16k}, D in {64, 128}, causal and not. Forward, backward and forward+backward
TFLOP/s (FLOPs: forward 4*B*H*S*S*D, halved when causal; backward 2.5x), medians of CUDA-event
timings after warm-up (each call timed alone: events around it, then a synchronisation).
flashattn is called through its C ABI (ctypes) on the torch tensors' device pointers, on torch's
current stream, with the argument structures built once outside the timed call (cabi.py
bind_forward / bind_backward: the Python that fills them is not the library's time); the peer
is timed as called from Python (SDPA; torch.autograd.grad for its backward).

usage: bench_cuda_fp32.py --lib build/src/libflashattn.so [--quick] [--csv out.csv]
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cabi import MASK_CAUSAL_TOP_LEFT, MASK_NONE, CtypesLib


class FlashAttn(CtypesLib):
    """The C ABI (cabi.py) with this script's option set: causal or not, precision 0/1."""

    def __init__(self, path):
        super().__init__(path, torch)

    @staticmethod
    def options(causal, precision):
        return (MASK_CAUSAL_TOP_LEFT if causal else MASK_NONE, precision, False)


def call_times(fn, reps):
    """reps calls of fn, each timed alone (events around it, then a synchronisation), in ms."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(call_times(fn, reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--quick", action="store_true", help="S = 1k and 4k only")
    ap.add_argument("--csv")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    fa = FlashAttn(args.lib)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    seqs = [1024, 4096] if args.quick else [1024, 4096, 16384]
    rows = []
    hdr = (f"{'S':>6} {'D':>4} {'causal':>6} | {'fwd fp32':>8} {'fwd tf32':>8} {'fwd peer':>8} | "
           f"{'bwd fp32':>8} {'bwd tf32':>8} {'bwd peer':>8} | {'f+b fp32':>8} {'f+b tf32':>8} "
           f"{'f+b peer':>8} | ratios fp32/peer f,b  tf32/peer f,b")
    print("TFLOP/s (median of %d, CUDA events)" % args.reps)
    print(hdr, flush=True)
    for d in (64, 128):
        for s in seqs:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                g = torch.Generator(device=dev).manual_seed(0)
                q, k, v, do = (torch.randn(b, h, s, d, device=dev, generator=g) for _ in range(4))
                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, device=dev)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                fl_f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
                fl_b = 2.5 * fl_f
                res = {}
                for name, prec in (("fp32", 0), ("tf32", 1)):
                    o = fa.options(causal, prec)
                    tf = time_ms(fa.bind_forward(q, k, v, out, lse, o), 2, args.reps)
                    tb = time_ms(fa.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o), 2, args.reps)
                    res[name] = (tf, tb)
                # tf32 on the mma.sync kernels too (the sm_90a wgmma kernels are the default on
                # compute capability 9.0 at padded D = 64 and 128, forward and backward): what they gained.
                os.environ["FLASHATTN_CUDA_ARCH"] = "sm80"
                o = fa.options(causal, 1)
                tf80 = time_ms(fa.bind_forward(q, k, v, out, lse, o), 2, args.reps)
                tb80 = time_ms(fa.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o), 2, args.reps)
                del os.environ["FLASHATTN_CUDA_ARCH"]
                # The other fp32 forward on compute capability 9.0: the mma.sync one (the wgmma
                # 3xTF32 forward is the default at padded D = 64 and 128): its speed, and its O
                # against the default's (a failure is reported, not fatal).
                w_fwd, w_err = float("nan"), float("nan")
                w_name = "mma.sync"
                if d <= 128:
                    o = fa.options(causal, 0)
                    fa.forward(q, k, v, out, lse, o)
                    out_d = out.clone()
                    os.environ["FLASHATTN_CUDA_FP32_FWD"] = "mma"
                    try:
                        w_fwd = fl_f / time_ms(fa.bind_forward(q, k, v, out, lse, o), 2, args.reps) / 1e9
                        w_err = (out_d - out).abs().max().item()
                    except (RuntimeError, NotImplementedError) as e:
                        print(f"# fp32 {w_name} forward failed: {e}", flush=True)
                    del out_d
                    os.environ.pop("FLASHATTN_CUDA_FP32_FWD", None)
                # The fp32 mma.sync backward at padded D = 64 and 128 (the default there is the wgmma
                # pair kernels in 3xTF32 on compute capability 9.0): its speed, and its gradients
                # against the default's, relative to the largest.
                w_bwd, w_berr = float("nan"), float("nan")
                if d <= 128:
                    o = fa.options(causal, 0)
                    fa.forward(q, k, v, out, lse, o)
                    os.environ["FLASHATTN_CUDA_FP32_BWD"] = "mma"
                    try:
                        w_bwd = fl_b / time_ms(fa.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o), 2,
                                               args.reps) / 1e9
                        g_w = (dq.clone(), dk.clone(), dv.clone())
                        del os.environ["FLASHATTN_CUDA_FP32_BWD"]
                        fa.backward(q, k, v, out, do, lse, dq, dk, dv, o)
                        scale = max(t.abs().max().item() for t in (dq, dk, dv))
                        w_berr = max((a - b).abs().max().item() for a, b in zip(g_w, (dq, dk, dv))) / scale
                        del g_w
                    except (RuntimeError, NotImplementedError) as e:
                        print(f"# fp32 mma.sync backward failed: {e}", flush=True)
                    os.environ.pop("FLASHATTN_CUDA_FP32_BWD", None)
                qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                    def pf():
                        return F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                    tf = time_ms(pf, 2, args.reps)
                    o_peer = pf()
                    tb = time_ms(lambda: torch.autograd.grad(o_peer, (qg, kg, vg), do, retain_graph=True),
                                 2, args.reps)
                    res["peer"] = (tf, tb)
                    # sanity: same function
                    fa.forward(q, k, v, out, lse, fa.options(causal, 0))
                    err = (out - o_peer.detach()).abs().max().item()
                    fa.forward(q, k, v, out, lse, fa.options(causal, 1))
                    err_tf32 = (out - o_peer.detach()).abs().max().item()
                    # and the tf32 gradients against the peer's float32 ones (relative to the
                    # largest gradient, as the tests judge them)
                    g_peer = torch.autograd.grad(o_peer, (qg, kg, vg), do, retain_graph=True)
                    fa.backward(q, k, v, out, do, lse, dq, dk, dv, fa.options(causal, 1))
                    scale_g = max(t.abs().max().item() for t in g_peer)
                    err_g = max((a - b).abs().max().item() for a, b in zip((dq, dk, dv), g_peer)) / scale_g
                del qg, kg, vg, o_peer, g_peer
                tfl = {n: (fl_f / t[0] / 1e9, fl_b / t[1] / 1e9, (fl_f + fl_b) / (t[0] + t[1]) / 1e9)
                       for n, t in res.items()}
                f32, t32, pr = tfl["fp32"], tfl["tf32"], tfl["peer"]
                t80, b80 = fl_f / tf80 / 1e9, fl_b / tb80 / 1e9
                line = (f"{s:>6} {d:>4} {str(causal):>6} | {f32[0]:8.1f} {t32[0]:8.1f} {pr[0]:8.1f} | "
                        f"{f32[1]:8.1f} {t32[1]:8.1f} {pr[1]:8.1f} | {f32[2]:8.1f} {t32[2]:8.1f} {pr[2]:8.1f} | "
                        f"{f32[0]/pr[0]:.2f} {f32[1]/pr[1]:.2f}   {t32[0]/pr[0]:.2f} {t32[1]/pr[1]:.2f}"
                        f"   (max|O-O_peer| fp32 {err:.1e}, tf32 {err_tf32:.1e}; tf32 grads rel {err_g:.1e}; "
                        f"tf32 on mma.sync fwd {t80:.1f} bwd {b80:.1f}"
                        + (f"; fp32 fwd on {w_name} {w_fwd:.1f} = {w_fwd/pr[0]:.2f}x, max|O-O_default| {w_err:.1e}"
                           if w_fwd == w_fwd else "")
                        + (f"; fp32 bwd on mma.sync {w_bwd:.1f} = {w_bwd/pr[1]:.2f}x, grads rel vs default "
                           f"{w_berr:.1e}" if w_bwd == w_bwd else "") + ")")
                print(line, flush=True)
                rows.append((s, d, causal, f32, t32, pr, t80, b80, w_fwd, w_bwd))
                del q, k, v, do, out, lse, dq, dk, dv
                torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("S,D,causal,fwd_fp32,fwd_tf32,fwd_peer,bwd_fp32,bwd_tf32,bwd_peer,fb_fp32,fb_tf32,fb_peer,"
                    "fwd_tf32_mma_sync,bwd_tf32_mma_sync,fwd_fp32_other,bwd_fp32_mma_sync\n")
            for s, d, c, a, t, p, t80, b80, w, wb in rows:
                f.write(f"{s},{d},{int(c)},{a[0]:.2f},{t[0]:.2f},{p[0]:.2f},{a[1]:.2f},{t[1]:.2f},{p[1]:.2f},"
                        f"{a[2]:.2f},{t[2]:.2f},{p[2]:.2f},{t80:.2f},{b80:.2f},{w:.2f},{wb:.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
