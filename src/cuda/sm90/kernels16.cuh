// The Hopper (sm_90a) float16/bfloat16 kernels, forward and single-pass dK/dV (dQ by float32
// reductions): tiles copied by the tensor copy engine (TMA) into 128-byte-swizzled shared memory,
// warpgroup tensor-core products (wgmma) reading them there (no fragment loads through the
// register file), a producer warpgroup and two consumer warpgroups synchronised by mbarriers, and
// in-warpgroup software pipelining (the forward overlaps the softmax of key tile j+1 with
// O += P_j V_j). docs/ALGORITHM.md ("CUDA sm_90a (Hopper) kernels") has the
// pseudocode and the work model. Masks, statistics and epilogues are the mma.sync kernels' pieces.
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

// ================================================================================================
// dK/dV with dQ by atomics (FlashAttention 2's single-pass backward on warpgroups). CTA = 128 keys
// of one (batch, kv head), consumer warpgroup w owning keys 64w..64w+63 (the M of S^T = K Q^T);
// the producer streams 64-query tiles of Q and dO (TMA, one thread) and their LSE and D vectors
// (one warp), over every query head of the group, two stages deep. Per consumer warpgroup and
// query tile:
//   S^T = K_w Q^T, dP^T = V_w dO^T                       (wgmma from shared memory)
//   P^T = exp2(logit2(S^T) - lse2), dS^T = P^T (dP^T - D) (registers; masks)
//   dV_w += P^T dO, dK_w += dS^T Q                        (wgmma, P^T and dS^T from registers)
//   dS^T -> shared memory (double buffer); barrier among the consumers
//   dQ[:, cols_w] = dS K[:, cols_w]                       (wgmma, both operands read transposed)
// At D = 256 (col_split 2) a CTA has 64 keys; both warpgroups compute their S^T and dP^T and each
// accumulates half of dK's and dV's columns.
//   dq_accum += dQ (vector float32 reductions in L2); release the stage
// ================================================================================================
struct Sm90BwdArgs {
  BwdArgs f;
  CUtensorMap tq, tk, tv, tdo;
  const CUtensorMap* seq_maps;  // as Sm90FwdArgs::seq_maps: Q, dO, K, V per sequence
  // ORD kernels: one counter per (sequence, query head, query tile of BQ rows, warpgroup), zeroed,
  // lock_tiles query tiles per head (of the call's Sq, or max_seqlen_q when packed).
  int* locks;
  int64_t lock_tiles;
  // ORD under GQA with the head split (BackwardPlan::dkv_acc; nullptr: none): CTA (key block x,
  // query head y); the G CTAs of a key block add their dK/dV into dkv_acc in query-head order
  // (rows (b Hkv + hk) nk BK + key, dK's then dV's dkv_acc_rows later; DP floats each), counted
  // in dkv_locks[(b Hkv + hk) nk + x]; the last writes the sums as dK and dV.
  float* dkv_acc;
  int64_t dkv_acc_rows;
  int* dkv_locks;
};

// The ordered dQ reduction (ORD, deterministic): the key blocks that see a query tile add their
// dQ into its accumulator rows one after another, highest key block first, so every float sum
// has one order (bitwise reproducible); the counter of (tile, warpgroup) holds how many have
// added. Highest first is the order in which the blocks reach a tile: every block walks its query
// tiles upwards from the first it sees, and a higher key block's first tile is no lower (causal,
// windows), so under a band each block finds its turn already there instead of every block
// waiting for key block 0 (which reaches tile q last, q tiles in). The grid runs the key blocks
// of a head in reverse (x = gridDim.x - 1 - blockIdx.x), so a block only waits for blocks launched
// before it: a waiting CTA never holds a multiprocessor one it waits for needs. Without a mask
// all blocks would start at tile 0 and pass each tile's turn down a chain; with dq_rotate
// (BackwardPlan: no mask, and a head's key blocks all fit on the GPU at once, the condition for
// waiting on blocks launched later) they start at tiles spread over the row and take turns in
// the order they arrive (turn_of).
// The waiting and the release are a producer warp's (one per consumer warpgroup): it polls the
// counter, lets the warpgroup add through a named barrier, and after a second barrier (the adds
// issued) fences and counts - so the consumers never stall on the fence that waits for their adds
// to land in L2 (a thread that fenced and released itself held its whole warpgroup's next wgmma).
__device__ __forceinline__ void wait_turn(const int* lock, int order) {
#if defined(__CUDA_ARCH__)
  for (;;) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(lock) : "memory");
    if (v >= order) return;
    __nanosleep(64);
  }
