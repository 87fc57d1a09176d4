// The Hopper (sm_90a) float32 backward in tf32 mode at padded D = 128: the same split design, pre-pass
// and operand copies as the D = 64 kernels (tf32_bwd.cuh), with the work of a tile
// divided between two consumer warpgroups by product instead of by rows.
//
// Why: at D = 128 one warpgroup's stationary tf32 fragments (K and V, or Q and dO: 64 registers
// each per thread) and its two head-dim-wide accumulators (dK and dV: 64 each) exceed the 240
// registers a thread can have. Here both warpgroups cover the same 64 rows, and each holds one
// stationary operand and one accumulator: ~160 registers.
//   dK/dV pass (CTA = 64 keys; 32-query tiles):
//     warpgroup 0 (scores side):   S^T = K Q^T; P^T = exp2(logit2(S^T) - lse2), masked -> shared
//                                  memory; dV += P^T dO
//     warpgroup 1 (gradient side): dP^T = V dO^T; reads P^T; dS^T = P^T (dP^T - D); dK += dS^T Q
//   dQ pass (CTA = 64 queries; 32-key tiles):
//     warpgroup 0: S = Q K^T; P = exp2(logit2(S) - lse2), masked -> shared memory; reads dS;
//                  dQ[:, :64] += dS K
//     warpgroup 1: dP = dO V^T; reads P; dS = P (dP - D) -> shared memory; dQ[:, 64:] += dS K
// Each warpgroup issues 2 of the tile's 4 (dK/dV) or 3 (dQ, the last one split by columns)
// products, so the tensor work is even; one warpgroup's softmax or dS runs while the other's
// products do. The exchange goes through one buffer per direction in the accumulator layout
// (thread i of one warpgroup owns the same entries as thread i of the other): float4 stores and
// loads, conflict free, ordered by two mbarriers (128 arrivals each, one phase per tile). Named
// barriers (bar.arrive / bar.sync) would order it as well, but compute-sanitizer's racecheck does
// not follow an arrive-then-sync hand-off (12 false hazards on these buffers); mbarriers it does.
// docs/ALGORITHM.md ("float32 backward in tf32 mode on sm_90a") has the pseudocode.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/sm90/tf32_bwd.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/wgmma.cuh"

namespace flashattn::cuda::dev {

// The exchange's two mbarriers, initialised before init_ring_barriers publishes them: `ahead` -
// the scores side's values of a tile are in the buffer (128 arrivals of warpgroup 0); `back` - the
// gradient side has read them (dK/dV pass) or has written dS (dQ pass; 128 arrivals of
// warpgroup 1). Tile t completes phase t of each, so waits use parity t & 1.
// Also `empty_once` (count arrivals): the consumers have read the block's stationary tiles into
// registers, so that a persistent CTA's producer may copy the next block's over them.
__device__ __forceinline__ void init_exchange_barriers(uint64_t* ahead, uint64_t* back, uint64_t* empty_once,
                                                       int count) {
  if (threadIdx.x == 0) {
    mbar_init(ahead, 128);
    mbar_init(back, 128);
    mbar_init(empty_once, count);
  }
}

// A tile's scores in a 3xTF32 pair kernel (tf32: pair_tiles_pipelined): x = A B^T over the head
// dim, A the warpgroup's stationary fragments (big xa, small xs), B the streamed K-major tile at bx
// (its small part at bx + part), waited for: two chains of 4 k-steps (x2: the head dim's second
// half), added in float32 (x3_fwd.cuh on short chains). No keep_live_in_loop on the stationary
// fragments (the D = 64 split kernels' ptxas fault, wgmma.cuh): the SASS check of CI
// (scripts/check-sass-wgmma.py) finds no reuse of their registers in these kernels, and the
// XORs cost 64 instructions per tile in an instruction-bound loop (measurably slower).
template <class TB, int KS, int KX, int NS>
__device__ __forceinline__ void pair_scores(float (&x)[NS][4], uint32_t (&xa)[KS][4], uint32_t (&xs)[KX][4],
                                            uint32_t bx, int part) {
  static_assert(KX == KS, "3xTF32: big and small fragments");
  float x2[NS][4];
  wgmma_fence();  // x, x2: written only
  wg_gemm3_rs_tf32<KS / 2, TB, true>(x, ksteps<KS / 2>(xa, 0), ksteps<KS / 2>(xs, 0), bx, bx + part, 0, false);
  wg_gemm3_rs_tf32<KS / 2, TB, true>(x2, ksteps<KS / 2>(xa, KS / 2), ksteps<KS / 2>(xs, KS / 2),
                                     bx + TB::kBlockBytes, bx + part + TB::kBlockBytes, 0, false);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(x);
  fence_regs(x2);
  add_into(x, x2);
}

// The same at D = 128 in 3xTF32 with the stationary operand's small part in shared memory
// (pair_small_in_smem): four chains of 4 k-steps (a 32-column block of A and B each), each into a
// fresh accumulator (A_s B_b from shared memory, then A_b B_s, A_b B_b), added in the order
// ((c0 + c1) + c2) + c3.
template <class TA, class TB, int KS, int NS>
__device__ __forceinline__ void pair_scores_sms(float (&x)[NS][4], uint32_t (&xa)[KS][4], uint32_t sa_small,
                                                uint32_t bx, int part) {
  static_assert(KS == 16, "four chains of 4 k-steps");
  float xc[3][NS][4];  // chains 1-3 (chain 0 into x)
  wgmma_fence();       // x, xc: written only
#pragma unroll
  for (int c = 0; c < 4; ++c)
    wg_gemm3_rss_tf32<4, TA, TB, true>(c == 0 ? x : xc[c - 1], ksteps<4>(xa, 4 * c), sa_small + c * TA::kBlockBytes,
                                       bx + c * TB::kBlockBytes, bx + part + c * TB::kBlockBytes, 0, false);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(x);
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    fence_regs(xc[c]);
    add_into(x, xc[c]);
  }
}

