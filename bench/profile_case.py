#!/usr/bin/env python3
"""One flashattn call on CUDA for a profiler to capture (scripts/gpu-profile runs it under ncu).

Builds the issue benchmarks' shape (B = 16384 / S, H = 2048 / D, Sq = Skv = S), runs the pass
once to warm up, then once more between torch.cuda.profiler start/stop marks (ncu's
--profile-from-start off captures only that call's kernels). The C ABI is called through ctypes
on torch tensors' device pointers, as bench/gpu.py's ctypes path does.

usage: profile_case.py --lib build-gpu/src/libflashattn.so [--dtype bfloat16|float16|float32]
                       [--head-dim 128] [--seq 4096] [--causal] [--pass fwd|bwd]
                       [--precision fp32|tf32] [--deterministic]
"""
import argparse
import ctypes
import sys

import torch


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("device", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("shape", ctypes.c_int64 * 4), ("stride", ctypes.c_int64 * 4)]


class Options(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("softmax_scale", ctypes.c_float),
                ("mask", ctypes.c_int32), ("stream", ctypes.c_void_p),
                ("num_threads", ctypes.c_int32), ("precision", ctypes.c_int32),
                ("deterministic", ctypes.c_int32)]


DTYPES = {"float32": (torch.float32, 0), "float16": (torch.float16, 1), "bfloat16": (torch.bfloat16, 2)}


def view(t, code):
    v = Tensor()
    v.data, v.dtype, v.device, v.ndim = t.data_ptr(), code, t.device.index or 0, t.dim()
    for i in range(t.dim()):
        v.shape[i], v.stride[i] = t.shape[i], t.stride(i)
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--pass", dest="which", default="fwd", choices=("fwd", "bwd"))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32"))
    ap.add_argument("--deterministic", action="store_true")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.lib)
    lib.flashattn_last_error.restype = ctypes.c_char_p
    p = ctypes.POINTER(Tensor)
    lib.flashattn_forward.argtypes = [p] * 5 + [ctypes.POINTER(Options)]
    lib.flashattn_backward.argtypes = [p] * 9 + [ctypes.POINTER(Options)]
    dt, code = DTYPES[a.dtype]
    s, d = a.seq, a.head_dim
    b, h = max(1, 16384 // s), max(1, 2048 // d)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(4))
    out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    o = Options()
    o.struct_size = ctypes.sizeof(Options)
    o.mask = 1 if a.causal else 0
    o.stream = torch.cuda.current_stream().cuda_stream
    o.precision = 1 if a.precision == "tf32" else 0
    o.deterministic = int(a.deterministic)

    def check(rc):
        if rc != 0:
            sys.exit(f"flashattn: {lib.flashattn_last_error().decode()}")

    def fwd():
        check(lib.flashattn_forward(*(ctypes.byref(view(t, code)) for t in (q, k, v, out)),
                                    ctypes.byref(view(lse, 0)), ctypes.byref(o)))

    def bwd():
        ts = [view(t, code) for t in (q, k, v, out, do)] + [view(lse, 0)] + [view(t, code) for t in (dq, dk, dv)]
        check(lib.flashattn_backward(*(ctypes.byref(x) for x in ts), ctypes.byref(o)))

    fwd()
    run = fwd if a.which == "fwd" else bwd
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled: {a.which} {a.dtype} B={b} H={h} S={s} D={d} causal={a.causal} precision={a.precision}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
