#!/usr/bin/env python3
"""flashattn next to PyTorch SDPA's backends on a CUDA GPU: same process, identical inputs.
The one entry point of the GPU benchmarks, with two suites:

--suite training (the default): every dtype through autograd, as training code calls it,
  against every SDPA backend that takes the dtype (below).
--suite fp32: the CUDA float32 kernels' own benchmark: flashattn's precision fp32 (3xTF32) and
  tf32 modes against SDPA's memory-efficient backend in float32, on the float32 grid (S in
  {1k, 4k, 16k}, --quick: {1k, 4k}; D in {64, 128}; causal and not). flashattn is called through
  the C ABI with its argument structures built once (cabi.py bind_forward / bind_backward: the
  Python that fills them is not the library's time), the peer as training code calls it. Every
  call is timed alone in two views: host-inclusive (from an idle GPU: the host's work up to the
  first launch counts, for the peer its Python too) and kernel time (behind a GPU spin: only the
  GPU's time for the call's kernels). Median of --reps (default 5) after --warmup (default 2).
  Also per shape: tf32 on the mma.sync kernels, the fp32 mma.sync forward and backward (the
  wgmma ones are the defaults on compute capability 9.0) and the outputs against the peer's.
  Writes OUT/fp32.csv (TFLOP/s; the host-inclusive columns first, named as before the suite
  existed, then kernel_* and the checks) and OUT/fp32.md (the tables).

Backends of --suite training (--backends auto picks per dtype):
  float32           flashattn (precision fp32 = 3xTF32), flashattn-tf32; sdpa-efficient,
                    sdpa-math (full mode). SDPA's flash and cuDNN backends take no float32.
  bfloat16/float16  flashattn (library default backward: deterministic=0, FLASHATTN_CUDA_BWD
                    unset), flashattn-atomic (deterministic=0, FLASHATTN_CUDA_BWD=atomic:
                    one pass over key blocks, dQ accumulated with float32 atomics),
                    flashattn-ordered (deterministic=1, FLASHATTN_CUDA_BWD=ordered: the same
                    pass with dQ added in a fixed key-block order, bitwise reproducible; what
                    deterministic=1 runs on sm_90a; under GQA a CTA per query head, dK/dV summed
                    over the group in head order), flashattn-ordered-kvhead (the same without
                    that split: FLASHATTN_CUDA_ORD_HEADS=0), flashattn-split (deterministic=1,
                    FLASHATTN_CUDA_BWD=split: dQ pass + dK/dV pass, bitwise reproducible; what
                    it runs elsewhere); sdpa-flash, sdpa-cudnn, sdpa-efficient (full mode);
                    flashattn-blocks (FLASHATTN_CUDA_FWD_CTAS=0, forward only: one CTA per row
                    block instead of the walk); base:flashattn (--base-lib: another build).
  The two designs differ only in the backward, so their rows time the backward (and fwd+bwd in
  full mode); the forward is the flashattn row's.

Shapes (the CUDA issues): 16k tokens per batch (B = tokens / S), hidden 2048 (H = 2048 / D);
float32: S in {1k, 4k, 16k}, D in {64, 128}; bfloat16/float16: S in {512, 1k, 2k, 4k, 8k, 16k},
D in {64, 128, 256}; causal and not; with --kv-groups 4,8 also GQA (Hkv = H / g, 16-bit).
TFLOP/s by the FLOP model of attn_harness.flops (stated in
docs/PERF.md). Ratios to sdpa-flash and sdpa-cudnn per pass (the 16-bit target:
>= 1.0x sdpa-flash, forward and backward, at every shape; the gap to cuDNN is recorded).

Timing: CUDA-event medians after warm-up, inputs rotated among --sets independent sets (each far
larger than L2), a GPU spin before each timed call so host overhead is not timed
(attn_harness.Timer), training mode (requires_grad inputs, backward through autograd).
Memory: torch-visible peak beyond the inputs for one forward+backward; the library's own scratch
(cudaMallocAsync, invisible to torch) as the high-water mark of the device's stream-ordered pool,
next to the backward's formula (atomic: float32 dQ accumulator B*Hq*Sq*Dpad*4 + D workspace
B*Hq*Sq*4; split: D workspace only). Checks: each flashattn row's out, dq, dk, dv against the
first SDPA backend's (max error / max |peer|) and whether a second run is bitwise identical.

flashattn is called through the Python package (flashattn.torch.attention) when it takes
`deterministic`, else through the C ABI (ctypes, same autograd wiring) with the library given by
--lib or the one inside the installed package.

usage: python bench/gpu.py --out out/bench-gpu [--dtypes bfloat16,float16] [--quick]
       python bench/gpu.py --out DIR --lib build-gpu/src/libflashattn.so --quick  (no package)
       python bench/gpu.py --suite fp32 --out DIR --lib build-gpu/src/libflashattn.so [--quick]
       python bench/gpu.py --dry-run [--suite fp32] [--quick]  (grid, FLOPs, estimate; no torch)
--suite training writes OUT/gpu.csv (one row per case and backend, rewritten after every case),
OUT/gpu.md (tables, summary, notes; also printed last), OUT/gpu-summary.md (the same without the
16-bit per-shape tables) and OUT/gpu.png (TFLOP/s vs sequence length).
"""

import argparse
import contextlib
import ctypes
import datetime
import glob
import inspect
import math
import os
import platform
import statistics
import sys
import time
from typing import NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_harness as H  # noqa: E402  (imports torch only when it needs it)
from cabi import CtypesLib, EnvSettings  # noqa: E402

DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOW = ("bfloat16", "float16")


class Ours(NamedTuple):
    """One of flashattn's benchmark rows: how it is labelled and how it is selected."""
    short: str                       # column label
    design: str = ""                 # the backward design the row reports ("" = forward only)
    env_bwd: Optional[str] = None    # FLASHATTN_CUDA_BWD for its calls (None: the variable removed)
    deterministic: bool = False      # the C ABI's deterministic option
    knobs: Optional[dict] = None     # other kernel-selection overrides (developer builds' C ABI)
    only: Optional[str] = None       # "bwd": same forward as the default row; "fwd": same backward
    precision: str = "fp32"


# --base-lib: the default calls on another build of the library (a change's base), same process;
# base:flashattn-ordered the deterministic backward there.
BASE = "base:flashattn"
BASE_ROWS = (BASE, "base:flashattn-ordered")
# Every flashattn row, in report order. ordered-kvhead / ordered-heads: the ordered backward without
# / always with its GQA head split (a CTA per kv head walking the group's query heads / a CTA per
# query head); blocks: the 16-bit sm_90a forward with one CTA per row block (no walk).
OURS_TABLE = {
    "flashattn": Ours("flashattn", "default"),
    "flashattn-tf32": Ours("tf32", "tf32", precision="tf32"),
    "flashattn-atomic": Ours("atomic", "atomic", "atomic", only="bwd"),
    "flashattn-split": Ours("split", "split", "split", True, only="bwd"),
    "flashattn-ordered": Ours("ordered", "ordered", "ordered", True, only="bwd"),
    "flashattn-ordered-kvhead": Ours("kvhead", "ordered-kvhead", "ordered", True,
                                     {"FLASHATTN_CUDA_ORD_HEADS": "0"}, only="bwd"),
    "flashattn-ordered-heads": Ours("oheads", "ordered-heads", "ordered", True,
                                    {"FLASHATTN_CUDA_ORD_HEADS": "1"}, only="bwd"),
    "flashattn-atomic-heads": Ours("aheads", "atomic-heads", "atomic", knobs={"FLASHATTN_CUDA_ATOMIC_HEADS": "1"},
                                   only="bwd"),
    "flashattn-blocks": Ours("blocks", knobs={"FLASHATTN_CUDA_FWD_CTAS": "0"}, only="fwd"),
    BASE: Ours("base", "default"),
    "base:flashattn-ordered": Ours("base-ord", "ordered", "ordered", True, only="bwd"),
}


