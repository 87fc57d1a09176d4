// The Hopper (sm_90a) float16/bfloat16 forward: tiles copied by the tensor copy engine (TMA) into
// 128-byte-swizzled shared memory, warpgroup tensor-core products (wgmma) reading them there (no
// fragment loads through the register file), a producer warpgroup and two consumer warpgroups
// synchronised by mbarriers only, and an in-warpgroup software pipeline that overlaps the softmax
// of key tile j+1 with the product O += P_j V_j. docs/ALGORITHM.md ("CUDA sm_90 forward") has the pseudocode and
// the work model. Masks, statistics and the epilogue are the mma.sync kernels' pieces.
#pragma once

#include <cuda.h>
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

// Kernel arguments: the common ones plus tensor maps of Q, K and V ([B, H, S, D] boxes of 64
// columns x block rows, 128-byte swizzle), built by the launcher.
struct Sm90FwdArgs {
  FwdArgs f;
  CUtensorMap tq, tk, tv;
};

// ================================================================================================
// Forward. CTA = block_m query rows of one (batch, head): warpgroups 0..NWG-1 compute, 64 query
// rows each; warpgroup NWG produces (one thread issues every tile copy on the copy engine, TMA).
// K and V stream through two stages each, each stage with a "full" barrier (the copy's bytes
// landed) and an "empty" barrier (every consumer warp is done with it). Per consumer warpgroup,
// iteration j of the main loop:
//   wait K_{j+1}, V_j full; issue S_{j+1} = Q K_{j+1}^T and O += P_j V_j (asynchronous, in order)
//   wait for S_{j+1}: release K_{j+1}; mask, softmax statistics, P_{j+1} = exp2(S - m) while
//   P_j V_j runs on the tensor cores
//   wait for P_j V_j: release V_j; O *= alpha_{j+1}; P_{j+1} to A fragments
// No CTA-wide barrier inside the loop: the two warpgroups drift apart, and one's softmax runs
// beside the other's products.
// ================================================================================================
constexpr int kSm90ConsumerRegs = 240;  // per thread, after setmaxnreg (2 x 128 x 240 + 128 x 24 <= 64K)
constexpr int kSm90ProducerRegs = 24;

