"""Shared pieces of bench/gpu.py and bench/cpu.py: the shape grid, FLOP model, timing loops,
result table, CSV and chart.

Every backend is called the way training code calls it: inputs in FlashAttention's
(batch, seqlen, heads, headdim) memory layout, viewed as [B, H, S, D] without copies, with
requires_grad set, through autograd (forward builds the graph; backward is
torch.autograd.grad with the graph kept, so repeated backward calls time the backward alone).
Inputs rotate among several independent sets, so no backend finds its operands in cache.
"""

import csv
import math
import os
import statistics
import time

import torch

PASSES = ("fwd", "bwd", "both")


def flops(b, h, s, d, causal, pass_):
    """forward 4*B*H*S*S*D, halved when causal; backward 2.5x; both 3.5x (src/testing/problem.hpp)."""
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "both": 3.5 * f}[pass_]


def make_sets(n_sets, b, h, s, d, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        def mk():
            x = torch.randn(b, s, h, d, generator=g, dtype=torch.float32, device=device)
            return x.to(dtype).transpose(1, 2)  # [B, H, S, D] view of (B, S, H, D) memory
        q, k, v, dout = mk(), mk(), mk(), mk()
        for x in (q, k, v):
            x.requires_grad_(True)
        sets.append((q, k, v, dout))
    return sets


class Timer:
    """Median milliseconds of fn over `reps` calls after `warmup`, rotating the input sets."""

    def __init__(self, cuda):
        self.cuda = cuda

    def run(self, fn, n_sets, warmup, reps, budget_s):
        for i in range(warmup):
            fn(i % n_sets)
        self.sync()
        times = []
        t_start = time.perf_counter()
        for i in range(reps):
            if self.cuda:
                a = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                a.record()
                fn(i % n_sets)
                e.record()
                times.append((a, e))
            else:
                t0 = time.perf_counter()
                fn(i % n_sets)
                times.append((time.perf_counter() - t0) * 1e3)
            # Stop early on slow cases once a few samples are in (median of >= 3).
            if i >= 2 and time.perf_counter() - t_start > budget_s:
                break
        self.sync()
        if self.cuda:
            times = [a.elapsed_time(e) for a, e in times]
        return statistics.median(times)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def measure(attn, sets, timer, warmup, reps, budget_s):
    """ms for fwd, bwd, both of attn(q, k, v) -> out over the rotating sets."""
    n = len(sets)
    res = {}

    def fwd(i):
        q, k, v, _ = sets[i]
        attn(q, k, v)

    res["fwd"] = timer.run(fwd, n, warmup, reps, budget_s)

    outs = [attn(q, k, v) for q, k, v, _ in sets]

    def bwd(i):
        q, k, v, dout = sets[i]
        torch.autograd.grad(outs[i], (q, k, v), dout, retain_graph=True)

    res["bwd"] = timer.run(bwd, n, warmup, reps, budget_s)
    del outs

    def both(i):
        q, k, v, dout = sets[i]
        out = attn(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    res["both"] = timer.run(both, n, warmup, reps, budget_s)
    return res


def write_csv(path, rows):
    keys = list(rows[0].keys())
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def fmt(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def table(rows, ours, peers, unit="TFLOP/s", scale=1e12):
    """Markdown table: one line per case, fwd/bwd/both per backend, and ours / best peer."""
    cases = []
    for r in rows:
        key = (r["dtype"], r["causal"], r["head_dim"], r["seq"])
        if key not in cases:
            cases.append(key)
    backends = [b for b in ours + peers if any(r["backend"] == b for r in rows)]
    head = ["dtype", "causal", "D", "S", "B x H"]
    for b in backends:
        head += [f"{b} fwd", f"{b} bwd", f"{b} both"]
    for o in ours:
        head += [f"{o}/best fwd", f"{o}/best bwd", f"{o}/best both"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in cases:
        rs = {r["backend"]: r for r in rows
              if (r["dtype"], r["causal"], r["head_dim"], r["seq"]) == key}
        any_r = next(iter(rs.values()))
        cells = [key[0], "yes" if key[1] else "no", str(key[2]), str(key[3]),
                 f"{any_r['batch']} x {any_r['heads']}"]
        for b in backends:
            r = rs.get(b)
            for p in PASSES:
                v = r.get(f"{p}_flops_per_s") if r else None
                cells.append(fmt(v / scale if v else None))
        for o in ours:
            r = rs.get(o)
            for p in PASSES:
                best = max((rs[b][f"{p}_flops_per_s"] or 0) for b in peers if b in rs) or None
                v = r.get(f"{p}_flops_per_s") if r else None
                cells.append(fmt(v / best, 2) + "x" if v and best else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n(figures in {unit}; '-' = not supported or skipped, see the notes)"


def chart(rows, path, title, scale=1e12, unit="TFLOP/s"):
    """PNG: for each (dtype, head dim) a row of panels (fwd, bwd, both) x (causal no/yes),
    TFLOP/s against sequence length, one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in rows:
        g = (r["dtype"], r["head_dim"])
        if g not in groups:
            groups.append(g)
    cols = [(p, c) for c in (False, True) for p in PASSES]
    fig, axes = plt.subplots(len(groups), len(cols),
                             figsize=(3.2 * len(cols), 2.8 * len(groups) + 0.9), squeeze=False)
    backends = []
    for r in rows:
        if r["backend"] not in backends:
            backends.append(r["backend"])
    for gi, (dtype, d) in enumerate(groups):
        for ci, (p, causal) in enumerate(cols):
            ax = axes[gi][ci]
            for b in backends:
                pts = sorted((r["seq"], r[f"{p}_flops_per_s"] / scale) for r in rows
                             if r["backend"] == b and r["dtype"] == dtype and r["head_dim"] == d
                             and r["causal"] == causal and r[f"{p}_flops_per_s"])
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=b)
            ax.set_xscale("log", base=2)
            seqs = sorted({r["seq"] for r in rows})
            ax.set_xticks(seqs, [f"{x // 1024}k" if x >= 1024 else str(x) for x in seqs])
            ax.minorticks_off()
            ax.set_title(f"{dtype} D={d} {p}{' causal' if causal else ''}", fontsize=9)
            ax.set_xlabel("sequence length", fontsize=8)
            ax.set_ylabel(unit, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
    handles, labels = [], []
    for ax in axes.flat:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    top = 1.0 - 0.9 / (2.8 * len(groups) + 0.9)  # room for the title and legend, in figure units
    fig.suptitle(title, y=0.995, fontsize=10)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top + 0.5 * (1 - top)),
               ncol=min(len(labels), 7), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, top - 0.01))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def ensure_dir(path):
    os.makedirs(path, exist_ok=True)
    return path
