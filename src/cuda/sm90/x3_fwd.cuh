// The Hopper (sm_90a) float32 forward in the fp32-accurate mode (3xTF32) on wgmma: the default at
// padded D = 128 (measured 1.3-1.5x the mma.sync 3xTF32 kernel on an H200) and, since its
// descriptors stay on the uniform datapath, at D = 64 (measured 4-17% faster than mma.sync; with
// the descriptors built per thread it was 5-6% slower at S = 1k). FLASHATTN_CUDA_FP32_FWD=mma
// keeps the mma.sync kernel.
//
// Every product X Y is X_big Y_big + X_big Y_small + X_small Y_big (tf32_split, device.cuh), small
// terms first. With Q's big and small fragments (128 registers per thread at D = 128) a warpgroup
// owning 64 rows as in the tf32 forward cannot also hold O, so both consumer warpgroups own the
// same 64 query rows and split the head dim (the backward's pair design, tf32_bwd_pair.cuh):
//   warpgroup w (dims [w DP/2, (w + 1) DP/2)): qb, qs = split(Q[:, half w]) as A fragments (DP/2 registers)
//   per 32-key tile t:
//     S_w = Q[:, half w] K_t[:, half w]^T            (3 products x DP/16 k-steps, groups of 4 k-steps
//                                                     in separate accumulators, added with FADD)
//     exchange S_w through shared memory; S = S_0 + S_1 (both warpgroups: the same bits)
//     P = online softmax of S (both, identically: the same statistics)
//     O_t = P Vt_t[half w] (3 products x 4 k-steps, a fresh accumulator); O_w = alpha O_w + O_t
// The fresh accumulators matter: the tensor cores add into their fp32 accumulator with truncation,
// so a long chain drifts (the mma.sync kernels group two k-steps for the same reason, device.cuh).
// A pre-pass (launch_tf32_operands, as for the backward) writes K's big and small parts (rows =
// keys) and V's transposed (rows = head dim, keys in tf32_slot order, so P's accumulator is its A
// fragment unshuffled), big and small; the producer thread copies Q once and those four tiles per
// key tile. (Splitting K and transposing V in shared memory by producer warps, the first version,
// made the kernel shared-memory bound: ~1900 cycles of traffic per tile against ~1540 of tensor
// work; it measured 40-48 TFLOP/s.)
// docs/ALGORITHM.md ("fp32 forward on sm_90a") has the work model.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/sm90/tf32_fwd.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/wgmma.cuh"

