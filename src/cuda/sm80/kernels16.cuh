// The float16/bfloat16 kernels: forward, dQ over query blocks (split backward) and dK/dV over key
// blocks, the latter optionally also accumulating dQ with float32 atomics (FlashAttention 2's
// single-pass backward). docs/ALGORITHM.md ("CUDA float16/bfloat16") has the pseudocode and the
// work model. Templates over the padded head dim DP, the element type and XF, whether the kernel
// runs the score transform's per-entry step (softcap, ALiBi: core/score.hpp; as in the float32
// kernels, kernels_fp32.cuh); tiles come from tile_config16() (config.hpp) only. Products:
// mma.sync m16n8k16 with float32 accumulation (mma16.cuh); softmax, masks and statistics in
// float32 (device.cuh, shared with the float32 kernels).
#pragma once

#include <cuda_runtime.h>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/common/mma16.cuh"

namespace flashattn::cuda::dev {

template <class T>
__device__ __forceinline__ const uint16_t* in16(const T& op, int64_t b, int64_t h, int64_t s) {
  return static_cast<const uint16_t*>(op.ptr) + b * op.sb + h * op.sh + s * op.ss;
}
template <class T>
__device__ __forceinline__ uint16_t* out16(const T& op, int64_t b, int64_t h, int64_t s) {
  return static_cast<uint16_t*>(op.ptr) + b * op.sb + h * op.sh + s * op.ss;
}

// ================================================================================================
// Forward. CTA = block_m query rows of one (batch, head); warp = 16*mt of them. Loops over the key
// tiles the mask leaves visible (QueryBlock: tiles [t_begin, t_begin + ntiles)): S = Q K^T (Q and
// K fragments by ldmatrix), online softmax in float32 registers, P rounded to 16 bits and used
// directly as the A fragments of O += P V. XF: the logits are head.logit2_at(S, i, j).
// ================================================================================================
template <int DP, Half16 H, bool XF>
__global__ void __launch_bounds__(tile_config16(Pass::Forward, DP, kDeviceBig).threads(), 1)
    forward16_kernel(const __grid_constant__ FwdArgs args) {
  constexpr TileConfig16 C = tile_config16(Pass::Forward, DP, kDeviceBig);
  constexpr int BM = C.block_m, BN = C.block_n, T = C.threads(), MT = C.mt;
  constexpr int NS = BN / 8, NO = DP / 8;
  using TQ = Tile<BM, DP>;
  using TK = Tile<BN, DP>;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = reinterpret_cast<unsigned char*>(smem4);
  unsigned char* sK = sQ + TQ::kBytes;      // [2][BN x DP]
  unsigned char* sV = sK + 2 * TK::kBytes;  // [2][BN x DP]

  // A packed batch's sequence blockIdx.z as a dense call of its own (at_sequence).
  const FwdArgs a = at_sequence(args, blockIdx.z);
  const ForwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, hk = qb.hk, m0 = qb.m0;
  // The key tiles [t_begin, t_end) (QueryBlock), the loop counting tiles: the cp.async buffer of
  // tile t is t & 1 (no barrier phases that must start at 0), so one counter stays live instead
  // of an iteration count and t_begin.
  const int rows = qb.rows, t_end = qb.t_begin + qb.ntiles;
  if (rows <= 0) return;  // past a packed sequence's end: no work (never in a dense grid)
  const MaskRule& rule = qb.rule;
  const ScoreTransform::Head hd = XF ? a.score.head(b, h) : ScoreTransform::Head{};

  auto load_kv = [&](int tile, int stage) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    const int n = static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
    load_tile16<BN, DP, T>(sK + stage * TK::kBytes, in16(p.k, b, hk, n0), p.k.ss, n, D, a.vec16);
    load_tile16<BN, DP, T>(sV + stage * TK::kBytes, in16(p.v, b, hk, n0), p.v.ss, n, D, a.vec16);
  };
  load_tile16<BM, DP, T>(sQ, in16(p.q, b, h, m0), p.q.ss, rows, D, a.vec16);
  cp_async_commit();
  if (qb.ntiles > 0) load_kv(qb.t_begin, qb.t_begin & 1);
  cp_async_commit();

  const int warp = threadIdx.x / 32;
  const int wrow = warp * 16 * MT;     // first row of this warp inside the CTA tile
  const int64_t row_w = m0 + wrow;
  float o[MT][NO][4];
  zero(o);
  SoftmaxState st[MT];

