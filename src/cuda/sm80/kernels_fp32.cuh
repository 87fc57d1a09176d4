// The CUDA kernels: forward, backward preprocess (D = rowsum(dO * O)), dQ over query blocks and
// dK/dV over key blocks. docs/ALGORITHM.md ("CUDA backend") has the pseudocode and work model.
// Each kernel is a template over the padded head dim DP, the Math of its products and XF, whether
// it runs the score transform's per-entry step (softcap, ALiBi: core/score.hpp); tile sizes come
// from tile_config() (config.hpp) only.
#pragma once

#include <cuda_runtime.h>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {

namespace dev {

// ================================================================================================
// Forward. CTA = block_m query rows of one (batch, head); loops over the key tiles that the mask
// leaves visible (QueryBlock: tiles [t_begin, t_begin + ntiles)): S = Q K^T, online softmax, O += P V.
// XF: the logits are head.logit2_at(S, i, j) instead of S * scale (in log2 units either way).
// ================================================================================================
template <int DP, Math M, bool XF>
__global__ void __launch_bounds__(tile_config(Pass::Forward, DP, kDeviceBig).threads(), 1)
    forward_kernel(const __grid_constant__ FwdArgs args) {
  constexpr TileConfig C = tile_config(Pass::Forward, DP, kDeviceBig);
  constexpr int BM = C.block_m, BN = C.block_n, T = C.threads(), LD = smem_row(DP);
  constexpr int NS = BN / 8, NO = DP / 8;
  static_assert(BM == 16 * C.warps, "forward tile: one warp per 16 query rows");
  extern __shared__ float4 smem4[];
  float* sQ = reinterpret_cast<float*>(smem4);
  float* sK = sQ + BM * LD;             // [stages][BN][LD]
  float* sV = sK + C.stages * BN * LD;  // [stages][BN][LD]

  // A packed batch's sequence blockIdx.z as a dense call of its own (at_sequence).
  const FwdArgs a = at_sequence(args, blockIdx.z);
  const ForwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, hk = qb.hk, m0 = qb.m0;
  // The key tiles [t_begin, t_end) (QueryBlock), the loop counting tiles: with two stages the
  // cp.async buffer of tile t is t & 1 (no barrier phases that must start at 0), so one counter
  // stays live instead of an iteration count and t_begin.
  const int rows = qb.rows, t_end = qb.t_begin + qb.ntiles;
  if (rows <= 0) return;  // past a packed sequence's end: no work (never in a dense grid)
  const MaskRule& rule = qb.rule;
  const ScoreTransform::Head hd = XF ? a.score.head(b, h) : ScoreTransform::Head{};

  const float* q = static_cast<const float*>(p.q.ptr) + b * p.q.sb + h * p.q.sh + m0 * p.q.ss;
  const float* k = static_cast<const float*>(p.k.ptr) + b * p.k.sb + hk * p.k.sh;
  const float* v = static_cast<const float*>(p.v.ptr) + b * p.v.sb + hk * p.v.sh;
  auto load_kv = [&](int tile, int stage) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    const int n = static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
    load_tile<BN, DP, T>(sK + stage * BN * LD, k + n0 * p.k.ss, p.k.ss, n, D, a.vec16);
    load_tile<BN, DP, T>(sV + stage * BN * LD, v + n0 * p.v.ss, p.v.ss, n, D, a.vec16);
  };

  load_tile<BM, DP, T>(sQ, q, p.q.ss, rows, D, a.vec16);
  cp_async_commit();
  if (qb.ntiles > 0) load_kv(qb.t_begin, C.stages == 2 ? (qb.t_begin & 1) : 0);
  cp_async_commit();

  const int warp = threadIdx.x / 32;
  const float* sQw = sQ + warp * 16 * LD;
  const int64_t row_w = m0 + warp * 16;  // first query row of this warp
  float o[NO][4];
  zero(o);
  SoftmaxState st;
  // 3xtf32: K and V split once per CTA, their small parts
  // [stages][BN][LD] each following sV, SOFF floats past the big parts (split_smem_bytes).
  constexpr int SOFF = split_smem_bytes(Pass::Forward, DP, kDeviceBig, M) > 0 ? 2 * C.stages * BN * LD : 0;

