#!/usr/bin/env python3
"""Writes wgmma_ops.cuh: one inline-asm wrapper per (N, operand source) of the sm_90a warpgroup
product wgmma.mma_async m64nNk16 with float32 accumulators and float16/bfloat16 inputs, and of
m64nNk8 with tf32 inputs (A from registers). The accumulator operand list is N/2 registers long,
which is why these are generated, not written.
Run from anywhere: python3 src/cuda/sm90/generate_wgmma.py"""
import pathlib

NS = [32, 64, 96, 128, 192, 256]  # the N of every 16-bit product the sm_90 kernels issue
NS_TF32 = [32, 64, 128]  # and of every tf32 one
NS_TF32_SS = [32]  # tf32 with A from shared memory (the 3xTF32 pair kernels' stationary small parts)


def acc_list(n):
    return ", ".join(f"%{i}" for i in range(n // 2))


def acc_operands(n):
    return ", ".join(f'"+f"(d[{j}][{e}])' for j in range(n // 8) for e in range(4))


def ss(n):
    r = n // 2
    body = []
    for h, ty in (("BF16", "bf16"), ("F16", "f16")):
        body.append(
            f"  if constexpr (H == Half16::{h}) {{\n"
            f"    asm volatile(\n"
            f'        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
            f'        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{acc_list(n)}}}, %{r}, %{r + 1}, p, 1, 1, %{r + 3}, %{r + 4};\\n}}\\n"\n'
            f"        : {acc_operands(n)}\n"
            f'        : "l"(a), "l"(b), "r"(scale_d), "n"(TA), "n"(TB));\n'
            f"  }}\n")
    return (f"template <Half16 H, int TA, int TB>\n"
            f"__device__ __forceinline__ void wgmma_ss(float (&d)[{n // 8}][4], uint64_t a, uint64_t b, int scale_d) {{\n"
            + "".join(body) + "}\n")


def rs(n):
    r = n // 2
    body = []
    for h, ty in (("BF16", "bf16"), ("F16", "f16")):
        body.append(
            f"  if constexpr (H == Half16::{h}) {{\n"
            f"    asm volatile(\n"
            f'        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"\n'
            f'        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{acc_list(n)}}}, {{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1, %{r + 6};\\n}}\\n"\n'
            f"        : {acc_operands(n)}\n"
            f'        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB));\n'
            f"  }}\n")
    return (f"template <Half16 H, int TB>\n"
            f"__device__ __forceinline__ void wgmma_rs(float (&d)[{n // 8}][4], const uint32_t (&a)[4], uint64_t b, int scale_d) {{\n"
            + "".join(body) + "}\n")


def rs_tf32(n):
    r = n // 2
    return (f"__device__ __forceinline__ void wgmma_rs_tf32(float (&d)[{n // 8}][4], const uint32_t (&a)[4], uint64_t b, int scale_d) {{\n"
            f"  asm volatile(\n"
            f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{acc_list(n)}}}, {{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1;\\n}}\\n"\n'
            f"      : {acc_operands(n)}\n"
            f'      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));\n'
            f"}}\n")


def rs_tf32_init(n):
    # scale-d = 0 with write-only accumulators: the old contents are not inputs, so the compiler
    # need not keep them live up to the product.
    r = n // 2
    return (f"__device__ __forceinline__ void wgmma_rs_tf32_init(float (&d)[{n // 8}][4], const uint32_t (&a)[4], uint64_t b) {{\n"
            f"  asm volatile(\n"
            f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 5}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{acc_list(n)}}}, {{%{r}, %{r + 1}, %{r + 2}, %{r + 3}}}, %{r + 4}, p, 1, 1;\\n}}\\n"\n'
            f"      : {acc_operands(n).replace('+f', '=f')}\n"
            f'      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(0));\n'
            f"}}\n")


def ss_tf32(n):
    # Both operands by descriptors, K-major (tf32 has no transposed shared-memory operands).
    r = n // 2
    return (f"__device__ __forceinline__ void wgmma_ss_tf32(float (&d)[{n // 8}][4], uint64_t a, uint64_t b, int scale_d) {{\n"
            f"  asm volatile(\n"
            f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{acc_list(n)}}}, %{r}, %{r + 1}, p, 1, 1;\\n}}\\n"\n'
            f"      : {acc_operands(n)}\n"
            f'      : "l"(a), "l"(b), "r"(scale_d));\n'
            f"}}\n")


def ss_tf32_init(n):
    r = n // 2
    return (f"__device__ __forceinline__ void wgmma_ss_tf32_init(float (&d)[{n // 8}][4], uint64_t a, uint64_t b) {{\n"
            f"  asm volatile(\n"
            f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"\n'
            f'      "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 {{{acc_list(n)}}}, %{r}, %{r + 1}, p, 1, 1;\\n}}\\n"\n'
            f"      : {acc_operands(n).replace('+f', '=f')}\n"
            f'      : "l"(a), "l"(b), "r"(0));\n'
            f"}}\n")


out = ["// Generated by src/cuda/sm90/generate_wgmma.py; do not edit.",
       "// D[64 x N] (+)= A[64 x 16] * B[16 x N], float32 accumulators d[N/8][4] in the m16n8 layout",
       "// of each warp's 16 rows (device.cuh). wgmma_ss: A and B by shared-memory descriptors",
       "// (TA/TB = 1: stored M-/N-major, i.e. transposed); wgmma_rs: A as four registers in the",
       "// mma.sync m16k16 fragment layout. scale_d = 0 ignores the old contents of d.",
       "// wgmma_rs_tf32: D[64 x N] (+)= A[64 x 8] * B[8 x N], A as four registers (tf32 bit patterns)",
       "// in the mma.sync m16n8k8 tf32 layout (rows g, g+8; columns t, t+4), B K-major;",
       "// wgmma_rs_tf32_init: the same with scale_d = 0 and write-only d; wgmma_ss_tf32(_init): A by",
       "// a K-major shared-memory descriptor too.",
       "#pragma once", "", "#include <cstdint>", "", '#include "cuda/common/config.hpp"', "",
       "namespace flashattn::cuda::dev {", ""]
for n in NS:
    out += [ss(n), rs(n)]
for n in NS_TF32:
    out += [rs_tf32(n), rs_tf32_init(n)]
for n in NS_TF32_SS:
    out += [ss_tf32(n), ss_tf32_init(n)]
out += ["}  // namespace flashattn::cuda::dev", ""]
path = pathlib.Path(__file__).resolve().parent / "wgmma_ops.cuh"
path.write_text("\n".join(out))
print(path.name)
