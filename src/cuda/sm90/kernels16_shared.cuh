// What the Hopper (sm_90a) float16/bfloat16 kernels share - the forward (fwd16.cuh) and the
// single-pass dK/dV kernel (dkv16.cuh): their tiles are copied by the tensor copy engine (TMA) into
// 128-byte-swizzled shared memory and multiplied there by warpgroup tensor-core products (wgmma),
// with a producer warpgroup and two consumer warpgroups synchronised by mbarriers. Here: the
// forward's arguments, the per-CTA tensor maps of packed batches, and the per-entry score step
// (softcap, ALiBi). docs/ALGORITHM.md ("CUDA sm_90a (Hopper) kernels") has the pseudocode and the
// work model. Masks, statistics and epilogues are the mma.sync kernels' pieces.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/sm80/kernels16.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/seq_maps.hpp"
#include "cuda/sm90/wgmma.cuh"

namespace flashattn::cuda::dev {

// Kernel arguments: the common ones plus tensor maps of Q, K and V ([B, H, S, D] boxes of 64
// columns x block rows, 128-byte swizzle), built by the launcher.
struct Sm90FwdArgs {
  FwdArgs f;
  CUtensorMap tq, tk, tv;
  // A packed batch: per sequence b, maps Q, K, V at seq_maps[3 b ..] instead (sm90/seq_maps.hpp);
  // nullptr for a dense call.
  const CUtensorMap* seq_maps;
  // A packed batch on the compact grid: CTA (x, h) works on row block blocks[x].y (in launch
  // order, QueryBlock) of sequence blocks[x].x (blocks[x].x < 0: no work); nullptr: the dense
  // grid (x, h, sequence).
  const int2* blocks;
  // A CTA walking several row blocks of that grid (FwdWalk, ForwardPlan::walk_ctas); nx = 0:
  // one CTA per block.
  FwdWalk walk;
};

// The maps a CTA of sequence b copies its N streamed operands through and the batch coordinate
// they take: the kernel argument's maps (dense[i]) and b, or sequence b's own maps and 0 (packed:
// acquired from the pre-pass first, by the one thread that issues the copies).
template <int N>
struct CtaMaps {
  const void* m[N];
  int batch;
  __device__ __forceinline__ CtaMaps(const CUtensorMap* const (&dense)[N], const CUtensorMap* seq_maps, int64_t b) {
    const CUtensorMap* own = seq_maps != nullptr ? seq_maps + N * b : nullptr;
    if (own != nullptr) acquire_seq_maps(own, N);
#pragma unroll
    for (int i = 0; i < N; ++i) m[i] = own != nullptr ? static_cast<const void*>(own + i) : dense[i];
    batch = own != nullptr ? 0 : static_cast<int>(b);
  }
};

// ---- the per-entry score step (XF: softcap, ALiBi) ---------------------------------------------
// ScoreTransform::Head::logit2_at (core/score.hpp) on a warp's 16-row slice of a wgmma
// accumulator (mma.sync's m16n8 layout, for_each_entry), in place, part by part with one uniform
// branch per part and tile: the generic per-entry form (transform_scores) compiles here to two
// branches and ~10 64-bit integer instructions, an I2F.S64 among them, per entry:
//   softcap ? cap2 * tanh(cap_in s) : sl2 s;   then with ALiBi  -= slope2 |j - i - diag|.
// The same arithmetic as logit2_at; only the distance is formed differently: the lane's base for
// its row (an int64 converted once per tile) plus or minus the entry's compile-time column offset,
// added in float32. That is exact while |j - i - diag| < 2^24, and within an ulp of logit2_at's
// conversion beyond. `grad(j, e, c, F)` receives each entry's softcap factor F = 1 - tanh^2.
template <int NS, class G>
__device__ __forceinline__ void logits_of_scores(float (&s)[NS][4], const ScoreTransform::Head& hd, G&& grad) {
  if (hd.cap_in != 0.0f) {
    for_each_entry<NS>([&](int j, int e, int, int c) {
      const float th = softcap_tanh<true>(s[j][e] * hd.cap_in);
      s[j][e] = hd.cap2 * th;
      grad(j, e, c, fmaf(-th, th, 1.0f));
    });
  } else {
    for_each_entry<NS>([&](int j, int e, int, int c) {
      s[j][e] = s[j][e] * hd.sl2;
      grad(j, e, c, 1.0f);
    });
  }
}
// The ALiBi part: entry (g + 8r, 8jj + 2t + c) of the slice is query row0 + g + 8r and key
// col0 + 8jj + 2t + c, or with TRANSPOSED (S^T: the dK/dV kernel) key row0 + ... and query
// col0 + ....
template <bool TRANSPOSED, int NS>
__device__ __forceinline__ void alibi_scores(float (&s)[NS][4], const ScoreTransform::Head& hd, int64_t row0,
                                             int64_t col0) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
  // j - i - diag at the lane's first entry of row r = 0 (c = 0, jj = 0); row r adds -8r (+8r
  // transposed), column offset k = 8jj + c adds +k (-k transposed).
  const int64_t base = TRANSPOSED ? row0 + g - col0 - 2 * t - hd.diag : col0 + 2 * t - row0 - g - hd.diag;
  const float fb[2] = {static_cast<float>(base), static_cast<float>(TRANSPOSED ? base + 8 : base - 8)};
#pragma unroll
  for (int jj = 0; jj < NS; ++jj)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float k = static_cast<float>(8 * jj + (e & 1));
      const float d = TRANSPOSED ? fb[e >> 1] - k : fb[e >> 1] + k;
      s[jj][e] -= hd.slope2 * fabsf(d);
    }
}
// Both parts: raw products -> log2-unit logits.
template <bool TRANSPOSED, int NS, class G>
__device__ __forceinline__ void logits_at(float (&s)[NS][4], const ScoreTransform::Head& hd, int64_t row0,
                                          int64_t col0, G&& grad) {
  logits_of_scores(s, hd, grad);
  if (hd.slope2 != 0.0f) alibi_scores<TRANSPOSED>(s, hd, row0, col0);
}

}  // namespace flashattn::cuda::dev
