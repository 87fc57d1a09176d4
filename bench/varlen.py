#!/usr/bin/env python3
"""Packed variable-length batches on a CUDA GPU: flashattn's packed call against the same tokens
as uniform dense batches, and against PyTorch SDPA on nested (jagged) tensors - its varlen path,
FlashAttention 2 or cuDNN inside torch - in the same process on the same inputs.

Batches: --tokens (16k) tokens of sequences with lengths drawn uniformly from [1, L] (seeded) for
each L in --max-lens (1024, 4096), the last one cut to fill the total; an entry =L packs sequences
of length L only (the packed call's own cost against the dense one, with identical tiles); H = 2048 / D heads (MHA),
head dims --head-dims, --dtype (bfloat16), causal and not (the causal mask of equal lengths is
the same top-left and bottom-right). FLOPs count only real pairs: 4 D H sum(L^2) per forward
(halved when causal), the backward 2.5x that.
Rows (TFLOP/s of the forward and of the backward alone):
  packed        flashattn_forward_varlen / _backward_varlen over the C ABI (--lib)
  packed-compact  the forward on the compact grid (FLASHATTN_CUDA_PACKED_GRID=compact: one CTA
                per real row block instead of the dense grid over max_seqlen_q)
  dense         the same tokens as uniform dense batches: B = tokens / S at S = the mean length
                (rounded), flashattn's default kernels; ratio packed / dense is the issue's figure
  dense-sm80    the same dense batches on the mma.sync kernels (FLASHATTN_CUDA_ARCH=sm80: the
                kernel family's share of a difference; packed float32 calls run these)
  sdpa-<name>   torch SDPA on nested tensors, each backend that accepts them
Each is timed in two views (bench/attn_harness.time_views): kernel (a GPU spin hides host time)
and host-inclusive (each call from an idle GPU). Medians of --reps after --warmup.
Outputs: OUT/varlen.csv, OUT/varlen.md (also printed).

usage: python bench/varlen.py --lib build/src/libflashattn.so --out DIR [--quick]
"""

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_harness as H  # noqa: E402
from cabi import MASK_CAUSAL_BOTTOM_RIGHT, MASK_NONE, CtypesLib, EnvSettings  # noqa: E402