  for (int t = qb.t_begin; t < t_end; ++t) {
    pipeline_acquire<C.stages>(t, t_end, load_kv);
    const int stage = C.stages == 2 ? (t & 1) : 0;
    convert_step_tiles<M, SOFF, BN, DP, LD, T>(sK + stage * BN * LD, sV + stage * BN * LD);

    float s[NS][4];
    zero(s);
    gemm_nt<M, NS, DP, LD, SOFF>(s, sQw, sK + stage * BN * LD);

    const int64_t n0 = static_cast<int64_t>(t) * BN;
    // (The per-entry step before the mask: a masked -inf would turn finite under the tanh.)
    if constexpr (XF) transform_scores(s, hd, row_w, n0);
    else scale_scores(s, a.score);
    if (qb.tile_masked(n0, BN, Skv)) {
      for_each_entry<NS>([&](int j, int e, int r, int c) {
        if (!keep(rule, row_w + r, n0 + c, Sq, Skv)) s[j][e] = -INFINITY;
      });
    }
    online_softmax(st, s, o);
    gemm_rn<M, NO, NS, LD, SOFF>(o, s, sV + stage * BN * LD);
    pipeline_release<C.stages>(t, t_end, load_kv);
  }
  pipeline_drain();
  // Epilogue: O /= l; LSE = ln(sum exp(S)) = (m + log2 l) * ln 2. A row with no visible key (by
  // the band): O = 0 and LSE = -inf.
  bool sees[2];
  rows_in(row_w + lane_id() / 4, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
  float inv[2], lse[2];
  finish_rows(st, sees, inv, lse);
  normalize_rows(o, inv, sees);
  float* out = static_cast<float*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + m0 * p.out.ss;
  store_rows<NO>(out, p.out.ss, warp * 16, rows, 0, D, o, 1.0f, a.vec16);
  store_lse(p.lse, b, h, row_w, Sq, lse);
}

// ================================================================================================
// dQ. CTA = block_m query rows of one (batch, head), stationary Q and dO; loops over key tiles:
//   S = Q K^T, P = exp2(logit2(S) - lse2), dP = dO V^T, dS = P (dP - D), dQ += dS K;
//   dQ *= grad_scale.
// XF: logit2(S) = head.logit2_at(S, i, j), and dS = P (dP - D) F with F that step's factor
// (1 - tanh^2 under a softcap).
// ================================================================================================
template <int DP, Math M, bool XF>
__global__ void __launch_bounds__(tile_config(Pass::Dq, DP, kDeviceBig).threads(), 1)
    dq_kernel(const __grid_constant__ BwdArgs args) {
  constexpr TileConfig C = tile_config(Pass::Dq, DP, kDeviceBig);
  constexpr int BM = C.block_m, BN = C.block_n, T = C.threads(), LD = smem_row(DP);
  constexpr int NS = BN / 8, NO = DP / 8;
  static_assert(BM == 16 * C.warps, "dq tile: one warp per 16 query rows");
  extern __shared__ float4 smem4[];
  float* sQ = reinterpret_cast<float*>(smem4);
  float* sdO = sQ + BM * LD;
  float* sK = sdO + BM * LD;
  float* sV = sK + C.stages * BN * LD;

  // A packed batch's sequence blockIdx.z as a dense call of its own (at_sequence).
  const BwdArgs a = at_sequence(args, blockIdx.z, DP);
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, hk = qb.hk, m0 = qb.m0;
  // The key tiles [t_begin, t_end) (QueryBlock), the loop counting tiles: with two stages the
  // cp.async buffer of tile t is t & 1 (no barrier phases that must start at 0), so one counter
  // stays live instead of an iteration count and t_begin.
  const int rows = qb.rows, t_end = qb.t_begin + qb.ntiles;
  if (rows <= 0) return;  // past a packed sequence's end: no work (never in a dense grid)
  const MaskRule& rule = qb.rule;
  // XF: the per-entry step for this (b, h), and the linear part after it (multiplier 1).
  const ScoreTransform::Head hd = XF ? a.score.head(b, h) : ScoreTransform::Head{};
  const ScoreTransform lin = XF ? a.score.after_elementwise() : a.score;

  const float* k = static_cast<const float*>(p.k.ptr) + b * p.k.sb + hk * p.k.sh;
  const float* v = static_cast<const float*>(p.v.ptr) + b * p.v.sb + hk * p.v.sh;
  auto load_kv = [&](int tile, int stage) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    const int n = static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
    load_tile<BN, DP, T>(sK + stage * BN * LD, k + n0 * p.k.ss, p.k.ss, n, D, a.vec16);
    load_tile<BN, DP, T>(sV + stage * BN * LD, v + n0 * p.v.ss, p.v.ss, n, D, a.vec16);
  };
  load_tile<BM, DP, T>(sQ, static_cast<const float*>(p.q.ptr) + b * p.q.sb + h * p.q.sh + m0 * p.q.ss,
                       p.q.ss, rows, D, a.vec16);
  load_tile<BM, DP, T>(sdO, static_cast<const float*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh + m0 * p.dout.ss,
                       p.dout.ss, rows, D, a.vec16);
  cp_async_commit();
  if (qb.ntiles > 0) load_kv(qb.t_begin, C.stages == 2 ? (qb.t_begin & 1) : 0);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = lane_id();
  const int64_t row_w = m0 + warp * 16;
  float l2[2], dl[2];  // per-row LSE (log2 domain) and D of the lane's rows g and g+8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row_w + (lane >> 2) + 8 * r;
    const bool in = row < Sq;
    l2[r] = in ? lse_to_log2(p.lse.ptr[b * p.lse.sb + h * p.lse.sh + row * p.lse.ss]) : INFINITY;
    dl[r] = in ? a.delta[a.ws_row(b, h) + row] : 0.0f;
  }
  float dq[NO][4];
  zero(dq);
  // 3xtf32: K and V split once in shared memory; their small parts [stages][BN][LD] each follow
  // sV, SOFF floats past the big parts (split_smem_bytes).
  constexpr int SOFF = split_smem_bytes(Pass::Dq, DP, kDeviceBig, M) > 0 ? 2 * C.stages * BN * LD : 0;

  for (int t = qb.t_begin; t < t_end; ++t) {
    pipeline_acquire<C.stages>(t, t_end, load_kv);
    const int stage = C.stages == 2 ? (t & 1) : 0;
    convert_step_tiles<M, SOFF, BN, DP, LD, T>(sK + stage * BN * LD, sV + stage * BN * LD);
    const float* sKs = sK + stage * BN * LD;
    float s[NS][4], dp[NS][4];
    zero(s);
    zero(dp);
    gemm_nt<M, NS, DP, LD, SOFF>(s, sQ + warp * 16 * LD, sKs);
    gemm_nt<M, NS, DP, LD, SOFF>(dp, sdO + warp * 16 * LD, sV + stage * BN * LD);

    const int64_t n0 = static_cast<int64_t>(t) * BN;
    const bool masked = qb.tile_masked(n0, BN, Skv);
    float f[NS][4];  // XF: the per-entry factor F (unused otherwise)
    if constexpr (XF) transform_scores(s, f, hd, row_w, n0);
    for_each_entry<NS>([&](int j, int e, int r, int c) {
      float pe = exp2f(lin.exp2_arg(s[j][e], l2[e >> 1]));
      if (masked && !keep(rule, row_w + r, n0 + c, Sq, Skv)) pe = 0.0f;
      dp[j][e] = pe * (dp[j][e] - dl[e >> 1]);  // dS
      if constexpr (XF) dp[j][e] *= f[j][e];
    });
    gemm_rn<M, NO, NS, LD, SOFF>(dq, dp, sKs);
    pipeline_release<C.stages>(t, t_end, load_kv);
  }
  pipeline_drain();
  bool sees[2];  // rows that see no key: dQ = 0 exactly
  rows_in(row_w + lane / 4, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
  zero_rows_unless(dq, sees);
  float* out = static_cast<float*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + m0 * p.dq.ss;
  store_rows<NO>(out, p.dq.ss, warp * 16, rows, 0, D, dq, a.score.grad_scale(), a.vec16);
}