  for (int t = qb.t_begin; t < t_end; ++t) {
    pipeline_acquire<2>(t, t_end, load_kv);
    const int stage = t & 1;
    const uint32_t kst = smem_addr(sK + stage * TK::kBytes), vst = smem_addr(sV + stage * TK::kBytes);

    float s[MT][NS][4];
    zero(s);
    gemm_ss<H, MT, NS, DP, TQ, TK>(s, smem_addr(sQ), wrow, kst, 0);

    const int64_t n0 = static_cast<int64_t>(t) * BN;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      // (The per-entry step before the mask: a masked -inf would turn finite under the tanh.)
      if constexpr (XF) transform_scores<false, true>(s[m], hd, row_w + 16 * m, n0);
      else scale_scores(s[m], a.score);
    }
    if (qb.tile_masked(n0, BN, Skv)) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
        for_each_entry<NS>([&](int j, int e, int r, int c) {
          if (!keep(rule, row_w + 16 * m + r, n0 + c, Sq, Skv)) s[m][j][e] = -INFINITY;
        });
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) online_softmax<NS, NO, true>(st[m], s[m], o[m]);
    uint32_t pa[MT][NS / 2][4];
    to_afrag<H, MT, NS / 2>(pa, s);
    gemm_rs<H, MT, NO, NS / 2, TK>(o, pa, vst, 0, 0);
    pipeline_release<2>(t, t_end, load_kv);
  }
  pipeline_drain();

  // Epilogue: O /= l, staged through shared memory (the Q tile is free) for 16-byte stores;
  // LSE = (m + log2 l) * ln 2. A row with no visible key (by the band): O = 0 and LSE = -inf.
  const int lane = lane_id();
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    bool sees[2];
    rows_in(row_w + 16 * m + (lane >> 2), rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
    float inv[2], lse[2];
    finish_rows(st[m], sees, inv, lse);
    normalize_rows(o[m], inv, sees);
    if ((lane & 3) == 0) {
      float* l = p.lse.ptr + b * p.lse.sb + h * p.lse.sh;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t row = row_w + 16 * m + (lane >> 2) + 8 * r;
        if (row < Sq) l[row * p.lse.ss] = lse[r];
      }
    }
  }
  stage_acc<H, BM, DP, MT, NO>(sQ, o, wrow, 0, 1.0f);
  __syncthreads();
  store_tile16<BM, DP, T>(out16(p.out, b, h, m0), p.out.ss, sQ, rows, D, a.vec16);
}