def lengths(tokens, max_len, seed, uniform=False):
    if uniform:
        return [max_len] * max(1, tokens // max_len)
    rng = random.Random(seed)
    out, left = [], tokens
    while left > 0:
        n = min(left, rng.randint(1, max_len))
        out.append(n)
        left -= n
    return out


def fwd_flops(h, d, lens, causal):
    return sum(4.0 * h * d * n * n * (0.5 if causal else 1.0) for n in lens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--max-lens", default="1024,4096")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="--reps 8, --warmup 2")
    ap.add_argument("--no-sdpa", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.warmup = 8, 2
    import torch
    import torch.nn.functional as F

    H.ensure_dir(args.out)
    lib = CtypesLib(os.path.abspath(args.lib), torch)
    dtype = getattr(torch, args.dtype)
    timer = H.Timer(cuda=True)
    rows = []

    def timed(fn):
        return H.time_views(fn, args.warmup, args.reps, timer)

    def record(case, name, pass_, flops, t):
        rows.append(dict(case=case, impl=name, pass_=pass_, host_ms=t["host"], kernel_ms=t["kernel"],
                         tflops_kernel=flops / t["kernel"] / 1e9, tflops_host=flops / t["host"] / 1e9))

    for spec in args.max_lens.split(","):
        uniform = spec.startswith("=")
        max_len = int(spec.lstrip("="))
        lens = lengths(args.tokens, max_len, args.seed, uniform)
        T = sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        for d in [int(x) for x in args.head_dims.split(",")]:
            h = max(1, 2048 // d)
            for causal in [bool(int(x)) for x in args.causal.split(",")]:
                mix = f"={max_len}" if uniform else f"1..{max_len}"
                case = f"{mix} ({len(lens)} seqs) D{d} {'causal' if causal else 'full'}"
                print(f"== {case}", flush=True)
                ff = fwd_flops(h, d, lens, causal)
                mask = MASK_CAUSAL_BOTTOM_RIGHT if causal else MASK_NONE
                opts = (mask, 0, False)
                g = torch.Generator(device="cuda").manual_seed(1)
                q, k, v, do = (torch.randn(T, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
                out, dq, dk, dv = (torch.empty_like(q) for _ in range(4))
                lse = torch.empty(h, T, device="cuda")
                mx = max(lens)
                fwd = lib.bind_forward_varlen(q, k, v, out, lse, cu_t, cu_t, mx, mx, opts)
                bwd = lib.bind_backward_varlen(q, k, v, out, do, lse, dq, dk, dv, cu_t, cu_t, mx, mx, opts)
                fwd()
                record(case, "packed", "fwd", ff, timed(fwd))
                record(case, "packed", "bwd", 2.5 * ff, timed(bwd))
                with EnvSettings({"FLASHATTN_CUDA_PACKED_GRID": "compact"}):
                    fwd()
                    record(case, "packed-compact", "fwd", ff, timed(fwd))

                # The same tokens as uniform dense batches ([B, S, H, D] views: FlashAttention's layout).
                s = max(1, round(T / len(lens)))
                b = max(1, T // s)
                dff = fwd_flops(h, d, [s] * b, causal)
                dq_, dk_, dv_, ddo = (x[: b * s].view(b, s, h, d).transpose(1, 2) for x in (q, k, v, do))
                dout_, ddq, ddk, ddv = (torch.empty_like(x) for x in (dq_, dq_, dk_, dv_))
                dlse = torch.empty(b, h, s, device="cuda")
                dfwd = lib.bind_forward(dq_, dk_, dv_, dout_, dlse, opts)
                dbwd = lib.bind_backward(dq_, dk_, dv_, dout_, ddo, dlse, ddq, ddk, ddv, opts)
                for label, env in (("dense", {}), ("dense-sm80", {"FLASHATTN_CUDA_ARCH": "sm80"})):
                    with EnvSettings(env):
                        dfwd()
                        record(case + f" [dense S{s} B{b}]", label, "fwd", dff, timed(dfwd))
                        record(case + f" [dense S{s} B{b}]", label, "bwd", 2.5 * dff, timed(dbwd))

                if args.no_sdpa:
                    continue
                from torch.nn.attention import SDPBackend, sdpa_kernel
                offsets = cu_t.long()
                for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                 ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)):
                    try:
                        nq, nk, nv = (torch.nested.nested_tensor_from_jagged(x.detach().clone().requires_grad_(), offsets)
                                      .transpose(1, 2) for x in (q, k, v))
                        ndo = torch.nested.nested_tensor_from_jagged(do, offsets).transpose(1, 2)
                        with sdpa_kernel([be]):
                            o = F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal)
                            torch.cuda.synchronize()

                            def sfwd():
                                F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal)

                            def sbwd():
                                torch.autograd.grad(o, (nq, nk, nv), ndo, retain_graph=True)

                            sbwd()
                            record(case, name, "fwd", ff, timed(sfwd))
                            record(case, name, "bwd", 2.5 * ff, timed(sbwd))
                    except Exception as e:  # a backend that does not take nested tensors
                        print(f"   {name}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                    torch.cuda.synchronize()

    H.write_csv(os.path.join(args.out, "varlen.csv"), rows)
    lines = [f"# Packed batches, {args.dtype}, {args.tokens} tokens, H = 2048 / D; TFLOP/s kernel (host-inclusive)", ""]
    lines.append("| case | pass | impl | kernel ms | TFLOP/s kernel | TFLOP/s host | packed/this (kernel) |")
    lines.append("|---|---|---|---|---|---|---|")
    packed = {(r["case"], r["pass_"]): r for r in rows if r["impl"] == "packed"}
    for r in rows:
        base = r["case"].split(" [dense")[0]
        p = packed.get((base, r["pass_"]))
        ratio = p["tflops_kernel"] / r["tflops_kernel"] if p else float("nan")
        lines.append(f"| {r['case']} | {r['pass_']} | {r['impl']} | {r['kernel_ms']:.3f} | {r['tflops_kernel']:.1f} | "
                     f"{r['tflops_host']:.1f} | {ratio:.2f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "varlen.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
