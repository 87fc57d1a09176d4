// The Hopper (sm_90a) float16/bfloat16 forward kernel (forward_sm90_kernel): the pieces it shares
// with the dK/dV kernel are in kernels16_shared.cuh; docs/ALGORITHM.md ("Forward
// (`forward_sm90_kernel`...)") has the pseudocode and the work model.
#pragma once

#include "cuda/sm90/kernels16_shared.cuh"

namespace flashattn::cuda::dev {
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
// With a walk (Sm90FwdArgs::walk, FwdWalk) a CTA does several row blocks in turn. The stages and
// their phases run on over the CTA's tiles of all its blocks, Q has an "empty" barrier of its own,
// released after the block's last S = Q K^T (O staged in its own tile, fwd90_own_o) or after the
// epilogue read O back from Q's tile (D = 256), so the producer copies the next block's Q and
// first K and V tiles while this block's last products and epilogue run (at D = 256 its K_0 only:
// Q, then V_0 and K_1, wait for the epilogue). The CTA's counts g0 (tiles) and kq (blocks) are int;
// the launcher keeps the grid where a CTA's walk could pass 2^31 tiles.
// ================================================================================================

template <int DP, Half16 H, bool XF>
__global__ void __launch_bounds__(tile_config90(Pass::Forward, DP).threads(), tile_config90(Pass::Forward, DP).min_ctas)
    forward_sm90_kernel(const __grid_constant__ Sm90FwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90(Pass::Forward, DP);
  constexpr int BM = C.block_m, BN = C.block_n, NWG = C.warpgroups, TC = 128 * NWG;
  constexpr int NS = BN / 8, NO = DP / 8;
  constexpr bool kOwnO = fwd90_own_o(DP);
  using TQ = TileSw128<BM, DP>;
  using TK = TileSw128<BN, DP>;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sK = sQ + TQ::kBytes;      // [2][BN x DP]
  unsigned char* sV = sK + 2 * TK::kBytes;  // [2][BN x DP]
  unsigned char* sO = kOwnO ? sV + 2 * TK::kBytes : sQ;  // O's staging tile (BM x DP)
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * TK::kBytes + (kOwnO ? TQ::kBytes : 0));
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;   // [2]
  uint64_t* full_v = bars + 3;   // [2]
  uint64_t* empty_k = bars + 5;  // [2]
  uint64_t* empty_v = bars + 7;  // [2]
  uint64_t* empty_q = bars + 9;