namespace flashattn::cuda::dev {

template <int DP>
__global__ void __launch_bounds__(tile_config90_3xtf32(DP).threads(), 1)
    forward_3xtf32_sm90_kernel(const __grid_constant__ Sm90Tf32FwdArgs A) {  // the tf32 forward's arguments
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90_3xtf32(DP);
  constexpr int BM = C.block_m, BN = C.block_n, TC = 256;
  constexpr int NS = BN / 8, NH = DP / 16, KH = DP / 16;  // NH: 8-column blocks of a half; KH: its k-steps
  static_assert(C.warpgroups == 2 && BM == 64 && BN == 32 && (DP == 64 || DP == 128),
                "pair design at D = 64 and 128");
  constexpr int DH = DP / 2;  // a warpgroup's half of the head dim
  using TQ = TileSw128F<BM, DP>;
  using TK = TileSw128F<BN, DP>;   // K big and small: rows = keys
  using TVt = TileSw128F<DP, BN>;  // Vt big and small: rows = head dim, k = key slots
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sK = sQ + TQ::kBytes;        // [2] big
  unsigned char* sKs = sK + 2 * TK::kBytes;   // [2] small
  unsigned char* sVt = sKs + 2 * TK::kBytes;  // [2] big
  unsigned char* sVts = sVt + 2 * TVt::kBytes;  // [2] small
  float* xS = reinterpret_cast<float*>(sVts + 2 * TVt::kBytes);  // [2 warpgroups][BM x BN]
  uint64_t* bars = reinterpret_cast<uint64_t*>(xS + 2 * BM * BN);
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;     // [2] K big and small landed
  uint64_t* empty_k = bars + 3;    // [2] K big and small read by both warpgroups
  uint64_t* full_vt = bars + 5;    // [2] Vt big and small landed
  uint64_t* empty_vt = bars + 7;   // [2] Vt read by both warpgroups
  uint64_t* ready = bars + 9;      // [2] warpgroup w's partial scores in xS[w]
  uint64_t* taken = bars + 11;     // [2] warpgroup w's partial scores read by the other

  const FwdArgs& a = A.f;
  const ForwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, m0 = qb.m0;
  const int ntiles = qb.ntiles;
  const MaskRule& rule = qb.rule;

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_k + i, 1);
      mbar_init(empty_k + i, TC);
      mbar_init(full_vt + i, 1);
      mbar_init(empty_vt + i, TC);
      mbar_init(ready + i, 128);
      mbar_init(taken + i, 128);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = warpgroup_index();  // uniform (device.cuh)
  if (wg == 2) {
    // ---- producer -----------------------------------------------------------------------------
    regs_decrease<C.producer_regs>();
    if (threadIdx.x == TC) {
      const int bb = static_cast<int>(b), hk = static_cast<int>(qb.hk);
      mbar_expect_tx(full_q, TQ::kBytes);
#pragma unroll
      for (int blk = 0; blk < DP / 32; ++blk)
        tma_load_4d(sQ + blk * TQ::kBlockBytes, &A.tq, full_q, 32 * blk, static_cast<int>(m0), static_cast<int>(h), bb);
      // K_t (big, small) into stage t & 1 once both warpgroups released K_{t-2}; then Vt_t alike.
      // The consumers need K_0, then K_{t+1} before Vt_t: that order. t counts iterations (stages,
      // phases); iteration t copies key tile t_begin + t.
      auto load_k = [&](int t) {
        const int st = t & 1, n0 = static_cast<int>(qb.key0(t, BN));
        mbar_wait(empty_k + st, ((t >> 1) & 1) ^ 1);
        mbar_expect_tx(full_k + st, 2 * TK::kBytes);
#pragma unroll
        for (int blk = 0; blk < DP / 32; ++blk) {
          tma_load_4d(sK + st * TK::kBytes + blk * TK::kBlockBytes, &A.tk, full_k + st, 32 * blk, n0, hk, bb);
          tma_load_4d(sKs + st * TK::kBytes + blk * TK::kBlockBytes, &A.tks, full_k + st, 32 * blk, n0, hk, bb);
        }
      };
      auto load_vt = [&](int t) {
        const int st = t & 1, n0 = static_cast<int>(qb.key0(t, BN));
        mbar_wait(empty_vt + st, ((t >> 1) & 1) ^ 1);
        mbar_expect_tx(full_vt + st, 2 * TVt::kBytes);
        tma_load_4d(sVt + st * TVt::kBytes, &A.tv, full_vt + st, n0, 0, hk, bb);
        tma_load_4d(sVts + st * TVt::kBytes, &A.tvs, full_vt + st, n0, 0, hk, bb);
      };
      if (ntiles > 0) load_k(0);
      for (int t = 0; t < ntiles; ++t) {
        if (t + 1 < ntiles) load_k(t + 1);
        load_vt(t);
      }
    }
    return;
  }

  // ---- consumers: both warpgroups own query rows [m0, m0 + 64); warpgroup wg the dims of half wg --
  regs_increase<C.consumer_regs()>();
  const int wq = (threadIdx.x / 32) & 3, g = lane_id() >> 2;
  const int64_t row_w = m0 + 16 * wq;  // the warp's first query row
  // half wg: its DH / 32 column blocks (D = 128: 2wg, 2wg + 1)
  const uint32_t k_addr = smem_addr(sK) + (DH / 32) * wg * TK::kBlockBytes;
  const uint32_t ks_addr = smem_addr(sKs) + (DH / 32) * wg * TK::kBlockBytes;
  const uint32_t vt_addr = smem_addr(sVt), vts_addr = smem_addr(sVts);

  // Fixed across the tile loop; the SASS check (scripts/check-sass-wgmma.py, run on every build)
  // finds no reuse of their registers there, so no keep_live_in_loop as in the dK/dV kernels.
  uint32_t qb_[KH][4], qs_[KH][4];
  mbar_wait(full_q, 0);
  load_afrag_split_tf32<TQ>(qb_, qs_, sQ, 16 * wq, DH * wg);

  float o[NH][4], ot[NH][4];
  zero(o);
  SoftmaxState st;
  float s[NS][4], s2[NS][4];
  uint32_t pb[NS][4], ps[NS][4];
  float alpha_prev[2] = {1.0f, 1.0f};

  const RowKeys keys(rule, row_w + g, Sq, Skv);  // the lane's rows' visible keys
  const bool fused = a.score.scale > 0.0f;       // uniform: an increasing transform (softmax_rows)
  float* xmine = xS + wg * BM * BN;
  const float* xother = xS + (1 - wg) * BM * BN;