#endif
}
__device__ __forceinline__ void pass_turn(int* lock) {
#if defined(__CUDA_ARCH__)
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(lock) : "memory");
#endif
}

// f(std::true_type) on a tile with masked entries, f(std::false_type) on one without: one uniform
// branch per tile instead of a compare and select per entry on every tile (most tiles have no
// masked entry; the per-entry test cost 64 of ~840 instructions per tile at D = 128).
template <class F>
__device__ __forceinline__ void masked_or_not(bool masked, F&& f) {
  if (masked) f(std::true_type{});
  else f(std::false_type{});
}

// ORD: the ordered dQ reduction above (deterministic); otherwise reductions in any order.
template <int DP, Half16 H, int V, bool XF, bool ORD = false>
__global__ void __launch_bounds__(tile_config90(Pass::Dkv, DP, V).threads(), tile_config90(Pass::Dkv, DP, V).min_ctas)
    dkv_sm90_kernel(const __grid_constant__ Sm90BwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90(Pass::Dkv, DP, V);
  constexpr int BK = C.block_m, BQ = C.block_n, NWG = C.warpgroups, TC = 128 * NWG, CS = C.col_split;
  constexpr int DW = DP / CS;                         // dK/dV columns per warpgroup
  constexpr int DQN = DP / NWG, QC = DQN < 64 ? DQN : 64;  // dQ columns per warpgroup, per product
  // With col_split warpgroups sharing their 64 keys, each computes S^T and dP^T for BQ / CS of
  // the tile's queries only and publishes P^T and dS^T through shared memory; dV and dK then read
  // both from there (kQSplit). Without, P^T and dS^T stay in registers for dV and dK.
  constexpr bool kQSplit = CS > 1;
  constexpr int NS = BQ / 8 / CS, NO = DW / 8;  // S^T columns (n8 tiles) per warpgroup; dK/dV's
  static_assert(BK * CS == 64 * NWG, "64 keys per col_split warpgroups");
  using TK = TileSw128<BK, DP>;
  using TQ = TileSw128<BQ, DP>;
  using TS = TileSw128<BK, BQ>;
  extern __shared__ float4 smem4[];
  unsigned char* sK = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sV = sK + TK::kBytes;
  unsigned char* sQ = sV + TK::kBytes;        // [2][BQ x DP]
  unsigned char* sdO = sQ + 2 * TQ::kBytes;   // [2][BQ x DP]
  unsigned char* sdS = sdO + 2 * TQ::kBytes;  // [2][BK x BQ]: dS^T
  unsigned char* sP = sdS + 2 * TS::kBytes;   // kQSplit: [2][BK x BQ]: P^T
  float* sL = reinterpret_cast<float*>(sP + (kQSplit ? 2 * TS::kBytes : 0));  // [2][BQ]: LSE * log2(e)
  float* sD = sL + 2 * BQ;                                      // [2][BQ]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sD + 2 * BQ);
  uint64_t* full_kv = bars;
  uint64_t* full = bars + 1;   // [2]: Q, dO (copy engine) and LSE, D (32 producer lanes)
  uint64_t* empty = bars + 3;  // [2]

  // As the forward's: sequence blockIdx.z of a packed batch; CTAs past its keys have no work.
  const BwdArgs a = at_sequence(A.f, blockIdx.z, DP);
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  // (ORD: the key blocks of a head in reverse launch order, see wait_turn.)
  const int64_t kx = ORD ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  // The head split (BackwardPlan::dkv_acc): blockIdx.y is a query head, which walks its own query
  // tiles only; the group's dK/dV are summed in head order after the walk (epilogue).
  const bool hsplit = A.dkv_acc != nullptr;
  const int64_t G = p.shape.heads_q / p.shape.heads_kv;
  KeyBlock kb = key_block<BK, BQ>(p.shape, p.num, blockIdx.z, hsplit ? blockIdx.y / G : blockIdx.y, kx);
  if (hsplit) kb.one_head(blockIdx.y);
  if (kb.rows <= 0) return;
  const int64_t b = kb.b, hk = kb.hk, m0 = kb.m0;
  const int ntiles = kb.ntiles;
  const MaskRule& rule = kb.rule;
  // Every key block of a head adds into the same dQ rows; starting each CTA at a different query
  // tile spreads those reductions over different addresses at any moment. (ORD: every CTA walks
  // its tiles upwards from its first, in the order the counters take them; with dq_rotate - no
  // mask, so all nk key blocks see all ntiles tiles - block kx starts kx * step tiles in, see
  // turn_of.)
  const int nk = static_cast<int>((Skv + BK - 1) / BK);
  const bool ord_rot = ORD && A.f.dq_rotate && ntiles >= nk;
  const int step = ord_rot ? rotation_step(ntiles, nk) : 1;  // (read only when ord_rot)
  const int rot = ord_rot ? static_cast<int>(kx) * step : (!ORD && ntiles > 0 ? static_cast<int>(blockIdx.x % ntiles) : 0);
  auto tile_of = [&](int it) { return it + rot < ntiles ? it + rot : it + rot - ntiles; };
  // ORD: this block's place in the turns at entry x of the walk's list (work.hpp): after the
  // key blocks that reach it first - every one of them got there at least a step earlier.
  [[maybe_unused]] auto turn_of = [&](int x, int64_t n0) -> int {
    if (ord_rot) return turn_rotated(x, kx, nk, step);
    const int qrows = static_cast<int>(Sq - n0 < BQ ? Sq - n0 : BQ);
    return turn_highest_first(key_tiles(rule, n0, qrows, Skv, BK), kx);
  };
  // ORD: the named barriers between consumer warpgroup w and its turn warp (producer warp 2 + w):
  // kTurnBar + w "the turn is yours", kAddedBar + w "the adds are issued"; 128 + 32 threads.
  constexpr int kTurnBar = 6, kAddedBar = 8, kTurnThreads = 128 + 32;
  static_assert(!ORD || NWG <= 2, "a turn warp per consumer warpgroup: producer warps 2 and 3");

  init_stage_barriers(full_kv, full, 1 + 32, empty, TC);  // empty: every consumer thread (see below)

  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
  if (wg == NWG) {
    // ---- producer ---------------------------------------------------------------------------
    regs_decrease<C.producer_regs>();
    const int pw = (threadIdx.x - TC) / 32, lane = lane_id();
    if (pw == 0 && lane == 0) {
      const CtaMaps<4> mp({&A.tq, &A.tdo, &A.tk, &A.tv}, A.seq_maps, b);
      const int bb = mp.batch;
      mbar_expect_tx(full_kv, 2 * TK::kBytes);
#pragma unroll
      for (int blk = 0; blk < DP / 64; ++blk) {
        tma_load_4d(sK + blk * TK::kBlockBytes, mp.m[2], full_kv, 64 * blk, static_cast<int>(m0), static_cast<int>(hk), bb);
        tma_load_4d(sV + blk * TK::kBlockBytes, mp.m[3], full_kv, 64 * blk, static_cast<int>(m0), static_cast<int>(hk), bb);
      }
      for (int it = 0; it < ntiles; ++it) {
        const int st = it & 1;
        const int h = static_cast<int>(kb.head(tile_of(it))), n0 = static_cast<int>(kb.q0(tile_of(it), BQ));
        mbar_wait(empty + st, ((it >> 1) & 1) ^ 1);
        mbar_expect_tx(full + st, 2 * TQ::kBytes);
#pragma unroll
        for (int blk = 0; blk < DP / 64; ++blk) {
          tma_load_4d(sQ + st * TQ::kBytes + blk * TQ::kBlockBytes, mp.m[0], full + st, 64 * blk, n0, h, bb);
          tma_load_4d(sdO + st * TQ::kBytes + blk * TQ::kBlockBytes, mp.m[1], full + st, 64 * blk, n0, h, bb);
        }
      }
    } else if (pw == 1) {
      for (int it = 0; it < ntiles; ++it) {
        const int st = it & 1;
        const int64_t h = kb.head(tile_of(it)), n0 = kb.q0(tile_of(it), BQ);
        mbar_wait(empty + st, ((it >> 1) & 1) ^ 1);
        fill_lse_delta<BQ>(sL + st * BQ, sD + st * BQ, a, b, h, n0);
        mbar_arrive(full + st);
      }
    } else if (ORD && pw >= 2 && pw - 2 < NWG) {
      // ORD: warpgroup w = pw - 2's turns (turn_of).
      const int w = pw - 2;
      for (int it = 0; it < ntiles; ++it) {
        const int x = tile_of(it);
        const int64_t h = kb.head(x), n0 = kb.q0(x, BQ);
        int* lock = A.locks + ((b * p.shape.heads_q + h) * A.lock_tiles + n0 / BQ) * NWG + w;
        if (lane == 0) wait_turn(lock, turn_of(x, n0));
        __syncwarp();
        named_barrier(kTurnBar + w, kTurnThreads);
        named_barrier(kAddedBar + w, kTurnThreads);  // (the warpgroup's reductions are issued)
        // The barrier orders every consumer thread's reductions before this lane's fence, which
        // waits for them to be performed at the device; then the count.
        if (lane == 0) {
          __threadfence();
          pass_turn(lock);
        }
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------------
  regs_increase<C.consumer_regs()>();
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int kg = wg / CS, cg = wg % CS;                // key group (64 keys), column group
  const int krow = 64 * kg + 16 * (warp & 3);          // the warp's first key row in the CTA
  const int qc0 = 8 * NS * cg;                         // the warpgroup's first S^T column
  const int64_t row_w = m0 + krow;
  const uint32_t k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  float dk[1][NO][4], dv[1][NO][4];
  zero(dk[0]);
  zero(dv[0]);

  const KeyRowQueries kq(rule, row_w + lane / 4, Sq, Skv);
  float s[1][NS][4], dp[1][NS][4];
  // S^T and dP^T of tile it, issued as one wgmma group.
  auto issue_sdp = [&](int it) {
    const int st = it & 1;
    mbar_wait(full + st, (it >> 1) & 1);
    fence_regs(s[0]);
    fence_regs(dp[0]);
    wgmma_fence();
    wg_gemm_nt<H, DP, TK, TQ>(s[0], k_addr, 64 * kg, smem_addr(sQ + st * TQ::kBytes), qc0, false);
    wg_gemm_nt<H, DP, TK, TQ>(dp[0], v_addr, 64 * kg, smem_addr(sdO + st * TQ::kBytes), qc0, false);
    wgmma_commit();
  };
  // One tile. With a next tile, its S^T and dP^T are issued right after the last dQ product, so
  // they run on the tensor cores while this tile's dQ reductions go out; the last tile is a
  // separate instantiation (no conditional wgmma: see the forward's main loop). Only at D = 64:
  // with dK and dV at DP/2 registers each, the second S^T/dP^T set spills from D = 128 up, and
  // at D = 64 below 240 registers per thread.
  constexpr bool kOverlapNext = DP <= 64 && C.consumer_regs() >= 240;
  // dQ's reductions 16 bytes each (red.global.add.v4.f32 after a lane-pair swap) at D = 64, 8
  // bytes above: measured against each other in one process (H100, bf16 GQA 4/8, S 1k-16k), the
  // 16-byte form +0-14% at D = 64 and 3-9% slower at D = 128 (its ~90 more instructions per tile).
  constexpr bool kRed4 = DP <= 64;
  auto tile = [&](int it, auto has_next) {
    constexpr bool kNext = decltype(has_next)::value;
    const int st = it & 1;
    const uint32_t qa = smem_addr(sQ + st * TQ::kBytes), doa = smem_addr(sdO + st * TQ::kBytes);
    const float* sLs = sL + st * BQ;
    const float* sDs = sD + st * BQ;
    // XF: the tile's query head's per-entry step (its ALiBi slope loaded while the products run).
    [[maybe_unused]] ScoreTransform::Head hd{};
    if constexpr (XF) hd = a.score.head(b, kb.head(tile_of(it)));
    wgmma_wait<0>();
    fence_regs(s[0]);
    fence_regs(dp[0]);

    const int64_t h = kb.head(tile_of(it)), n0 = kb.q0(tile_of(it), BQ);  // first query row
    const bool masked = kb.tile_masked(n0, BQ, BK, Sq, Skv);
    int lo[2], hi[2];
    kq.tile_bounds(n0, BQ, masked, lo, hi);
    if constexpr (XF) {
      // S^T's rows are keys, its columns queries. The per-entry step (before masking) gives the
      // logits and the softcap's factor F, folded into dP^T - D at once (no array of F held):
      // dS^T = P^T ((dP^T - D) F), which both dK and dQ read.
      logits_at<true>(s[0], hd, row_w, n0 + qc0, [&](int j, int e, int cw, float f) {
        dp[0][j][e] = (dp[0][j][e] - sDs[qc0 + cw]) * f;
      });
      const ScoreTransform after = a.score.after_elementwise();
      masked_or_not(masked, [&](auto mask) {
        for_each_entry<NS>([&](int j, int e, int r, int cw) {
          const int c = qc0 + cw;
          float pe = exp2_ftz(after.exp2_arg(s[0][j][e], sLs[c]));
          if (mask && (c < lo[r >> 3] || c >= hi[r >> 3])) pe = 0.0f;
          s[0][j][e] = pe;
          dp[0][j][e] = pe * dp[0][j][e];
        });
      });
    } else {
      masked_or_not(masked, [&](auto mask) {
        for_each_entry<NS>([&](int j, int e, int r, int cw) {
          const int c = qc0 + cw;  // query column in the tile
          float pe = exp2_ftz(a.score.exp2_arg(s[0][j][e], sLs[c]));
          if (mask && (c < lo[r >> 3] || c >= hi[r >> 3])) pe = 0.0f;
          s[0][j][e] = pe;
          dp[0][j][e] = pe * (dp[0][j][e] - sDs[c]);  // dS^T
        });
      });
    }
    if constexpr (!kQSplit) {
      uint32_t pp[1][NS / 2][4], pds[1][NS / 2][4];
      to_afrag<H, 1, NS / 2>(pp, s);
      to_afrag<H, 1, NS / 2>(pds, dp);
      fence_regs(dv[0]);
      fence_regs(dk[0]);
      wgmma_fence();
      wg_gemm_rn<H, NS / 2, TQ>(dv[0], pp[0], doa, 0, cg * DW);
      wg_gemm_rn<H, NS / 2, TQ>(dk[0], pds[0], qa, 0, cg * DW);
      wgmma_commit();
    }

    // dS^T of both warpgroups into this iteration's buffer; the barrier also tells each
    // warpgroup that the other finished the previous iteration's dQ (which read the other
    // buffer), so one barrier per iteration protects both.
    // With kQSplit P^T goes the same way, and dV and dK follow the barrier.
    unsigned char* sdSi = sdS + st * TS::kBytes;
    stage_acc_as<H, TS, 1, NS>(sdSi, dp, krow, qc0, 1.0f);
    if constexpr (kQSplit) stage_acc_as<H, TS, 1, NS>(sP + st * TS::kBytes, s, krow, qc0, 1.0f);
    fence_proxy_async();
    named_barrier(1, TC);
    if constexpr (kQSplit) {
      fence_regs(dv[0]);
      fence_regs(dk[0]);
      wgmma_fence();
      wg_gemm_sn<H, BQ / 16, TS, TQ>(dv[0], smem_addr(sP + st * TS::kBytes), 64 * kg, doa, 0, cg * DW);
      wg_gemm_sn<H, BQ / 16, TS, TQ>(dk[0], smem_addr(sdSi), 64 * kg, qa, 0, cg * DW);
      wgmma_commit();
    }
    float* acc = a.dq_accum + (a.ws_row(b, h) + n0) * DP + DQN * wg;
    const int g = lane >> 2, t = lane & 3, wq = 16 * (warp & 3);
#pragma unroll
    for (int c = 0; c < DQN / QC; ++c) {
      const bool last = c + 1 == DQN / QC;
      float dq[1][QC / 8][4];
      fence_regs(dq[0]);
      wgmma_fence();
      wg_gemm_tt<H, BK / 16, TS, TK>(dq[0], smem_addr(sdSi), 0, k_addr, DQN * wg + QC * c, false);
      wgmma_commit();
      if (kNext && last) {
        issue_sdp(it + 1);
        wgmma_wait<1>();  // all but the next tile's S^T and dP^T
      } else {
        wgmma_wait<0>();
      }
      fence_regs(dq[0]);
      if constexpr (ORD) {
        if (c == 0) named_barrier(kTurnBar + wg, kTurnThreads);  // this warpgroup's turn at the tile
      }
      if (last) {
        fence_regs(dv[0]);
        fence_regs(dk[0]);
        // Every thread arrives: an arrival releases only the arriving thread's own accesses
        // (the sL/sD reads above), which the producer's next writes to this stage must follow.
        mbar_arrive(empty + st);
      }
      // A row that sees no key adds nothing: its dS is 0, but 0 * a NaN in K is NaN, and its
      // dQ must stay exactly 0.
      if constexpr (kRed4) {
        // 16-byte reductions: lanes t and t ^ 1 swap halves, so that the even lane holds 4
        // neighbouring columns of row g and the odd lane 4 of row g + 8 (the same float adds).
        const bool odd = t & 1;
        const int qr = wq + g + (odd ? 8 : 0);
        const bool live = n0 + qr >= rule.live_rows_begin(Sq) && n0 + qr < rule.live_rows_end(Sq, Skv);
        float* accr = acc + static_cast<int64_t>(qr) * DP + QC * c + 2 * t - (odd ? 2 : 0);
#pragma unroll
        for (int j = 0; j < QC / 8; ++j) {
          const float* e = dq[0][j];
          const float x = __shfl_xor_sync(0xffffffffu, odd ? e[0] : e[2], 1);
          const float y = __shfl_xor_sync(0xffffffffu, odd ? e[1] : e[3], 1);
          if (live) red_add4(accr + 8 * j, odd ? x : e[0], odd ? y : e[1], odd ? e[2] : x, odd ? e[3] : y);
        }
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int qr = wq + g + 8 * r;
          if (n0 + qr < rule.live_rows_begin(Sq) || n0 + qr >= rule.live_rows_end(Sq, Skv)) continue;
#pragma unroll
          for (int j = 0; j < QC / 8; ++j)
            red_add2(acc + static_cast<int64_t>(qr) * DP + QC * c + 8 * j + 2 * t, dq[0][j][2 * r],
                     dq[0][j][2 * r + 1]);
        }
      }
      if constexpr (ORD) {
        if (last) named_barrier(kAddedBar + wg, kTurnThreads);  // (the turn warp fences and counts)
      }
    }
  };

  mbar_wait(full_kv, 0);
  if constexpr (kOverlapNext) {
    if (ntiles > 0) issue_sdp(0);
    for (int it = 0; it + 1 < ntiles; ++it) tile(it, std::true_type{});
    if (ntiles > 0) tile(ntiles - 1, std::false_type{});
  } else {
    for (int it = 0; it < ntiles; ++it) {
      issue_sdp(it);
      tile(it, std::false_type{});
    }
  }

  // Epilogue: dK (times grad_scale) and dV through the Q and dO stages' shared memory
  // (plain swizzled Tile layout, BK rows each) once every consumer is done with them.
  static_assert(BK * DP * 2 <= 2 * TQ::kBytes, "dK/dV staging reuses both Q (dO) stages");
  bool seen[2];  // keys no query row sees: dK = dV = 0 exactly
  rows_in(row_w + lane / 4, rule.live_keys_begin(Skv), rule.live_keys_end(Sq, Skv), seen);
  zero_rows_unless(dk[0], seen);
  zero_rows_unless(dv[0], seen);
  if (hsplit) {
    // The head split: this head's partial dK/dV joins the group's sum in head order (g = its
    // place): g = 0 stores, 0 < g < G - 1 adds and stores, the last adds and writes the result
    // below. Each float sum is (earlier heads' sum) + this head's: one order, bitwise
    // reproducible. The counter is waited for by one thread and passed on after a barrier
    // that orders every consumer's stores before its fence (as the dQ turns); the partials go
    // through L2 (.cg: another SM wrote them, this SM's L1 may hold stale lines).
    const int64_t g = blockIdx.y - hk * G;
    int* lock = A.dkv_locks + (b * p.shape.heads_kv + hk) * nk + kx;
    const int64_t row0 = (b * p.shape.heads_kv + hk) * nk * BK + m0 + krow + lane / 4;
    float* acc_k = A.dkv_acc + row0 * DP + cg * DW + 2 * (lane & 3);
    float* acc_v = acc_k + A.dkv_acc_rows * DP;
    if (threadIdx.x == 0) wait_turn(lock, static_cast<int>(g));
    __syncwarp();  // (bar.sync is aligned: the warp reconverges first)
    named_barrier(1, TC);
    // One fragment row-half at a time (NO float2 of dK or dV: registers S and dP no longer
    // need), all its loads issued before any store: the stores could alias the loads as far as
    // the compiler knows, and load-add-store per pair made every pair an L2 round trip.
    auto join = [&](float(&acc)[1][NO][4], float* base, int r) {
      float* rowp = base + 8 * r * DP;
      float2 prev[NO];
      if (g > 0) {
#pragma unroll
        for (int j = 0; j < NO; ++j) prev[j] = __ldcg(reinterpret_cast<const float2*>(rowp + 8 * j));
#pragma unroll
        for (int j = 0; j < NO; ++j) {
          acc[0][j][2 * r] = prev[j].x + acc[0][j][2 * r];
          acc[0][j][2 * r + 1] = prev[j].y + acc[0][j][2 * r + 1];
        }
      }
      if (g + 1 < G) {
#pragma unroll
        for (int j = 0; j < NO; ++j)
          __stcg(reinterpret_cast<float2*>(rowp + 8 * j), make_float2(acc[0][j][2 * r], acc[0][j][2 * r + 1]));
      }
    };
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      join(dk, acc_k, r);
      join(dv, acc_v, r);
    }
    if (g + 1 < G) {
      named_barrier(1, TC);
      if (threadIdx.x == 0) {
        __threadfence();
        pass_turn(lock);
      }
      return;
    }
  }
  named_barrier(1, TC);
  stage_acc<H, BK, DP, 1, NO>(sQ, dk, krow, cg * DW, a.score.grad_scale());
  stage_acc<H, BK, DP, 1, NO>(sdO, dv, krow, cg * DW, 1.0f);
  named_barrier(1, TC);
  const int D = static_cast<int>(p.shape.head_dim);
  store_tile16<BK, DP, TC>(out16(p.dk, b, hk, m0), p.dk.ss, sQ, kb.rows, D, true);
  store_tile16<BK, DP, TC>(out16(p.dv, b, hk, m0), p.dv.ss, sdO, kb.rows, D, true);
#endif
}

}  // namespace flashattn::cuda::dev