  // The CTA's blocks: blockIdx alone, or both blocks of units blockIdx.x, + gridDim.x, ... of the
  // walk (FwdWalk).
  const FwdWalk& walk = A.walk;
  const bool walking = walk.nx > 0;
  const int64_t nunits = walking ? walk.units() : 1;
  const int halves = walking ? 2 : 1;
  // Block `half` of unit u as grid coordinates, then a packed batch's sequence (blockIdx.z, or the
  // compact grid's table entry) as a dense call of its own (at_sequence); false: no such block
  // (a unit of one block; past a packed sequence's rows).
  auto block_of = [&](int64_t u, int half, int64_t* seq, int64_t* y, int64_t* xb) {
    int64_t x = blockIdx.x, z = blockIdx.z;
    *y = blockIdx.y;
    if (walking && !walk.at(u, half, &x, y, &z)) return false;
    *seq = z;
    *xb = x;
    if (A.blocks != nullptr) {
      const int2 e = A.blocks[x];
      if (e.x < 0) return false;
      *seq = e.x;
      *xb = e.y;
    }
    return true;
  };

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    mbar_init(empty_q, 4 * NWG);  // lane 0 of every consumer warp
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_k + i, 1);
      mbar_init(full_v + i, 1);
      mbar_init(empty_k + i, 4 * NWG);
      mbar_init(empty_v + i, 4 * NWG);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == NWG) {
    // ---- producer ---------------------------------------------------------------------------
    regs_decrease<C.producer_regs>();
    if (threadIdx.x == TC) {
      int g0 = 0, kq = 0;  // the CTA's tiles and blocks so far
      for (int64_t u = walking ? blockIdx.x : 0; u < nunits; u += walking ? gridDim.x : 1)
      for (int half = 0; half < halves; ++half) {
        int64_t seq, y, xb;
        if (!block_of(u, half, &seq, &y, &xb)) continue;
        const FwdArgs a = at_sequence(A.f, seq);
        const QueryBlock qb = query_block<BM, BN>(a.p.shape, a.p.num, seq, y, xb);
        if (qb.rows <= 0) continue;
        const CtaMaps<3> mp({&A.tq, &A.tk, &A.tv}, A.seq_maps, qb.b);
        copy_forward_tiles<TQ, TK, DP, BN>(mp.m[0], mp.m[1], mp.m[2], sQ, sK, sV, full_q, full_k, empty_k, full_v,
                                           empty_v, static_cast<int>(qb.m0), static_cast<int>(qb.h),
                                           static_cast<int>(qb.hk), mp.batch, qb.t_begin, qb.ntiles, g0, empty_q, kq);
        g0 += qb.ntiles;
        ++kq;
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------------
  regs_increase<C.consumer_regs()>();
  const int warp = threadIdx.x / 32;
  const int wg_row = wg * 64;  // the warpgroup's first row in the CTA tile
  const uint32_t q_addr = smem_addr(sQ), k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  const bool lane0 = lane_id() == 0;
  auto wait_k = [&](int g) { mbar_wait(full_k + (g & 1), (g >> 1) & 1); };
  auto wait_v = [&](int g) { mbar_wait(full_v + (g & 1), (g >> 1) & 1); };
  auto release = [&](uint64_t* empty, int g) {
    if (lane0) mbar_arrive(empty + (g & 1));
  };
  // Ping-pong: warpgroup w issues its products only between a signal from the other one and its
  // own signal back (named barriers 2 and 3), so one warpgroup's softmax runs while the other's
  // products occupy the tensor cores. Warpgroup 0 starts; warpgroup 1's last signal of a block
  // starts warpgroup 0's first turn of the next (pp_open: that signal is pending), and the CTA's
  // last one is taken at its end, so the barriers alternate strictly over the walk.
  bool pp_open = false;
  int g0 = 0, kq = 0;  // as the producer's
  for (int64_t u = walking ? blockIdx.x : 0; u < nunits; u += walking ? gridDim.x : 1)
  for (int half = 0; half < halves; ++half) {
    int64_t seq, y, xb;
    if (!block_of(u, half, &seq, &y, &xb)) continue;
    const FwdArgs a = at_sequence(A.f, seq);
    const ForwardParams& p = a.p;
    const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
    const QueryBlock qb = query_block<BM, BN>(p.shape, p.num, seq, y, xb);
    if (qb.rows <= 0) continue;
    const int64_t b = qb.b, h = qb.h, m0 = qb.m0;
    const int ntiles = qb.ntiles;
    const MaskRule& rule = qb.rule;
    const int64_t row_w = m0 + 16 * warp;  // the warp's first query row
    float o[1][NO][4];
    zero(o[0]);
    SoftmaxState st;
    float s[1][NS][4];
    uint32_t pa[1][BN / 16][4];

    // The lane's rows g and g + 8: keys outside their ranges are hidden from them (sequence end
    // and both band edges; rows past Sq see none and are never stored).
    const RowKeys keys(rule, row_w + lane_id() / 4, Sq, Skv);
    const bool fused = a.score.scale > 0.0f;  // uniform: an increasing transform (softmax_rows)
    // XF: the per-entry step (softcap, ALiBi) turns the raw products into log2-unit logits first,
    // before masking (tanh would make a masked -inf finite); the softmax then goes the unfused way
    // with multiplier 1 (after_elementwise), which is exact for either sign of the scale and costs
    // an FADD where the fused path has its FFMA.
    const ScoreTransform::Head hd = XF ? a.score.head(b, h) : ScoreTransform::Head{};
    const ScoreTransform after = a.score.after_elementwise();
    // Scores of iteration it's key tile (in s) -> P in s, statistics updated, alpha for O.
    auto softmax_tile = [&](int it, float(&alpha)[2]) {
      const int64_t n0 = qb.key0(it, BN);
      if constexpr (XF) {
        logits_at<false>(s[0], hd, row_w, n0, [](int, int, int, float) {});
        softmax_tile_sm90<BN>(s[0], st, alpha, keys, n0, qb.tile_masked(n0, BN, Skv), false, after);
      } else {
        softmax_tile_sm90<BN>(s[0], st, alpha, keys, n0, qb.tile_masked(n0, BN, Skv), fused, a.score);
      }
    };
    const bool pp = a.pingpong && ntiles > 0;
    auto turn_begin = [&] {
      if (pp) named_barrier(2 + wg, TC);
    };
    auto turn_end = [&] {
      if (pp) named_barrier_arrive(2 + (wg ^ 1), TC);
    };
    if (pp && !pp_open) {
      if (wg == 1) named_barrier_arrive(2, TC);
      pp_open = true;
    }

    mbar_wait(full_q, kq & 1);
    if (ntiles > 0) {
      wait_k(g0);
      fence_regs(s[0]);
      wgmma_fence();
      turn_begin();
      wg_gemm_nt<H, DP, TQ, TK>(s[0], q_addr, wg_row, k_addr + (g0 & 1) * TK::kBytes, 0, false);
      wgmma_commit();
      turn_end();
      wgmma_wait<0>();
      fence_regs(s[0]);
      release(empty_k, g0);
      float alpha[2];
      softmax_tile(0, alpha);
      to_afrag<H, 1, BN / 16>(pa, s);
    }
    // All but the last key tile: the next tile's scores overlap this tile's P V. (The last tile is
    // peeled off so that every wgmma in this loop is issued unconditionally: the compiler then sees
    // which group each wait retires and keeps the two products asynchronous.)
    for (int it = 0; it + 1 < ntiles; ++it) {
      const int g = g0 + it;
      wait_k(g + 1);
      wait_v(g);
      fence_regs(o[0]);
      fence_regs(s[0]);
      wgmma_fence();
      turn_begin();
      wg_gemm_nt<H, DP, TQ, TK>(s[0], q_addr, wg_row, k_addr + ((g + 1) & 1) * TK::kBytes, 0, false);
      wgmma_commit();
      wg_gemm_rn<H, BN / 16, TK>(o[0], pa[0], v_addr + (g & 1) * TK::kBytes, 0, 0);
      wgmma_commit();
      turn_end();
      wgmma_wait<1>();
      fence_regs(s[0]);
      release(empty_k, g + 1);
      float alpha[2];
      softmax_tile(it + 1, alpha);
      wgmma_wait<0>();
      fence_regs(o[0]);
      release(empty_v, g);
      rescale_rows(o[0], alpha);
      to_afrag<H, 1, BN / 16>(pa, s);
    }
    // Every product reading Q has completed: with O's own tile, the next block's Q may come.
    if (kOwnO && lane0) mbar_arrive(empty_q);
    if (ntiles > 0) {
      const int g = g0 + ntiles - 1;
      wait_v(g);
      fence_regs(o[0]);
      wgmma_fence();
      turn_begin();
      wg_gemm_rn<H, BN / 16, TK>(o[0], pa[0], v_addr + (g & 1) * TK::kBytes, 0, 0);
      wgmma_commit();
      turn_end();
      wgmma_wait<0>();
      fence_regs(o[0]);
      release(empty_v, g);
    }
    g0 += ntiles;

    // Epilogue: O /= l, LSE = (m + log2 l) ln 2 (a row without visible keys by the band: O = 0,
    // LSE = -inf), staged as 16-bit values into this warpgroup's own 64 rows of O's tile (Q's at
    // D = 256, where only this warpgroup's products read those rows) for 16-byte stores: the
    // warpgroups never wait for each other here.
    bool sees[2];
    rows_in(row_w + lane_id() / 4, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
    float inv[2], lse[2];
    finish_rows(st, sees, inv, lse);
    normalize_rows(o[0], inv, sees);
    store_lse(p.lse, b, h, row_w, Sq, lse);
    named_barrier(4 + wg, 128);  // every warp of this warpgroup is past its last product (and
                                 // its previous block's reads of these rows)
    stage_acc_as<H, TQ, 1, NO>(sO, o, 16 * warp, 0, 1.0f);
    named_barrier(4 + wg, 128);
    store_rows16_as<TQ, 64, 128>(out16(p.out, b, h, m0), p.out.ss, sO, wg_row, qb.rows,
                                 static_cast<int>(p.shape.head_dim), true, static_cast<int>(threadIdx.x) - 128 * wg);
    if constexpr (!kOwnO) {
      // O read back from Q's tile (the loads above have returned: their values were stored): the
      // copy engine may overwrite it after this warp's generic-proxy writes are ordered before it.
      fence_proxy_async();
      __syncwarp();
      if (lane0) mbar_arrive(empty_q);
    }
    ++kq;
  }
  if (pp_open && wg == 0) named_barrier(2, TC);  // the last signal of warpgroup 1, unanswered
#endif
}

}  // namespace flashattn::cuda::dev
