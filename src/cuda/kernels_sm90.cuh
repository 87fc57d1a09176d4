// The Hopper (sm_90a) float16/bfloat16 forward: warpgroup tensor-core products (wgmma) reading
// Q, K and V straight from 128-byte-swizzled shared memory, so no fragment loads go through the
// register file, and an in-warpgroup software pipeline that overlaps the softmax of key tile j+1
// with the product O += P_j V_j. docs/ALGORITHM.md ("CUDA sm_90 forward") has the pseudocode and
// the work model. Masks, statistics and the epilogue are the mma.sync kernels' pieces.
#pragma once

#include <cuda_runtime.h>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/config.hpp"
#include "cuda/device.cuh"
#include "cuda/kernels16.cuh"
#include "cuda/launch.hpp"
#include "cuda/wgmma.cuh"

namespace flashattn::cuda::dev {

// Shared memory of a CTA aligned up to 1024 bytes (the swizzle atoms' alignment).
__device__ __forceinline__ unsigned char* smem_aligned1024(unsigned char* p) {
  const uint32_t a = smem_addr(p);
  return p + ((1024 - (a & 1023)) & 1023);
}

// ================================================================================================
// Forward. CTA = block_m query rows of one (batch, head), one warpgroup per 64 of them. K and V
// stream through two stages each. Iteration j of the main loop, per warpgroup:
//   issue S_{j+1} = Q K_{j+1}^T and O += P_j V_j (asynchronous, in that order)
//   wait for S_{j+1}; mask, softmax statistics, P_{j+1} = exp2(S - m) (while P_j V_j runs)
//   wait for P_j V_j; O *= alpha_{j+1}; P_{j+1} to A fragments
//   barrier; prefetch V_{j+2} and K_{j+3} into the buffers just released
// ================================================================================================
template <int DP, Half16 H>
__global__ void __launch_bounds__(tile_config90(Pass::Forward, DP).threads(), 1)
    forward_sm90_kernel(const __grid_constant__ FwdArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90(Pass::Forward, DP);
  constexpr int BM = C.block_m, BN = C.block_n, T = C.threads();
  constexpr int NS = BN / 8, NO = DP / 8;
  using TQ = TileSw128<BM, DP>;
  using TK = TileSw128<BN, DP>;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sK = sQ + TQ::kBytes;      // [2][BN x DP]
  unsigned char* sV = sK + 2 * TK::kBytes;  // [2][BN x DP]

  const ForwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num.mask);
  const int64_t b = qb.b, h = qb.h, hk = qb.hk, m0 = qb.m0;
  const int ntiles = qb.ntiles;
  const MaskRule& rule = qb.rule;