template <int DP, Half16 H>
__global__ void __launch_bounds__(tile_config90(Pass::Forward, DP).threads(), 1)
    forward_sm90_kernel(const __grid_constant__ Sm90FwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90(Pass::Forward, DP);
  constexpr int BM = C.block_m, BN = C.block_n, NWG = C.warpgroups, TC = 128 * NWG;
  constexpr int NS = BN / 8, NO = DP / 8;
  using TQ = TileSw128<BM, DP>;
  using TK = TileSw128<BN, DP>;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sK = sQ + TQ::kBytes;      // [2][BN x DP]
  unsigned char* sV = sK + 2 * TK::kBytes;  // [2][BN x DP]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * TK::kBytes);
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;   // [2]
  uint64_t* full_v = bars + 3;   // [2]
  uint64_t* empty_k = bars + 5;  // [2]
  uint64_t* empty_v = bars + 7;  // [2]

  const FwdArgs& a = A.f;
  const ForwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num.mask);
  const int64_t b = qb.b, h = qb.h, m0 = qb.m0;
  const int ntiles = qb.ntiles;
  const MaskRule& rule = qb.rule;

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_k + i, 1);
      mbar_init(full_v + i, 1);
      mbar_init(empty_k + i, 4 * NWG);  // lane 0 of every consumer warp
      mbar_init(empty_v + i, 4 * NWG);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == NWG) {
    // ---- producer ---------------------------------------------------------------------------
    regs_decrease<kSm90ProducerRegs>();
    if (threadIdx.x == TC) {
      const int bb = static_cast<int>(b), hh = static_cast<int>(h), hk = static_cast<int>(qb.hk);
      mbar_expect_tx(full_q, TQ::kBytes);
#pragma unroll
      for (int blk = 0; blk < DP / 64; ++blk)
        tma_load_4d(sQ + blk * TQ::kBlockBytes, &A.tq, full_q, 64 * blk, static_cast<int>(m0), hh, bb);
      // Tile t goes into stage t & 1 once the consumers released tile t - 2 from it.
      auto load = [&](const CUtensorMap* map, unsigned char* base, uint64_t* full, uint64_t* empty, int t) {
        const int st = t & 1;
        mbar_wait(empty + st, ((t >> 1) & 1) ^ 1);
        mbar_expect_tx(full + st, TK::kBytes);
#pragma unroll
        for (int blk = 0; blk < DP / 64; ++blk)
          tma_load_4d(base + st * TK::kBytes + blk * TK::kBlockBytes, map, full + st, 64 * blk, t * BN, hk, bb);
      };
      // In the order the consumers need them: K_0, then K_{t+1} before V_t.
      if (ntiles > 0) load(&A.tk, sK, full_k, empty_k, 0);
      for (int t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) load(&A.tk, sK, full_k, empty_k, t + 1);
        load(&A.tv, sV, full_v, empty_v, t);
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------------
  regs_increase<kSm90ConsumerRegs>();
  const int warp = threadIdx.x / 32;
  const int wg_row = wg * 64;              // the warpgroup's first row in the CTA tile
  const int64_t row_w = m0 + 16 * warp;    // the warp's first query row
  const uint32_t q_addr = smem_addr(sQ), k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  const bool lane0 = lane_id() == 0;
  float o[1][NO][4];
  zero(o[0]);
  SoftmaxState st;
  float s[1][NS][4];
  uint32_t pa[1][BN / 16][4];

  // Scores of tile `tile` (in s) -> P in s, statistics updated, alpha for O.
  auto softmax_tile = [&](int tile, float(&alpha)[2]) {
    scale_scores(s[0], a.sl2);
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    if (qb.tile_masked(n0, BN, Skv))
      for_each_entry<NS>([&](int j, int e, int r, int c) {
        if (!keep(rule, row_w + r, n0 + c, Sq, Skv)) s[0][j][e] = -INFINITY;
      });
    softmax_rows<NS, true>(st, s[0], alpha);
  };
  auto wait_k = [&](int t) { mbar_wait(full_k + (t & 1), (t >> 1) & 1); };
  auto wait_v = [&](int t) { mbar_wait(full_v + (t & 1), (t >> 1) & 1); };
  auto release = [&](uint64_t* empty, int t) {
    if (lane0) mbar_arrive(empty + (t & 1));
  };

  mbar_wait(full_q, 0);
  if (ntiles > 0) {
    wait_k(0);
    fence_regs(s[0]);
    wgmma_fence();
    wg_gemm_nt<H, DP, TQ, TK>(s[0], q_addr, wg_row, k_addr, 0, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s[0]);
    release(empty_k, 0);
    float alpha[2];
    softmax_tile(0, alpha);
    to_afrag<H, 1, BN / 16>(pa, s);
  }
  // All but the last key tile: the next tile's scores overlap this tile's P V. (The last tile is
  // peeled off so that every wgmma in this loop is issued unconditionally: the compiler then sees
  // which group each wait retires and keeps the two products asynchronous.)
  for (int it = 0; it + 1 < ntiles; ++it) {
    wait_k(it + 1);
    wait_v(it);
    fence_regs(o[0]);
    fence_regs(s[0]);
    wgmma_fence();
    wg_gemm_nt<H, DP, TQ, TK>(s[0], q_addr, wg_row, k_addr + ((it + 1) & 1) * TK::kBytes, 0, false);
    wgmma_commit();
    wg_gemm_rn<H, BN / 16, TK>(o[0], pa[0], v_addr + (it & 1) * TK::kBytes, 0, 0);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(s[0]);
    release(empty_k, it + 1);
    float alpha[2];
    softmax_tile(it + 1, alpha);
    wgmma_wait<0>();
    fence_regs(o[0]);
    release(empty_v, it);
    rescale_rows(o[0], alpha);
    to_afrag<H, 1, BN / 16>(pa, s);
  }
  if (ntiles > 0) {
    const int it = ntiles - 1;
    wait_v(it);
    fence_regs(o[0]);
    wgmma_fence();
    wg_gemm_rn<H, BN / 16, TK>(o[0], pa[0], v_addr + (it & 1) * TK::kBytes, 0, 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o[0]);
    release(empty_v, it);
  }

  // Epilogue: O /= l, LSE = (m + log2 l) ln 2 (a row without visible keys: O = 0, LSE = -inf),
  // staged through the Q tile's shared memory (plain swizzled Tile layout) for 16-byte stores
  // once both warpgroups are done reading Q.
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
  named_barrier(1, TC);
  stage_acc<H, BM, DP, 1, NO>(sQ, o, 16 * warp, 0, 1.0f);
  named_barrier(1, TC);
  store_tile16<BM, DP, TC>(out16(p.out, b, h, m0), p.out.ss, sQ, qb.rows, static_cast<int>(p.shape.head_dim),
                           true);
#endif
}

}  // namespace flashattn::cuda::dev