def knobs(name):
    """The kernel-selection overrides a row's calls run with ({} for the default and peers)."""
    o = OURS_TABLE.get(name)
    return dict(o.knobs or {}) if o else {}


# 16-bit backward designs (their rows time the backward) and forward variants (the forward).
DESIGNS = tuple(n for n, o in OURS_TABLE.items() if o.only == "bwd")
FWD_VARIANTS = tuple(n for n, o in OURS_TABLE.items() if o.only == "fwd")
OURS = tuple(OURS_TABLE)
OURS_16 = tuple(n for n in OURS if n != "flashattn-tf32")  # the rows 16-bit runs have (tf32: float32 only)
SDPA_NAMES = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
# Head dims the CUDA kernels are compiled for; others run padded to the next one.
COMPILED_HEAD_DIMS = (64, 96, 128, 256)
ENV_BWD = "FLASHATTN_CUDA_BWD"
# The math backend materialises S (and P, dP, dS) per head: cap its scratch.
MATH_MAX_BYTES = 12 << 30
# Flag (not fail) a flashattn row whose outputs differ from the SDPA peer's by more than this,
# relative to max |peer|: a few times what two correct implementations differ by (both round
# to the storage type), far below what a broken kernel gives (O(1)).
ERR_FLAG = {"float32": 1e-4, "float32-tf32": 1e-2, "bfloat16": 3e-2, "float16": 5e-3}
ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- what runs: backends, passes, the grid (no torch needed) -------------------------------------


class Impl:
    """One benchmarked backend for one dtype."""

    def __init__(self, name, passes):
        self.name = name
        self.ours = name in OURS
        self.passes = passes
        o = OURS_TABLE.get(name, Ours(name))
        self.precision = o.precision
        self.deterministic = o.deterministic
        # The default row runs with the variable removed, so it shows the library's own choice.
        self.env = o.env_bwd
        self.design = o.design
        self.overrides = knobs(name)


def backend_names(dname, args):
    if args.backends == "auto":
        if dname == "float32":
            names = ["sdpa-efficient"] + ([] if args.quick else ["sdpa-math"])
            names += ["flashattn", "flashattn-tf32"]
        else:
            names = ["sdpa-flash", "sdpa-cudnn"] + ([] if args.quick else ["sdpa-efficient"])
            names += ["flashattn", "flashattn-atomic", "flashattn-split", "flashattn-ordered"]
    else:
        names = args.backends.split(",")
    keep = []
    for n in names:
        if n == "flashattn-tf32" and dname != "float32":
            continue  # tf32 is a float32 mode
        if n in BASE_ROWS and not args.base_lib:
            continue
        if (n in DESIGNS or n in FWD_VARIANTS) and dname not in LOW:
            continue  # float32's backward has one design (always deterministic); 16-bit variants
        keep.append(n)
    # Peers first: their numbers are in when ours are printed, with ratios.
    return [n for n in keep if n not in OURS] + [n for n in keep if n in OURS]


def impls_for(dname, args):
    out = []
    for n in backend_names(dname, args):
        passes = list(args.passes)
        if n in DESIGNS:
            passes = [p for p in passes if p != "fwd"]  # same forward as the flashattn row
        if n in FWD_VARIANTS:
            passes = [p for p in passes if p == "fwd"]  # same backward
        if passes:
            out.append(Impl(n, passes))
    return out


