// The Hopper (sm_90a) float16/bfloat16 single-pass dK/dV kernel (dkv_sm90_kernel; dQ by float32
// reductions, in any order or in a fixed key-block order): the pieces it shares with the forward
// are in kernels16_shared.cuh; docs/ALGORITHM.md ("Backward, single pass (`dkv_sm90_kernel`...)")
// has the pseudocode and the work model.
#pragma once

#include "cuda/sm90/kernels16_shared.cuh"

namespace flashattn::cuda::dev {
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
// At D = 64 instead tile t's whole dQ by warpgroup t % 2, which alone waits for the other's dS^T
// (kAlt, below).
// At D = 256 (col_split 2) a CTA has 64 keys; both warpgroups compute their S^T and dP^T and each
// accumulates half of dK's and dV's columns.
//   dq_accum += dQ (vector float32 reductions in L2; at D = 128 in the default design staged in
//   shared memory and added by a producer warp's bulk reductions, kBulkDq); release the stage
// ================================================================================================
struct Sm90BwdArgs {
  BwdArgs f;
  CUtensorMap tq, tk, tv, tdo;
  const CUtensorMap* seq_maps;  // as Sm90FwdArgs::seq_maps: Q, dO, K, V per sequence
  // ORD kernels: one counter per (sequence, query head, query tile of BQ rows, warpgroup), zeroed,
  // lock_tiles query tiles per head (of the call's Sq, or max_seqlen_q when packed).
  int* locks;
  int64_t lock_tiles;
  // The head split under GQA (BackwardPlan::dkv_acc, the ordered design's and by a knob the
  // default's; nullptr: none): CTA (key block x, query head y); the G CTAs of a key block add
  // their dK/dV into dkv_acc in query-head order
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
  // Alternating dQ (kAlt, below): each tile's whole dQ by one warpgroup, the two taking turns.
  constexpr bool kAlt = CS == 1 && NWG == 2 && DP <= 64;
  // Delayed dQ (kDelay, below): at D = 128 in the ordered design, each warpgroup's dQ columns of
  // the previous tile.
  constexpr bool kDelay = ORD && CS == 1 && NWG == 2 && !kAlt;
  constexpr int DQN = kAlt ? DP : DP / NWG, QC = DQN < 64 ? DQN : 64;  // dQ columns per warpgroup's turn, per product
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
  // dQ by the copy engine (kBulkDq: D = 128, default design; dkv90_bulk_dq). With red.global.add
  // from the consumer threads each warpgroup issued 16 vector reductions per thread and tile
  // through its SM's load/store path, and the warps stalled on it (36% of their stall cycles on
  // L1TEX scoreboards, ncu at D 128). Instead both warpgroups store their dQ column halves into
  // one staged tile in shared memory (8-byte stores, conflict-free: kDqLd) and arrive at
  // kDqStaged; producer warp 2 then adds each live row (DP floats) to the accumulator with a bulk
  // reduction, waits until the copy engine has read the tile and arrives at kDqFree, which the
  // consumers wait for before they stage the next tile. Rows that see no key are not added (see
  // adds, below).
  constexpr bool kBulkDq = dkv90_bulk_dq(DP, V, ORD);
  constexpr int kDqLd = dkv90_dq_ld(DP);
  float* sDq = reinterpret_cast<float*>(bars + 16);  // [BQ][kDqLd], after the 16 mbarriers' space
  constexpr int kDqStaged = 2, kDqFree = 3, kDqThreads = TC + 32;
  static_assert(!kBulkDq || (CS == 1 && NWG == 2 && !kAlt), "kBulkDq: the column split of two key groups");

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
  // kTurnBar + w "the turn is yours", kAddedBar + w "the adds are issued"; 128 + 32 threads,
  // waiting at two places in the code: the unaligned form (named_barrier_unaligned).
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
    } else if (kBulkDq && pw == 2) {
      // kBulkDq: tile it's staged dQ, row by row into the accumulator.
      const int64_t lo = rule.live_rows_begin(Sq), hi = rule.live_rows_end(Sq, Skv);
      for (int it = 0; it < ntiles; ++it) {
        const int64_t h = kb.head(tile_of(it)), n0 = kb.q0(tile_of(it), BQ);
        float* acc = a.dq_accum + (a.ws_row(b, h) + n0) * DP;
        named_barrier(kDqStaged, kDqThreads);
        for (int r = lane; r < BQ; r += 32)
          if (n0 + r >= lo && n0 + r < hi) bulk_reduce_add_f32(acc + static_cast<int64_t>(r) * DP, sDq + r * kDqLd, DP * 4);
        bulk_commit();
        bulk_wait_read<0>();
        __syncwarp();
        if (it + 1 < ntiles) named_barrier_arrive(kDqFree, kDqThreads);
      }
      bulk_wait<0>();  // (the adds performed before the CTA ends)
    } else if (ORD && pw >= 2 && pw - 2 < NWG) {
      // ORD: warpgroup w = pw - 2's turns (turn_of). With alternating dQ, those of the tiles it
      // owns (it % 2 == w), each on the tile's first counter: one warpgroup adds all its columns.
      const int w = pw - 2;
      for (int it = kAlt ? w : 0; it < ntiles; it += kAlt ? 2 : 1) {
        const int x = tile_of(it);
        const int64_t h = kb.head(x), n0 = kb.q0(x, BQ);
        int* lock = A.locks + ((b * p.shape.heads_q + h) * A.lock_tiles + n0 / BQ) * NWG + (kAlt ? 0 : w);
        if (lane == 0) wait_turn(lock, turn_of(x, n0));
        __syncwarp();
        named_barrier_unaligned(kTurnBar + w, kTurnThreads);
        named_barrier_unaligned(kAddedBar + w, kTurnThreads);  // (the warpgroup's reductions are issued)
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
  // Alternating dQ (D = 64: two key groups, no column split). With the tile's dQ split
  // by columns both warpgroups wait at every tile for the other's half of dS^T, so they run in
  // step: both in their exponentials while the tensor cores idle, both in their products after.
  // Instead warpgroup it % 2 computes and adds tile it's whole dQ (DP columns, all BK keys) and
  // only it waits for the other's dS^T (barrier kSdsFull + stage, which the other merely
  // arrives at); the other goes on to the next tile's products at once. Each still does half of
  // the dQ work over two tiles, but the two now run half a tile apart: one's exponentials beside
  // the other's dQ product. The dS^T buffer of a stage is free again for the non-owner once the
  // owner's dQ product two tiles back has read it (kSdsFree + stage). The owner issues the next
  // tile's S^T/dP^T right after its dQ product, before the reductions.
  // Measured against the column split in one process (H100, bf16, S 1k-16k): D 64 default
  // 1.00-1.13x, ordered 1.10-1.34x; D 128 0.84-0.89x / 0.88-0.98x, so not there: with dK and dV
  // at 128 registers the owner cannot hold the next S^T/dP^T beside a dQ part (it spills), and its
  // two dQ products and all the reductions then run with nothing issued behind them.
  constexpr int kSdsFull = 2, kSdsFree = 4;
  // Delayed dQ (the ordered design at D = 128; it takes its turns in dq_delayed, in the same tile
  // order). Where the alternation cannot keep the owner's tensor cores fed (the next tile's
  // S^T/dP^T beside a dQ part spills), the column split stays but each warpgroup computes its dQ
  // columns of tile t - 1 during tile t: the barriers then wait only on events half a tile or
  // more in the past - the other's dS^T of tile t - 1 (kDFull + 2 x its warpgroup + stage,
  // arrived right after its staging) and, before a buffer is written again, the other's dQ
  // product of tile t - 2 (kDFree + ...) - and no barrier joins the two warpgroups at the current
  // tile, whose turn may wait for other CTAs. Against the column split in step (H100, bf16, S
  // 1k-16k, MHA and GQA 4/8): ordered 0.99-1.04x; the default design 0.95-1.01x, so not there.
  // The last tile's dQ follows the loop.
  constexpr int kDFull = 2, kDFree = 10;
  // dQ's reductions (the threads' own: not kBulkDq) 16 bytes each (red.global.add.v4.f32 after a
  // lane-pair swap) at D = 64, 8 bytes above: measured against each other in one process (H100, bf16 GQA 4/8, S 1k-16k), the
  // 16-byte form +0-14% at D = 64 and 3-9% slower at D = 128 (its ~90 more instructions per tile).
  constexpr bool kRed4 = DP <= 64;
  // After a wait that covered the dV and dK products reading Q/dO stage st: every thread
  // arrives - an arrival releases only the arriving thread's own accesses (the products' reads,
  // the sL/sD reads), which the producer's next writes to this stage must follow.
  auto release_stage = [&](int st) {
    fence_regs(dv[0]);
    fence_regs(dk[0]);
    mbar_arrive(empty + st);
  };
  // kDelay: warpgroup wg's dQ columns of tile j (during tile j + 1, or after the loop for the
  // last), from the dS^T buffer of stage j & 1 once the other warpgroup's half is in; then,
  // when a tile j + 2 will write that buffer, the other is told this one has read it.
  // release >= 0: the Q/dO stage to release once the product's wait also covered the current
  // tile's dV/dK - before the ordered design's turn, which may wait for other CTAs.
  [[maybe_unused]] auto dq_delayed = [&](int j, int release) {
    static_assert(!kDelay || DQN == QC, "one dQ product per warpgroup and tile");
    const int sj = j & 1;
    const int64_t hj = kb.head(tile_of(j)), nj = kb.q0(tile_of(j), BQ);
    named_barrier(kDFull + 2 * (wg ^ 1) + sj, TC);
    float dq[1][QC / 8][4];
    fence_regs(dq[0]);
    wgmma_fence();
    wg_gemm_tt<H, BK / 16, TS, TK>(dq[0], smem_addr(sdS + sj * TS::kBytes), 0, k_addr, DQN * wg, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(dq[0]);
    if (release >= 0) release_stage(release);
    if (j + 2 < ntiles) named_barrier_arrive(kDFree + 2 * wg + sj, TC);
    if constexpr (ORD) named_barrier_unaligned(kTurnBar + wg, kTurnThreads);  // this warpgroup's turn at tile j
    float* acc = a.dq_accum + (a.ws_row(b, hj) + nj) * DP + DQN * wg;
    const int g = lane >> 2, t = lane & 3, wq = 16 * (warp & 3);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int qr = wq + g + 8 * r;
      // (as below: a row that sees no key adds nothing)
      if (nj + qr < rule.live_rows_begin(Sq) || nj + qr >= rule.live_rows_end(Sq, Skv)) continue;
#pragma unroll
      for (int q = 0; q < QC / 8; ++q)
        red_add2(acc + static_cast<int64_t>(qr) * DP + 8 * q + 2 * t, dq[0][q][2 * r], dq[0][q][2 * r + 1]);
    }
    if constexpr (ORD) named_barrier_unaligned(kAddedBar + wg, kTurnThreads);  // (the turn warp fences and counts)
  };
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

    // dS^T of both warpgroups into this iteration's buffer. In step (D >= 128) the barrier also
    // tells each warpgroup that the other finished the previous iteration's dQ (which read the
    // other buffer), so one barrier per iteration protects both; kAlt has a barrier for each.
    // With kQSplit P^T goes the same way, and dV and dK follow the barrier.
    unsigned char* sdSi = sdS + st * TS::kBytes;
    [[maybe_unused]] const bool owner = (it & 1) == wg;
    if constexpr (kAlt) {
      if (!owner && it >= 2) named_barrier(kSdsFree + st, TC);
    }
    if constexpr (kDelay) {
      if (it >= 2) named_barrier(kDFree + 2 * (wg ^ 1) + st, TC);  // the other read tile it - 2's dS^T
    }
    stage_acc_as<H, TS, 1, NS>(sdSi, dp, krow, qc0, 1.0f);
    if constexpr (kQSplit) stage_acc_as<H, TS, 1, NS>(sP + st * TS::kBytes, s, krow, qc0, 1.0f);
    fence_proxy_async();
    if constexpr (kAlt) {
      if (!owner) {
        named_barrier_arrive(kSdsFull + st, TC);
        if constexpr (kNext) {
          issue_sdp(it + 1);
          wgmma_wait<1>();  // dV and dK, which read this stage's Q and dO
        } else {
          wgmma_wait<0>();
        }
        release_stage(st);
        return;
      }
      named_barrier(kSdsFull + st, TC);
    } else if constexpr (kDelay) {
      named_barrier_arrive(kDFull + 2 * wg + st, TC);
      if (it >= 1) {
        dq_delayed(it - 1, st);  // (its wait covers this tile's dV and dK)
      } else {
        wgmma_wait<0>();
        release_stage(st);
      }
      return;
    } else {
      named_barrier(1, TC);
    }
    if constexpr (kQSplit) {
      fence_regs(dv[0]);
      fence_regs(dk[0]);
      wgmma_fence();
      wg_gemm_sn<H, BQ / 16, TS, TQ>(dv[0], smem_addr(sP + st * TS::kBytes), 64 * kg, doa, 0, cg * DW);
      wg_gemm_sn<H, BQ / 16, TS, TQ>(dk[0], smem_addr(sdSi), 64 * kg, qa, 0, cg * DW);
      wgmma_commit();
    }
    const int dq_col0 = kAlt ? 0 : DQN * wg;  // this warpgroup's first dQ column
    float* acc = a.dq_accum + (a.ws_row(b, h) + n0) * DP + dq_col0;
    const int g = lane >> 2, t = lane & 3, wq = 16 * (warp & 3);
#pragma unroll
    for (int c = 0; c < DQN / QC; ++c) {
      const bool last = c + 1 == DQN / QC;
      float dq[1][QC / 8][4];
      fence_regs(dq[0]);
      wgmma_fence();
      wg_gemm_tt<H, BK / 16, TS, TK>(dq[0], smem_addr(sdSi), 0, k_addr, dq_col0 + QC * c, false);
      wgmma_commit();
      if (kNext && last) {
        issue_sdp(it + 1);
        wgmma_wait<1>();  // all but the next tile's S^T and dP^T
      } else {
        wgmma_wait<0>();
      }
      fence_regs(dq[0]);
      if (last) {
        release_stage(st);  // (before the ordered turn, which may wait for other CTAs)
        if constexpr (kAlt) {
          if (it + 2 < ntiles) named_barrier_arrive(kSdsFree + st, TC);  // (dS^T read: see kAlt)
        }
      }
      if constexpr (ORD) {
        if (c == 0) named_barrier_unaligned(kTurnBar + wg, kTurnThreads);  // this warpgroup's turn at the tile
      }
      // A row that sees no key adds nothing: its dS is 0, but 0 * a NaN in K is NaN, and its
      // dQ must stay exactly 0.
      auto adds = [&](int qr) { return n0 + qr >= rule.live_rows_begin(Sq) && n0 + qr < rule.live_rows_end(Sq, Skv); };
      if constexpr (kBulkDq) {
        if (c == 0 && it >= 1) named_barrier(kDqFree, kDqThreads);  // the copy engine read tile it - 1
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int qr = wq + g + 8 * r;
          if (!adds(qr)) continue;  // (nor does the producer add the row)
#pragma unroll
          for (int j = 0; j < QC / 8; ++j)
            *reinterpret_cast<float2*>(sDq + qr * kDqLd + dq_col0 + QC * c + 8 * j + 2 * t) =
                make_float2(dq[0][j][2 * r], dq[0][j][2 * r + 1]);
        }
        if (last) {
          fence_proxy_async();  // (the stores, before the copy engine reads them)
          named_barrier_arrive(kDqStaged, kDqThreads);
        }
      } else if constexpr (kRed4) {
        // 16-byte reductions: lanes t and t ^ 1 swap halves, so that the even lane holds 4
        // neighbouring columns of row g and the odd lane 4 of row g + 8 (the same float adds).
        const bool odd = t & 1;
        const int qr = wq + g + (odd ? 8 : 0);
        const bool live = adds(qr);
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
          if (!adds(qr)) continue;
#pragma unroll
          for (int j = 0; j < QC / 8; ++j)
            red_add2(acc + static_cast<int64_t>(qr) * DP + QC * c + 8 * j + 2 * t, dq[0][j][2 * r],
                     dq[0][j][2 * r + 1]);
        }
      }
      if constexpr (ORD) {
        if (last) named_barrier_unaligned(kAddedBar + wg, kTurnThreads);  // (the turn warp fences and counts)
      }
    }
  };

  mbar_wait(full_kv, 0);
  if constexpr (kOverlapNext || kAlt) {
    if (ntiles > 0) issue_sdp(0);
    for (int it = 0; it + 1 < ntiles; ++it) tile(it, std::true_type{});
    if (ntiles > 0) tile(ntiles - 1, std::false_type{});
  } else {
    for (int it = 0; it < ntiles; ++it) {
      issue_sdp(it);
      tile(it, std::false_type{});
    }
    if constexpr (kDelay) {
      if (ntiles > 0) dq_delayed(ntiles - 1, -1);
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