// The stationary operand of a pair kernel in 3xTF32 at D = 128 (pair_small_in_smem): big
// fragments of the warpgroup's 64 rows into registers, the small part over the tile (read by
// the tensor cores from there), ordered before any wgmma of this warpgroup reads it.
template <class T, int KS>
__device__ __forceinline__ void split_stationary(uint32_t (&xa)[KS][4], unsigned char* tile, int wq, int wg) {
  split_afrag_in_place<T>(xa, tile, 16 * wq);
  fence_proxy_async();
  named_barrier(1 + wg, 128);
}

// A tile's gradient product in a pair kernel: acc += F B, F the P / dS fragments (X3: big fa,
// small fs) over the tile's k-steps, B the transposed tile at bt from row b_row0 (X3: its small
// part at bt + part), waited for. X3: into a fresh accumulator added in float32 (one chain over
// all tiles would drift: the tensor cores truncate as they accumulate).
template <bool X3, class TB, int NK, int KX, int NT>
__device__ __forceinline__ void pair_accumulate(float (&acc)[NT][4], uint32_t (&fa)[NK][4], uint32_t (&fs)[KX][4],
                                                uint32_t bt, int part, int b_row0) {
  fence_regs(fa);  // written before the fence (wgmma.cuh, fence_regs)
  if constexpr (X3) {
    float at[NT][4];
    fence_regs(fs);
    wgmma_fence();
    wg_gemm3_rs_tf32<NK, TB, true>(at, fa, fs, bt, bt + part, b_row0, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(at);
    add_into(acc, at);
  } else {
    fence_regs(acc);
    wgmma_fence();
    wg_gemm_rs_tf32<NK, TB>(acc, fa, bt, b_row0, true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
  }
}

// The tf32 pair kernels' tile loop (both passes): tile t + 1's scores (S / dP, or S^T / dP^T)
// run on the tensor cores during tile t's softmax / dS and exchange (softmax_ds(t, g0 + t, x),
// which leaves the tile's P / dS fragments in fa). Per tile: issue the next scores into the other
// buffer; softmax_ds; issue acc += fa B_t (B: the G half's tile at g_base from row g_row0); wait
// for both products and release this tile's G half and the next one's X half. The scores' operand
// is the X half's tile at x_base. Every product is waited for within its tile: a product in
// flight across the loop's back edge made ptxas serialize them all (C7515). x's buffer and whether
// a next tile exists are template arguments (registers indexed at run time would go to local
// memory, and no wgmma is issued conditionally), hence the loop unrolled by two.
template <class TX, class TG, int KS, int NS, int NT, int NB, class SoftmaxDs>
__device__ __forceinline__ void pair_tiles_pipelined(float (&acc)[NT][4], uint32_t (&fa)[NS][4],
                                                     const uint32_t (&xa)[KS][4], const TileRing<NB>& ring,
                                                     int g0, int ntiles, uint32_t x_base, int x_stride,
                                                     uint32_t g_base, int g_stride, int g_row0,
                                                     SoftmaxDs&& softmax_ds) {
  float x[2][NS][4];
  auto issue_x = [&](int gt, float(&xo)[NS][4]) {
    ring.wait_x(gt);
    wgmma_fence();  // xo: written only (its last tile's values were read before this)
    wg_gemm_rs_tf32<KS, TX, true>(xo, xa, x_base + ring.slot(gt) * x_stride, 0, false);
    wgmma_commit();
  };
  auto tile = [&](int t, auto cur_c, auto next_c) {
    constexpr int cur = decltype(cur_c)::value;
    constexpr bool kNext = decltype(next_c)::value;
    const int gt = g0 + t;
    if constexpr (kNext) issue_x(gt + 1, x[cur ^ 1]);
    softmax_ds(t, gt, x[cur]);
    ring.wait_g(gt);
    fence_regs(fa);  // written before the fence (wgmma.cuh, fence_regs)
    fence_regs(acc);
    wgmma_fence();
    wg_gemm_rs_tf32<NS, TG>(acc, fa, g_base + ring.slot(gt) * g_stride, g_row0, true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc);
    ring.release_g(gt);
    if constexpr (kNext) {
      fence_regs(x[cur ^ 1]);
      ring.release_x(gt + 1);
    }
  };
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;
  if (ntiles <= 0) return;
  issue_x(g0, x[0]);
  wgmma_wait<0>();
  fence_regs(x[0]);
  ring.release_x(g0);
  int t = 0;
  for (; t + 2 < ntiles; t += 2) {
    tile(t, I0{}, std::true_type{});
    tile(t + 1, I1{}, std::true_type{});
  }
  if (t + 2 == ntiles) {
    tile(t, I0{}, std::true_type{});
    tile(t + 1, I1{}, std::false_type{});
  } else {
    tile(t, I0{}, std::false_type{});
  }
}

// ================================================================================================
// dQ pass, pair design. CTA = BM = 64 queries of one (batch, head); the producer streams BN-key
// tiles of K, V (X half) and K^T (G half) through a TileRing (two buffers; 3xTF32 at D = 128
// one). Per key tile t (in tf32 the next tile's S / dP issued first, below):
//   wg 0: S = Q K_t^T; P = exp2(logit2(S) - lse2) (masked) -> xP; arrive(ahead); wait(back, t);
//         dsa <- xdS; dQ[:, 0:64] += dS K_t
//   wg 1: dP = dO V_t^T; wait(ahead, t); P <- xP; dS = P (dP - D); dsa = tf32(dS) -> xdS;
//         arrive(back); dQ[:, 64:128] += dS K_t
// Order of the buffers: wg 0 writes xP of tile t + 1 only after waiting for tile t's dS, which
// wg 1 writes after reading tile t's P; wg 1 writes xdS of tile t + 1 only after tile t + 1's P
// arrived, which wg 0 sends after reading tile t's dS. One buffer each suffices.
// ================================================================================================
template <int DP, bool X3, bool kWalk>
__global__ void __launch_bounds__(tile_config90_tf32_bwd(Pass::Dq, true).threads(), 1)
    dq_tf32_sm90_pair_kernel(const __grid_constant__ Sm90Tf32BwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90_tf32_bwd(Pass::Dq, true);
  constexpr int BM = C.block_m, BN = C.block_n, TC = 256;
  constexpr int NS = BN / 8, KS = DP / 8, NH = DP / 16;  // NH: 8-column blocks of a dQ half
  static_assert(C.warpgroups == 2 && BM == 64 && 128 * NS * 4 == BM * BN, "pair design: two warpgroups, 64 rows");
  // kSm (3xTF32 at D = 128): Q's / dO's small part in shared memory, the streamed copies in half
  // stages (config.hpp, pair_small_in_smem).
  constexpr bool kSm = pair_small_in_smem(DP, X3);
  static_assert(!X3 || NS == 4, "3xTF32: chains of 4 k-steps");
  static_assert(!X3 || KS == (kSm ? 16 : 8), "3xTF32: chains of 4 k-steps (KS / 2, or KS / 4 with kSm)");
  using TQ = TileSw128F<BM, DP>;  // Q, dO: rows = queries
  using TK = TileSw128F<BN, DP>;  // K, V: rows = keys
  using TT = TileSw128F<DP, BN>;  // K^T: rows = head dim, k = key slots
  // The TileRing's NB buffers of X halves [K, V] and G halves [K^T] (X3: then their small parts;
  // kSm: one buffer each).
  constexpr int NB = kSm ? 1 : 2, kParts = X3 ? 2 : 1;
  constexpr int kHalfX = kParts * 2 * TK::kBytes, kHalfG = kParts * TT::kBytes;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sdO = sQ + TQ::kBytes;
  unsigned char* sX = sdO + TQ::kBytes;
  unsigned char* sG = sX + NB * kHalfX;
  float* xP = reinterpret_cast<float*>(sG + NB * kHalfG);     // [BM x BN] in accumulator order
  uint32_t* xdS = reinterpret_cast<uint32_t*>(xP + BM * BN);  // dS as tf32 A fragments (X3: big, small)
  uint64_t* bars = reinterpret_cast<uint64_t*>(xdS + (X3 ? 2 : 1) * BM * BN);
  uint64_t* full_q = bars;
  uint64_t* ahead = bars + 1;    // the exchange's (init_exchange_barriers)
  uint64_t* back = bars + 2;
  uint64_t* empty_q = bars + 3;  // Q and dO read into registers (persistent: the next block's may land)
  const TileRing<NB> ring{bars + 4};
  // (kWalk false: one block per CTA, blockIdx.x known uniform at compile time - with the queue
  // chosen at run time the block's coordinates left the uniform datapath: the dQ pass measured
  // 5-8% slower at 3xTF32 D = 128.)
  const BlockQueue queue{kWalk ? A.queue : nullptr, reinterpret_cast<int*>(bars + 4 + TileRing<NB>::kBars)};

  const BwdArgs& a = A.f;
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int64_t nx = (Sq + BM - 1) / BM, nitems = nx * p.shape.heads_q * p.shape.batch;

  init_exchange_barriers(ahead, back, empty_q, TC);
  init_ring_barriers(full_q, ring, TC);

  // Persistent-capable: the CTA runs the blocks of its BlockQueue (work_item; one block per CTA by
  // default, select.hpp persistent_ctas); the tiles of all of them form one sequence through the
  // stages and the exchange (g0: the block's first tile in it).
  const int wg = warpgroup_index();  // uniform (device.cuh)
  if (wg == 2) {
    // ---- producer: one thread issues every copy ---------------------------------------------
    regs_decrease<C.producer_regs>();
    if (threadIdx.x == TC) {
      ItemPhase ph{empty_q, 0, 0};
      for (int i = queue.first();; ++ph.k) {
        if (ph.k > 0 && queue.counter == nullptr) break;  // one block per CTA
        ph.wait_once();  // the consumers released the last block (and read its slot)
        queue.slot[ph.k & 1] = i;
        if (i >= nitems) {
          mbar_arrive(full_q);  // no copy: the consumers read the end
          break;
        }
        const int next = queue.next();  // early: the atomic's latency under this block's copies
        const WorkItem w = work_item(i, nx, p.shape.heads_q);
        const QueryBlock qb = query_block<BM, BN>(p.shape, p.num, w.b, w.h, w.x);
        copy_dq_tiles<DP, BM, BN, X3>(A, qb, sQ, sdO, sX, sG, full_q, ring, ph);
        ph.g0 += qb.ntiles;
        i = next;
      }
    }
    return;
  }

  // ---- consumers: both warpgroups own query rows [m0, m0 + 64) ------------------------------
  regs_increase<C.consumer_regs()>();
  const int wq = (threadIdx.x / 32) & 3, g = lane_id() >> 2;
  const uint32_t x_addr = smem_addr(sX), g_addr = smem_addr(sG);
  int g0 = 0;
  for (int k = 0;; ++k) {
    // One CTA per block: block blockIdx.x, known before its copy lands, so that the LSE/D loads
    // below go out under the copy; walking: the slot, once the copy (or the end) has landed.
    // (Nothing may read the stationary tiles in shared memory before the second wait below.)
    const bool walk = queue.counter != nullptr;
    if (k > 0 && !walk) break;
    if (walk) mbar_wait(full_q, k & 1);
    const int i = queue.read(k);
    if (i >= nitems) break;
    const WorkItem w = work_item(i, nx, p.shape.heads_q);
    const QueryBlock qb = query_block<BM, BN>(p.shape, p.num, w.b, w.h, w.x);
    const int64_t b = qb.b, h = qb.h, m0 = qb.m0;
    const int ntiles = qb.ntiles;
    const MaskRule& rule = qb.rule;
    const int64_t row_w = m0 + 16 * wq;  // the warp's first query row

    float l2[2], dl[2];  // the lane's rows g and g + 8: LSE (log2 domain; scores side), D (gradient side)
    const RowKeys keys(rule, row_w + g, Sq, Skv);  // and their visible keys
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row_w + g + 8 * r;
      const bool in = row < Sq;
      l2[r] = in && wg == 0 ? lse_to_log2(p.lse.ptr[b * p.lse.sb + h * p.lse.sh + row * p.lse.ss]) : INFINITY;
      dl[r] = in && wg == 1 ? a.delta[a.ws_row(b, h) + row] : 0.0f;
    }
    // Q (scores side) or dO (gradient side); X3: as stored, split into big (xa) and small (xs;
    // kSm: the small part over the tile in shared memory, read there until the block ends).
    uint32_t xa[KS][4], xs[X3 && !kSm ? KS : 1][4];
    if (!walk) mbar_wait(full_q, k & 1);  // the block's Q and dO have landed
    if constexpr (kSm) split_stationary<TQ>(xa, wg == 0 ? sQ : sdO, wq, wg);
    else if constexpr (X3) load_afrag_split_tf32<TQ>(xa, xs, wg == 0 ? sQ : sdO, 16 * wq, 0);
    else load_afrag_tf32<TQ>(xa, wg == 0 ? sQ : sdO, 16 * wq);
    if constexpr (!kSm) mbar_arrive(empty_q);

    float dq[NH][4];
    zero(dq);
    uint32_t dsa[NS][4], dss[X3 ? NS : 1][4];  // dS's fragments (X3: big, small)
    // Tile t's P (wg 0) or dS (wg 1) from its scores x (S or dP), and the exchange: both
    // warpgroups leave with dS's fragments in dsa (X3: and dss).
    auto softmax_ds = [&](int t, int gt, float(&x)[NS][4]) {
      if (wg == 0) {
        const int64_t n0 = qb.key0(t, BN);  // t: the block's iteration; gt: the CTA's (phases)
        // (Masked or not as two loops: with the test inside one, every entry branched around it.)
        if (qb.tile_masked(n0, BN, Skv)) {
          int lo[2], hi[2];
          keys.tile_cols(n0, BN, lo, hi);
          for_each_entry<NS>([&](int j, int e, int r, int c) {
            const float pe = exp2_ftz(a.score.exp2_arg(x[j][e], l2[e >> 1]));
            x[j][e] = c >= lo[r >> 3] && c < hi[r >> 3] ? pe : 0.0f;
          });
        } else {
          for_each_entry<NS>([&](int j, int e, int, int) { x[j][e] = exp2_ftz(a.score.exp2_arg(x[j][e], l2[e >> 1])); });
        }
        exchange_store<NS>(xP, x);
        mbar_arrive(ahead);
        mbar_wait(back, gt & 1);
        exchange_load_frags(dsa, xdS);
        if constexpr (X3) exchange_load_frags(dss, xdS + BM * BN);
      } else {
        float pv[NS][4];
        mbar_wait(ahead, gt & 1);
        exchange_load<NS>(pv, xP);
#pragma unroll
        for (int j = 0; j < NS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) x[j][e] = pv[j][e] * (x[j][e] - dl[e >> 1]);  // dS
        if constexpr (X3) {
          acc_to_afrag_split_tf32(dsa, dss, x);
          exchange_store_frags(xdS + BM * BN, dss);
        } else {
          acc_to_afrag_tf32(dsa, x);
        }
        exchange_store_frags(xdS, dsa);
        mbar_arrive(back);
      }
    };
    if constexpr (!X3) {
      // tf32: the next tile's S / dP during this tile's softmax, dS and exchange; the gradient
      // product dQ[:, half wg] += dS K_t (B = K^T's rows of that half).
      pair_tiles_pipelined<TK, TT>(dq, dsa, xa, ring, g0, ntiles, x_addr + (wg == 0 ? 0 : TK::kBytes), kHalfX, g_addr,
                                   kHalfG, (DP / 2) * wg, softmax_ds);
    } else {
      // 3xTF32: tile by tile (the split products' extra fragments and partial sums leave no
      // registers for a second tile's scores).
      float x[NS][4];  // S or dP
      for (int t = 0; t < ntiles; ++t) {
        const int gt = g0 + t;
        // S (K) or dP (V), then the X half is free
        const uint32_t bx = x_addr + ring.slot(gt) * kHalfX + (wg == 0 ? 0 : TK::kBytes);
        ring.wait_x(gt);
        if constexpr (kSm)
          pair_scores_sms<TQ, TK>(x, xa, smem_addr(wg == 0 ? sQ : sdO), bx, 2 * TK::kBytes);
        else
          pair_scores<TK>(x, xa, xs, bx, 2 * TK::kBytes);
        ring.release_x(gt);
        softmax_ds(t, gt, x);
        // dQ[:, half wg] += dS K_t (B = K^T's rows of that half).
        ring.wait_g(gt);
        pair_accumulate<X3, TT>(dq, dsa, dss, g_addr + ring.slot(gt) * kHalfG, TT::kBytes, (DP / 2) * wg);
        ring.release_g(gt);
      }
    }
    if constexpr (kSm) mbar_arrive(empty_q);  // the tensor cores' last read of Q's / dO's small part is done

    bool sees[2];  // rows that see no key: dQ = 0 exactly
    rows_in(row_w + g, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
    zero_rows_unless(dq, sees);
    float* out = static_cast<float*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + m0 * p.dq.ss;
    store_rows(out, p.dq.ss, 16 * wq, qb.rows, (DP / 2) * wg, static_cast<int>(p.shape.head_dim), dq,
               a.score.grad_scale(), true);
    g0 += ntiles;
  }
#endif
}

// ================================================================================================
// dK/dV pass, pair design. CTA = BK = 64 keys of one (batch, kv head); the producer streams
// BQ-query tiles of Q, dO (X half), Q^T and dO^T (G half; one thread) and their LSE and D vectors
// (one warp) over every query head of the group through a TileRing (two buffers; 3xTF32 at
// D = 128 one). Per query tile (in tf32 the next tile's S^T / dP^T issued first, below):
//   wg 0: S^T = K Q^T; P^T = exp2(logit2(S^T) - lse2) (masked); wait(back, t - 1) unless first;
//         P^T -> xP; arrive(ahead); dV += P^T dO
//   wg 1: dP^T = V dO^T; wait(ahead, t); P^T <- xP; arrive(back);
//         dS^T = P^T (dP^T - D); dK += dS^T Q
// ================================================================================================
template <int DP, bool X3, bool kWalk>
__global__ void __launch_bounds__(tile_config90_tf32_bwd(Pass::Dkv, true).threads(), 1)
    dkv_tf32_sm90_pair_kernel(const __grid_constant__ Sm90Tf32BwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90_tf32_bwd(Pass::Dkv, true);
  constexpr int BK = C.block_m, BQ = C.block_n, TC = 256;
  constexpr int NS = BQ / 8, NO = DP / 8, KS = DP / 8;
  static_assert(C.warpgroups == 2 && BK == 64 && 128 * NS * 4 == BK * BQ, "pair design: two warpgroups, 64 rows");
  constexpr bool kSm = pair_small_in_smem(DP, X3);  // as in the dQ pair kernel
  static_assert(!X3 || NS == 4, "3xTF32: chains of 4 k-steps");
  static_assert(!X3 || KS == (kSm ? 16 : 8), "3xTF32: chains of 4 k-steps (KS / 2, or KS / 4 with kSm)");
  using TK = TileSw128F<BK, DP>;  // K, V as stored: rows = keys
  using TQ = TileSw128F<BQ, DP>;  // Q, dO: rows = queries
  using TT = TileSw128F<DP, BQ>;  // Q^T, dO^T: rows = head dim, k = query slots
  // The TileRing's NB buffers of X halves [Q, dO] and G halves [Q^T, dO^T] (X3: then their small
  // parts; kSm: one buffer each).
  constexpr int NB = kSm ? 1 : 2, kParts = X3 ? 2 : 1;
  constexpr int kHalfX = kParts * 2 * TQ::kBytes, kHalfG = kParts * 2 * TT::kBytes;
  extern __shared__ float4 smem4[];
  unsigned char* sK = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sV = sK + TK::kBytes;
  unsigned char* sX = sV + TK::kBytes;
  unsigned char* sG = sX + NB * kHalfX;
  float* xP = reinterpret_cast<float*>(sG + NB * kHalfG);  // [BK x BQ] in accumulator order
  float* sL = xP + BK * BQ;                                 // [2][BQ]
  float* sD = sL + 2 * BQ;                                  // [2][BQ]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sD + 2 * BQ);
  uint64_t* full_kv = bars;
  uint64_t* ahead = bars + 1;  // the exchange's (init_exchange_barriers)
  uint64_t* back = bars + 2;
  uint64_t* empty_kv = bars + 3;  // K and V read into registers (persistent: the next block's may land)
  const TileRing<NB> ring{bars + 4};
  // (kWalk false: one block per CTA, blockIdx.x known uniform at compile time, as in the dQ pair
  // kernel above.)
  const BlockQueue queue{kWalk ? A.queue : nullptr, reinterpret_cast<int*>(bars + 4 + TileRing<NB>::kBars)};

  const BwdArgs& a = A.f;
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int64_t nx = (Skv + BK - 1) / BK, nitems = nx * p.shape.heads_kv * p.shape.batch;

  init_exchange_barriers(ahead, back, empty_kv, TC);
  init_ring_barriers(full_kv, ring, TC);

  // Persistent-capable, as the dQ pair kernel: the blocks of its BlockQueue, one tile sequence.
  const int wg = warpgroup_index();  // uniform (device.cuh)
  if (wg == 2) {
    // ---- producer: warp 0's first thread copies, warp 1 fills the LSE/D vectors -------------------
    regs_decrease<C.producer_regs>();
    const int pw = (threadIdx.x - TC) / 32;
    if (pw >= 2) return;
    const bool leader = pw == 0 && lane_id() == 0;
    ItemPhase ph{empty_kv, 0, 0};
    for (int i = leader ? queue.first() : 0;; ++ph.k) {
      if (ph.k > 0 && queue.counter == nullptr) break;  // one block per CTA
      if (leader) {
        ph.wait_once();  // the consumers released the last block (and read its slot)
        queue.slot[ph.k & 1] = i;
      }
      // Warps 0 and 1 meet once per block: warp 1 reads the slot written above, and the leader
      // writes it again only after warp 1 met it here for the next block.
      __syncwarp();
      named_barrier(3, 64);
      const int item = queue.read(ph.k);
      if (item >= nitems) {
        if (leader) mbar_arrive(full_kv);  // no copy: the consumers read the end
        break;
      }
      const int next = leader ? queue.next() : 0;
      const WorkItem w = work_item(item, nx, p.shape.heads_kv);
      const KeyBlock kb = key_block<BK, BQ>(p.shape, p.num, w.b, w.h, w.x);
      copy_dkv_tiles<DP, BK, BQ, X3>(A, kb, pw, sK, sV, sX, sG, sL, sD, full_kv, ring, ph);
      ph.g0 += kb.ntiles;
      i = next;
    }
    return;
  }

  // ---- consumers: both warpgroups own key rows [m0, m0 + 64) --------------------------------
  regs_increase<C.consumer_regs()>();
  const int wq = (threadIdx.x / 32) & 3, lane = lane_id();
  const int krow = 16 * wq;  // the warp's first key row in the CTA
  const uint32_t x_addr = smem_addr(sX), g_addr = smem_addr(sG);
  int g0 = 0;
  for (int k = 0;; ++k) {
    if (k > 0 && queue.counter == nullptr) break;  // one block per CTA
    mbar_wait(full_kv, k & 1);  // the block's K and V (or the end) have landed
    const int i = queue.read(k);
    if (i >= nitems) break;
    const WorkItem w = work_item(i, nx, p.shape.heads_kv);
    const KeyBlock kb = key_block<BK, BQ>(p.shape, p.num, w.b, w.h, w.x);
    const int64_t b = kb.b, hk = kb.hk, m0 = kb.m0;
    const int ntiles = kb.ntiles;
    const MaskRule& rule = kb.rule;
    const int64_t row_w = m0 + krow;

    // K (scores side) or V (gradient side); X3: split into big (xa) and small (xs; kSm: the
    // small part over the tile in shared memory, read there until the block ends).
    uint32_t xa[KS][4], xs[X3 && !kSm ? KS : 1][4];
    if constexpr (kSm) split_stationary<TK>(xa, wg == 0 ? sK : sV, wq, wg);
    else if constexpr (X3) load_afrag_split_tf32<TK>(xa, xs, wg == 0 ? sK : sV, krow, 0);
    else load_afrag_tf32<TK>(xa, wg == 0 ? sK : sV, krow);
    if constexpr (!kSm) mbar_arrive(empty_kv);
    float acc[NO][4];  // dV (scores side) or dK (gradient side)
    zero(acc);

    const KeyRowQueries kq(rule, row_w + lane / 4, Sq, Skv);

    uint32_t fa[NS][4], fs[X3 ? NS : 1][4];  // P^T or dS^T as A fragments (X3: big, small)
    // Tile it's P^T (wg 0) or dS^T (wg 1) from its scores x (S^T or dP^T), the exchange, and the
    // result as A fragments in fa (X3: and fs). Every thread arrives on the vectors' empty
    // barrier: an arrival releases only the arriving thread's own accesses (the sL/sD reads),
    // which the producer's next writes there must follow.
    auto softmax_ds = [&](int it, int gt, float(&x)[NS][4]) {
      ring.wait_v(gt);
      if (wg == 0) {
        const int64_t n0 = kb.q0(it, BQ);  // first query row
        const float* sLs = sL + (gt & 1) * BQ;
        // (Masked or not as two loops: with the test inside one, every entry branched around it.)
        if (kb.tile_masked(n0, BQ, BK, Sq, Skv)) {
          int lo[2], hi[2];
          kq.tile_bounds(n0, BQ, true, lo, hi);
          for_each_entry<NS>([&](int j, int e, int r, int c) {
            const float pe = exp2_ftz(a.score.exp2_arg(x[j][e], sLs[c]));
            x[j][e] = c >= lo[r >> 3] && c < hi[r >> 3] ? pe : 0.0f;
          });
        } else {
          for_each_entry<NS>([&](int j, int e, int, int c) { x[j][e] = exp2_ftz(a.score.exp2_arg(x[j][e], sLs[c])); });
        }
        ring.release_v(gt);
        if (gt > 0) mbar_wait(back, (gt - 1) & 1);  // the other side has read the last tile's P^T
        exchange_store<NS>(xP, x);
        mbar_arrive(ahead);
      } else {
        float pv[NS][4];
        mbar_wait(ahead, gt & 1);
        exchange_load<NS>(pv, xP);
        mbar_arrive(back);
        const float* sDs = sD + (gt & 1) * BQ;
        for_each_entry<NS>([&](int j, int e, int, int c) { x[j][e] = pv[j][e] * (x[j][e] - sDs[c]); });  // dS^T
        ring.release_v(gt);
      }
      if constexpr (X3) acc_to_afrag_split_tf32(fa, fs, x);
      else acc_to_afrag_tf32(fa, x);
    };
    if constexpr (!X3) {
      // tf32: the next tile's S^T / dP^T during this tile's softmax, dS^T and exchange (as in the
      // dQ pair kernel); the gradient product dV += P^T dO (B = dO^T) or dK += dS^T Q (B = Q^T).
      pair_tiles_pipelined<TQ, TT>(acc, fa, xa, ring, g0, ntiles, x_addr + (wg == 0 ? 0 : TQ::kBytes), kHalfX,
                                   g_addr + (wg == 0 ? TT::kBytes : 0), kHalfG, 0, softmax_ds);
    } else {
      // 3xTF32: tile by tile (as in the dQ pair kernel).
      float x[NS][4];  // S^T or dP^T
      for (int it = 0; it < ntiles; ++it) {
        const int gt = g0 + it;
        // S^T (Q) or dP^T (dO), then the X half is free
        const uint32_t bx = x_addr + ring.slot(gt) * kHalfX + (wg == 0 ? 0 : TQ::kBytes);
        ring.wait_x(gt);
        if constexpr (kSm)
          pair_scores_sms<TK, TQ>(x, xa, smem_addr(wg == 0 ? sK : sV), bx, 2 * TQ::kBytes);
        else
          pair_scores<TQ>(x, xa, xs, bx, 2 * TQ::kBytes);
        ring.release_x(gt);
        softmax_ds(it, gt, x);
        // dV += P^T dO (B = dO^T) or dK += dS^T Q (B = Q^T)
        const uint32_t bt = g_addr + ring.slot(gt) * kHalfG + (wg == 0 ? TT::kBytes : 0);
        ring.wait_g(gt);
        if constexpr (kSm) {
          // by head-dim halves: a fresh accumulator of 64 columns at a time (registers)
          pair_accumulate<X3, TT>(acc_cols<NO / 2>(acc, 0), fa, fs, bt, 2 * TT::kBytes, 0);
          pair_accumulate<X3, TT>(acc_cols<NO / 2>(acc, NO / 2), fa, fs, bt, 2 * TT::kBytes, DP / 2);
        } else {
          pair_accumulate<X3, TT>(acc, fa, fs, bt, 2 * TT::kBytes, 0);
        }
        ring.release_g(gt);
      }
    }
    if constexpr (kSm) mbar_arrive(empty_kv);  // the tensor cores' last read of K's / V's small part is done

    bool seen[2];  // keys no query row sees: dK = dV = 0 exactly
    rows_in(row_w + lane / 4, rule.live_keys_begin(Skv), rule.live_keys_end(Sq, Skv), seen);
    zero_rows_unless(acc, seen);
    const int D = static_cast<int>(p.shape.head_dim);
    if (wg == 0) {
      float* dvp = static_cast<float*>(p.dv.ptr) + b * p.dv.sb + hk * p.dv.sh + m0 * p.dv.ss;
      store_rows(dvp, p.dv.ss, krow, kb.rows, 0, D, acc, 1.0f, true);
    } else {
      float* dkp = static_cast<float*>(p.dk.ptr) + b * p.dk.sb + hk * p.dk.sh + m0 * p.dk.ss;
      store_rows(dkp, p.dk.ss, krow, kb.rows, 0, D, acc, a.score.grad_scale(), true);
    }
    g0 += ntiles;
  }
#endif
}

}  // namespace flashattn::cuda::dev
