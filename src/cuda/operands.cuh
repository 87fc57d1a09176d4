// The Hopper float32 kernels' operand copies: one 64-row block of X [B, H, S, D] as tf32 copies.
// Shared by the stand-alone pre-pass (preprocess.cu, tf32_operand_kernel: K and V, and the 3xTF32
// forward's) and the sm_90a dQ kernels, whose otherwise idle producer warps write the Q and dO
// copies that only the dK/dV pass after them reads (kernels_sm90_tf32_bwd.cuh): that part of the
// memory-bound pre-pass then runs under the dQ pass's tensor work instead of before it.
#pragma once

#include <cstdint>

#include "core/params.hpp"
#include "cuda/device.cuh"

namespace flashattn::cuda::dev {

// The copies of rows [n0, n0 + 64) of X's (b, h) slice (bh = b * H + h): xr = X rounded to tf32,
// contiguous [B, H, S, DP] with columns D..DP zero, and when xt is set the same values transposed,
// contiguous [B, H, DP, S8] (S8 = S rounded up to 8) with position n of each group of 8 in column
// tf32_slot(n) and the columns past S zero (a NaN there would survive its zero probability).
// kSplit (the fp32-accurate kernels): xs and xts take the small parts X - tf32(X), rounded to
// tf32, in the same layouts. Each output is optional (nullptr: not written). The rows are staged
// in `tile` as read, so that every output is written in whole coalesced rows. kVec (D = DP and
// X's rows 16-byte aligned, the usual case): 16-byte loads and stores, UNROLL rows in flight per
// thread. T threads take part (tid in [0, T)); sync() is a barrier over exactly them: called after
// the staging and after the transposed writes, so the tile may be filled again right away.
template <int DP, bool kVec, bool kSplit, int T, int UNROLL, class Sync>
__device__ __forceinline__ void tf32_operand_rows(const In4& x, int64_t b, int64_t h, int64_t bh, int64_t n0,
                                                  int64_t seq, int head_dim, int64_t seq8, float* xr, float* xt,
                                                  float* xs, float* xts, float (*tile)[DP + 1], int tid, Sync sync) {
  const float* src = static_cast<const float*>(x.ptr) + b * x.sb + h * x.sh;
  float* dst = xr != nullptr ? xr + bh * seq * DP : nullptr;
  float* dsts = kSplit && xs != nullptr ? xs + bh * seq * DP : nullptr;
  // v's tf32 value and (kSplit) the tf32 value of the rest.
  auto big = [](float v) { return __uint_as_float(to_tf32(v)); };
  auto small = [](float v) { return __uint_as_float(to_tf32(v - __uint_as_float(to_tf32(v)))); };
  if constexpr (kVec) {
    constexpr int kChunks = DP / 4;  // 16-byte chunks per row
#pragma unroll UNROLL
    for (int i = tid; i < 64 * kChunks; i += T) {
      const int r = i / kChunks, c = (i % kChunks) * 4;
      const int64_t n = n0 + r;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (n < seq) {
        v = *reinterpret_cast<const float4*>(src + n * x.ss + c);
        if (dst != nullptr)
          *reinterpret_cast<float4*>(dst + n * DP + c) = make_float4(big(v.x), big(v.y), big(v.z), big(v.w));
        if (kSplit && dsts != nullptr)
          *reinterpret_cast<float4*>(dsts + n * DP + c) = make_float4(small(v.x), small(v.y), small(v.z), small(v.w));
      }
      tile[r][c] = v.x;
      tile[r][c + 1] = v.y;
      tile[r][c + 2] = v.z;
      tile[r][c + 3] = v.w;
    }
  } else {
    for (int i = tid; i < 64 * DP; i += T) {
      const int r = i / DP, c = i % DP;
      const int64_t n = n0 + r;
      const float v = n < seq && c < head_dim ? src[n * x.ss + c] : 0.0f;
      tile[r][c] = v;
      if (n < seq) {
        if (dst != nullptr) dst[n * DP + c] = big(v);
        if (kSplit && dsts != nullptr) dsts[n * DP + c] = small(v);
      }
    }
  }
  if (xt == nullptr) return;
  sync();
  float* dt = xt + bh * DP * seq8;
  float* dts = kSplit && xts != nullptr ? xts + bh * DP * seq8 : nullptr;
#pragma unroll UNROLL
  for (int i = tid; i < 64 * DP; i += T) {
    const int d = i / 64, r = i % 64;
    const int64_t col = n0 + tf32_slot(r);
    if (col < seq8) {
      const float v = tile[r][d];
      dt[d * seq8 + col] = big(v);
      if (kSplit && dts != nullptr) dts[d * seq8 + col] = small(v);
    }
  }
  sync();
}

}  // namespace flashattn::cuda::dev