  auto tile_rows = [&](int tile) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    return static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
  };
  auto load_k = [&](int tile) {
    if (tile < ntiles)
      load_tile16_as<TK, T>(sK + (tile & 1) * TK::kBytes, in16(p.k, b, hk, static_cast<int64_t>(tile) * BN),
                            p.k.ss, tile_rows(tile), D, a.vec16);
  };
  auto load_v = [&](int tile) {
    if (tile < ntiles)
      load_tile16_as<TK, T>(sV + (tile & 1) * TK::kBytes, in16(p.v, b, hk, static_cast<int64_t>(tile) * BN),
                            p.v.ss, tile_rows(tile), D, a.vec16);
  };
  // Copy groups, in order: {Q, K0}, {V0, K1}, then after S_0 {V1, K2}, then one per iteration.
  // The top of iteration j needs {V_j, K_{j+1}} and leaves the newest group in flight.
  load_tile16_as<TQ, T>(sQ, in16(p.q, b, h, m0), p.q.ss, qb.rows, D, a.vec16);
  load_k(0);
  cp_async_commit();
  load_v(0);
  load_k(1);
  cp_async_commit();

  const int warp = threadIdx.x / 32;
  const int wg_row = (threadIdx.x / 128) * 64;  // the warpgroup's first row in the CTA tile
  const int64_t row_w = m0 + 16 * warp;         // the warp's first query row
  const uint32_t q_addr = smem_addr(sQ), k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  float o[1][NO][4];
  zero(o[0]);
  SoftmaxState st;
  float s[1][NS][4];
  uint32_t pa[1][BN / 16][4];

  // Scores of tile `tile` (already in s) -> P in s, statistics updated, alpha for O.
  auto softmax_tile = [&](int tile, float(&alpha)[2]) {
    scale_scores(s[0], a.sl2);
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    if (qb.tile_masked(n0, BN, Skv))
      for_each_entry<NS>([&](int j, int e, int r, int c) {
        if (!keep(rule, row_w + r, n0 + c, Sq, Skv)) s[0][j][e] = -INFINITY;
      });
    softmax_rows<NS, true>(st, s[0], alpha);
  };

  if (ntiles > 0) {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
    fence_regs(s[0]);
    wgmma_fence();
    wg_gemm_nt<H, DP, TQ, TK>(s[0], q_addr, wg_row, k_addr, 0, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s[0]);
    float alpha[2];
    softmax_tile(0, alpha);
    to_afrag<H, 1, BN / 16>(pa, s);
    __syncthreads();  // every warpgroup is done with K_0: its stage takes K_2
  }
  load_v(1);
  load_k(2);
  cp_async_commit();

  // Top of iteration j: {V_j, K_{j+1}} have landed and are visible to the tensor cores.
  auto acquire = [&] {
    cp_async_wait<1>();
    fence_proxy_async();
    __syncthreads();
  };
  // Bottom: every warpgroup is done with V_j and K_{j+1}; their buffers take V_{j+2}, K_{j+3}.
  auto release = [&](int it) {
    __syncthreads();
    load_v(it + 2);
    load_k(it + 3);
    cp_async_commit();
  };
  // All but the last key tile: the next tile's scores overlap this tile's P V. (The last tile is
  // peeled off so that every wgmma in this loop is issued unconditionally: the compiler then sees
  // which group each wait retires and keeps the two products asynchronous.)
  for (int it = 0; it + 1 < ntiles; ++it) {
    acquire();
    fence_regs(o[0]);
    fence_regs(s[0]);
    wgmma_fence();
    wg_gemm_nt<H, DP, TQ, TK>(s[0], q_addr, wg_row, k_addr + ((it + 1) & 1) * TK::kBytes, 0, false);
    wgmma_commit();
    wg_gemm_rn<H, BN / 16, TK>(o[0], pa[0], v_addr + (it & 1) * TK::kBytes, 0, 0);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(s[0]);
    float alpha[2];
    softmax_tile(it + 1, alpha);
    wgmma_wait<0>();
    fence_regs(o[0]);
    rescale_rows(o[0], alpha);
    to_afrag<H, 1, BN / 16>(pa, s);
    release(it);
  }
  if (ntiles > 0) {
    acquire();
    fence_regs(o[0]);
    wgmma_fence();
    wg_gemm_rn<H, BN / 16, TK>(o[0], pa[0], v_addr + ((ntiles - 1) & 1) * TK::kBytes, 0, 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o[0]);
  }
  pipeline_drain();

  // Epilogue: O /= l, LSE = (m + log2 l) ln 2 (a row without visible keys: O = 0, LSE = -inf),
  // staged through the Q tile's shared memory (plain swizzled Tile layout) for 16-byte stores.
  const int lane = lane_id();
  float inv[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(st.l[r]);
    inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    lse[r] = l > 0.0f ? (st.m[r] + log2f(l)) * kLn2 : -INFINITY;
  }
  rescale_rows(o[0], inv);
  if ((lane & 3) == 0) {
    float* l = p.lse.ptr + b * p.lse.sb + h * p.lse.sh;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row_w + (lane >> 2) + 8 * r;
      if (row < Sq) l[row * p.lse.ss] = lse[r];
    }
  }
  stage_acc<H, BM, DP, 1, NO>(sQ, o, 16 * warp, 0, 1.0f);
  __syncthreads();
  store_tile16<BM, DP, T>(out16(p.out, b, h, m0), p.out.ss, sQ, qb.rows, D, a.vec16);
#endif
}

}  // namespace flashattn::cuda::dev