// ================================================================================================
// dK/dV. CTA = block_m key rows of one (batch, kv head), stationary K and V; loops over the
// query heads of the kv group and, for each, the query tiles that can see these keys:
//   S^T = K Q^T, P^T = exp2(logit2(S^T) - lse2), dV += P^T dO, dP^T = V dO^T,
//   dS^T = P^T (dP^T - D), dK += dS^T Q; dK *= grad_scale. col_split warps share 16 key rows,
// each owning D/col_split columns of dK and dV (recomputing S^T and dP^T) so that the
// accumulators fit in registers at D = 256.
// XF: as in dQ, on S^T (rows are keys: the transposed per-entry step), dS^T = P^T (dP^T - D) F^T;
// the query head, and with it the ALiBi slope, changes along the loop.
// ================================================================================================
template <int DP, Math M, bool XF>
__global__ void __launch_bounds__(tile_config(Pass::Dkv, DP, kDeviceBig).threads(), 1)
    dkv_kernel(const __grid_constant__ BwdArgs args) {
  constexpr TileConfig C = tile_config(Pass::Dkv, DP, kDeviceBig);
  constexpr int BM = C.block_m, BN = C.block_n, T = C.threads(), LD = smem_row(DP);
  constexpr int CS = C.col_split, DW = DP / CS;  // columns of dK/dV per warp
  constexpr int NS = BN / 8, NO = DW / 8;
  static_assert(BM * CS == 16 * C.warps, "dkv tile: warps must cover block_m key rows");
  extern __shared__ float4 smem4[];
  float* sK = reinterpret_cast<float*>(smem4);
  float* sV = sK + BM * LD;
  float* sQ = sV + BM * LD;             // [stages][BN][LD]
  float* sdO = sQ + C.stages * BN * LD;  // [stages][BN][LD]
  float* sL = sdO + C.stages * BN * LD;  // [stages][BN] LSE
  float* sD = sL + C.stages * BN;        // [stages][BN] D

  // A packed batch's sequence blockIdx.z as a dense call of its own (at_sequence).
  const BwdArgs a = at_sequence(args, blockIdx.z, DP);
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const int D = static_cast<int>(p.shape.head_dim);
  const KeyBlock kb = key_block<BM, BN>(p.shape, p.num);
  const int64_t b = kb.b, hk = kb.hk, m0 = kb.m0;
  const int rows = kb.rows, ntiles = kb.ntiles;
  if (rows <= 0) return;  // past a packed sequence's end: no work (never in a dense grid)
  const MaskRule& rule = kb.rule;
  const ScoreTransform lin = XF ? a.score.after_elementwise() : a.score;  // see dq_kernel

  load_tile<BM, DP, T>(sK, static_cast<const float*>(p.k.ptr) + b * p.k.sb + hk * p.k.sh + m0 * p.k.ss,
                       p.k.ss, rows, D, a.vec16);
  load_tile<BM, DP, T>(sV, static_cast<const float*>(p.v.ptr) + b * p.v.sb + hk * p.v.sh + m0 * p.v.ss,
                       p.v.ss, rows, D, a.vec16);
  cp_async_commit();
  auto load_q = [&](int it, int stage) {
    const int64_t h = kb.head(it), n0 = kb.q0(it, BN);
    const int n = static_cast<int>(Sq - n0 < BN ? Sq - n0 : BN);
    load_tile<BN, DP, T>(sQ + stage * BN * LD,
                         static_cast<const float*>(p.q.ptr) + b * p.q.sb + h * p.q.sh + n0 * p.q.ss,
                         p.q.ss, n, D, a.vec16);
    load_tile<BN, DP, T>(sdO + stage * BN * LD,
                         static_cast<const float*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh + n0 * p.dout.ss,
                         p.dout.ss, n, D, a.vec16);
    load_vec<BN, T>(sL + stage * BN, p.lse.ptr + b * p.lse.sb + h * p.lse.sh + n0 * p.lse.ss, p.lse.ss, n);
    load_vec<BN, T>(sD + stage * BN, a.delta + a.ws_row(b, h) + n0, 1, n);
  };
  if (ntiles > 0) load_q(0, 0);
  cp_async_commit();

  const int warp = threadIdx.x / 32, kw = warp / CS, cw = warp % CS;
  const int64_t row_w = m0 + kw * 16;  // first key row of this warp
  float dk[NO][4], dv[NO][4];
  zero(dk);
  zero(dv);

  // 3xtf32: Q and dO split once in shared memory; their small parts [stages][BN][LD] each follow
  // sD, SOFF floats past the big parts (split_smem_bytes).
  constexpr int SOFF =
      split_smem_bytes(Pass::Dkv, DP, kDeviceBig, M) > 0 ? 2 * C.stages * BN * LD + 2 * C.stages * BN : 0;
  for (int it = 0; it < ntiles; ++it) {
    pipeline_acquire<C.stages>(it, ntiles, load_q);
    const int stage = C.stages == 2 ? (it & 1) : 0;
    convert_step_tiles<M, SOFF, BN, DP, LD, T>(sQ + stage * BN * LD, sdO + stage * BN * LD);
    const float* sQs = sQ + stage * BN * LD;
    const float* sdOs = sdO + stage * BN * LD;
    const float* sLs = sL + stage * BN;
    const float* sDs = sD + stage * BN;
    float s[NS][4], dp[NS][4];
    zero(s);
    zero(dp);
    gemm_nt<M, NS, DP, LD, SOFF>(s, sK + kw * 16 * LD, sQs);
    gemm_nt<M, NS, DP, LD, SOFF>(dp, sV + kw * 16 * LD, sdOs);

    const int64_t n0 = kb.q0(it, BN);  // first query row
    const bool masked = kb.tile_masked(n0, BN, BM, Sq, Skv);
    float f[NS][4];  // XF: the per-entry factor F^T (unused otherwise)
    if constexpr (XF) transform_scores<true>(s, f, a.score.head(b, kb.head(it)), row_w, n0);
    for_each_entry<NS>([&](int j, int e, int r, int c) {
      float pe = exp2f(lin.exp2_arg(s[j][e], lse_to_log2(sLs[c])));
      if (masked && !keep(rule, n0 + c, row_w + r, Sq, Skv)) pe = 0.0f;
      s[j][e] = pe;
      dp[j][e] = pe * (dp[j][e] - sDs[c]);  // dS^T
      if constexpr (XF) dp[j][e] *= f[j][e];
    });
    gemm_rn<M, NO, NS, LD, SOFF>(dv, s, sdOs + cw * DW);
    gemm_rn<M, NO, NS, LD, SOFF>(dk, dp, sQs + cw * DW);
    pipeline_release<C.stages>(it, ntiles, load_q);
  }
  pipeline_drain();
  const int cols = D - cw * DW;
  float* dkp = static_cast<float*>(p.dk.ptr) + b * p.dk.sb + hk * p.dk.sh + m0 * p.dk.ss + cw * DW;
  float* dvp = static_cast<float*>(p.dv.ptr) + b * p.dv.sb + hk * p.dv.sh + m0 * p.dv.ss + cw * DW;
  store_rows<NO>(dkp, p.dk.ss, kw * 16, rows, 0, cols, dk, a.score.grad_scale(), a.vec16);
  store_rows<NO>(dvp, p.dv.ss, kw * 16, rows, 0, cols, dv, 1.0f, a.vec16);
  bool seen[2];  // keys no query row sees: dK = dV = 0 exactly (zero_stored_rows: why after)
  rows_in(row_w + lane_id() / 4, rule.live_keys_begin(Skv), rule.live_keys_end(Sq, Skv), seen);
  zero_stored_rows<NO>(dkp, p.dk.ss, kw * 16, rows, 0, cols, seen);
  zero_stored_rows<NO>(dvp, p.dv.ss, kw * 16, rows, 0, cols, seen);
}

}  // namespace dev
}  // namespace flashattn::cuda
