#!/usr/bin/env python3
"""Sliding window, logit softcap and ALiBi on a CUDA GPU: what each costs in flashattn, and
flashattn next to PyTorch's FlexAttention (the peer that offers all three; SDPA's flash and cuDNN
backends take none of them) in the same process on the same inputs.

Sections (16-bit, default bfloat16; head dims --head-dims, default 64,128):
  window    S = --window-seq (16k), B = 1, H = 2048 / D: causal (bottom-right) against causal with
            window_size = (--window, 0). FLOPs count only visible (query, key) pairs, so the
            window's cost against its FLOP share is cost = (t_window / t_causal) /
            (pairs_window / pairs_causal): 1.0 means the window is exactly proportional.
  overhead  16k tokens (B = 16384 / S), hidden 2048: plain, softcap (--softcap), ALiBi (standard
            slopes 2^(-8(h+1)/H)) and both, causal and not, S in --seqs: t_variant / t_plain.
  flex      (--flex) torch.nn.attention.flex_attention, compiled, with the same masks and score
            mods (score_mod / block_mask) at a few shapes: flex time / flashattn time.
Every pass (fwd; bwd = the backward alone, graph kept) is timed through autograd with
attn_harness.measure over rotating input sets in two views: kernel time (a GPU spin before each
call hides host time) and host-inclusive (no spin: the call's host work counts). Median of
--reps after --warmup. flashattn is called over the C ABI (--lib) with gpu.py's autograd wiring.
Outputs: OUT/mods.csv, OUT/mods.md (also printed).

usage: python bench/mods.py --lib build/src/libflashattn.so --out DIR [--quick] [--flex]
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_harness as H  # noqa: E402
from cabi import MASK_CAUSAL_BOTTOM_RIGHT, MASK_NONE, CtypesLib, EnvSettings  # noqa: E402
from gpu import FWD_VARIANTS, ctypes_attention, knobs  # noqa: E402


def visible_pairs(s_q, s_kv, causal, window):
    """(query, key) pairs a query block sees: causal bottom-right and/or FlashAttention's window
    (left, right), -1 unbounded; the FLOP model counts these (4 D per pair forward)."""
    d = s_kv - s_q
    total = 0
    left, right = window if window else (-1, -1)
    for i in range(s_q):
        hi = s_kv - 1
        if right >= 0:
            hi = min(hi, i + d + right)
        if causal:
            hi = min(hi, i + d)
        lo = max(0, i + d - left) if left >= 0 else 0
        total += max(0, hi - lo + 1)
    return total


def pass_flops(b, h, d, pairs, p):
    f = 4.0 * b * h * pairs * d
    return {"fwd": f, "bwd": 2.5 * f, "both": 3.5 * f}[p]


def alibi_slopes(torch, h):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float32, device="cuda")


class Ours:
    def __init__(self, torch, lib_path):
        self.lib = CtypesLib(os.path.abspath(lib_path), torch)
        self.fn = ctypes_attention(torch, self.lib)

    def make(self, causal, mods):
        opts = (MASK_CAUSAL_BOTTOM_RIGHT if causal else MASK_NONE, 0, False, mods)
        return lambda q, k, v: self.fn.apply(q, k, v, opts)


class Flex:
    """FlexAttention with the same mask and score mods, compiled once per (mods, shape)."""

    def __init__(self, torch):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.torch = torch
        self.cbm = create_block_mask
        self.flex = torch.compile(flex_attention, dynamic=False)

    def make(self, s, causal, mods):
        window = mods.get("window")
        cap = mods.get("softcap", 0.0)
        slopes = mods.get("alibi")

        def mask_mod(b, h, qi, kj):
            keep = qi >= kj if causal else qi >= 0
            if window is not None:
                keep = keep & (qi - kj <= window[0])
            return keep

        block_mask = self.cbm(mask_mod, B=None, H=None, Q_LEN=s, KV_LEN=s) if (causal or window) else None
        torch = self.torch

        def score_mod(score, b, h, qi, kj):
            if cap:
                score = cap * torch.tanh(score / cap)
            if slopes is not None:
                score = score - slopes[h] * (qi - kj).abs()
            return score

        sm = score_mod if (cap or slopes is not None) else None
        flex = self.flex
        return lambda q, k, v: flex(q, k, v, score_mod=sm, block_mask=block_mask)


def run_case(torch, args, impls, dtype, b, h, s, d, causal, mods, pairs, timers, section, label, rows):
    sets = H.make_sets(args.sets, b, h, s, d, dtype, "cuda")
    row = dict(section=section, case=label, dtype=args.dtype, B=b, H=h, S=s, D=d, causal=int(causal))
    outs = {}
    for name, impl in impls:
        try:
            ours = name.startswith("flashattn")
            attn = impl.make(causal, mods) if ours else impl.make(s, causal, mods)
        except Exception as e:  # a peer that cannot express the case
            row[f"{name}_error"] = str(e)[:120]
            continue
        q, k, v, _ = sets[0]
        with EnvSettings(knobs(name)):  # (a variant's knobs for its calls only)
            outs[name] = attn(q, k, v).detach().float()
            for view, timer in timers.items():
                ms = H.measure(attn, sets, timer, args.warmup, args.reps, args.budget, passes=("fwd", "bwd"))
                for p, t in ms.items():
                    row[f"{name}_{p}_{view}_ms"] = t
                    row[f"{name}_{p}_{view}_tflops"] = pass_flops(b, h, d, pairs, p) / (t * 1e-3) / 1e12
    if "flashattn" in outs and "flex" in outs:
        ref = outs["flex"]
        row["max_diff_vs_flex"] = float((outs["flashattn"] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    rows.append(row)
    del sets
    torch.cuda.empty_cache()
    return row


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", default="out/bench-mods")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqs", default="1024,4096,16384")
    ap.add_argument("--window-seq", type=int, default=16384)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="head dim 128, S 1k/4k for the overhead")
    ap.add_argument("--variants", default="",
                    help="also time these forward variants of a developer build in the same runs (comma list "
                         "of " + ",".join(FWD_VARIANTS) + "): rows <variant>_..., window cost cost_<variant>_...")
    ap.add_argument("--window-only", action="store_true", help="the window section only")
    ap.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles per case)")
    ap.add_argument("--flex-dims", default="128", help="head dims FlexAttention runs at (each case compiles)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--budget", type=float, default=3.0)
    args = ap.parse_args()
    if args.quick:
        args.head_dims, args.seqs = "128", "1024,4096"

    import torch

    dtype = getattr(torch, args.dtype)
    ours = Ours(torch, args.lib)
    impls = [("flashattn", ours)] + [(v, ours) for v in args.variants.split(",") if v]
    flex = None
    if args.flex:
        try:
            flex = Flex(torch)
        except Exception as e:
            print(f"FlexAttention unavailable: {e}")
    timers = {"kernel": H.Timer(True), "host": H.Timer(True, gpu_sleep=False)}
    rows = []
    H.ensure_dir(args.out)
    dims = [int(x) for x in args.head_dims.split(",")]

    # window: its cost against its FLOP share of full causal
    s = args.window_seq
    for d in dims:
        h = max(1, 2048 // d)
        w = (args.window, 0)
        pc = visible_pairs(s, s, True, None)
        pw = visible_pairs(s, s, True, w)
        use = impls + ([("flex", flex)] if flex and str(d) in args.flex_dims.split(",") else [])
        rc = run_case(torch, args, use, dtype, 1, h, s, d, True, {}, pc, timers, "window", "causal", rows)
        rw = run_case(torch, args, use, dtype, 1, h, s, d, True, {"window": w}, pw, timers, "window",
                      f"causal+window{w}", rows)
        for name, _ in impls:
            pre = "" if name == "flashattn" else name + "_"
            for p in ("fwd", "bwd"):
                for view in timers:
                    key = f"{name}_{p}_{view}_ms"
                    if key in rc and key in rw:
                        rw[f"cost_{pre}{p}_{view}"] = (rw[key] / rc[key]) / (pw / pc)
            print(f"window D={d} {name}: pair share {pw / pc:.4f}, cost fwd {fmt(rw.get(f'cost_{pre}fwd_kernel'))} "
                  f"bwd {fmt(rw.get(f'cost_{pre}bwd_kernel'))} (kernel view; fwd "
                  f"{fmt(rw.get(f'{name}_fwd_kernel_ms'), 3)} ms)", flush=True)
        rw["pair_share"] = pw / pc

    # overhead of softcap / ALiBi against the same shape without
    for d in ([] if args.window_only else dims):
        h = max(1, 2048 // d)
        slopes = alibi_slopes(torch, h)
        variants = [("plain", {}), ("softcap", {"softcap": args.softcap}), ("alibi", {"alibi": slopes}),
                    ("softcap+alibi", {"softcap": args.softcap, "alibi": slopes})]
        for s in [int(x) for x in args.seqs.split(",")]:
            b = max(1, 16384 // s)
            for causal in (False, True):
                pairs = visible_pairs(s, s, causal, None)
                base = None
                for label, mods in variants:
                    # FlexAttention compiles per case: one shape (S = 4k, causal) per head dim.
                    use = impls + ([("flex", flex)] if flex and s == 4096 and causal and
                                   str(d) in args.flex_dims.split(",") else [])
                    r = run_case(torch, args, use, dtype, b, h, s, d, causal, mods, pairs, timers, "overhead",
                                 label, rows)
                    if base is None:
                        base = r
                    for p in ("fwd", "bwd"):
                        for view in timers:
                            key = f"flashattn_{p}_{view}_ms"
                            if key in r and key in base:
                                r[f"overhead_{p}_{view}"] = r[key] / base[key]
                    print(f"overhead D={d} S={s} causal={int(causal)} {label}: fwd "
                          f"{fmt(r.get('overhead_fwd_kernel'), 3)} bwd {fmt(r.get('overhead_bwd_kernel'), 3)}",
                          flush=True)
                H.write_csv(os.path.join(args.out, "mods.csv"), rows)

    for r in rows:
        for p in ("fwd", "bwd"):
            for view in timers:
                a, f = r.get(f"flashattn_{p}_{view}_ms"), r.get(f"flex_{p}_{view}_ms")
                if a and f:
                    r[f"vs_flex_{p}_{view}"] = f / a
    H.write_csv(os.path.join(args.out, "mods.csv"), rows)
    lines = [f"# flashattn window / softcap / ALiBi ({args.dtype}, {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "",
             "| section | case | D | S | B | causal | fwd TFLOP/s | bwd TFLOP/s | fwd host TFLOP/s | bwd host TFLOP/s "
             "| overhead or cost fwd | bwd | flex fwd | flex bwd | ours/flex fwd | bwd |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sec = r["section"]
        of = r.get("cost_fwd_kernel") if sec == "window" else r.get("overhead_fwd_kernel")
        ob = r.get("cost_bwd_kernel") if sec == "window" else r.get("overhead_bwd_kernel")
        lines.append(
            f"| {sec} | {r['case']} | {r['D']} | {r['S']} | {r['B']} | {r['causal']} | "
            f"{fmt(r.get('flashattn_fwd_kernel_tflops'), 1)} | {fmt(r.get('flashattn_bwd_kernel_tflops'), 1)} | "
            f"{fmt(r.get('flashattn_fwd_host_tflops'), 1)} | {fmt(r.get('flashattn_bwd_host_tflops'), 1)} | "
            f"{fmt(of, 3)} | {fmt(ob, 3)} | {fmt(r.get('flex_fwd_kernel_tflops'), 1)} | "
            f"{fmt(r.get('flex_bwd_kernel_tflops'), 1)} | {fmt(r.get('vs_flex_fwd_kernel'))} | "
            f"{fmt(r.get('vs_flex_bwd_kernel'))} |")
    lines += ["", "overhead = t(variant) / t(plain) at the same shape (kernel view); window cost = "
              "(t_window / t_causal) / (visible pairs share); ours/flex = flex time / our time."]
    md = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "mods.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