  // S_w of tile t: k-steps 0-3 into s, (D = 128) 4-7 into s2 (one commit group each).
  static_assert(KH == 4 || KH == 8, "chains of 4 k-steps");
  auto issue_scores = [&](int t) {
    const uint32_t kb = k_addr + (t & 1) * TK::kBytes, ks = ks_addr + (t & 1) * TK::kBytes;
    fence_regs(s);
    fence_regs(s2);
    wgmma_fence();
    wg_gemm3_rs_tf32<4, TK, true>(s, ksteps<4>(qb_, 0), ksteps<4>(qs_, 0), kb, ks, 0, false);
    wgmma_commit();
    if constexpr (KH == 8) {
      wg_gemm3_rs_tf32<4, TK, true>(s2, ksteps<4>(qb_, 4), ksteps<4>(qs_, 4), kb + TK::kBlockBytes,
                                    ks + TK::kBlockBytes, 0, false);
      wgmma_commit();
    }
  };
  // O_t = P Vt_t[half] into ot (a fresh accumulator).
  auto issue_pv = [&](int t) {
    const uint32_t off = (t & 1) * TVt::kBytes + DH * wg * 128;  // Vt rows [DH wg, DH (wg + 1))
    fence_regs(ot);
    fence_regs(pb);
    fence_regs(ps);
    wgmma_fence();
    wg_gemm3_rs_tf32<NS, TVt, true>(ot, pb, ps, vt_addr + off, vts_addr + off, 0, false);
    wgmma_commit();
  };
  // After the scores of iteration t completed: S = S_0 + S_1 through the exchange, softmax, P's
  // fragments; alpha (for O) returned.
  auto scores_to_p = [&](int t, float (&alpha)[2]) {
    fence_regs(s);
    fence_regs(s2);
    if constexpr (KH == 8) add_into(s, s2);
    if (t > 0) mbar_wait(taken + wg, (t - 1) & 1);  // the other side read our last partial
    exchange_store<NS>(xmine, s);
    mbar_arrive(ready + wg);
    mbar_wait(ready + (1 - wg), t & 1);
    exchange_load<NS>(s2, xother);
    mbar_arrive(taken + (1 - wg));
    // S_0 + S_1 in both warpgroups (addition commutes exactly): the same P and statistics.
    add_into(s, s2);
    const int64_t n0 = qb.key0(t, BN);
    softmax_tile_sm90<BN>(s, st, alpha, keys, n0, qb.tile_masked(n0, BN, Skv), fused, a.score);
  };
  // P (in s) -> its big and small A fragments; only once no P V product still reads pb, ps.
  auto to_pa = [&] { acc_to_afrag_split_tf32(pb, ps, s); };
  // O = alpha O + O_t, alpha of the tile whose P made O_t.
  auto add_tile = [&] {
    fence_regs(ot);
#pragma unroll
    for (int j = 0; j < NH; ++j) {
      o[j][0] = fmaf(o[j][0], alpha_prev[0], ot[j][0]);
      o[j][1] = fmaf(o[j][1], alpha_prev[0], ot[j][1]);
      o[j][2] = fmaf(o[j][2], alpha_prev[1], ot[j][2]);
      o[j][3] = fmaf(o[j][3], alpha_prev[1], ot[j][3]);
    }
  };
  auto wait_k = [&](int t) { mbar_wait(full_k + (t & 1), (t >> 1) & 1); };
  auto wait_vt = [&](int t) { mbar_wait(full_vt + (t & 1), (t >> 1) & 1); };

  if (ntiles > 0) {
    wait_k(0);
    issue_scores(0);
    wgmma_wait<0>();
    mbar_arrive(empty_k);
    scores_to_p(0, alpha_prev);
    to_pa();
  }
  // Tile t + 1's scores are issued before tile t's P V, so its exchange and softmax run while
  // P V does; every wgmma in the loop is unconditional (the last tile is peeled).
  for (int it = 0; it + 1 < ntiles; ++it) {
    wait_k(it + 1);
    wait_vt(it);
    issue_scores(it + 1);
    issue_pv(it);
    wgmma_wait<1>();
    mbar_arrive(empty_k + ((it + 1) & 1));
    float alpha[2];
    scores_to_p(it + 1, alpha);  // while P_it V_it runs
    wgmma_wait<0>();
    mbar_arrive(empty_vt + (it & 1));
    add_tile();
    alpha_prev[0] = alpha[0];
    alpha_prev[1] = alpha[1];
    to_pa();
  }
  if (ntiles > 0) {
    const int it = ntiles - 1;
    wait_vt(it);
    issue_pv(it);
    wgmma_wait<0>();
    mbar_arrive(empty_vt + (it & 1));
    add_tile();
  }

  bool sees[2];  // rows that see no key by the band: O = 0, LSE = -inf
  rows_in(row_w + g, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
  float inv[2], lse[2];
  finish_rows(st, sees, inv, lse);
  normalize_rows(o, inv, sees);
  if (wg == 0) store_lse(p.lse, b, h, row_w, Sq, lse);
  float* out = static_cast<float*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + m0 * p.out.ss;
  store_rows(out, p.out.ss, 16 * wq, qb.rows, DH * wg, static_cast<int>(p.shape.head_dim), o, 1.0f, true);
#endif
}

}  // namespace flashattn::cuda::dev
