"""Shared pieces of the Python benchmarks (bench/gpu.py, bench/cpu.py) and GPU tools
(ab_cuda_fp32.py, kernel_times.py): the FLOP model, input sets, timing loops, result table, CSV
and chart.

measure() calls every backend the way training code calls it: inputs in FlashAttention's
(batch, seqlen, heads, headdim) memory layout, viewed as [B, H, S, D] without copies, with
requires_grad set, through autograd (forward builds the graph; backward is
torch.autograd.grad with the graph kept, so repeated backward calls time the backward alone).
Inputs rotate among several independent sets, so no backend finds its operands in cache.
time_views() times one prepared call (e.g. the C ABI with its arguments bound) in two views:
host-inclusive (from an idle GPU) and kernel time (behind a GPU spin).

torch is imported on first use, so that `bench/gpu.py --help` and `--dry-run` work on a machine
without it.
"""

import csv
import math
import os
import statistics
import time

PASSES = ("fwd", "bwd", "both")


def _torch():
    import torch

    return torch


def flops(b, h, s, d, causal, pass_, s_kv=None):
    """The FLOP model of every Python benchmark and tool (pass_ "fwd", "bwd" or "both"; h = query
    heads, s = query length, s_kv = key length, default s). It is the C++ side's
    (src/testing/problem.cpp forward_flops / backward_flops; docs/PERF.md states it): forward
    4*B*H*Sq*Skv*D (two matmuls), halved when causal; backward 2.5x the forward; both 3.5x."""
    f = 4.0 * b * h * s * (s if s_kv is None else s_kv) * d * (0.5 if causal else 1.0)
    return {"fwd": f, "bwd": 2.5 * f, "both": 3.5 * f}[pass_]


def make_sets(n_sets, b, h, s, d, dtype, device, seed=0, h_kv=None):
    """n_sets of (q, k, v, dout), [B, H, S, D] views of (B, S, H, D) memory; k and v with h_kv
    heads (GQA) when given."""
    torch = _torch()
    g = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        def mk(heads=h):
            x = torch.randn(b, s, heads, d, generator=g, dtype=torch.float32, device=device)
            return x.to(dtype).transpose(1, 2)  # [B, H, S, D] view of (B, S, H, D) memory
        q, k, v, dout = mk(), mk(h_kv or h), mk(h_kv or h), mk()
        for x in (q, k, v):
            x.requires_grad_(True)
        sets.append((q, k, v, dout))
    return sets


def spin_ms(host_ms):
    """How long a GPU spin before a timed call must last for the host to queue the whole call
    behind it: 2x the call's host time, plus 50 us for the event records, capped at 50 ms."""
    return min(2.0 * host_ms + 0.05, 50.0)


class Timer:
    """Median milliseconds of fn over `reps` calls after `warmup`, rotating the input sets.

    On CUDA each call is bracketed by two events, so what is timed is the GPU's time for the
    call's kernels. With gpu_sleep (default), a spin kernel (torch.cuda._sleep) is queued before
    each call's start event, long enough (twice the call's host time measured during warm-up)
    that the CPU has queued the whole call before the GPU reaches it: host-side launch overhead
    (Python, autograd, the dispatcher) then never shows as idle GPU time between the events.
    Small shapes would otherwise be timed partly on the CPU, and the backends differ there.
    """

    def __init__(self, cuda, gpu_sleep=True):
        self.cuda = cuda
        self.gpu_sleep = cuda and gpu_sleep
        self._cycles_per_ms = None
        self.last = {}  # statistics of the last run(): median, min, max, n (ms), sleep_ms

    def cycles_per_ms(self):
        """GPU clock cycles per millisecond of torch.cuda._sleep, measured once."""
        if self._cycles_per_ms is None:
            torch = _torch()
            torch.cuda._sleep(1000)
            best = None
            for _ in range(3):
                a = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                a.record()
                torch.cuda._sleep(2_000_000)
                e.record()
                e.synchronize()
                ms = a.elapsed_time(e)
                best = ms if best is None else min(best, ms)
            self._cycles_per_ms = 2_000_000 / max(best, 1e-3)
        return self._cycles_per_ms

    def run(self, fn, n_sets, warmup, reps, budget_s):
        torch = _torch() if self.cuda else None
        host = []
        for i in range(max(warmup, 1 if self.gpu_sleep else 0)):
            t0 = time.perf_counter()
            fn(i % n_sets)
            host.append((time.perf_counter() - t0) * 1e3)
            self.sync()  # so the next call's host time is not spent waiting on a full queue
        sleep_ms = 0.0
        if self.gpu_sleep:
            # The first warm call includes one-off setup: skip it when there is more than one.
            sleep_ms = spin_ms(max(host[1:] if len(host) > 1 else host))
            sleep_cycles = int(sleep_ms * self.cycles_per_ms())
        times = []
        t_start = time.perf_counter()
        for i in range(reps):
            if self.cuda:
                a = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                if self.gpu_sleep:
                    torch.cuda._sleep(sleep_cycles)
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
        self.last = dict(median=statistics.median(times), min=min(times), max=max(times),
                         n=len(times), sleep_ms=sleep_ms)
        return self.last["median"]

    def sync(self):
        if self.cuda:
            _torch().cuda.synchronize()


# ---- bound calls, timed one by one (bench/gpu.py --suite fp32, ab_cuda_fp32.py) -----------------


