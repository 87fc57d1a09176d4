#!/usr/bin/env python3
"""Per-call host time of tiny attention calls: flashattn's PyTorch entry points against SDPA in
the same process on the same inputs (issue: framework integration, host overhead).

The shape is tiny (default B 1, H 1, S 128, D 64, bfloat16 on CUDA / float32 on the CPU) so that
the device work is a few microseconds and what is measured is the host's cost of a call: Python,
autograd, the dispatcher, validation and the launches. Each entry is called --calls times back to
back (after --warmup), the device synchronised once at the end; the figure is the median over
--rounds of (wall time / calls), in microseconds:
  fwd       the forward alone, under torch.no_grad() (inference)
  fwd+bwd   forward with grad, then backward of out (a training step's attention)
Entries: flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func (one sequence),
flashattn.torch.attention, and SDPA (each backend that takes the inputs: flash, cudnn, efficient,
math on CUDA; the default on the CPU). On the CPU the device work is not negligible; compare
entries with each other there, not with CUDA figures. Prints a table and writes OUT/host.csv.

With --profile NAME, also runs NAME's forward+backward under cProfile and prints the functions
with the most time of their own: the extension's calls (_call_fwd, _call_bwd: the library's host
path, launches included), autograd's engine (run_backward: on CUDA it hands the backward to the
device's thread and back), Python glue.

The last column times, in one more round, the host time spent inside the extension's calls (the
library's C++ path: validation, planning, scratch, launches); the rest of a row is Python and
autograd around it. flashattn.torch's C++ eager ops (flash_attn_func and attention by default
where they are built) call the library without the extension: "-" there; the "(Python path)"
rows time the same calls through the Python autograd path in the same process, the "(Python
glue, the op's entry)" rows the functions' Python argument handling before the op's direct entry
instead of the functions' own C++ entries, the "(C++ op via the dispatcher)" row that glue and the
C++ op called through PyTorch's dispatcher, and bench/host_calls.cpp times the library's own part
through the C ABI.

usage: python bench/host_overhead.py [--device cuda|cpu] [--out DIR] [--profile ENTRY]
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default="1,1,128,64", help="B,H,S,D")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile", default=None, help="an entry to run under cProfile, e.g. flash_attn_func")
    ap.add_argument("--compiled", action="store_true",
                    help="also flash_attn_func and SDPA under torch.compile (backend aot_eager: the graph "
                         "as captured, no generated kernels), the compiled rows timed after their warm-up")
    ap.add_argument("--ops", action="store_true",
                    help="also the ops alone, without autograd (fwd: the forward op; fwd+bwd: the forward op then "
                         "the backward op on its outputs) for flashattn's C++ op and SDPA flash's ATen ops, and the "
                         "autograd floors (q * 1, and addcmul(q, k, v) of three inputs, with their backward): where a "
                         "fwd+bwd row's time goes")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    import flashattn
    import flashattn.torch as fat
    from flashattn import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func

    dev = args.device or ("cuda" if torch.cuda.is_available() and flashattn.cuda_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if dev == "cuda" else torch.float32)
    b, h, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=g)  # noqa: E731
    q, k, v, do = mk(b, s, h, d), mk(b, s, h, d), mk(b, s, h, d), mk(b, s, h, d)  # [B, S, H, D]
    qkv = torch.stack([q, k, v], dim=2)
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))  # [B, H, S, D] views
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
    qp, kp, vp, dop = (x.reshape(b * s, h, d) for x in (q, k, v, do))

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def timed(fns):
        """Median per-call time (us) of each (context, callable): the rounds interleave the
        callables (round r of every one before round r + 1 of any), so that a slow spell of the
        machine falls on all of them alike instead of on whichever ran then."""
        for ctx, fn in fns:
            with ctx():
                for _ in range(args.warmup):
                    fn()
        sync()
        per = [[] for _ in fns]
        for _ in range(args.rounds):
            for i, (ctx, fn) in enumerate(fns):
                with ctx():
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn()
                    sync()
                    per[i].append((time.perf_counter() - t0) / args.calls * 1e6)
        return [statistics.median(p) for p in per]

    # Each entry: (name, forward callable on leaf tensors, the gradient for its output, and a
    # context the entry is timed in: entered once around its loops, not per call).
    def entry(name, fwd, leaves, grad, ctx=contextlib.nullcontext):
        def inference():
            with torch.no_grad():
                fwd(*leaves)

        req = [x.detach().clone().requires_grad_() for x in leaves]

        def train():
            out = fwd(*req)
            out.backward(grad)

        return name, inference, train, ctx

    @contextlib.contextmanager
    def python_path():  # flashattn.torch's Python autograd path instead of its C++ eager ops
        prev = fat.use_eager_ops(False)
        try:
            yield
        finally:
            fat.use_eager_ops(prev)

    @contextlib.contextmanager
    def entries_off(names):  # the named direct entries of flashattn.torch off (None) for a row
        prev = [getattr(fat, n) for n in names]
        for n in names:
            setattr(fat, n, None)
        try:
            yield
        finally:
            for n, p in zip(names, prev):
                setattr(fat, n, p)

    def python_glue():  # the public functions' Python glue, then the op's direct entry
        return entries_off(("_FAST_FLASH", "_FAST_ATTENTION"))

    def dispatcher():  # the Python glue, then the C++ op through PyTorch's dispatcher
        return entries_off(("_FAST_FLASH", "_FAST_ATTENTION", "_FAST_FORWARD"))

    entries = [
        entry("flash_attn_func", lambda a, b_, c: flash_attn_func(a, b_, c, causal=True), (q, k, v), do),
        entry("flash_attn_qkvpacked_func", lambda x: flash_attn_qkvpacked_func(x, causal=True), (qkv,), do),
        entry("flash_attn_varlen_func",
              lambda a, b_, c: flash_attn_varlen_func(a, b_, c, cu, cu, s, s, causal=True), (qp, kp, vp), dop),
        entry("flashattn.torch.attention", lambda a, b_, c: fat.attention(a, b_, c, is_causal=True), (qt, kt, vt),
              dot),
    ]
    if fat.eager_ops_available():  # the same calls through the Python path, in the same process
        entries += [
            entry("flash_attn_func (Python glue, the op's entry)",
                  lambda a, b_, c: flash_attn_func(a, b_, c, causal=True), (q, k, v), do, python_glue),
            entry("flashattn.torch.attention (Python glue, the op's entry)",
                  lambda a, b_, c: fat.attention(a, b_, c, is_causal=True), (qt, kt, vt), dot, python_glue),
            entry("flash_attn_func (C++ op via the dispatcher)",
                  lambda a, b_, c: flash_attn_func(a, b_, c, causal=True), (q, k, v), do, dispatcher),
            entry("flash_attn_func (Python path)", lambda a, b_, c: flash_attn_func(a, b_, c, causal=True),
                  (q, k, v), do, python_path),
            entry("flashattn.torch.attention (Python path)",
                  lambda a, b_, c: fat.attention(a, b_, c, is_causal=True), (qt, kt, vt), dot, python_path),
        ]
    # SDPA as a user calls it (its own backend choice), then each backend forced by sdpa_kernel,
    # entered once around the loops (per call, the context manager's Python would be counted).
    entries.append(entry("sdpa", lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=True),
                         (qt, kt, vt), dot))
    if args.compiled:  # (aot_eager: dynamo's guards and AOTAutograd's function around the ops)
        entries += [
            entry("flash_attn_func (compiled)",
                  torch.compile(lambda a, b_, c: flash_attn_func(a, b_, c, causal=True), backend="aot_eager"),
                  (q, k, v), do),
            entry("sdpa (compiled)",
                  torch.compile(lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=True),
                                backend="aot_eager"), (qt, kt, vt), dot),
        ]
    if args.ops:
        entries += ops_entries(args, dev, fat, q, k, v, do, qt, kt, vt, dot)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = ([("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                 ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION), ("sdpa-math", SDPBackend.MATH)]
                if dev == "cuda" else [("sdpa", None)])
    for name, be in backends:
        if be is None:
            continue  # (the CPU: the "sdpa" entry above)
        def sdpa(a, b_, c):
            return F.scaled_dot_product_attention(a, b_, c, is_causal=True)
        try:
            with sdpa_kernel([be]):
                sdpa(qt, kt, vt)
            entries.append(entry(name, sdpa, (qt, kt, vt), dot, lambda be=be: sdpa_kernel([be])))
        except Exception as e:  # a backend that does not take these inputs
            print(f"{name}: not available ({type(e).__name__})")

    # Where flashattn's time goes: one more round of forward+backward with the extension's entry
    # points wrapped, timing the host time spent inside them (the library's C++ path: validation,
    # planning, scratch, launches) apart from the Python and autograd around them.
    inside = [0.0, 0]

    def wrapped(fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t0
                inside[1] += 1
        return call

    ext_names = ("forward", "backward", "forward_varlen", "backward_varlen")

    def ext_time(fn):
        saved = {n: getattr(flashattn._ext, n) for n in ext_names}
        for n in ext_names:
            setattr(flashattn._ext, n, wrapped(saved[n]))
        try:
            for _ in range(args.warmup):
                fn()
            sync()
            inside[0], inside[1] = 0.0, 0
            for _ in range(args.calls):
                fn()
            sync()
            # (No extension call: the C++ eager ops call the library themselves, out of reach here;
            # bench/host_calls.cpp times the library's part through the C ABI.)
            return inside[0] / args.calls * 1e6 if inside[1] else float("nan")
        finally:
            for n in ext_names:
                setattr(flashattn._ext, n, saved[n])

    rows = []
    fwd_us = timed([(ctx, inference) for _, inference, _, ctx in entries])
    fwd_bwd_us = timed([(ctx, train) for _, _, train, ctx in entries])
    for (name, _, train, ctx), f, fb in zip(entries, fwd_us, fwd_bwd_us):
        with ctx():
            rows.append(dict(entry=name, fwd_us=f, fwd_bwd_us=fb,
                             fwd_bwd_library_us=ext_time(train) if not name.startswith("sdpa") else float("nan")))
    ref = next((r for r in rows if r["entry"] in ("sdpa-flash", "sdpa")), None)
    print(f"# host time per call, {dev}, {dtype}, B{b} H{h} S{s} D{d}, torch {torch.__version__}"
          f" (median of {args.rounds} rounds of {args.calls} calls)")
    print(f"| entry | fwd us | fwd+bwd us | fwd / {ref['entry'] if ref else '-'} | fwd+bwd / same "
          "| of fwd+bwd: in the library us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rf = r["fwd_us"] / ref["fwd_us"] if ref else float("nan")
        rb = r["fwd_bwd_us"] / ref["fwd_bwd_us"] if ref else float("nan")
        lib = r["fwd_bwd_library_us"]
        print(f"| {r['entry']} | {r['fwd_us']:.1f} | {r['fwd_bwd_us']:.1f} | {rf:.2f} | {rb:.2f} | "
              f"{'-' if lib != lib else f'{lib:.1f}'} |")
    if args.profile:
        import cProfile
        import pstats
        train = next(t for n, _, t, _ in entries if n == args.profile)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            train()
        sync()
        pr.disable()
        print(f"# cProfile of {args.profile} forward+backward, {args.calls} calls (tottime / call in us below)")
        st = pstats.Stats(pr)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:15]
        for (file, line, fn), (_, ncalls, tot, cum, _) in top:
            print(f"{tot / args.calls * 1e6:8.1f} us own {cum / args.calls * 1e6:8.1f} us cum  {ncalls:6d}x  "
                  f"{os.path.basename(file)}:{line}({fn})")
    if args.out:
        import csv
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def ops_entries(args, dev, fat, q, k, v, do, qt, kt, vt, dot):
    """--ops: rows without autograd, in entry()'s form (name, fwd callable, fwd+bwd callable,
    context), so that a fwd+bwd row splits into its ops and the engine's part."""
    import torch
    from flashattn import flash_attn_interface as fai

    rows = []
    floor_in = q.detach().clone().requires_grad_()

    def floor_fwd():
        with torch.no_grad():
            q * 1.0

    def floor_train():  # the least an autograd forward+backward costs: one node and its backward
        (floor_in * 1.0).backward(do)

    rows.append(("autograd floor (q * 1)", floor_fwd, floor_train, contextlib.nullcontext))
    # The same for one ATen op of three inputs that need gradients (out = q + k * v, its backward
    # three products): what any attention with q, k and v as leaves pays the engine per step -
    # three gradient edges, three AccumulateGrad nodes - before any attention work.
    floor3_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def floor3_fwd():
        with torch.no_grad():
            torch.addcmul(q, k, v)

    def floor3_train():
        torch.addcmul(*floor3_in).backward(do)

    rows.append(("autograd floor, three inputs (addcmul)", floor3_fwd, floor3_train, contextlib.nullcontext))
    if fat.eager_ops_available():
        codes = fai._codes(None, True, False, (-1, -1), 0.0, k.shape[1])

        def fa_fwd():
            with torch.no_grad():
                fat._cpp("bshd_fwd", q, k, v, *codes, None)

        def fa_both():
            with torch.no_grad():
                o, l_ = fat._cpp("bshd_fwd", q, k, v, *codes, None)
                fat._cpp("bshd_bwd", do, q, k, v, o, l_, *codes, None)

        rows.append(("flashattn C++ ops alone (fwd; fwd op + bwd op)", fa_fwd, fa_both, contextlib.nullcontext))
    if dev == "cuda":
        aten = torch.ops.aten

        def sd_fwd():
            with torch.no_grad():
                aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False)

        def sd_both():
            with torch.no_grad():
                r = aten._scaled_dot_product_flash_attention(qt, kt, vt, 0.0, True, False)
                aten._scaled_dot_product_flash_attention_backward(dot, qt, kt, vt, r[0], r[1], r[2], r[3], r[4],
                                                                  r[5], 0.0, True, r[6], r[7])

        try:
            sd_both()
            rows.append(("sdpa-flash ATen ops alone (fwd; fwd op + bwd op)", sd_fwd, sd_both,
                         contextlib.nullcontext))
        except Exception as e:  # (an ATen signature of another torch)
            print(f"sdpa-flash ops alone: not available ({type(e).__name__}: {e})")
    # entry() wraps a forward callable; these are given whole: (name, inference, train, ctx)
    return rows


if __name__ == "__main__":
    main()
