#!/usr/bin/env python3
"""A/B of flashattn builds and settings against the float32 peer, in one process.

Each VARIANT is a library path, optionally followed by ':' and comma-separated environment
settings applied around its calls (e.g. build-gpu/src/libflashattn.so:FLASHATTN_CUDA_CONVERT_CTAS=0).
For every shape and precision the peer (SDPA's memory-efficient backend, float32) and every
variant are timed in ROUNDS interleaved rounds of REPS calls each, as bench/gpu.py --suite fp32
times a call in its host-inclusive view (attn_harness.call_times: events around it from an idle
GPU, bound arguments); prints the medians, TFLOP/s (attn_harness.flops) and the ratio to the
peer. Interleaving spreads the machine's drift over all variants, so differences of a few
percent between variants of one run mean more than the same differences between runs.

usage: ab_cuda_fp32.py [--rounds N] [--reps N] [--shapes S:D:CAUSAL,...] [--prec tf32,fp32] [--fwd]
                       VARIANT [VARIANT ...]
"""
import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attn_harness as H
from cabi import CtypesLib, EnvSettings, issue_problem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", default="1024:64:1,1024:128:1,1024:128:0,1024:64:0")
    ap.add_argument("--prec", default="tf32,fp32")
    ap.add_argument("--fwd", action="store_true", help="time the forward (default: the backward)")
    ap.add_argument("variants", nargs="+")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    libs, variants = {}, []
    for v in a.variants:
        path, _, env = v.partition(":")
        if path not in libs:
            libs[path] = CtypesLib(path, torch)
        variants.append((v, libs[path], dict(e.split("=", 1) for e in env.split(",") if e)))
    for shape in a.shapes.split(","):
        s, d, causal = (int(x) for x in shape.split(":"))
        prob = issue_problem(torch, s, d, torch.float32)
        b, h = prob["b"], prob["h"]
        q, k, v, do, out, lse, dq, dk, dv = (prob[n] for n in ("q", "k", "v", "do", "out", "lse", "dq", "dk", "dv"))
        flops = H.flops(b, h, s, d, causal, "fwd" if a.fwd else "bwd")
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            def peer_f():
                return F.scaled_dot_product_attention(qg, kg, vg, is_causal=bool(causal))
            o_peer = peer_f()

            def peer_b():
                return torch.autograd.grad(o_peer, (qg, kg, vg), do, retain_graph=True)
            peer = peer_f if a.fwd else peer_b
            for prec in a.prec.split(","):
                times = {"peer": []}
                times.update({name: [] for name, _, _ in variants})
                for _ in range(a.rounds):
                    for _ in range(2):
                        peer()
                    torch.cuda.synchronize()  # (the first timed call from an idle GPU too)
                    times["peer"] += H.call_times(peer, a.reps)
                    for name, lib, env in variants:
                        with EnvSettings(env):
                            o = lib.options(bool(causal), 1 if prec == "tf32" else 0)
                            lib.forward(q, k, v, out, lse, o)
                            fn = (lib.bind_forward(q, k, v, out, lse, o) if a.fwd else
                                  lib.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o))
                            for _ in range(2):
                                fn()
                            torch.cuda.synchronize()
                            times[name] += H.call_times(fn, a.reps)
                pm = statistics.median(times["peer"])
                line = f"S={s} D={d} causal={causal} {prec} {'fwd' if a.fwd else 'bwd'}: peer {flops / pm / 1e9:.1f}"
                for name, _, _ in variants:
                    m = statistics.median(times[name])
                    line += f" | {name} {m * 1e3:.0f} us {flops / m / 1e9:.1f} x{pm / m:.3f}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
