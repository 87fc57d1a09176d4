#!/usr/bin/env python3
"""Compares the ptxas resource reports of two builds, entry function by entry function.

Usage: ptxas-diff.py BEFORE.log AFTER.log [--all] [--max-regs N]

Each log is the output of a build configured with -DFLASHATTN_CUDA_PTXAS_VERBOSE=ON (ptxas -v:
"Compiling entry function 'X' for 'sm_NN'", then its stack frame, spill stores and loads, and
"Used N registers"). Prints one row per kernel (demangled, shortened) with registers, stack and
spill bytes before -> after; --all prints unchanged kernels too. Exits 1 when a kernel gained
spill bytes or more than --max-regs registers (default 8), or appeared or disappeared.
"""
import argparse
import re
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def parse(path):
    """{(mangled name, arch): (registers, stack, spill stores, spill loads)}"""
    out, cur, frame = {}, None, (0, 0, 0)
    with open(path, errors="replace") as f:
        for line in f:
            m = ENTRY.search(line)
            if m:
                cur, frame = (m.group(1), m.group(2)), (0, 0, 0)
                continue
            m = FRAME.search(line)
            if m and cur:
                frame = tuple(int(x) for x in m.groups())
                continue
            m = USED.search(line)
            if m and cur:
                out[cur] = (int(m.group(1)),) + frame
                cur = None
    return out


def demangle(names):
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, r.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def short(name):
    if name.endswith(")"):  # drop the parameter list (the last balanced parentheses)
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = re.sub(r"^void ", "", name)
    for ns in ("flashattn::cuda::dev::", "flashattn::cuda::", "flashattn::"):
        name = name.replace(ns, "")
    return name.replace("(Half16)", "H").replace("(Math)", "M").replace(", ", ",")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--all", action="store_true", help="also list unchanged kernels")
    ap.add_argument("--max-regs", type=int, default=8, help="register growth allowed per kernel")
    args = ap.parse_args()
    a, b = parse(args.before), parse(args.after)
    keys = sorted(set(a) | set(b))
    names = demangle([k[0] for k in keys])
    bad, rows = 0, []
    for k in keys:
        x, y = a.get(k), b.get(k)
        flag = ""
        if x is None or y is None:
            flag = "NEW" if x is None else "GONE"
            bad += 1
        else:
            if y[2] > x[2] or y[3] > x[3]:
                flag = "SPILL"
                bad += 1
            elif y[0] - x[0] > args.max_regs:
                flag = "REGS"
                bad += 1
            if not flag and x == y and not args.all:
                continue
        fmt = lambda v: "-" if v is None else f"{v[0]:3d} r {v[1]:4d} st {v[2]:4d}/{v[3]:4d} sp"
        rows.append(f"{short(names[k[0]]):<60} {k[1]:<7} {fmt(x):>24} -> {fmt(y):>24} {flag}")
    print(f"{len(keys)} kernels; {len(rows)} listed (registers, stack bytes, spill stores/loads)")
    print("\n".join(rows))
    if bad:
        print(f"{bad} kernel(s) flagged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
