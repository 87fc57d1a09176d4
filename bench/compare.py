#!/usr/bin/env python3
"""Before/after comparison of two GPU benchmark runs of bench/gpu.py (e.g. a change and its base,
measured in one session): flashattn's TFLOP/s per shape and pass, the ratio after/before, and the
median, lowest and highest ratio per series. Reads what gpu.py writes: the 16-bit suite's log lines
("bfloat16  D= 64 S=  512 causal=0 flashattn  fwd  264.8 ...  bwd  220.3 ...") and the float32
suite's CSV (columns fwd_fp32, fwd_tf32, bwd_fp32, bwd_tf32, ...).

usage: bench/compare.py --before16 LOG --after16 LOG [--before32 CSV --after32 CSV] [--md OUT.md]
"""
import argparse
import csv
import re
import statistics
import sys

LINE16 = re.compile(r"^(bfloat16|float16)\s+D=\s*(\d+)\s+S=\s*(\d+)\s+causal=(\d)\s+(flashattn(?:-atomic|-split)?)\s+(.*)$")
PASS = re.compile(r"\b(fwd|bwd)\s+([\d.]+)\s+\(")


def read16(path):
    """{(dtype, D, S, causal, impl, pass): TFLOP/s}"""
    out = {}
    for line in open(path, errors="replace"):
        m = LINE16.match(line.strip())
        if not m:
            continue
        dtype, d, s, c, impl, rest = m.groups()
        for p, v in PASS.findall(rest):
            out[(dtype, int(d), int(s), int(c), impl, p)] = float(v)
    return out


def read32(path):
    """{(S, D, causal, column): TFLOP/s} for the flashattn columns of the float32 suite."""
    out = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            key = (int(row["S"]), int(row["D"]), int(row["causal"]))
            for col in ("fwd_fp32", "fwd_tf32", "bwd_fp32", "bwd_tf32"):
                if row.get(col) not in (None, ""):
                    out[key + (col,)] = float(row[col])
    return out


def compare(before, after, series_of):
    """Rows (key, before, after, ratio) for keys in both, and per-series ratio summaries."""
    rows, series = [], {}
    for k in sorted(set(before) & set(after)):
        r = after[k] / before[k] if before[k] > 0 else float("nan")
        rows.append((k, before[k], after[k], r))
        series.setdefault(series_of(k), []).append(r)
    return rows, series


def summary_lines(series):
    lines = ["| series | shapes | median after/before | lowest | highest |", "| --- | --- | --- | --- | --- |"]
    for name, rs in sorted(series.items()):
        lines.append(f"| {name} | {len(rs)} | {statistics.median(rs):.3f} | {min(rs):.3f} | {max(rs):.3f} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before16")
    ap.add_argument("--after16")
    ap.add_argument("--before32")
    ap.add_argument("--after32")
    ap.add_argument("--md", help="also write the tables here (markdown)")
    a = ap.parse_args()
    out = []
    if a.before16 and a.after16:
        rows, series = compare(read16(a.before16), read16(a.after16), lambda k: f"{k[4]} {k[5]}")
        if not rows:
            sys.exit("no common 16-bit rows")
        out += ["## 16-bit (flashattn TFLOP/s)", ""] + summary_lines(series) + [""]
        out += ["| dtype | D | S | causal | impl | pass | before | after | ratio |", "| --- " * 9 + "|"]
        out += [f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {k[4]} | {k[5]} | {b:.1f} | {x:.1f} | {r:.3f} |"
                for k, b, x, r in rows] + [""]
    if a.before32 and a.after32:
        rows, series = compare(read32(a.before32), read32(a.after32), lambda k: k[3])
        if not rows:
            sys.exit("no common float32 rows")
        out += ["## float32 (flashattn TFLOP/s)", ""] + summary_lines(series) + [""]
        out += ["| S | D | causal | column | before | after | ratio |", "| --- " * 7 + "|"]
        out += [f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {b:.1f} | {x:.1f} | {r:.3f} |" for k, b, x, r in rows] + [""]
    if not out:
        sys.exit("nothing to compare: give --before16/--after16 and/or --before32/--after32")
    text = "\n".join(out)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