def call_times(fn, reps, spin_cycles=0, cuda=True):
    """reps calls of fn(), each timed alone, in ms. On CUDA an event before and after each call,
    then a synchronisation. spin_cycles = 0: every call starts on an idle GPU, so the host's work
    up to the call's first launch (and any launch later than the GPU could have run it) counts:
    the host-inclusive time. spin_cycles > 0: a GPU spin of that many cycles is queued before the
    first event, long enough for the host to queue the whole call behind it: the GPU's time for
    the call's kernels (the kernel time). cuda=False: wall clock (a CPU smoke test)."""
    ts = []
    if not cuda:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return ts
    torch = _torch()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def time_call(fn, warmup, reps, spin_cycles=0, cuda=True):
    """Median ms of call_times after `warmup` calls and a synchronisation."""
    for _ in range(warmup):
        fn()
    if cuda:
        _torch().cuda.synchronize()
    return statistics.median(call_times(fn, reps, spin_cycles, cuda))


def host_ms(fn, calls=3, cuda=True):
    """The host's time for one call of fn() (wall clock until it returns, the GPU idle before
    each), the slowest of calls after the first."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            _torch().cuda.synchronize()
    return max(ts[1:] if len(ts) > 1 else ts)


def time_views(fn, warmup, reps, timer):
    """{"host": ms, "kernel": ms} of fn(): the median host-inclusive time (each call from an
    idle GPU), then the median kernel time (each call behind a GPU spin sized by spin_ms from the
    call's host time); timer (a Timer) gives the spin's clock rate. Without CUDA both are wall
    clock."""
    cuda = timer.cuda
    out = {"host": time_call(fn, warmup, reps, cuda=cuda)}
    if not cuda:
        out["kernel"] = time_call(fn, 0, reps, cuda=False)
        return out
    cycles = int(spin_ms(host_ms(fn)) * timer.cycles_per_ms())
    out["kernel"] = time_call(fn, 0, reps, spin_cycles=cycles)
    return out


# ---- autograd calls over rotating input sets (bench/gpu.py, bench/cpu.py) ---------------------


def measure(attn, sets, timer, warmup, reps, budget_s, passes=PASSES, stats=None):
    """ms for each pass in `passes` (fwd, bwd, both) of attn(q, k, v) -> out over the rotating
    sets; `stats`, when a dict, receives the timer's statistics per pass."""
    torch = _torch()
    n = len(sets)
    res = {}

    def keep(p):
        if stats is not None:
            stats[p] = dict(timer.last)

    if "fwd" in passes:
        def fwd(i):
            q, k, v, _ = sets[i]
            attn(q, k, v)

        res["fwd"] = timer.run(fwd, n, warmup, reps, budget_s)
        keep("fwd")

    if "bwd" in passes:
        outs = [attn(q, k, v) for q, k, v, _ in sets]

        def bwd(i):
            q, k, v, dout = sets[i]
            torch.autograd.grad(outs[i], (q, k, v), dout, retain_graph=True)

        res["bwd"] = timer.run(bwd, n, warmup, reps, budget_s)
        keep("bwd")
        del outs

    if "both" in passes:
        def both(i):
            q, k, v, dout = sets[i]
            out = attn(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)

        res["both"] = timer.run(both, n, warmup, reps, budget_s)
        keep("both")
    return res


def write_csv(path, rows):
    """All keys of all rows, in first-seen order (rows of different dtypes and backends carry
    different columns); missing cells are empty."""
    keys = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous complete file


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
    passes = [p for p in PASSES if any(r.get(f"{p}_flops_per_s") for r in rows)]
    head = ["dtype", "causal", "D", "S", "B x H"]
    for b in backends:
        head += [f"{b} {p}" for p in passes]
    for o in ours:
        head += [f"{o}/best {p}" for p in passes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in cases:
        rs = {r["backend"]: r for r in rows
              if (r["dtype"], r["causal"], r["head_dim"], r["seq"]) == key}
        any_r = next(iter(rs.values()))
        cells = [key[0], "yes" if key[1] else "no", str(key[2]), str(key[3]),
                 f"{any_r['batch']} x {any_r['heads']}"]
        for b in backends:
            r = rs.get(b)
            for p in passes:
                v = r.get(f"{p}_flops_per_s") if r else None
                cells.append(fmt(v / scale if v else None))
        for o in ours:
            r = rs.get(o)
            for p in passes:
                best = max((rs[b].get(f"{p}_flops_per_s") or 0) for b in peers if b in rs) \
                    if any(b in rs for b in peers) else None
                v = r.get(f"{p}_flops_per_s") if r else None
                cells.append(fmt(v / best, 2) + "x" if v and best else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return ("\n".join(lines)
            + f"\n\n(figures in {unit}; '-' = not supported or skipped, see the notes)")


def chart(rows, path, title, scale=1e12, unit="TFLOP/s"):
    """PNG: for each (dtype, head dim) a row of panels (passes) x (causal no/yes),
    TFLOP/s against sequence length, one line per backend. Without matplotlib: no chart (said)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no chart ({path}): matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = []
    for r in rows:
        g = (r["dtype"], r["head_dim"])
        if g not in groups:
            groups.append(g)
    passes = [p for p in PASSES if any(r.get(f"{p}_flops_per_s") for r in rows)]
    cols = [(p, c) for c in (False, True) for p in passes]
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
                             and r["causal"] == causal and r.get(f"{p}_flops_per_s"))
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