// ================================================================================================
// dQ (split backward). CTA = block_m query rows of one (batch, head), Q and dO stationary; loops
// over key tiles: S = Q K^T, P = exp2(logit2(S) - lse2), dP = dO V^T, dS = P (dP - D),
// dQ += dS K; dQ *= grad_scale. XF: logit2(S) = head.logit2_at(S, i, j) and dS = P (dP - D) F,
// F that step's factor (1 - tanh^2 under a softcap).
// ================================================================================================
template <int DP, Half16 H, bool XF>
__global__ void __launch_bounds__(tile_config16(Pass::Dq, DP, kDeviceBig).threads(), 1)
    dq16_kernel(const __grid_constant__ BwdArgs args) {
  constexpr TileConfig16 C = tile_config16(Pass::Dq, DP, kDeviceBig);
  constexpr int BM = C.block_m, BN = C.block_n, T = C.threads();
  constexpr int NS = BN / 8, NO = DP / 8;
  static_assert(C.mt == 1 && C.col_split == 1, "dq16: one m16 tile per warp");
  using TQ = Tile<BM, DP>;
  using TK = Tile<BN, DP>;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = reinterpret_cast<unsigned char*>(smem4);
  unsigned char* sdO = sQ + TQ::kBytes;
  unsigned char* sK = sdO + TQ::kBytes;     // [2][BN x DP]
  unsigned char* sV = sK + 2 * TK::kBytes;  // [2][BN x DP]

  // A packed batch's sequence blockIdx.z as a dense call of its own (at_sequence).
  const BwdArgs a = at_sequence(args, blockIdx.z, DP);
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, hk = qb.hk, m0 = qb.m0;
  // The key tiles [t_begin, t_end) (QueryBlock), the loop counting tiles: the cp.async buffer of
  // tile t is t & 1 (no barrier phases that must start at 0), so one counter stays live instead
  // of an iteration count and t_begin.
  const int rows = qb.rows, t_end = qb.t_begin + qb.ntiles;
  if (rows <= 0) return;  // past a packed sequence's end: no work (never in a dense grid)
  const MaskRule& rule = qb.rule;
  // XF: the per-entry step for this (b, h), and the linear part after it (multiplier 1).
  const ScoreTransform::Head hd = XF ? a.score.head(b, h) : ScoreTransform::Head{};
  const ScoreTransform lin = XF ? a.score.after_elementwise() : a.score;

  auto load_kv = [&](int tile, int stage) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    const int n = static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
    load_tile16<BN, DP, T>(sK + stage * TK::kBytes, in16(p.k, b, hk, n0), p.k.ss, n, D, a.vec16);
    load_tile16<BN, DP, T>(sV + stage * TK::kBytes, in16(p.v, b, hk, n0), p.v.ss, n, D, a.vec16);
  };
  load_tile16<BM, DP, T>(sQ, in16(p.q, b, h, m0), p.q.ss, rows, D, a.vec16);
  load_tile16<BM, DP, T>(sdO, in16(p.dout, b, h, m0), p.dout.ss, rows, D, a.vec16);
  cp_async_commit();
  if (qb.ntiles > 0) load_kv(qb.t_begin, qb.t_begin & 1);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = lane_id();
  const int64_t row_w = m0 + warp * 16;
  float l2[2], dl[2];  // LSE (log2 domain) and D of the lane's rows g and g+8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row_w + (lane >> 2) + 8 * r;
    const bool in = row < Sq;
    l2[r] = in ? lse_to_log2(p.lse.ptr[b * p.lse.sb + h * p.lse.sh + row * p.lse.ss]) : INFINITY;
    dl[r] = in ? a.delta[a.ws_row(b, h) + row] : 0.0f;
  }
  float dq[1][NO][4];
  zero(dq);

  for (int t = qb.t_begin; t < t_end; ++t) {
    pipeline_acquire<2>(t, t_end, load_kv);
    const int stage = t & 1;
    const uint32_t kst = smem_addr(sK + stage * TK::kBytes), vst = smem_addr(sV + stage * TK::kBytes);
    float s[1][NS][4], dp[1][NS][4];
    zero(s);
    zero(dp);
    gemm_ss<H, 1, NS, DP, TQ, TK>(s, smem_addr(sQ), warp * 16, kst, 0);
    gemm_ss<H, 1, NS, DP, TQ, TK>(dp, smem_addr(sdO), warp * 16, vst, 0);

    const int64_t n0 = static_cast<int64_t>(t) * BN;
    const bool masked = qb.tile_masked(n0, BN, Skv);
    for_each_entry<NS>([&](int j, int e, int r, int c) {
      // XF: the per-entry step (before the mask), its factor F used at once: an F array for the
      // whole slice (transform_scores) spilled up to 140 bytes here and 508 in dK/dV at D = 64.
      float f = 1.0f;
      if constexpr (XF) s[0][j][e] = transform_score<false, true>(s[0][j][e], f, hd, row_w + r, n0 + c);
      float pe = exp2_ftz(lin.exp2_arg(s[0][j][e], l2[e >> 1]));
      if (masked && !keep(rule, row_w + r, n0 + c, Sq, Skv)) pe = 0.0f;
      dp[0][j][e] = pe * (dp[0][j][e] - dl[e >> 1]);  // dS
      if constexpr (XF) dp[0][j][e] *= f;
    });
    uint32_t pds[1][NS / 2][4];
    to_afrag<H, 1, NS / 2>(pds, dp);
    gemm_rs<H, 1, NO, NS / 2, TK>(dq, pds, kst, 0, 0);
    pipeline_release<2>(t, t_end, load_kv);
  }
  pipeline_drain();
  bool sees[2];  // rows that see no key: dQ = 0 exactly
  rows_in(row_w + (lane >> 2), rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
  zero_rows_unless(dq[0], sees);
  stage_acc<H, BM, DP, 1, NO>(sQ, dq, warp * 16, 0, a.score.grad_scale());
  __syncthreads();
  store_tile16<BM, DP, T>(out16(p.dq, b, h, m0), p.dq.ss, sQ, rows, D, a.vec16);
}

