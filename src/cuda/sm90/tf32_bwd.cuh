// The Hopper (sm_90a) float32 backward in tf32 mode: the split design of the mma.sync kernels (a
// dQ pass over query blocks and a dK/dV pass over key blocks; every sum in a fixed order, no
// atomics) with tf32 wgmma (m64nNk8). tf32 wgmma reads shared memory K-major only, so every B
// operand must be stored with its k dimension contiguous: the products contract over the head dim
// (S = Q K^T, dP = dO V^T: K, V, Q, dO as stored) and over keys or queries (dQ = dS K,
// dV = P^T dO, dK = dS^T Q: K, dO, Q transposed). A pre-pass (operand_copies.cu,
// launch_tf32_operands) writes each operand once rounded to tf32 and, where needed, transposed,
// with positions in tf32_slot order so that the P / dS accumulators serve as A fragments as they
// are (device.cuh); the copy engine then streams those copies like the 16-bit kernels' tiles.
// The stationary operands (Q and dO of a query block, K and V of a key block) are tf32 register
// fragments. docs/ALGORITHM.md ("float32 backward in tf32 mode on sm_90a") has the pseudocode.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <climits>
#include <type_traits>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/wgmma.cuh"

namespace flashattn::cuda::dev {

// Tensor maps (4-d, boxes of 32 columns): dQ pass: tq, tdo (Q, dO as the caller stores them,
// rounded or split when loaded into registers; 64-row boxes),
// tk, tv (rounded K, V; 64-row boxes), tkt (K^T: rows = head dim, columns = key slots);
// dK/dV pass: tk, tv (K, V as the caller stores them; 128-row boxes), tq, tdo (rounded Q, dO),
// tqt, tdot (Q^T, dO^T: rows = head dim, columns = query slots). The fp32-accurate backward (the
// pair kernels with X3) reads the stationary operands as the caller stores them (tq, tdo in the
// dQ pass, tk, tv in the dK/dV pass; split into big and small when loaded into registers - at
// D = 128 big into registers, small in place in shared memory) and every streamed one twice: the
// big copies above and the small parts in the *s maps.
struct Sm90Tf32BwdArgs {
  BwdArgs f;
  CUtensorMap tq, tdo, tk, tv, tkt, tqt, tdot;
  CUtensorMap tks, tvs, tkts, tqs, tdos, tqts, tdots;
  uint32_t opaque_zero;  // 0, unknown to the compiler (keep_live_in_loop, wgmma.cuh)
  int* queue;  // the pair kernels launched with fewer CTAs than blocks: this pass's counter (BlockQueue)
};

// The block sequence of a pair kernel's CTA. One CTA per block (queue == nullptr): block
// blockIdx.x alone (the default). Fewer CTAs than blocks (select.hpp persistent_ctas): every block,
// the first too, taken from a global counter (zeroed before the launch) by the producer thread, so
// that a CTA whose blocks ran short takes more - causal blocks differ in length, and a fixed walk
// (c, c + N, ...) measured slower: it left CTAs idle while others worked - and a CTA that
// starts late (its multiprocessor busy with the side stream's copies) holds no block meanwhile.
// The producer thread publishes the k-th block's index in shared slot k & 1 before the arrival that
// starts the block's stationary copy, and an index >= the block count (then arriving without a
// copy) ends the CTA; the consumers read the slot once that barrier phase has completed. A slot is
// written again two blocks later, after the consumers released the block in between.
struct BlockQueue {
  int* counter;  // global (nullptr: one block per CTA)
  int* slot;     // shared, [2]
  __device__ __forceinline__ int first() const {
    return counter == nullptr ? static_cast<int>(blockIdx.x) : atomicAdd(counter, 1);
  }
  __device__ __forceinline__ int next() const { return counter == nullptr ? INT_MAX : atomicAdd(counter, 1); }
  // Block k's index as every lane of a whole, converged warp reads it (not from a single thread:
  // the broadcast needs all 32 lanes): one CTA per block, blockIdx.x;
  // else the slot, broadcast from lane 0 so that the compiler knows it is warp-uniform (read as
  // is, the block's coordinates and addresses left the uniform datapath).
  __device__ __forceinline__ int read(int k) const {
    return counter == nullptr ? static_cast<int>(blockIdx.x) : __shfl_sync(0xffffffffu, slot[k & 1], 0);
  }
};

// A block's place in a persistent CTA's sequence of blocks (the pair kernels): the block is the
// k-th of the CTA, its first tile the g0-th of the CTA (TileRing slot and phase of tile g0),
// and its stationary tiles may be copied once the consumers released the last block's from
// `empty_once` (none before the first block; a CTA of one block passes no barrier).
struct ItemPhase {
  uint64_t* empty_once = nullptr;
  int k = 0, g0 = 0;
  __device__ __forceinline__ void wait_once() const {
    if (empty_once != nullptr) mbar_wait(empty_once, (k & 1) ^ 1);
  }
};

// The streamed tiles of the tf32 backward kernels: per tile an X half (the scores' operands: K, V
// or Q, dO; X3: then their small parts) and a G half (the gradient product's B operands: K^T or
// Q^T, dO^T; X3: then their small parts), NB buffers of each (NB = 2; 1 for the 3xTF32 pair
// kernels at D = 128, pair_small_in_smem), each buffer with a full barrier (the copy engine's
// bytes, one arrival) and an empty barrier (every consumer thread). A tile's X half is released
// once its scores are done and its G half once its gradient product is, each as early as its
// readers allow: with one barrier per whole stage the next-but-one tile's copy waited for the
// gradient product, and the scores issued right after it waited for that copy's whole latency.
// dK/dV: the tile's LSE and D vectors in a ring of two of their own (fullv: the 32 lanes that
// fill them; emptyv: every consumer thread, after its softmax and dS reads).
// Layout: bars[fullx NB][fullg NB][emptyx NB][emptyg NB][fullv 2][emptyv 2].
template <int NB>
struct TileRing {
  static_assert(NB == 1 || NB == 2, "one or two buffers per half");
  static constexpr int kBars = 4 * NB + 4;
  uint64_t* bars;
  __device__ __forceinline__ static int slot(int gt) { return NB == 1 ? 0 : gt & 1; }
  __device__ __forceinline__ static uint32_t phase(int gt) { return (NB == 1 ? gt : gt >> 1) & 1; }
  __device__ __forceinline__ uint64_t* fullx(int gt) const { return bars + slot(gt); }
  __device__ __forceinline__ uint64_t* fullg(int gt) const { return bars + NB + slot(gt); }
  __device__ __forceinline__ uint64_t* emptyx(int gt) const { return bars + 2 * NB + slot(gt); }
  __device__ __forceinline__ uint64_t* emptyg(int gt) const { return bars + 3 * NB + slot(gt); }
  __device__ __forceinline__ uint64_t* fullv(int gt) const { return bars + 4 * NB + (gt & 1); }
  __device__ __forceinline__ uint64_t* emptyv(int gt) const { return bars + 4 * NB + 2 + (gt & 1); }
  // consumers
  __device__ __forceinline__ void wait_x(int gt) const { mbar_wait(fullx(gt), phase(gt)); }
  __device__ __forceinline__ void wait_g(int gt) const { mbar_wait(fullg(gt), phase(gt)); }
  __device__ __forceinline__ void wait_v(int gt) const { mbar_wait(fullv(gt), (gt >> 1) & 1); }
  __device__ __forceinline__ void release_x(int gt) const { mbar_arrive(emptyx(gt)); }
  __device__ __forceinline__ void release_g(int gt) const { mbar_arrive(emptyg(gt)); }
  __device__ __forceinline__ void release_v(int gt) const { mbar_arrive(emptyv(gt)); }
  // the LSE/D lanes: once the consumers released tile gt - 2's vectors
  __device__ __forceinline__ void wait_v_free(int gt) const { mbar_wait(emptyv(gt), ((gt >> 1) & 1) ^ 1); }
};

// Thread 0 initialises the block's stationary barrier `once` (one arrival), a TileRing's and the
// pair kernels' exchange barriers (init_exchange_barriers, before this), then the CTA meets.
template <int NB>
__device__ __forceinline__ void init_ring_barriers(uint64_t* once, const TileRing<NB>& ring, int consumers) {
  if (threadIdx.x == 0) {
    mbar_init(once, 1);
    for (int i = 0; i < NB; ++i) {
      mbar_init(ring.bars + i, 1);
      mbar_init(ring.bars + NB + i, 1);
      mbar_init(ring.bars + 2 * NB + i, consumers);
      mbar_init(ring.bars + 3 * NB + i, consumers);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(ring.bars + 4 * NB + i, 32);
      mbar_init(ring.bars + 4 * NB + 2 + i, consumers);
    }
    mbar_init_fence();
  }
  __syncthreads();
}

// One half of tile gt into buffer dst once the consumers released it (empty, phase parity
// `phase` of the fill): tile gt's box of each of the N maps into consecutive TB tiles from dst,
// NBLK 32-column blocks each. Row-major copies start at row x0 (columns = head dim); transposed
// ones (rows = head dim) at column x0. (A rolled loop: unrolled, the producer's 64 registers
// spilled the addresses.)
template <class TB, int NBLK, bool kTransposed, int N>
__device__ __forceinline__ void copy_half_stage(unsigned char* dst, const CUtensorMap* const (&maps)[N], uint64_t* full,
                                                uint64_t* empty, uint32_t phase, int x0, int hh, int bb) {
  mbar_wait(empty, phase ^ 1);
  mbar_expect_tx(full, N * TB::kBytes);
#pragma unroll 1
  for (int blk = 0; blk < NBLK; ++blk)
#pragma unroll
    for (int m = 0; m < N; ++m)
      tma_load_4d(dst + m * TB::kBytes + blk * TB::kBlockBytes, maps[m], full, kTransposed ? x0 + 32 * blk : 32 * blk,
                  kTransposed ? 0 : x0, hh, bb);
}

// The first N of a list of tensor maps (the big copies' maps come first, the small parts' after).
template <int N, int M>
__device__ __forceinline__ const CUtensorMap* const (&first_maps(const CUtensorMap* const (&maps)[M]))[N] {
  static_assert(N <= M, "first N of M maps");
  return *reinterpret_cast<const CUtensorMap* const(*)[N]>(&maps);
}

// The producer warpgroups of the dQ kernels (here and tf32_bwd_pair.cuh): one thread
// copies the block's Q and dO (BM rows, 64-row boxes) once, then per BN-key tile its X half
// [K, V] (rows = keys; X3: then [Ks, Vs]) and its G half [K^T] (rows = head dim; X3: then K^Ts)
// into the TileRing's buffers from sX and sG.
// ph: where the block sits in a persistent CTA's sequence (the default: a CTA of one block).
template <int DP, int BM, int BN, bool X3, int NB>
__device__ __forceinline__ void copy_dq_tiles(const Sm90Tf32BwdArgs& A, const QueryBlock& qb, unsigned char* sQ,
                                              unsigned char* sdO, unsigned char* sX, unsigned char* sG,
                                              uint64_t* full_q, const TileRing<NB>& ring, ItemPhase ph = ItemPhase{}) {
  using TQ = TileSw128F<BM, DP>;
  using TK = TileSw128F<BN, DP>;
  using TT = TileSw128F<DP, BN>;
  constexpr int kHalfX = (X3 ? 2 : 1) * 2 * TK::kBytes, kHalfG = (X3 ? 2 : 1) * TT::kBytes;
  const int bb = static_cast<int>(qb.b), hh = static_cast<int>(qb.h), hk = static_cast<int>(qb.hk);
  ph.wait_once();
  mbar_expect_tx(full_q, 2 * TQ::kBytes);
#pragma unroll
  for (int blk = 0; blk < DP / 32; ++blk)
#pragma unroll
    for (int rb = 0; rb < BM / 64; ++rb) {
      const int off = blk * TQ::kBlockBytes + rb * 64 * 128, row = static_cast<int>(qb.m0) + 64 * rb;
      tma_load_4d(sQ + off, &A.tq, full_q, 32 * blk, row, hh, bb);
      tma_load_4d(sdO + off, &A.tdo, full_q, 32 * blk, row, hh, bb);
    }
  // t counts the block's iterations, gt the CTA's (ring slots and phases); the key tile is t_begin + t.
  for (int t = 0; t < qb.ntiles; ++t) {
    const int gt = ph.g0 + t, n0 = static_cast<int>(qb.key0(t, BN)), sl = ring.slot(gt);
    // the big copies' maps, then the small parts' (X3 only)
    const CUtensorMap* const xs[4] = {&A.tk, &A.tv, &A.tks, &A.tvs};
    const CUtensorMap* const gs[2] = {&A.tkt, &A.tkts};
    copy_half_stage<TK, DP / 32, false>(sX + sl * kHalfX, first_maps<X3 ? 4 : 2>(xs), ring.fullx(gt), ring.emptyx(gt),
                                        ring.phase(gt), n0, hk, bb);
    copy_half_stage<TT, BN / 32, true>(sG + sl * kHalfG, first_maps<X3 ? 2 : 1>(gs), ring.fullg(gt), ring.emptyg(gt),
                                       ring.phase(gt), n0, hk, bb);
  }
}

// The producer warpgroups of the dK/dV kernels: producer warp pw = 0's first thread copies the
// block's K and V (BK rows) once, then per BQ-query tile its X half [Q, dO] (rows = queries; X3:
// then [Qs, dOs]) and its G half [Q^T, dO^T] (rows = head dim; X3: then [Q^Ts, dO^Ts]) into the
// TileRing's buffers; warp 1 writes the tile's LSE and D vectors into the ring's vector buffer
// gt & 1 (sL, sD: [2][BQ]). ph: as for copy_dq_tiles.
template <int DP, int BK, int BQ, bool X3, int NB>
__device__ __forceinline__ void copy_dkv_tiles(const Sm90Tf32BwdArgs& A, const KeyBlock& kb, int pw, unsigned char* sK,
                                               unsigned char* sV, unsigned char* sX, unsigned char* sG, float* sL,
                                               float* sD, uint64_t* full_kv, const TileRing<NB>& ring,
                                               ItemPhase ph = ItemPhase{}) {
  using TK = TileSw128F<BK, DP>;
  using TQ = TileSw128F<BQ, DP>;
  using TT = TileSw128F<DP, BQ>;
  constexpr int kHalfX = (X3 ? 2 : 1) * 2 * TQ::kBytes, kHalfG = (X3 ? 2 : 1) * 2 * TT::kBytes;
  const int bb = static_cast<int>(kb.b), hk = static_cast<int>(kb.hk), m0 = static_cast<int>(kb.m0);
  if (pw == 0 && lane_id() == 0) {
    ph.wait_once();
    mbar_expect_tx(full_kv, 2 * TK::kBytes);
#pragma unroll
    for (int blk = 0; blk < DP / 32; ++blk) {
      tma_load_4d(sK + blk * TK::kBlockBytes, &A.tk, full_kv, 32 * blk, m0, hk, bb);
      tma_load_4d(sV + blk * TK::kBlockBytes, &A.tv, full_kv, 32 * blk, m0, hk, bb);
    }
    for (int it = 0; it < kb.ntiles; ++it) {
      const int gt = ph.g0 + it, sl = ring.slot(gt);
      const int h = static_cast<int>(kb.head(it)), n0 = static_cast<int>(kb.q0(it, BQ));
      const CUtensorMap* const xs[4] = {&A.tq, &A.tdo, &A.tqs, &A.tdos};
      const CUtensorMap* const gs[4] = {&A.tqt, &A.tdot, &A.tqts, &A.tdots};
      copy_half_stage<TQ, DP / 32, false>(sX + sl * kHalfX, first_maps<X3 ? 4 : 2>(xs), ring.fullx(gt),
                                          ring.emptyx(gt), ring.phase(gt), n0, h, bb);
      copy_half_stage<TT, BQ / 32, true>(sG + sl * kHalfG, first_maps<X3 ? 4 : 2>(gs), ring.fullg(gt),
                                         ring.emptyg(gt), ring.phase(gt), n0, h, bb);
    }
  } else if (pw == 1) {
    for (int it = 0; it < kb.ntiles; ++it) {
      const int gt = ph.g0 + it;
      ring.wait_v_free(gt);
      fill_lse_delta<BQ>(sL + (gt & 1) * BQ, sD + (gt & 1) * BQ, A.f, kb.b, kb.head(it), kb.q0(it, BQ));
      mbar_arrive(ring.fullv(gt));
    }
  }
}

// ================================================================================================
// dQ pass. CTA = 128 query rows of one (batch, head), warpgroup w owning rows 64w..64w+63; the
// producer streams 64-key tiles of K, V (X half) and K^T (G half) through a TileRing of two.
// Per consumer warpgroup, with S_0, dP_0 issued before the loop and P_0, dS_0 computed:
//   iteration j: dS_j -> A fragments; issue S_{j+1} = Q K_{j+1}^T, dP_{j+1} = dO V_{j+1}^T and
//   dQ += dS_j K_j (asynchronous, in that order); wait for S_{j+1}, dP_{j+1}, release tile j + 1's
//   X half; P_{j+1} = exp2(logit2(S) - lse2), dS_{j+1} = P (dP - D) while dQ += dS_j K_j runs; wait;
//   release tile j's G half.
// ================================================================================================
template <int DP>
__global__ void __launch_bounds__(tile_config90_tf32_bwd(Pass::Dq, false).threads(), 1)
    dq_tf32_sm90_kernel(const __grid_constant__ Sm90Tf32BwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90_tf32_bwd(Pass::Dq, false);
  constexpr int BM = C.block_m, BN = C.block_n, NWG = C.warpgroups, TC = 128 * NWG;
  constexpr int NS = BN / 8, NO = DP / 8, KS = DP / 8;
  using TQ = TileSw128F<BM, DP>;  // Q, dO: rows = queries
  using TK = TileSw128F<BN, DP>;  // K, V: rows = keys
  using TT = TileSw128F<DP, BN>;  // K^T: rows = head dim, k = key slots
  constexpr int kHalfX = 2 * TK::kBytes, kHalfG = TT::kBytes;  // [K, V], [K^T]
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sdO = sQ + TQ::kBytes;
  unsigned char* sX = sdO + TQ::kBytes;  // [2][K, V]
  unsigned char* sG = sX + 2 * kHalfX;   // [2][K^T]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sG + 2 * kHalfG);
  uint64_t* full_q = bars;
  const TileRing<2> ring{bars + 1};

  const BwdArgs& a = A.f;
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, m0 = qb.m0;
  const int ntiles = qb.ntiles;
  const MaskRule& rule = qb.rule;

  init_ring_barriers(full_q, ring, TC);

  const int wg = warpgroup_index();  // uniform (device.cuh)
  if (wg == NWG) {
    // ---- producer: one thread issues every copy ---------------------------------------------
    regs_decrease<C.producer_regs>();
    if (threadIdx.x == TC) copy_dq_tiles<DP, BM, BN, false>(A, qb, sQ, sdO, sX, sG, full_q, ring);
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------------
  regs_increase<C.consumer_regs()>();
  const int warp = threadIdx.x / 32, g = lane_id() >> 2;
  const int64_t row_w = m0 + 16 * warp;  // the warp's first query row
  const uint32_t x_addr = smem_addr(sX), g_addr = smem_addr(sG);

  float l2[2], dl[2];  // the lane's rows g and g + 8: LSE (log2 domain) and D
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row_w + g + 8 * r;
    const bool in = row < Sq;
    l2[r] = in ? lse_to_log2(p.lse.ptr[b * p.lse.sb + h * p.lse.sh + row * p.lse.ss]) : INFINITY;
    dl[r] = in ? a.delta[a.ws_row(b, h) + row] : 0.0f;
  }
  const RowKeys keys(rule, row_w + g, Sq, Skv);  // and their visible keys
  uint32_t qa[KS][4], doa[KS][4];
  mbar_wait(full_q, 0);
  load_afrag_tf32<TQ>(qa, sQ, 16 * warp);
  load_afrag_tf32<TQ>(doa, sdO, 16 * warp);

  float dq[NO][4];
  zero(dq);
  float s[NS][4], dp[NS][4];
  uint32_t dsa[NS][4];

  auto issue_sdp = [&](int t) {
    const uint32_t s0 = x_addr + ring.slot(t) * kHalfX;
    ring.wait_x(t);
    fence_regs(s);
    fence_regs(dp);
    wgmma_fence();
    wg_gemm_rs_tf32<KS, TK>(s, qa, s0, 0, false);
    wg_gemm_rs_tf32<KS, TK>(dp, doa, s0 + TK::kBytes, 0, false);
    wgmma_commit();
  };
  // P = exp2(logit2(S) - lse2) (0 where masked), dS = P (dP - D) into dp; iteration t.
  auto probs = [&](int t) {
    const int64_t n0 = qb.key0(t, BN);
    // (Masked or not as two loops: with the test inside one, every entry branched around it.)
    if (qb.tile_masked(n0, BN, Skv)) {
      int lo[2], hi[2];
      keys.tile_cols(n0, BN, lo, hi);
      for_each_entry<NS>([&](int j, int e, int r, int c) {
        const float pe = exp2_ftz(a.score.exp2_arg(s[j][e], l2[e >> 1]));
        dp[j][e] = (c >= lo[r >> 3] && c < hi[r >> 3] ? pe : 0.0f) * (dp[j][e] - dl[e >> 1]);
      });
    } else {
      for_each_entry<NS>([&](int j, int e, int, int) {
        dp[j][e] = exp2_ftz(a.score.exp2_arg(s[j][e], l2[e >> 1])) * (dp[j][e] - dl[e >> 1]);
      });
    }
  };
  // Tile t's dQ product, overlapped with tile t + 1's scores (the last tile is a separate
  // instantiation, so that no wgmma is issued conditionally: see the forward's main loop).
  auto tile = [&](int t, auto has_next) {
    constexpr bool kNext = decltype(has_next)::value;
    acc_to_afrag_tf32(dsa, dp);
    fence_regs(dsa);  // written before the fence (wgmma.cuh, fence_regs)
    if constexpr (kNext) issue_sdp(t + 1);
    ring.wait_g(t);
    fence_regs(dq);
    wgmma_fence();
    wg_gemm_rs_tf32<NS, TT>(dq, dsa, g_addr + ring.slot(t) * kHalfG, 0, true);
    wgmma_commit();
    if constexpr (kNext) {
      wgmma_wait<1>();
      fence_regs(s);
      fence_regs(dp);
      ring.release_x(t + 1);  // S and dP of tile t + 1 are done: its X half may be refilled
      probs(t + 1);
    }
    wgmma_wait<0>();
    fence_regs(dq);
    ring.release_g(t);
  };

  if (ntiles > 0) {
    issue_sdp(0);
    wgmma_wait<0>();
    fence_regs(s);
    fence_regs(dp);
    ring.release_x(0);
    probs(0);
    for (int t = 0; t + 1 < ntiles; ++t) tile(t, std::true_type{});
    tile(ntiles - 1, std::false_type{});
  }

  bool sees[2];  // rows that see no key: dQ = 0 exactly
  rows_in(row_w + g, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
  zero_rows_unless(dq, sees);
  float* out = static_cast<float*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + m0 * p.dq.ss;
  store_rows(out, p.dq.ss, 16 * warp, qb.rows, 0, static_cast<int>(p.shape.head_dim), dq, a.score.grad_scale(),
             true);
#endif
}

// ================================================================================================
// dK/dV pass. CTA = 128 keys of one (batch, kv head), warpgroup w owning keys 64w..64w+63; the
// producer streams 64-query tiles of Q, dO (X half), Q^T and dO^T (G half; one thread, copy
// engine) and their LSE and D vectors (one warp) over every query head of the group through a
// TileRing of two. Per consumer
// warpgroup and query tile:
//   S^T = K_w Q^T, dP^T = V_w dO^T                       (K_w, V_w: register fragments)
//   P^T = exp2(logit2(S^T) - lse2), dS^T = P^T (dP^T - D) (registers; masks)
//   dV_w += P^T dO, dK_w += dS^T Q                        (P^T, dS^T as A fragments; B = dO^T, Q^T)
// K_w and V_w (64 of the 240 registers), dK_w, dV_w and S^T, dP^T (then P^T, dS^T as A
// fragments) leave no room for a second set of scores, so a warpgroup's products do not overlap
// its own softmax; the other warpgroup's do.
// ================================================================================================
template <int DP>
__global__ void __launch_bounds__(tile_config90_tf32_bwd(Pass::Dkv, false).threads(), 1)
    dkv_tf32_sm90_kernel(const __grid_constant__ Sm90Tf32BwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90_tf32_bwd(Pass::Dkv, false);
  constexpr int BK = C.block_m, BQ = C.block_n, NWG = C.warpgroups, TC = 128 * NWG;
  constexpr int NS = BQ / 8, NO = DP / 8, KS = DP / 8;
  using TK = TileSw128F<BK, DP>;  // K, V as stored: rows = keys
  using TQ = TileSw128F<BQ, DP>;  // Q, dO: rows = queries
  using TT = TileSw128F<DP, BQ>;  // Q^T, dO^T: rows = head dim, k = query slots
  constexpr int kHalfX = 2 * TQ::kBytes, kHalfG = 2 * TT::kBytes;  // [Q, dO], [Q^T, dO^T]
  extern __shared__ float4 smem4[];
  unsigned char* sK = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sV = sK + TK::kBytes;
  unsigned char* sX = sV + TK::kBytes;  // [2][Q, dO]
  unsigned char* sG = sX + 2 * kHalfX;  // [2][Q^T, dO^T]
  float* sL = reinterpret_cast<float*>(sG + 2 * kHalfG);  // [2][BQ]
  float* sD = sL + 2 * BQ;                                // [2][BQ]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sD + 2 * BQ);
  uint64_t* full_kv = bars;
  const TileRing<2> ring{bars + 1};

  const BwdArgs& a = A.f;
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const KeyBlock kb = key_block<BK, BQ>(p.shape, p.num);
  const int64_t b = kb.b, hk = kb.hk, m0 = kb.m0;
  const int ntiles = kb.ntiles;
  const MaskRule& rule = kb.rule;

  init_ring_barriers(full_kv, ring, TC);

  const int wg = warpgroup_index();  // uniform (device.cuh)
  if (wg == NWG) {
    // ---- producer -------------------------------------------------------------------------------
    regs_decrease<C.producer_regs>();
    copy_dkv_tiles<DP, BK, BQ, false>(A, kb, (threadIdx.x - TC) / 32, sK, sV, sX, sG, sL, sD, full_kv, ring);
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------------
  regs_increase<C.consumer_regs()>();
  const int warp = threadIdx.x / 32, lane = lane_id();
  const int krow = 64 * wg + 16 * (warp & 3);  // the warp's first key row in the CTA
  const int64_t row_w = m0 + krow;
  const uint32_t x_addr = smem_addr(sX), g_addr = smem_addr(sG);

  uint32_t ka[KS][4], va[KS][4];
  mbar_wait(full_kv, 0);
  load_afrag_tf32<TK>(ka, sK, krow);
  load_afrag_tf32<TK>(va, sV, krow);
  float dk[NO][4], dv[NO][4];
  zero(dk);
  zero(dv);

  const KeyRowQueries kq(rule, row_w + lane / 4, Sq, Skv);

  float s[NS][4], dp[NS][4];
  for (int it = 0; it < ntiles; ++it) {
    const uint32_t x0 = x_addr + ring.slot(it) * kHalfX, g0 = g_addr + ring.slot(it) * kHalfG;
    ring.wait_x(it);
    wgmma_fence();  // s, dp: written only (the last tile's P^T, dS^T are in pa, dsa)
    wg_gemm_rs_tf32<KS, TQ, true>(s, ka, x0, 0, false);
    wg_gemm_rs_tf32<KS, TQ, true>(dp, va, x0 + TQ::kBytes, 0, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    fence_regs(dp);
    ring.release_x(it);

    const int64_t n0 = kb.q0(it, BQ);  // first query row
    const float* sLs = sL + (it & 1) * BQ;
    const float* sDs = sD + (it & 1) * BQ;
    ring.wait_v(it);
    // (Masked or not as two loops: with the test inside one, every entry branched around it.)
    if (kb.tile_masked(n0, BQ, BK, Sq, Skv)) {
      int lo[2], hi[2];
      kq.tile_bounds(n0, BQ, true, lo, hi);
      for_each_entry<NS>([&](int j, int e, int r, int c) {
        const float ex = exp2_ftz(a.score.exp2_arg(s[j][e], sLs[c]));
        const float pe = c >= lo[r >> 3] && c < hi[r >> 3] ? ex : 0.0f;
        s[j][e] = pe;
        dp[j][e] = pe * (dp[j][e] - sDs[c]);  // dS^T
      });
    } else {
      for_each_entry<NS>([&](int j, int e, int, int c) {
        const float pe = exp2_ftz(a.score.exp2_arg(s[j][e], sLs[c]));
        s[j][e] = pe;
        dp[j][e] = pe * (dp[j][e] - sDs[c]);  // dS^T
      });
    }
    // Every thread arrives: an arrival releases only the arriving thread's own accesses (the
    // sL/sD reads above), which the producer's next writes to these vectors must follow.
    ring.release_v(it);
    uint32_t pa[NS][4], dsa[NS][4];
    acc_to_afrag_tf32(pa, s);   // P^T's A fragments
    acc_to_afrag_tf32(dsa, dp);  // dS^T's
    fence_regs(pa);  // written before the fence (wgmma.cuh, fence_regs)
    fence_regs(dsa);
    fence_regs(dv);
    fence_regs(dk);
    ring.wait_g(it);
    wgmma_fence();
    wg_gemm_rs_tf32<NS, TT>(dv, pa, g0 + TT::kBytes, 0, true);
    wg_gemm_rs_tf32<NS, TT>(dk, dsa, g0, 0, true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dv);
    fence_regs(dk);
    keep_live_in_loop(ka, A.opaque_zero);  // a ptxas fault otherwise reuses their registers
    keep_live_in_loop(va, A.opaque_zero);
    ring.release_g(it);
  }

  bool seen[2];  // keys no query row sees: dK = dV = 0 exactly
  rows_in(row_w + lane / 4, rule.live_keys_begin(Skv), rule.live_keys_end(Sq, Skv), seen);
  zero_rows_unless(dk, seen);
  zero_rows_unless(dv, seen);
  const int D = static_cast<int>(p.shape.head_dim);
  float* dkp = static_cast<float*>(p.dk.ptr) + b * p.dk.sb + hk * p.dk.sh + m0 * p.dk.ss;
  float* dvp = static_cast<float*>(p.dv.ptr) + b * p.dv.sb + hk * p.dv.sh + m0 * p.dv.ss;
  store_rows(dkp, p.dk.ss, krow, kb.rows, 0, D, dk, a.score.grad_scale(), true);
  store_rows(dvp, p.dv.ss, krow, kb.rows, 0, D, dv, 1.0f, true);
#endif
}

}  // namespace flashattn::cuda::dev
