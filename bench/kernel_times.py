#!/usr/bin/env python3
"""Where a flashattn call's time goes, kernel by kernel (CUDA, torch.profiler's CUPTI timings).

For each case, the issue benchmarks' shape (B = 16384 / S, H = 2048 / D, Sq = Skv = S): one warm-up
call, then REPS calls under torch.profiler; prints per kernel its mean time per call (us), its
share of the call's kernel time and the call's total, so that a slow shape can be traced to its
kernel (a pre-pass, the dQ pass, the dK/dV pass) before anything is changed. Since kernels of one
call can run at once (the float32 backward's operand copies on a side stream), it also prints the
call's elapsed time: the median of REPS calls timed one by one with CUDA events, twice - with ~1 ms
of GPU spin queued before each call (the host's work is not timed: what the GPU needs) and from
an idle GPU (as bench/gpu.py --suite fp32 times its host-inclusive view: the host's work up to
its first launch counts, and any launch that comes later than the GPU could have run it) - and
the host's time per call (wall clock of the call while the GPU is busy). --timeline prints the
last profiled call's kernels in the order they started: start and end (us from the call's first
kernel) and stream. Environment variables that steer kernel selection (FLASHATTN_CUDA_*) apply as
in any call; CASE may set them per case: "env=FLASHATTN_CUDA_TF32_BWD=wgmma".

usage: kernel_times.py --lib build-gpu/src/libflashattn.so [--reps N] [--timeline] CASE [CASE ...]
  CASE: comma-separated key=value: pass=fwd|bwd, dtype=float32|bfloat16|float16, d=64, s=4096,
        causal=0|1, precision=fp32|tf32, env=VAR=VALUE (repeatable)
  e.g.  pass=bwd,precision=tf32,d=64,s=1024,causal=1,env=FLASHATTN_CUDA_TF32_BWD=wgmma
"""
import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import torch

import attn_harness as H
from cabi import MASK_CAUSAL_TOP_LEFT, MASK_NONE, CtypesLib, EnvSettings, issue_problem

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_case(text):
    c = {"pass": "bwd", "dtype": "float32", "d": 64, "s": 4096, "causal": 0, "precision": "fp32", "env": []}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key == "env":
            c["env"].append(value)
        elif key in ("d", "s", "causal"):
            c[key] = int(value)
        elif key in c:
            c[key] = value
        else:
            raise SystemExit(f"unknown case key '{key}' in '{text}'")
    return c


def short(name, width=70):
    name = name.replace("flashattn::cuda::dev::", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def timeline(prof, calls):
    """The last of `calls` profiled calls' device activities (kernels, memsets) from the profiler's
    trace, as (start us, end us, stream, name) relative to the call's first start."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    if not dev or len(dev) % calls:
        return []
    last = dev[-len(dev) // calls:]
    t0 = last[0]["ts"]
    return [(e["ts"] - t0, e["ts"] + e["dur"] - t0, e.get("args", {}).get("stream", "?"), e["name"]) for e in last]


def run_case(lib, c, reps, show_timeline=False):
    with EnvSettings(a.partition("=")[::2] for a in c["env"]):
        s, d, dt = c["s"], c["d"], DTYPES[c["dtype"]]
        prob = issue_problem(torch, s, d, dt)
        b, h = prob["b"], prob["h"]
        q, k, v, do, out, lse, dq, dk, dv = (prob[n] for n in ("q", "k", "v", "do", "out", "lse", "dq", "dk", "dv"))
        opts = (MASK_CAUSAL_TOP_LEFT if c["causal"] else MASK_NONE, 1 if c["precision"] == "tf32" else 0, False)

        # (Argument structures built once, as bench/gpu.py --suite fp32 does: the host time is the library's.)
        if c["pass"] == "fwd":
            call = lib.bind_forward(q, k, v, out, lse, opts)
        else:
            call = lib.bind_backward(q, k, v, out, do, lse, dq, dk, dv, opts)

        lib.forward(q, k, v, out, lse, opts)
        call()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(reps):
                call()
            torch.cuda.synchronize()
        per = defaultdict(float)
        count = defaultdict(int)
        for e in prof.key_averages():
            # Kernels and memsets are the rows with time of their own on the device (the launch
            # API rows have none); torch < 2.4 spells the field self_cuda_time_total.
            t = getattr(e, "self_device_time_total", None)
            t = e.self_cuda_time_total if t is None else t
            if t > 0:
                per[e.key] += t
                count[e.key] += e.count
        total = sum(per.values()) / reps
        elapsed, idle, host = [], [], []
        for _ in range(reps):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU spin queued first: the host's launches are not timed
            t0.record()
            h0 = time.perf_counter()
            call()
            host.append((time.perf_counter() - h0) * 1e6)
            t1.record()
            t1.synchronize()
            elapsed.append(t0.elapsed_time(t1) * 1e3)
            t0.record()  # from an idle GPU: the host's work before (and between) the launches counts
            call()
            t1.record()
            t1.synchronize()
            idle.append(t0.elapsed_time(t1) * 1e3)
        med = lambda xs: sorted(xs)[len(xs) // 2]
        wall = med(elapsed)
        flops = H.flops(b, h, s, d, c["causal"], "fwd" if c["pass"] == "fwd" else "bwd")
        label = " ".join(f"{k}={c[k]}" for k in ("pass", "dtype", "precision", "d", "s", "causal")) + (
            " " + " ".join(c["env"]) if c["env"] else "")
        print(f"== {label}: B={b} H={h}; elapsed {wall:.1f} us per call = {flops / wall * 1e-6:.1f} TFLOP/s"
              f" (kernels {total:.1f} us); from an idle GPU {med(idle):.1f} us; host {med(host):.1f} us per call")
        for name, t in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"   {t / reps:9.1f} us {100 * t / reps / total:5.1f}%  x{count[name] // reps}  {short(name)}")
        if show_timeline:
            print("   timeline of the last profiled call (us from its first kernel's start):")
            for start, end, stream, name in timeline(prof, reps):
                print(f"   {start:8.1f} {end:8.1f}  stream {stream}  {short(name, 60)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeline", action="store_true", help="print the last profiled call's kernels in order")
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    lib = CtypesLib(a.lib, torch)
    for text in a.cases:
        run_case(lib, parse_case(text), a.reps, a.timeline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