def grid(args):
    """[(dtype name, D, S, causal, B, Hq, Hkv)] in run order: Hkv = Hq / g for each --kv-groups
    g that divides Hq (16-bit only; float32 runs MHA)."""
    causals = [bool(int(c)) for c in args.causal.split(",")]
    groups = [int(g) for g in args.kv_groups.split(",")]
    cases = []
    for dname in args.dtypes.split(","):
        seqs = args.seqs if dname == "float32" else args.bf16_seqs
        dims = args.head_dims if dname == "float32" else args.bf16_head_dims
        for d in map(int, dims.split(",")):
            for s in map(int, seqs.split(",")):
                b, h = max(1, args.tokens // s), max(1, args.hidden // d)
                for g in ([1] if dname == "float32" else groups):
                    if g < 1 or h % g:
                        continue
                    for causal in causals:
                        cases.append((dname, d, s, causal, b, h, h // g))
    return cases


def padded_head_dim(d):
    return next((c for c in COMPILED_HEAD_DIMS if c >= d), d)


def scratch_bytes(impl_name, dname, b, hq, sq, d, hkv=None, causal=False):
    """The library's backward scratch by design (docs/ALGORITHM.md): D = rowsum(dO * O) in
    float32 for every design; the atomic design adds its float32 dQ accumulator at the padded
    head dim; the ordered one under GQA (hkv < hq) with its head split (causal past 1024 keys,
    or causal at D = 256: select.cpp) the group's float32 dK and dV sums (128-key blocks, 64 at
    D = 256). None for the default row (whichever design the library picks) and for peers."""
    d_ws = b * hq * sq * 4
    if impl_name in ("flashattn-atomic", "flashattn-ordered", "flashattn-ordered-kvhead"):
        # (ordered: + one int per 64-row tile)
        dp = padded_head_dim(d)
        acc = 0
        if impl_name == "flashattn-ordered" and hkv is not None and hkv < hq and causal and (sq > 1024 or dp > 128):
            bk = 64 if dp > 128 else 128
            acc = 2 * b * hkv * ((sq + bk - 1) // bk) * bk * dp * 4
        return d_ws + b * hq * sq * dp * 4 + acc
    if impl_name == "flashattn-split" or (dname == "float32" and impl_name in OURS):
        return d_ws
    return None


def dry_run(args):
    """The grid, FLOP counts, scratch formulas and a rough time estimate; runs nothing."""
    cases = grid(args)
    rf, rb = (float(x) * 1e12 for x in args.assume_tflops.split(","))
    print(f"grid: {len(cases)} cases; tokens {args.tokens}, hidden {args.hidden}; passes "
          f"{','.join(args.passes)}; warm-up {args.warmup}, reps {args.reps}, sets {args.sets}, "
          f"budget {args.budget} s per measurement")
    for dname in args.dtypes.split(","):
        print(f"  {dname}: " + ", ".join(f"{i.name} [{','.join(i.passes)}]"
                                         for i in impls_for(dname, args)))
    print()
    print(f"{'dtype':9s} {'D':>4s} {'S':>6s} {'c':>2s} {'B':>4s} {'H':>4s} {'Hkv':>4s} {'fwd GFLOP':>10s} "
          f"{'bwd GFLOP':>10s} {'atomic MiB':>10s} {'split MiB':>10s}")
    gpu_s, calls, n_meas = 0.0, 0, 0
    warm = max(args.warmup, 1)
    for dname, d, s, causal, b, h, hkv in cases:
        f = {p: H.flops(b, h, s, d, causal, p) for p in H.PASSES}
        sa = scratch_bytes("flashattn-atomic", dname, b, h, s, d) / 2**20
        ss = scratch_bytes("flashattn-split", dname, b, h, s, d) / 2**20
        print(f"{dname:9s} {d:4d} {s:6d} {int(causal):2d} {b:4d} {h:4d} {hkv:4d} {f['fwd'] / 1e9:10.1f} "
              f"{f['bwd'] / 1e9:10.1f} {sa:10.1f} {ss:10.2f}")
        t = {"fwd": f["fwd"] / rf, "bwd": f["bwd"] / rb}
        t["both"] = t["fwd"] + t["bwd"]
        for impl in impls_for(dname, args):
            for p in impl.passes:
                # Timed reps stop after 3 once the budget is spent.
                reps = max(3, min(args.reps, math.ceil(args.budget / max(t[p], 1e-9))))
                gpu_s += (warm + reps) * t[p] + (args.sets * t["fwd"] if p == "bwd" else 0)
                calls += warm + reps
                n_meas += 1
            gpu_s += t["both"] * (2 if impl.ours else 1)  # memory probe (+ repeat check)
    # Host-side costs are guesses, not measurements: interpreter + CUDA start 20 s; 0.2 s per
    # input-set creation; 0.5 s per cuDNN graph built (one per new shape and pass); 50 ms per
    # measurement (syncs, probes); 0.5 ms per call (the spin before it, Python dispatch).
    n_shapes = len({c[:3] + c[6:] for c in cases})
    n_cudnn = sum(len(i.passes) for c in cases for i in impls_for(c[0], args)
                  if i.name == "sdpa-cudnn")
    host = {"start": 20, "input sets": 0.2 * n_shapes, "cuDNN graphs": 0.5 * n_cudnn,
            "measurements": 0.05 * n_meas, "calls": 0.5e-3 * calls}
    print(f"\n{n_meas} measurements, {calls} timed/warm-up calls. Estimate at an assumed "
          f"{rf / 1e12:.0f} TFLOP/s forward and {rb / 1e12:.0f} backward for every backend: GPU "
          f"{gpu_s:.0f} s + host (guesses) " + ", ".join(f"{k} {v:.0f}" for k, v in host.items())
          + f" = ~{gpu_s + sum(host.values()):.0f} s")


# ---- flashattn callers ---------------------------------------------------------------------------


def ctypes_attention(torch, lib):
    """Differentiable attention over the C ABI, wired like flashattn.torch's custom op (outputs
    laid out like the inputs, float32 LSE saved for the backward)."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, opts):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
            lib.forward(q, k, v, out, lse, opts)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.opts = opts
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            if dout.stride(-1) != 1:
                dout = dout.contiguous()
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            lib.backward(q, k, v, out, dout, lse, dq, dk, dv, ctx.opts)
            return dq, dk, dv, None

    return Fn


def package_library(pkg):
    """The package's own copy of libflashattn (next to its extension: python/CMakeLists.txt), or
    None."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(pkg.__file__), "libflashattn*.so*")))
    return found[0] if found else None


class Flashattn:
    """How this run calls flashattn: 'package' (flashattn.torch.attention) or 'ctypes'."""

    def __init__(self, torch, args, notes):
        self.torch = torch
        self.via, self.lib, self.pkg_det = None, None, False
        pkg = fat = None
        # The package is imported unless --lib names the library (then it is not needed, and an
        # older installed package must not shadow the build being measured).
        if args.via == "package" or args.lib is None:
            try:
                import flashattn as pkg
                import flashattn.torch as fat
            except ImportError as e:
                if args.via == "package":
                    sys.exit(f"--via package: cannot import flashattn ({e})")
                notes.append(f"flashattn package not importable ({e})")
        if fat is not None:
            self.pkg_det = "deterministic" in inspect.signature(fat.attention).parameters
        lib_path = args.lib
        if lib_path is None and pkg is not None:
            lib_path = package_library(pkg)
        if args.via == "package" or (args.via == "auto" and fat is not None and
                                     (self.pkg_det or lib_path is None)):
            self.via, self.pkg, self.fat = "package", pkg, fat
            if not self.pkg_det:
                notes.append("flashattn.torch.attention takes no `deterministic` yet and no "
                             "library was found for the C ABI: flashattn-split is skipped")
        else:
            if lib_path is None:
                sys.exit("no flashattn: neither --lib nor an installed package with its library")
            self.via = "ctypes"
            self.lib = CtypesLib(os.path.abspath(lib_path), torch)
            self.fn = ctypes_attention(torch, self.lib)
        self.base_fn = None
        if getattr(args, "base_lib", None):
            self.base_lib = CtypesLib(os.path.abspath(args.base_lib), torch)
            self.base_fn = ctypes_attention(torch, self.base_lib)

    def describe(self):
        if self.via == "package":
            where = os.path.dirname(self.pkg.__file__)
            return f"flashattn {self.pkg.__version__} via package ({where})"
        return f"flashattn {self.lib.version()} via C ABI ({self.lib.path})"

    def cuda_available(self):
        return self.pkg.cuda_available() if self.via == "package" else self.lib.cuda_available()

    def make(self, impl, causal):
        """attn(q, k, v) -> out for impl, or a string saying why it cannot run."""
        mask = "causal_top_left" if causal else "none"  # equal to bottom-right for Sq == Skv
        if self.via == "package":
            kw = {"deterministic": impl.deterministic} if self.pkg_det else {}
            if impl.deterministic and not self.pkg_det:
                return "the package takes no deterministic= and no library for the C ABI"
            if impl.env or impl.overrides:
                return ("a kernel-selection override needs the C ABI of a developer build "
                        "(--lib with FLASHATTN_DEV_OVERRIDES)")
            fat, prec = self.fat, impl.precision
            return lambda q, k, v: fat.attention(q, k, v, mask=mask, precision=prec, **kw)
        opts = (1 if causal else 0, 1 if impl.precision == "tf32" else 0, impl.deterministic)
        fn = self.fn
        if impl.name in BASE_ROWS:
            if self.base_fn is None:
                return "no --base-lib"
            fn = self.base_fn
        return lambda q, k, v: fn.apply(q, k, v, opts)


# ---- measurement helpers -------------------------------------------------------------------------


class StreamPool:
    """High-water mark of the device's current stream-ordered memory pool, through the driver
    API: the library's workspace comes from cudaMallocAsync there, which torch's allocator
    statistics never see (unless torch itself runs on cudaMallocAsync: then both are in it)."""

    USED_MEM_HIGH = 8  # CU_MEMPOOL_ATTR_USED_MEM_HIGH (cuda.h), a cuuint64_t

    def __init__(self, device_index):
        self.why = None
        try:
            cu = ctypes.CDLL("libcuda.so.1")
            cu.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
            cu.cuDeviceGetMemPool.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
            cu.cuMemPoolGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            cu.cuMemPoolSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            dev, pool = ctypes.c_int(), ctypes.c_void_p()
            rc = cu.cuDeviceGet(ctypes.byref(dev), device_index)
            rc = rc or cu.cuDeviceGetMemPool(ctypes.byref(pool), dev)
            if rc:
                raise OSError(f"CUresult {rc}")
            self.cu, self.pool = cu, pool
            self.reset()
            if self.high() is None:
                raise OSError("cuMemPoolGetAttribute failed")
        except (OSError, AttributeError) as e:
            self.why = str(e)

    def reset(self):
        if self.why is None:
            zero = ctypes.c_uint64(0)  # the high-water mark can only be reset to 0
            self.cu.cuMemPoolSetAttribute(self.pool, self.USED_MEM_HIGH, ctypes.byref(zero))

    def high(self):
        v = ctypes.c_uint64(0)
        rc = self.cu.cuMemPoolGetAttribute(self.pool, self.USED_MEM_HIGH, ctypes.byref(v))
        return v.value if rc == 0 else None


def probe(torch, fn, inputs, pool, repeat):
    """One forward+backward on set 0: torch-visible peak beyond the inputs, the stream pool's
    high-water mark, the results (out, dq, dk, dv) and, with repeat, whether a second run gives
    bitwise identical results."""
    q, k, v, dout = inputs
    res = dict(peak_mib=float("nan"), pool_mib=None, bitwise=None)
    if q.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if pool is not None and pool.why is None:
            pool.reset()
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    if q.is_cuda:
        torch.cuda.synchronize()
        res["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        if pool is not None and pool.why is None:
            hi = pool.high()
            res["pool_mib"] = None if hi is None else hi / 2**20
    result = (out.detach(),) + tuple(grads)
    del out, grads
    if repeat:
        out2 = fn(q, k, v)
        again = (out2.detach(),) + tuple(torch.autograd.grad(out2, (q, k, v), dout))
        res["bitwise"] = all(torch.equal(a, b) for a, b in zip(result, again))
        del out2, again
    res["result"] = result
    return res


def rel_err(got, ref):
    """max over out, dq, dk, dv of max|got - ref| / max|ref|; NaN when anything is not finite."""
    worst = 0.0
    for a, b in zip(got, ref):
        b32 = b.float()
        e = (a.float() - b32).abs().max().item() / max(b32.abs().max().item(), 1e-30)
        if not math.isfinite(e):
            return float("nan")
        worst = max(worst, e)
    return worst


def supported(torch, fn, ctx, dtype, d, device, group=1):
    """Runs one tiny forward+backward (group query heads per kv head); returns None or the
    reason it failed."""
    q = torch.randn(1, 2 * group, 128, d, device=device, dtype=dtype, requires_grad=True)
    kv = q if group == 1 else torch.randn(1, 2, 128, d, device=device, dtype=dtype, requires_grad=True)
    try:
        with ctx():
            out = fn(q, kv, kv)
            out.sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return None
    except (RuntimeError, NotImplementedError, TypeError) as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


# ---- report --------------------------------------------------------------------------------------

SHORT = {**{n: o.short for n, o in OURS_TABLE.items()},
         "sdpa-flash": "flash", "sdpa-cudnn": "cudnn", "sdpa-efficient": "efficient",
         "sdpa-math": "math"}
RATIO_TO = (("sdpa-flash", "flash"), ("sdpa-cudnn", "cudnn"))


def case_key(r):
    """(dtype, causal, D, S, query heads per kv head)."""
    return (r["dtype"], r["causal"], r["head_dim"], r["seq"], r["heads"] // (r.get("heads_kv") or r["heads"]))


def case_label(key):
    return f"{key[0]} D={key[2]} S={key[3]}{' causal' if key[1] else ''}{f' GQA {key[4]}' if key[4] > 1 else ''}"


def ratio_col(p, peer):
    return f"{p}_vs_{peer.replace('-', '_')}"


def add_ratios(case_rows):
    """{pass}_vs_sdpa_flash / _vs_sdpa_cudnn on every row of one case whose peer was measured."""
    by = {r["backend"]: r for r in case_rows}
    for r in case_rows:
        for peer, _ in RATIO_TO:
            if peer == r["backend"] or peer not in by:
                continue
            for p in H.PASSES:
                a, b = r.get(f"{p}_flops_per_s"), by[peer].get(f"{p}_flops_per_s")
                if a and b:
                    r[ratio_col(p, peer)] = round(a / b, 3)


def lp_table(rows, p):
    """Markdown: one line per 16-bit case, pass p, TFLOP/s per backend, ours over flash/cuDNN."""
    rows = [r for r in rows if r["dtype"] in LOW]
    has = lambda b: any(r["backend"] == b and r.get(f"{p}_flops_per_s") for r in rows)  # noqa
    ours = [b for b in OURS_16 if has(b)]
    peers = [b for b in SDPA_NAMES if has(b)]
    if not ours and not peers:
        return ""
    # The default row repeats one of the designs: ratios for the designs when both are there.
    rated = [b for b in ours if b in DESIGNS] or ours
    label = lambda b: "default" if (b == "flashattn" and p != "fwd") else SHORT[b]  # noqa
    cases = list(dict.fromkeys(case_key(r) for r in rows))
    gqa = any(k[4] > 1 for k in cases)  # (a column Hq/Hkv only where some case has GQA)
    head = ["dtype", "causal", "D", "S"] + (["Hq/Hkv"] if gqa else []) + [label(b) for b in ours + peers]
    for peer, pl in RATIO_TO:
        if has(peer):
            head += [f"{label(b)}/{pl}" for b in rated]
    lines = [f"{p} (TFLOP/s; ratios > 1: flashattn faster)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in cases:
        rs = {r["backend"]: r for r in rows if case_key(r) == key}
        cells = [key[0], "yes" if key[1] else "no", str(key[2]), str(key[3])] + ([str(key[4])] if gqa else [])
        for b in ours + peers:
            v = rs.get(b, {}).get(f"{p}_flops_per_s")
            cells.append(H.fmt(v / 1e12 if v else None))
        for peer, _ in RATIO_TO:
            if has(peer):
                for b in rated:
                    x = rs.get(b, {}).get(ratio_col(p, peer))
                    cells.append(f"{x:.2f}" if x else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lp_summary(rows):
    """Per pass and flashattn row: how many shapes meet >= 1.0x sdpa-flash, and the cuDNN gap."""
    rows = [r for r in rows if r["dtype"] in LOW]
    out = []
    all_cases = list(dict.fromkeys(case_key(r) for r in rows))
    for p in H.PASSES:
        for b in OURS_16:
            mine = [r for r in rows if r["backend"] == b and r.get(f"{p}_flops_per_s")]
            if not mine:
                continue
            for peer, pl in RATIO_TO:
                col = ratio_col(p, peer)
                xs = sorted((r[col], case_key(r)) for r in mine if r.get(col))
                if not xs:
                    continue
                n_peer = sum(1 for r in rows if r["backend"] == peer and r.get(f"{p}_flops_per_s"))
                met = sum(1 for x, _ in xs if x >= 1.0)
                name = "default" if b == "flashattn" and p != "fwd" else SHORT[b]
                out.append(f"- {p} {name} vs {pl}: >= 1.0x at {met}/{len(xs)} shapes (peer ran "
                           f"at {n_peer}/{len(all_cases)}); median "
                           f"{statistics.median(x for x, _ in xs):.2f}x, worst {xs[0][0]:.2f}x "
                           f"({case_label(xs[0][1])}), best {xs[-1][0]:.2f}x")
    return "\n".join(out)


def scratch_table(rows):
    """Per (dtype, D): the library's backward scratch per design (formula and the stream pool's
    high-water mark, over S) and the torch-visible peak beyond inputs per backend."""
    rows = [r for r in rows if r["dtype"] in LOW]
    if not rows:
        return ""

    def rng(xs, nd=1):
        xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
        if not xs:
            return "-"
        lo, hi = min(xs), max(xs)
        return f"{lo:.{nd}f}" if abs(hi - lo) < 0.05 else f"{lo:.{nd}f}-{hi:.{nd}f}"

    backends = [b for b in SDPA_NAMES + ("flashattn",) + DESIGNS
                if any(r["backend"] == b for r in rows)]
    head = ["dtype", "D"]
    for b in backends:
        if b in OURS:  # the default row has no formula of its own: it is one of the designs
            head += ([f"{SHORT[b]} formula"] if b in DESIGNS else []) + [f"{SHORT[b]} pool"]
    head += [f"{SHORT[b]} torch peak" for b in backends]
    lines = ["backward scratch and memory (MiB; formula = the design's workspace, pool = measured "
             "high-water mark of the stream-ordered pool the library allocates from; torch peak ="
             " torch-visible allocations beyond the inputs over one forward+backward; ranges over "
             "S)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys((r["dtype"], r["head_dim"]) for r in rows):
        rs = [r for r in rows if (r["dtype"], r["head_dim"]) == key]
        cells = [key[0], str(key[1])]
        for b in backends:
            if b in OURS:
                mine = [r for r in rs if r["backend"] == b]
                if b in DESIGNS:
                    cells.append(rng([r.get("scratch_formula_mib") for r in mine], 2))
                cells.append(rng([r.get("lib_pool_high_mib") for r in mine], 2))
        for b in backends:
            cells.append(rng([r.get("fwd_bwd_peak_extra_mib") for r in rs if r["backend"] == b], 0))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks_summary(rows):
    out = []
    mine = [r for r in rows if r["backend"] in OURS]
    flagged = [r for r in mine if r.get("check") == "FLAG"]
    compared = [r for r in mine if r.get("max_rel_err") is not None]
    if compared:
        worst = max(compared, key=lambda r: (r["max_rel_err"] if math.isfinite(r["max_rel_err"])
                                             else float("inf")))
        out.append(f"- outputs vs the SDPA peer: {len(compared) - len(flagged)}/{len(compared)} "
                   f"rows within the flag threshold; worst {worst['max_rel_err']:.2e} "
                   f"({worst['backend']}, {case_label(case_key(worst))})")
    for r in flagged:
        out.append(f"  - FLAG {r['backend']} {case_label(case_key(r))}: max error / max |peer| = "
                   f"{r['max_rel_err']:.2e} vs {r['err_ref']}")
    for b in ("flashattn",) + DESIGNS:
        rep = [r for r in mine if r["backend"] == b and r.get("bitwise_repeat") is not None]
        if rep and rows and any(r["dtype"] in LOW for r in rep):
            same = sum(1 for r in rep if r["bitwise_repeat"])
            out.append(f"- {b}: a second forward+backward bitwise identical at {same}/{len(rep)} "
                       f"shapes" + (" (must be all: deterministic=1)" if b == "flashattn-split"
                                    else ""))
    return "\n".join(out)


# ---- --suite fp32: the float32 kernels against SDPA's memory-efficient backend ------------------

# TFLOP/s columns of OUT/fp32.csv: the host-inclusive view keeps the names the float32 benchmark's
# CSV files had before this suite existed (docs/bench/, docs/perf-log/data/), so they compare
# column by column; the kernel view and the checks follow.
FP32_MAIN = ("fwd_fp32", "fwd_tf32", "fwd_peer", "bwd_fp32", "bwd_tf32", "bwd_peer",
             "fb_fp32", "fb_tf32", "fb_peer")
FP32_SIDE = ("fwd_tf32_mma_sync", "bwd_tf32_mma_sync", "fwd_fp32_other", "bwd_fp32_mma_sync")
FP32_CHECKS = ("err_out_fp32", "err_out_tf32", "err_grads_tf32", "err_out_fp32_other",
               "err_grads_fp32_mma_sync")
FP32_COLUMNS = (("S", "D", "causal") + FP32_MAIN + FP32_SIDE + tuple("kernel_" + c for c in FP32_MAIN)
                + FP32_CHECKS + ("B", "H"))
FP32_VIEWS = (("host", "", "host-inclusive: each call from an idle GPU, the host's work up to its "
               "first launch counted (the peer's Python too)"),
              ("kernel", "kernel_", "kernel time: each call behind a GPU spin, only the GPU's time "
               "for its kernels"))
# The CUDA float32 issue's targets, per pass: fp32 mode and tf32 mode over the peer.
FP32_TARGETS = (("fp32", 1.3), ("tf32", 3.0))


def fp32_cases(args):
    return [c[:6] for c in grid(args) if c[0] == "float32"]


def fp32_dry_run(args):
    cases = fp32_cases(args)
    print(f"--suite fp32: {len(cases)} shapes; tokens {args.tokens}, hidden {args.hidden}; "
          f"warm-up {args.warmup}, reps {args.reps}; flashattn fp32 and tf32 (C ABI, bound "
          f"calls) vs sdpa-efficient, forward and backward, host-inclusive and kernel time")
    print(f"{'D':>4s} {'S':>6s} {'c':>2s} {'B':>4s} {'H':>4s} {'fwd GFLOP':>10s} {'bwd GFLOP':>10s}")
    for _, d, s, causal, b, h in cases:
        print(f"{d:4d} {s:6d} {int(causal):2d} {b:4d} {h:4d} "
              f"{H.flops(b, h, s, d, causal, 'fwd') / 1e9:10.1f} "
              f"{H.flops(b, h, s, d, causal, 'bwd') / 1e9:10.1f}")


def fp32_table(rows, prefix):
    """One view's table, as docs/PERF.md shows it: TFLOP/s and the ratios to the peer."""
    lines = ["| S | D | causal | fwd fp32 | fwd tf32 | fwd peer | bwd fp32 | bwd tf32 | bwd peer | "
             "f+b fp32 | f+b tf32 | f+b peer | fp32/peer f, b, f+b | tf32/peer f, b, f+b |",
             "|" + " --- |" * 14]
    for r in rows:
        cells = [str(r["S"]), str(r["D"]), "yes" if r["causal"] else "no"]
        cells += [H.fmt(r[prefix + c]) for c in FP32_MAIN]
        for m, _ in FP32_TARGETS:
            cells.append(" ".join(H.fmt(r[f"{prefix}{p}_{m}"] / r[f"{prefix}{p}_peer"], 2)
                                  for p in ("fwd", "bwd", "fb")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fp32_summary(rows, prefix):
    """Per mode and pass: at how many shapes the target ratio is met, and the range."""
    out = []
    for m, target in FP32_TARGETS:
        for p, pl in (("fwd", "forward"), ("bwd", "backward")):
            xs = [r[f"{prefix}{p}_{m}"] / r[f"{prefix}{p}_peer"] for r in rows]
            out.append(f"- {m} {pl}: >= {target}x the peer at {sum(x >= target for x in xs)}/"
                       f"{len(xs)} shapes ({min(xs):.2f}-{max(xs):.2f}x)")
    return "\n".join(out)


def fp32_side_table(rows):
    lines = ["| S | D | causal | tf32 on mma.sync f, b | fp32 mma.sync forward | fp32 mma.sync "
             "backward | max\\|O - O_peer\\| fp32, tf32 | tf32 grads vs peer | fp32 mma.sync vs "
             "default: O, grads |", "|" + " --- |" * 9]
    for r in rows:
        e = lambda c: f"{r[c]:.1e}"  # noqa: E731
        lines.append(f"| {r['S']} | {r['D']} | {'yes' if r['causal'] else 'no'} | "
                     f"{H.fmt(r['fwd_tf32_mma_sync'])} {H.fmt(r['bwd_tf32_mma_sync'])} | "
                     f"{H.fmt(r['fwd_fp32_other'])} | {H.fmt(r['bwd_fp32_mma_sync'])} | "
                     f"{e('err_out_fp32')} {e('err_out_tf32')} | {e('err_grads_tf32')} | "
                     f"{e('err_out_fp32_other')} {e('err_grads_fp32_mma_sync')} |")
    return "\n".join(lines)


def fp32_suite(args):
    if args.dry_run:
        fp32_dry_run(args)
        return 0
    t_begin = time.monotonic()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = args.device
    cuda = dev == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (or --device cpu, --dry-run)")
    path = args.lib
    if path is None:
        try:
            import flashattn as pkg
            path = package_library(pkg)
        except ImportError:
            pass
    if path is None:
        sys.exit("--suite fp32 calls the C ABI: give --lib (or install the package with its library)")
    fa = CtypesLib(os.path.abspath(path), torch)
    if cuda and not fa.cuda_available():
        sys.exit(f"this flashattn has no usable CUDA backend ({path})")
    H.ensure_dir(args.out)
    torch.backends.cuda.matmul.allow_tf32 = False  # the peer stays float32-accurate
    torch.backends.cudnn.allow_tf32 = False
    # The CPU smoke test (--device cpu) has no memory-efficient SDPA: the math backend stands in.
    peer = SDPBackend.EFFICIENT_ATTENTION if cuda else SDPBackend.MATH
    timer = H.Timer(cuda=cuda)
    warmup, reps = args.warmup, args.reps
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    dev_name = (torch.cuda.get_device_name() if cuda else platform.machine() + " CPU")
    header = (f"{stamp}; {dev_name}; torch {torch.__version__}; flashattn {fa.version()} via C ABI "
              f"({fa.path}); python {platform.python_version()}\ntiming: median of {reps} after "
              f"{warmup} warm-up, each call timed alone, peer SDPA {peer.name} float32; command: "
              f"{' '.join(sys.argv)}")
    print(header, flush=True)
    print(f"{'S':>6} {'D':>4} {'causal':>6} {'view':>6} | {'fwd fp32':>8} {'fwd tf32':>8} "
          f"{'fwd peer':>8} | {'bwd fp32':>8} {'bwd tf32':>8} {'bwd peer':>8} | {'f+b fp32':>8} "
          f"{'f+b tf32':>8} {'f+b peer':>8} | ratios fp32/peer f,b  tf32/peer f,b", flush=True)
    csv_path = os.path.join(args.out, "fp32.csv")
    rows, notes, stopped = [], [], None
    nan = float("nan")
    cases = fp32_cases(args)
    for ci, (_, d, s, causal, b, h) in enumerate(cases):
        if args.time_limit and time.monotonic() - t_begin > args.time_limit:
            stopped = (f"time limit {args.time_limit:.0f} s reached: stopped before shape "
                       f"{ci + 1}/{len(cases)} (D={d} S={s}{' causal' if causal else ''})")
            notes.append(stopped)
            break
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device=dev, generator=g) for _ in range(4))
        out = torch.empty_like(q)
        lse = torch.empty(b, h, s, device=dev)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fl_f, fl_b = H.flops(b, h, s, d, causal, "fwd"), H.flops(b, h, s, d, causal, "bwd")

        def tflops(fl, ms):
            return fl / ms / 1e9

        def side_ms(fn):  # the side measurements: host-inclusive view only
            return H.time_call(fn, warmup, reps, cuda=cuda)

        ms = {}  # (impl, pass) -> {"host": ms, "kernel": ms}
        for name, prec in (("fp32", 0), ("tf32", 1)):
            o = fa.options(causal, prec)
            ms[name, "fwd"] = H.time_views(fa.bind_forward(q, k, v, out, lse, o), warmup, reps, timer)
            ms[name, "bwd"] = H.time_views(fa.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o),
                                           warmup, reps, timer)
        row = dict(S=s, D=d, causal=int(causal))
        # tf32 on the mma.sync kernels too (the sm_90a wgmma kernels are the default on compute
        # capability 9.0 at padded D = 64 and 128, forward and backward): what they gained.
        o = fa.options(causal, 1)
        with EnvSettings({"FLASHATTN_CUDA_ARCH": "sm80"}):
            row["fwd_tf32_mma_sync"] = tflops(fl_f, side_ms(fa.bind_forward(q, k, v, out, lse, o)))
            row["bwd_tf32_mma_sync"] = tflops(
                fl_b, side_ms(fa.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o)))
        # The other fp32 forward on compute capability 9.0, the mma.sync one (the wgmma 3xTF32
        # forward is the default at padded D = 64 and 128): its speed, and its O against the
        # default's (a failure is reported, not fatal).
        row["fwd_fp32_other"] = row["err_out_fp32_other"] = nan
        row["bwd_fp32_mma_sync"] = row["err_grads_fp32_mma_sync"] = nan
        if d <= 128:
            o = fa.options(causal, 0)
            fa.forward(q, k, v, out, lse, o)
            out_d = out.clone()
            try:
                with EnvSettings({"FLASHATTN_CUDA_FP32_FWD": "mma"}):
                    row["fwd_fp32_other"] = tflops(fl_f, side_ms(fa.bind_forward(q, k, v, out, lse, o)))
                row["err_out_fp32_other"] = (out_d - out).abs().max().item()
            except (RuntimeError, NotImplementedError) as e:
                notes.append(f"D={d} S={s}: fp32 mma.sync forward failed: {e}")
            del out_d
            # The fp32 mma.sync backward at padded D = 64 and 128 (the default there is the wgmma
            # pair kernels in 3xTF32 on compute capability 9.0): its speed, and its gradients
            # against the default's, relative to the largest.
            fa.forward(q, k, v, out, lse, o)
            try:
                with EnvSettings({"FLASHATTN_CUDA_FP32_BWD": "mma"}):
                    row["bwd_fp32_mma_sync"] = tflops(
                        fl_b, side_ms(fa.bind_backward(q, k, v, out, do, lse, dq, dk, dv, o)))
                g_w = (dq.clone(), dk.clone(), dv.clone())
                fa.backward(q, k, v, out, do, lse, dq, dk, dv, o)
                scale = max(t.abs().max().item() for t in (dq, dk, dv))
                row["err_grads_fp32_mma_sync"] = max(
                    (x - y).abs().max().item() for x, y in zip(g_w, (dq, dk, dv))) / scale
                del g_w
            except (RuntimeError, NotImplementedError) as e:
                notes.append(f"D={d} S={s}: fp32 mma.sync backward failed: {e}")
        # The peer, as training code calls it; then flashattn's outputs against its outputs.
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel(peer):
            def peer_fwd():
                return F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)

            ms["peer", "fwd"] = H.time_views(peer_fwd, warmup, reps, timer)
            o_peer = peer_fwd()

            def peer_bwd():
                return torch.autograd.grad(o_peer, (qg, kg, vg), do, retain_graph=True)

            ms["peer", "bwd"] = H.time_views(peer_bwd, warmup, reps, timer)
            fa.forward(q, k, v, out, lse, fa.options(causal, 0))
            row["err_out_fp32"] = (out - o_peer.detach()).abs().max().item()
            fa.forward(q, k, v, out, lse, fa.options(causal, 1))
            row["err_out_tf32"] = (out - o_peer.detach()).abs().max().item()
            # the tf32 gradients against the peer's float32 ones, relative to the largest
            # gradient (as the tests judge them)
            g_peer = peer_bwd()
            fa.backward(q, k, v, out, do, lse, dq, dk, dv, fa.options(causal, 1))
            scale_g = max(t.abs().max().item() for t in g_peer)
            row["err_grads_tf32"] = max(
                (x - y).abs().max().item() for x, y in zip((dq, dk, dv), g_peer)) / scale_g
        del qg, kg, vg, o_peer, g_peer
        for view, prefix, _ in FP32_VIEWS:
            for m in ("fp32", "tf32", "peer"):
                tf, tb = ms[m, "fwd"][view], ms[m, "bwd"][view]
                row[f"{prefix}fwd_{m}"] = tflops(fl_f, tf)
                row[f"{prefix}bwd_{m}"] = tflops(fl_b, tb)
                row[f"{prefix}fb_{m}"] = tflops(fl_f + fl_b, tf + tb)
        row.update(B=b, H=h)
        row = {c: row[c] for c in FP32_COLUMNS}
        for view, prefix, _ in FP32_VIEWS:
            r = {c: row[prefix + c] for c in FP32_MAIN}
            line = (f"{s:>6} {d:>4} {str(causal):>6} {view:>6} | {r['fwd_fp32']:8.1f} "
                    f"{r['fwd_tf32']:8.1f} {r['fwd_peer']:8.1f} | {r['bwd_fp32']:8.1f} "
                    f"{r['bwd_tf32']:8.1f} {r['bwd_peer']:8.1f} | {r['fb_fp32']:8.1f} "
                    f"{r['fb_tf32']:8.1f} {r['fb_peer']:8.1f} | "
                    f"{r['fwd_fp32'] / r['fwd_peer']:.2f} {r['bwd_fp32'] / r['bwd_peer']:.2f}   "
                    f"{r['fwd_tf32'] / r['fwd_peer']:.2f} {r['bwd_tf32'] / r['bwd_peer']:.2f}")
            if view == "host":
                line += (f"   (max|O-O_peer| fp32 {row['err_out_fp32']:.1e}, tf32 "
                         f"{row['err_out_tf32']:.1e}; tf32 grads rel {row['err_grads_tf32']:.1e}; "
                         f"tf32 on mma.sync fwd {row['fwd_tf32_mma_sync']:.1f} bwd "
                         f"{row['bwd_tf32_mma_sync']:.1f}; fp32 mma.sync fwd "
                         f"{row['fwd_fp32_other']:.1f}, bwd {row['bwd_fp32_mma_sync']:.1f})")
            print(line, flush=True)
        rows.append(row)
        H.write_csv(csv_path, [{c: (float(f"{x:.3g}") if c in FP32_CHECKS else round(x, 2)
                                    if c in FP32_MAIN + FP32_SIDE or c.startswith("kernel_") else x)
                                for c, x in r.items()} for r in rows])
        del q, k, v, do, out, lse, dq, dk, dv
        if cuda:
            torch.cuda.empty_cache()
    if not rows:
        sys.exit("nothing was measured")
    md = header + "\n"
    for view, prefix, what in FP32_VIEWS:
        md += (f"\n## {what} (TFLOP/s)\n\n" + fp32_table(rows, prefix) + "\n\n"
               + fp32_summary(rows, prefix) + "\n")
    md += ("\n## other kernels (host-inclusive TFLOP/s) and checks\n\n" + fp32_side_table(rows)
           + "\n")
    if notes:
        md += "\nNotes:\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    md += f"\n({len(rows)} shapes, {time.monotonic() - t_begin:.0f} s)\n"
    with open(os.path.join(args.out, "fp32.md"), "w") as f:
        f.write(md)
    print(f"\nwrote {args.out}/fp32.csv, fp32.md\n", flush=True)
    print(md, flush=True)
    return 2 if stopped else 0


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--suite", choices=("training", "fp32"), default="training",
                    help="training: every dtype through autograd against SDPA's backends; fp32: "
                    "the float32 kernels (fp32 and tf32 modes, C ABI) against SDPA's memory-"
                    "efficient backend, host-inclusive and kernel time (see above)")
    ap.add_argument("--out", help="folder for the results: gpu.csv, gpu.md, gpu-summary.md and "
                    "gpu.png; --suite fp32: fp32.csv and fp32.md (required unless --dry-run)")
    ap.add_argument("--dtypes", default=None,
                    help="default float32,bfloat16,float16 (--suite fp32: float32 only)")
    ap.add_argument("--seqs", default=None,
                    help="sequence lengths for float32 (default 1024,4096,16384; --suite fp32 "
                    "--quick: 1024,4096)")
    ap.add_argument("--head-dims", default="64,128", help="head dims for float32")
    ap.add_argument("--bf16-seqs", default="512,1024,2048,4096,8192,16384",
                    help="sequence lengths for bfloat16/float16")
    ap.add_argument("--bf16-head-dims", default="64,128,256", help="head dims for bfloat16/float16")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens / S)")
    ap.add_argument("--hidden", type=int, default=2048, help="H = hidden / D")
    ap.add_argument("--kv-groups", default="1",
                    help="query heads per kv head, comma separated (1: MHA; 4,8: GQA with Hkv = H / g; "
                    "16-bit only). SDPA's flash kernel takes no GQA: its rows get K and V expanded to H "
                    "heads inside the timed call, as its users do; cuDNN takes enable_gqa")
    ap.add_argument("--backends", default="auto",
                    help="comma list from " + ",".join(SDPA_NAMES + OURS) + ", or auto (per dtype:"
                    " see above)")
    ap.add_argument("--passes", default=None,
                    help="subset of fwd,bwd,both (default: fwd,bwd,both; --quick: fwd,bwd)")
    ap.add_argument("--sets", type=int, default=3, help="input sets rotated between calls")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up calls (default 3, --quick 1; --suite fp32: 2)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed calls (default 20, --quick 5; --suite fp32: 5)")
    ap.add_argument("--budget", type=float, default=1.5, help="seconds per measurement, at most")
    ap.add_argument("--quick", action="store_true",
                    help="5 reps, 1 warm-up, 0.3 s budget, passes fwd,bwd, auto backends without "
                    "sdpa-efficient (16-bit) / sdpa-math (float32): the 16-bit grid in ~1-2 min on "
                    "an H200 (see --dry-run); --suite fp32: S = 1k and 4k only")
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds: start no new case after this (results so far are written; "
                    "exit status 2); 0 = none")
    ap.add_argument("--no-gpu-sleep", action="store_true",
                    help="no spin kernel before timed calls (host overhead then may be timed)")
    ap.add_argument("--via", choices=("auto", "package", "ctypes"), default="auto",
                    help="how to call flashattn (auto: the package if it takes deterministic=, "
                    "else the C ABI; --lib alone means the C ABI)")
    ap.add_argument("--lib", help="libflashattn.so for the C ABI path")
    ap.add_argument("--base-lib", help="another libflashattn.so (a change's base): backend base:flashattn, its "
                    "default calls in the same process and rounds as flashattn's")
    ap.add_argument("--device", default="cuda",
                    help="'cpu' runs the same script on the CPU (a smoke test of the script)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the grid, FLOPs, scratch formulas and a time estimate; no torch")
    ap.add_argument("--assume-tflops", default="300,200",
                    help="forward,backward TFLOP/s assumed by --dry-run's time estimate")
    args = ap.parse_args(argv)
    if args.suite == "fp32":
        # The float32 kernels' benchmark: its own defaults; --quick only shortens the grid.
        if args.dtypes not in (None, "float32"):
            ap.error("--suite fp32 measures float32 only (--dtypes float32 or nothing)")
        if args.device not in ("cuda", "cpu"):
            ap.error("--suite fp32: --device cuda (or cpu, a smoke test of the script)")
        args.dtypes = "float32"
        args.seqs = args.seqs or ("1024,4096" if args.quick else "1024,4096,16384")
        args.reps = 5 if args.reps is None else args.reps
        args.warmup = 2 if args.warmup is None else args.warmup
    else:
        args.dtypes = args.dtypes or "float32,bfloat16,float16"
        args.seqs = args.seqs or "1024,4096,16384"
        args.reps = 20 if args.reps is None else args.reps
        args.warmup = 3 if args.warmup is None else args.warmup
        if args.quick:
            args.reps, args.warmup, args.budget = 5, 1, 0.3
    args.passes = (args.passes or ("fwd,bwd" if args.quick else "fwd,bwd,both")).split(",")
    for p in args.passes:
        if p not in H.PASSES:
            ap.error(f"--passes: unknown pass {p!r}")
    for d in args.dtypes.split(","):
        if d not in DTYPE_NAMES:
            ap.error(f"--dtypes: unknown dtype {d!r}")
    if args.backends != "auto":
        for b in args.backends.split(","):
            if b not in SDPA_NAMES + OURS:
                ap.error(f"--backends: unknown backend {b!r}")
    if not args.dry_run and not args.out:
        ap.error("--out is required (or --dry-run)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.suite == "fp32":
        return fp32_suite(args)
    if args.dry_run:
        dry_run(args)
        return 0
    t_begin = time.monotonic()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (or --device cpu, --dry-run)")
    notes = []
    fa = Flashattn(torch, args, notes)
    if dev == "cuda" and not fa.cuda_available():
        sys.exit(f"this flashattn has no usable CUDA backend ({fa.describe()})")
    H.ensure_dir(args.out)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 peers stay float32-accurate
    torch.backends.cudnn.allow_tf32 = False
    if os.environ.get(ENV_BWD) is not None:
        notes.append(f"{ENV_BWD}={os.environ[ENV_BWD]} was set: the flashattn rows ran without "
                     "it (library default), the design rows with their own value")
    pool = None
    if dev == "cuda":
        pool = StreamPool(torch.cuda.current_device())
        if pool.why:
            notes.append(f"stream-ordered pool not readable ({pool.why}): library scratch is "
                         "given by formula only")
        elif torch.cuda.get_allocator_backend() != "native":
            notes.append("torch allocates with cudaMallocAsync too: 'pool' figures include "
                         "torch's allocations")

    if dev == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        try:  # torch >= 2.9 can swap SDPA's flash kernels for FA3/FA4: say which one ran
            flash_impl = torch.nn.attention.current_flash_attention_impl()
        except (AttributeError, RuntimeError):
            flash_impl = None
        dev_name = (f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB); "
                    f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
                    f"SDPA flash impl {flash_impl or 'built-in'}")
    else:
        dev_name = platform.machine() + " CPU"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    timer = H.Timer(cuda=dev == "cuda", gpu_sleep=not args.no_gpu_sleep)
    header = (f"{stamp}; {dev_name}; torch {torch.__version__}; {fa.describe()}; python "
              f"{platform.python_version()}\ntiming: median of {args.reps} reps (fewer past "
              f"{args.budget} s) after {args.warmup} warm-up, {args.sets} input sets rotated, "
              f"gpu sleep {'on' if timer.gpu_sleep else 'off'}; command: {' '.join(sys.argv)}")
    print(header, flush=True)

    def context(impl):
        if impl.name in sdpa:
            return lambda: sdpa_kernel(sdpa[impl.name])  # pinned once around a measurement
        return lambda: EnvSettings({ENV_BWD: impl.env, **impl.overrides})

    def sdpa_fn(causal, name):
        def call(q, k, v):
            g = q.shape[1] // k.shape[1]
            if g > 1 and name == "sdpa-flash":  # (no GQA in that kernel: K, V expanded, timed)
                k, v = (x.repeat_interleave(g, dim=1) for x in (k, v))
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=g > 1)
        return call

    csv_path = os.path.join(args.out, "gpu.csv")
    rows = []
    cases = grid(args)
    stopped = None
    fns, skip = {}, {}
    prev_shape = None
    sets = None
    if any(c[5] != c[6] for c in cases):
        notes.append("GQA rows: sdpa-flash gets K and V expanded to Hq heads inside the timed call "
                     "(repeat_interleave; its kernel takes no GQA, so that is what its users run); "
                     "sdpa-cudnn and flashattn take Hkv heads")
    for ci, (dname, d, s, causal, b, h, hkv) in enumerate(cases):
        if args.time_limit and time.monotonic() - t_begin > args.time_limit:
            stopped = (f"time limit {args.time_limit:.0f} s reached: stopped before case "
                       f"{ci + 1}/{len(cases)} ({dname} D={d} S={s}{' causal' if causal else ''})")
            notes.append(stopped)
            break
        dtype = dtypes[dname]
        impls = impls_for(dname, args)
        g = h // hkv
        gqa = f" GQA {g}" if g > 1 else ""
        for impl in impls:  # one probe per (dtype, D, causal, group, backend)
            key = (dname, d, causal, g, impl.name)
            if key in fns:
                continue
            fn = fa.make(impl, causal) if impl.ours else sdpa_fn(causal, impl.name)
            why = fn if isinstance(fn, str) else supported(torch, fn, context(impl), dtype, d, dev, g)
            fns[key] = fn
            if why:
                skip[key] = why
                notes.append(f"{impl.name} {dname} D={d}{' causal' if causal else ''}{gqa}: "
                             f"skipped ({why})")
        if prev_shape != (dname, d, s, hkv):
            sets = None
            if dev == "cuda":
                torch.cuda.empty_cache()
            sets = H.make_sets(args.sets, b, h, s, d, dtype, dev, h_kv=hkv)
            prev_shape = (dname, d, s, hkv)
        case_rows, ref = [], None
        for impl in impls:
            key = (dname, d, causal, g, impl.name)
            if key in skip:
                continue
            fn = fns[key]
            if impl.name == "sdpa-math" and 4 * b * h * s * s * 4 > MATH_MAX_BYTES:
                notes.append(f"sdpa-math {dname} D={d} S={s}: skipped (S x S matrices need > "
                             f"{MATH_MAX_BYTES >> 30} GiB)")
                continue
            stats = {}
            try:
                with context(impl)():
                    ms = H.measure(fn, sets, timer, args.warmup, args.reps, args.budget,
                                   passes=impl.passes, stats=stats)
                    pr = probe(torch, fn, sets[0], pool, repeat=impl.ours)
            except torch.cuda.OutOfMemoryError:
                if dev == "cuda":
                    torch.cuda.empty_cache()
                notes.append(f"{impl.name} {dname} D={d} S={s}: out of memory")
                continue
            except (RuntimeError, NotImplementedError, TypeError) as e:
                notes.append(f"{impl.name} {dname} D={d} S={s}{' causal' if causal else ''}: "
                             f"failed ({(str(e).strip().splitlines() or [''])[0][:160]})")
                continue
            row = dict(dtype=dname, causal=causal, head_dim=d, seq=s, batch=b, heads=h, heads_kv=hkv,
                       backend=impl.name, design=impl.design,
                       deterministic=int(impl.deterministic) if impl.ours else "",
                       env_bwd=(impl.env or "") if impl.ours else "",
                       via=fa.via if impl.ours else "torch")
            for p in impl.passes:
                row[f"{p}_ms"] = round(ms[p], 4)
                row[f"{p}_ms_min"] = round(stats[p]["min"], 4)
                row[f"{p}_reps"] = stats[p]["n"]
                row[f"{p}_flops_per_s"] = H.flops(b, h, s, d, causal, p) / (ms[p] * 1e-3)
                row[f"{p}_tflops"] = round(row[f"{p}_flops_per_s"] / 1e12, 2)
            sb = scratch_bytes(impl.name, dname, b, h, s, d, hkv, causal)
            row["scratch_formula_mib"] = round(sb / 2**20, 3) if sb is not None else None
            pool_mib = pr["pool_mib"]
            row["lib_pool_high_mib"] = round(pool_mib, 3) if pool_mib is not None else None
            row["fwd_bwd_peak_extra_mib"] = round(pr["peak_mib"], 1)
            if not impl.ours and ref is None:
                ref = (impl.name, pr["result"])
            if impl.ours and ref is not None:
                err = rel_err(pr["result"], ref[1])
                limit = ERR_FLAG["float32-tf32" if impl.precision == "tf32" else dname]
                row.update(max_rel_err=err, err_ref=ref[0],
                           check="ok" if err <= limit else "FLAG")  # NaN compares False: FLAG
            row["bitwise_repeat"] = pr["bitwise"]
            del pr
            case_rows.append(row)
            add_ratios(case_rows)
            line = (f"{dname:9s} D={d:3d} S={s:5d} causal={int(causal)}{gqa} {impl.name:16s} "
                    + "  ".join(f"{p} {row[p + '_flops_per_s'] / 1e12:6.1f} "
                                f"({row[p + '_ms']:.3f} ms)" for p in impl.passes) + " TFLOP/s")
            for peer, pl in RATIO_TO:
                rs = [f"{row[ratio_col(p, peer)]:.2f}" for p in impl.passes
                      if row.get(ratio_col(p, peer))]
                if rs:
                    line += f"  /{pl} {','.join(rs)}"
            if row.get("lib_pool_high_mib"):
                line += f"  scratch {row['lib_pool_high_mib']:.1f} MiB"
            if row.get("check") == "FLAG":
                line += f"  CHECK: error {row['max_rel_err']:.1e} vs {row['err_ref']}"
            print(line, flush=True)
        del ref
        rows += case_rows
        if rows:
            H.write_csv(csv_path, rows)
    del sets
    if not rows:
        print("\n".join(f"- {n}" for n in dict.fromkeys(notes)))
        sys.exit("nothing was measured")

    # gpu.md: every table; gpu-summary.md: the same without the 16-bit per-shape tables (logs).
    md, short = header + "\n", header + "\n"
    f32 = [r for r in rows if r["dtype"] == "float32"]
    if f32:  # a dozen lines: in the summary too
        t = ("\n## float32\n\n" + H.table(f32, ["flashattn", "flashattn-tf32"], list(SDPA_NAMES))
             + "\n")
        md += t
        short += t
    if any(r["dtype"] in LOW for r in rows):
        md += "\n## bfloat16 / float16\n"
        for p in H.PASSES:
            t = lp_table(rows, p)
            if t:
                md += "\n" + t + "\n"
        tail = ("\nTarget: >= 1.0x sdpa-flash, forward and backward, at every shape; the gap to "
                "cuDNN recorded.\n" + lp_summary(rows) + "\n\n" + scratch_table(rows) + "\n")
        md += tail
        short += tail
    checks = checks_summary(rows)
    tail = ("\nChecks:\n" + checks + "\n" if checks else "")
    if notes:
        tail += "\nNotes:\n" + "\n".join(f"- {n}" for n in dict.fromkeys(notes)) + "\n"
    tail += f"\n({len(rows)} rows, {time.monotonic() - t_begin:.0f} s)\n"
    md += tail
    short += tail
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "gpu-summary.md"), "w") as f:
        f.write(short)
    try:
        H.chart([r for r in rows if r["heads_kv"] == r["heads"]], os.path.join(args.out, "gpu.png"),
                f"flashattn vs PyTorch SDPA, {dev_name.split(';')[0]}, TFLOP/s (training mode)")
        png = ", gpu.png"
    except Exception as e:  # noqa: BLE001  (the chart is a convenience; the numbers are written)
        png = f" (no chart: {type(e).__name__}: {e})"
    print(f"\nwrote {args.out}/gpu.csv, gpu.md{png}\n", flush=True)
    print(md, flush=True)
    return 2 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