// ================================================================================================
// dK/dV. CTA = block_m key rows of one (batch, kv head), K and V stationary; loops over the query
// heads of the kv group and, for each, the query tiles that can see these keys:
//   S^T = K Q^T, P^T = exp2(logit2(S^T) - lse2), dV += P^T dO, dP^T = V dO^T,
//   dS^T = P^T (dP^T - D), dK += dS^T Q; dK *= grad_scale.
// ATOMIC (FlashAttention 2's single pass): dS^T also goes to shared memory and the CTA adds
// dQ_tile += dS K to a float32 accumulator with atomics (a convert pass applies grad_scale and
// rounds it);
// the dQ pass is then not needed. Float atomics make dQ's summation order vary run to run.
// XF: as in dQ, on S^T (rows are keys: the transposed per-entry step), dS^T = P^T (dP^T - D) F^T
// (the dQ atomics get F too); the query head, and with it the ALiBi slope, changes along the loop.
// ================================================================================================
template <int DP, Half16 H, bool ATOMIC, bool XF>
__global__ void __launch_bounds__(tile_config16(Pass::Dkv, DP, kDeviceBig).threads(), 1)
    dkv16_kernel(const __grid_constant__ BwdArgs args) {
  constexpr TileConfig16 C = tile_config16(Pass::Dkv, DP, kDeviceBig);
  constexpr int BK = C.block_m, BQ = C.block_n, T = C.threads(), W = C.warps;
  constexpr int CS = C.col_split, DW = DP / CS;  // dK/dV columns per warp
  constexpr int NS = BQ / 8, NO = DW / 8;
  static_assert(C.mt == 1, "dkv16: one m16 tile per warp");
  using TK = Tile<BK, DP>;
  using TQ = Tile<BQ, DP>;
  using TS = Tile<BK, BQ>;
  extern __shared__ float4 smem4[];
  unsigned char* sK = reinterpret_cast<unsigned char*>(smem4);
  unsigned char* sV = sK + TK::kBytes;
  unsigned char* sQ = sV + TK::kBytes;        // [2][BQ x DP]
  unsigned char* sdO = sQ + 2 * TQ::kBytes;   // [2][BQ x DP]
  float* sL = reinterpret_cast<float*>(sdO + 2 * TQ::kBytes);  // [2][BQ] LSE
  float* sD = sL + 2 * BQ;                                      // [2][BQ] D
  unsigned char* sdS = reinterpret_cast<unsigned char*>(sD + 2 * BQ);  // ATOMIC: dS^T [BK x BQ]

  // A packed batch's sequence blockIdx.z as a dense call of its own (at_sequence).
  const BwdArgs a = at_sequence(args, blockIdx.z, DP);
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const KeyBlock kb = key_block<BK, BQ>(p.shape, p.num);
  const int64_t b = kb.b, hk = kb.hk, m0 = kb.m0;
  const int rows = kb.rows, ntiles = kb.ntiles;
  if (rows <= 0) return;  // past a packed sequence's end: no work (never in a dense grid)
  const MaskRule& rule = kb.rule;
  const ScoreTransform lin = XF ? a.score.after_elementwise() : a.score;  // see dq16_kernel
  // ATOMIC: every key block of a head adds into the same dQ rows; starting each CTA at a
  // different query tile spreads those atomics over different addresses at any moment instead
  // of serialising them on one tile's rows in L2.
  const int rot = ATOMIC && ntiles > 0 ? static_cast<int>(blockIdx.x % ntiles) : 0;
  auto tile_of = [&](int it) { return it + rot < ntiles ? it + rot : it + rot - ntiles; };

  load_tile16<BK, DP, T>(sK, in16(p.k, b, hk, m0), p.k.ss, rows, D, a.vec16);
  load_tile16<BK, DP, T>(sV, in16(p.v, b, hk, m0), p.v.ss, rows, D, a.vec16);
  cp_async_commit();
  // Iteration `it` covers KeyBlock iteration tile_of(it).
  auto load_q = [&](int it, int stage) {
    const int64_t h = kb.head(tile_of(it)), n0 = kb.q0(tile_of(it), BQ);
    const int n = static_cast<int>(Sq - n0 < BQ ? Sq - n0 : BQ);
    load_tile16<BQ, DP, T>(sQ + stage * TQ::kBytes, in16(p.q, b, h, n0), p.q.ss, n, D, a.vec16);
    load_tile16<BQ, DP, T>(sdO + stage * TQ::kBytes, in16(p.dout, b, h, n0), p.dout.ss, n, D, a.vec16);
    load_vec<BQ, T>(sL + stage * BQ, p.lse.ptr + b * p.lse.sb + h * p.lse.sh + n0 * p.lse.ss, p.lse.ss, n);
    load_vec<BQ, T>(sD + stage * BQ, a.delta + a.ws_row(b, h) + n0, 1, n);
  };
  if (ntiles > 0) load_q(0, 0);
  cp_async_commit();

  const int warp = threadIdx.x / 32, kw = warp / CS, cw = warp % CS, lane = lane_id();
  const int64_t row_w = m0 + kw * 16;  // first key row of this warp
  float dk[1][NO][4], dv[1][NO][4];
  zero(dk);
  zero(dv);

  for (int it = 0; it < ntiles; ++it) {
    pipeline_acquire<2>(it, ntiles, load_q);
    const int stage = it & 1;
    const uint32_t qst = smem_addr(sQ + stage * TQ::kBytes), dost = smem_addr(sdO + stage * TQ::kBytes);
    const float* sLs = sL + stage * BQ;
    const float* sDs = sD + stage * BQ;
    float s[1][NS][4], dp[1][NS][4];
    zero(s);
    zero(dp);
    gemm_ss<H, 1, NS, DP, TK, TQ>(s, smem_addr(sK), kw * 16, qst, 0);
    gemm_ss<H, 1, NS, DP, TK, TQ>(dp, smem_addr(sV), kw * 16, dost, 0);

    const int64_t h = kb.head(tile_of(it)), n0 = kb.q0(tile_of(it), BQ);  // first query row
    const bool masked = kb.tile_masked(n0, BQ, BK, Sq, Skv);
    const ScoreTransform::Head hd = XF ? a.score.head(b, h) : ScoreTransform::Head{};
    for_each_entry<NS>([&](int j, int e, int r, int c) {
      float f = 1.0f;  // XF: as in dq16_kernel, on S^T
      if constexpr (XF) s[0][j][e] = transform_score<true, true>(s[0][j][e], f, hd, row_w + r, n0 + c);
      float pe = exp2_ftz(lin.exp2_arg(s[0][j][e], lse_to_log2(sLs[c])));
      if (masked && !keep(rule, n0 + c, row_w + r, Sq, Skv)) pe = 0.0f;
      s[0][j][e] = pe;
      dp[0][j][e] = pe * (dp[0][j][e] - sDs[c]);  // dS^T
      if constexpr (XF) dp[0][j][e] *= f;
    });
    uint32_t pp[1][NS / 2][4], pds[1][NS / 2][4];
    to_afrag<H, 1, NS / 2>(pp, s);
    to_afrag<H, 1, NS / 2>(pds, dp);
    gemm_rs<H, 1, NO, NS / 2, TQ>(dv, pp, dost, 0, cw * DW / 8);
    gemm_rs<H, 1, NO, NS / 2, TQ>(dk, pds, qst, 0, cw * DW / 8);

    if constexpr (ATOMIC) {
      // dQ[BQ x DP] += dS[BQ x BK] K[BK x DP], the warps tiling it as MQ m16 row tiles x NSPLIT
      // column strips of DQW.
      constexpr int MQ = BQ / 16, NSPLIT = W / MQ, DQW = DP / NSPLIT;
      if (cw == 0) stage_acc<H, BK, BQ, 1, NS>(sdS, dp, kw * 16, 0, 1.0f);
      __syncthreads();
      const int mq = warp % MQ, ns = warp / MQ;
      float dq[1][DQW / 8][4];
      zero(dq);
      gemm_ts<H, DQW / 8, BK / 16, TS, TK>(dq, smem_addr(sdS), 2 * mq, smem_addr(sK), ns * DQW / 8);
      float* acc = a.dq_accum + (a.ws_row(b, h) + n0) * DP;
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int qr = mq * 16 + g + 8 * r;
        // A row that sees no key adds nothing: its dS is 0, but 0 * a NaN in K is NaN, and its
        // dQ must stay exactly 0.
        if (n0 + qr < rule.live_rows_begin(Sq) || n0 + qr >= rule.live_rows_end(Sq, Skv)) continue;
#pragma unroll
        for (int j = 0; j < DQW / 8; ++j) {
          float* dst = acc + static_cast<int64_t>(qr) * DP + ns * DQW + 8 * j + 2 * t;
          atomicAdd(dst, dq[0][j][2 * r]);
          atomicAdd(dst + 1, dq[0][j][2 * r + 1]);
        }
      }
    }
    pipeline_release<2>(it, ntiles, load_q);
  }
  pipeline_drain();
  bool seen[2];  // keys no query row sees: dK = dV = 0 exactly
  rows_in(row_w + (lane >> 2), rule.live_keys_begin(Skv), rule.live_keys_end(Sq, Skv), seen);
  zero_rows_unless(dk[0], seen);
  zero_rows_unless(dv[0], seen);
  stage_acc<H, BK, DP, 1, NO>(sK, dk, kw * 16, cw * DW, a.score.grad_scale());
  stage_acc<H, BK, DP, 1, NO>(sV, dv, kw * 16, cw * DW, 1.0f);
  __syncthreads();
  store_tile16<BK, DP, T>(out16(p.dk, b, hk, m0), p.dk.ss, sK, rows, D, a.vec16);
  store_tile16<BK, DP, T>(out16(p.dv, b, hk, m0), p.dv.ss, sV, rows, D, a.vec16);
}

}  // namespace flashattn::cuda::dev
