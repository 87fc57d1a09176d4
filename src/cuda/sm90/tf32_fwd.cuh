// The Hopper (sm_90a) float32 forward in tf32 mode: the float16/bfloat16 forward's design
// (sm90/fwd16.cuh: TMA copies into 128-byte-swizzled shared memory, a producer warpgroup, two
// consumer warpgroups on mbarriers, S_{j+1} overlapping P_j V_j) with tf32 wgmma (m64nNk8).
// tf32 wgmma reads both shared-memory operands K-major only (no transposing descriptor as for
// 16 bits), so:
//   - Q is the A operand from registers (rounded to tf32 once per CTA), S = Q K^T reads K as
//     stored (rows = keys, k = head dim);
//   - V must be transposed: three producer warps copy each V tile into Vt (rows = head dim,
//     k = keys), rounding to tf32, in the slot order that lets the S accumulators serve as the
//     A operand of O += P V unshuffled (below); they also round each K tile to tf32 in place
//     (the tensor cores would truncate it: measured 2-3.5x the error of rounded operands);
//   - the Vt stages live in the Q tile's shared memory, free once both warpgroups hold Q in
//     registers.
// P as the A operand: a thread's accumulator holds columns 2t and 2t+1 of each 8-column block,
// while a tf32 A fragment wants k = t and t+4. The product sums over k in any order as long as A
// and B agree, so k-slot t takes key 2t and slot t+4 key 2t+1: A is the accumulator as it is, and
// the transposing warps write key n of each group of 8 into slot (n >> 1) + 4 (n & 1).
// docs/ALGORITHM.md ("float32 forward in tf32 mode on sm_90a") has the pseudocode and the work model.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/wgmma.cuh"

namespace flashattn::cuda::dev {

// The 3xTF32 forward (x3_fwd.cuh): tk, tks = K's big and small copies, tv, tvs = V's
// transposed big and small copies (the pre-pass's), tq = Q as stored.
struct Sm90Tf32FwdArgs {
  FwdArgs f;
  CUtensorMap tq, tk, tv;
  CUtensorMap tks, tvs;
};

// A tile of shared memory (BYTES, 16-byte words, T threads numbered tid) rounded to tf32 in
// place. The callers fence and publish.
template <int BYTES, int T>
__device__ __forceinline__ void convert_tile_tf32(unsigned char* tile, int tid) {
  static_assert(BYTES % 16 == 0, "16-byte words");
  float4* w = reinterpret_cast<float4*>(tile);
  for (int i = tid; i < BYTES / 16; i += T) {
    const float4 v = w[i];
    w[i] = make_float4(__uint_as_float(to_tf32(v.x)), __uint_as_float(to_tf32(v.y)), __uint_as_float(to_tf32(v.z)),
                       __uint_as_float(to_tf32(v.w)));
  }
}

// The transposing warps' work on one V tile (T threads, numbered tid): V (rows = keys,
// TileSw128F<BN, DP>) -> Vt (rows = head dim, TileSw128F<DP, BN>, key n in slot tf32_slot(n)),
// rounded to tf32. A unit of work is 32 consecutive keys (one per lane) of one
// 4-column chunk: its 16-byte reads hit 8 different chunks per 8 rows (the swizzle) and its 4-byte
// writes fill one 128-byte row, so neither side has bank conflicts. Lane l always takes key
// 32q + l, whose slot (32q + sigma(l)) and swizzle phase (l & 7) are fixed, so a unit's
// addresses cost a few integer ops instead of two full TileSw128F::offset evaluations per
// element (the transposing warps, not the tensor cores, were the tf32 forward's limit: 17.6
// SASS instructions per element before, about 6 now).
template <int BN, int DP, int T>
__device__ __forceinline__ void transpose_v_tf32(const unsigned char* v, unsigned char* vt, int tid) {
  using TK = TileSw128F<BN, DP>;
  using TVt = TileSw128F<DP, BN>;
  static_assert(BN % 32 == 0 && DP % 8 == 0, "units of 32 keys x 4 columns");
  const int lane = tid & 31, tw = tid >> 5;
  const int l7 = lane & 7, sl = tf32_slot(lane);
  const unsigned char* src = v + lane * 128;
  unsigned char* dst = vt + (sl & 3) * 4;
  const uint32_t sc4 = ((sl >> 2) & 7) << 4;
  // A warp takes column chunks c4 = tw, tw + T/32, ... and, for each, every 32-key group q:
  // the addresses depend on q only through constants (block and row offsets).
  for (int c4 = tw; c4 < DP / 4; c4 += T / 32) {
    // TK::offset(32q + lane, 4c4): block c4 / 8, row 32q + lane, 16-byte chunk (c4 ^ lane) & 7.
    const unsigned char* s = src + (c4 >> 3) * TK::kBlockBytes + (((c4 ^ l7) & 7) << 4);
    // TVt::offset(4c4 + i, 32q + sl): block q, row 4c4 + i, chunk ((sl >> 2) & 7) ^ ((4c4 + i) & 7);
    // (4c4 + i) & 7 = 4 (c4 & 1) | i, so the chunk is x ^ i with x = ((sl >> 2) & 7) ^ 4 (c4 & 1).
    const uint32_t x = sc4 ^ ((c4 & 1) << 6);
    unsigned char* d = dst + c4 * 4 * 128;
    unsigned char* dd[4] = {d + x, d + 128 + (x ^ 16), d + 256 + (x ^ 32), d + 384 + (x ^ 48)};
#pragma unroll
    for (int q = 0; q < BN / 32; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(s + q * 32 * 128);
      const float e[4] = {f.x, f.y, f.z, f.w};
      const int o = q * TVt::kBlockBytes;
#pragma unroll
      for (int i = 0; i < 4; ++i) *reinterpret_cast<uint32_t*>(dd[i] + o) = to_tf32(e[i]);
    }
  }
}

// kCopies (the operand pre-pass's copies the kernel streams, launch_tf32_operands):
//   0: none - A.tv maps V as stored, producer warps 1-3 transpose each tile and round K in place;
//   1: A.tv maps V transposed and rounded (rows = head dim, keys in tf32_slot order: the 3xTF32
//      forward's big part), copied into the Vt stages as it is; warps 1-3 only round K;
//   2: as 1, and A.tk maps K rounded (rows): warps 1-3 have nothing to do.
// Every variant multiplies the same tf32 values in the same key slots: the results are bitwise
// equal.
template <int DP, int kCopies>
__global__ void __launch_bounds__(tile_config90_tf32(DP).threads(), 1)
    forward_tf32_sm90_kernel(const __grid_constant__ Sm90Tf32FwdArgs A) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr TileConfig90 C = tile_config90_tf32(DP);
  constexpr int BM = C.block_m, BN = C.block_n, NWG = C.warpgroups, TC = 128 * NWG;
  constexpr int NS = BN / 8, NO = DP / 8;
  constexpr int kTransposers = 96;  // producer warps 1-3
  using TQ = TileSw128F<BM, DP>;
  using TK = TileSw128F<BN, DP>;   // K and V as stored: rows = keys
  using TVt = TileSw128F<DP, BN>;  // V transposed: rows = head dim, k = key slots
  static_assert(2 * TVt::kBytes <= TQ::kBytes, "the Vt stages reuse the Q tile");
  extern __shared__ float4 smem4[];
  unsigned char* sQ = smem_aligned1024(reinterpret_cast<unsigned char*>(smem4));
  unsigned char* sVt = sQ;                  // [2][DP x BN], once Q is in registers
  unsigned char* sK = sQ + TQ::kBytes;      // [2][BN x DP]
  unsigned char* sV = sK + 2 * TK::kBytes;  // [2][BN x DP]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sV + 2 * TK::kBytes);
  uint64_t* full_q = bars;
  uint64_t* q_free = bars + 1;    // every consumer thread holds its Q fragments
  uint64_t* full_k = bars + 2;    // [2]
  uint64_t* empty_k = bars + 4;   // [2]
  uint64_t* full_v = bars + 6;    // [2] V as stored landed
  uint64_t* empty_v = bars + 8;   // [2] V as stored read by the transposing warps
  uint64_t* full_vt = bars + 10;  // [2] Vt written
  uint64_t* empty_vt = bars + 12; // [2] Vt read by both warpgroups' products
  uint64_t* round_k = bars + 14;  // [2] K rounded to tf32 in place

  const FwdArgs& a = A.f;
  const ForwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q, Skv = p.shape.seq_kv;
  const QueryBlock qb = query_block<BM, BN>(p.shape, p.num);
  const int64_t b = qb.b, h = qb.h, m0 = qb.m0;
  const int ntiles = qb.ntiles;
  const MaskRule& rule = qb.rule;

  if (threadIdx.x == 0) {
    mbar_init(full_q, 1);
    mbar_init(q_free, TC);
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_k + i, 1);
      mbar_init(empty_k + i, TC);
      mbar_init(full_v + i, 1);
      mbar_init(empty_v + i, kTransposers);
      mbar_init(full_vt + i, kCopies > 0 ? 1 : kTransposers);
      mbar_init(empty_vt + i, TC);
      mbar_init(round_k + i, kTransposers);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = warpgroup_index();  // uniform (device.cuh)
  if (wg == NWG) {
    // ---- producer ---------------------------------------------------------------------------
    regs_decrease<C.producer_regs>();
    const int pt = threadIdx.x - TC;
    if (pt == 0 && kCopies > 0) {
      // Vt of iteration t straight into its stage (columns = key slots n0.., rows = head dim); the
      // Vt stages are the Q tile's memory: the first waits until both warpgroups hold Q in registers.
      const int hk = static_cast<int>(qb.hk), bb = static_cast<int>(b);
      copy_forward_tiles_with<TQ, TK, DP, BN>(&A.tq, &A.tk, sQ, sK, full_q, full_k, empty_k, static_cast<int>(m0),
                                              static_cast<int>(h), hk, bb, qb.t_begin, ntiles, [&](int t, int n0) {
                                                if (t == 0) mbar_wait(q_free, 0);
                                                tma_load_stage<TVt, 32>(&A.tv, sVt, full_vt, empty_vt, t, n0, 0, hk,
                                                                        bb);
                                              });
    } else if (pt == 0) {
      copy_forward_tiles<TQ, TK, DP, BN>(&A.tq, &A.tk, &A.tv, sQ, sK, sV, full_q, full_k, empty_k, full_v, empty_v,
                                         static_cast<int>(m0), static_cast<int>(h), static_cast<int>(qb.hk),
                                         static_cast<int>(b), qb.t_begin, ntiles);
    } else if (pt >= 32 && kCopies < 2) {
      // Warps 1-3: K_t rounded in place (contiguous 16-byte words: no bank conflicts), then
      // published; without the V copy also V_t -> Vt_t (transpose_v_tf32). t counts iterations
      // (stages, phases); the tiles' keys are the copying thread's business.
      const int tid = pt - 32;
      auto round_tile_k = [&](int t) {
        const int st = t & 1;
        mbar_wait(full_k + st, (t >> 1) & 1);
        convert_tile_tf32<TK::kBytes, kTransposers>(sK + st * TK::kBytes, tid);
        fence_proxy_async();
        mbar_arrive(round_k + st);
      };
      if constexpr (kCopies == 1) {
        for (int t = 0; t < ntiles; ++t) round_tile_k(t);  // as each copy lands and its stage is free
      } else {
        // In the order the consumers need them: K_0, then K_{t+1} before Vt_t.
        if (ntiles > 0) round_tile_k(0);
        mbar_wait(q_free, 0);
        for (int t = 0; t < ntiles; ++t) {
          if (t + 1 < ntiles) round_tile_k(t + 1);
          const int st = t & 1;
          mbar_wait(full_v + st, (t >> 1) & 1);
          mbar_wait(empty_vt + st, ((t >> 1) & 1) ^ 1);
          transpose_v_tf32<BN, DP, kTransposers>(sV + st * TK::kBytes, sVt + st * TVt::kBytes, tid);
          mbar_arrive(empty_v + st);
          fence_proxy_async();  // the writes, before the tensor cores read them
          mbar_arrive(full_vt + st);
        }
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------------
  regs_increase<C.consumer_regs()>();
  const int warp = threadIdx.x / 32, g = lane_id() >> 2;
  const int64_t row_w = m0 + 16 * warp;  // the warp's first query row
  const uint32_t k_addr = smem_addr(sK), vt_addr = smem_addr(sVt);

  // Q fragments (tf32) of the warp's 16 rows: k-step kk holds columns 8kk + t and 8kk + t + 4.
  uint32_t qa[DP / 8][4];
  mbar_wait(full_q, 0);
  load_afrag_tf32<TQ>(qa, sQ, 16 * warp);
  mbar_arrive(q_free);

  float o[1][NO][4];
  zero(o[0]);
  SoftmaxState st;
  float s[1][NS][4];
  uint32_t pa[NS][4];

  const RowKeys keys(rule, row_w + g, Sq, Skv);  // the lane's rows' visible keys
  const bool fused = a.score.scale > 0.0f;       // uniform: an increasing transform (softmax_rows)
  // Scores of iteration it's key tile (in s) -> P in s, statistics updated, alpha for O.
  auto softmax_tile = [&](int it, float(&alpha)[2]) {
    const int64_t n0 = qb.key0(it, BN);
    softmax_tile_sm90<BN>(s[0], st, alpha, keys, n0, qb.tile_masked(n0, BN, Skv), fused, a.score);
  };
  // P (fp32 in s) -> tf32 A fragments, k-slot t = column 2t, slot t + 4 = column 2t + 1.
  auto to_pa = [&] { acc_to_afrag_tf32(pa, s[0]); };
  // K_t ready: rounded by warps 1-3, or (kCopies 2) rounded already and landed.
  auto wait_k = [&](int t) { mbar_wait((kCopies == 2 ? full_k : round_k) + (t & 1), (t >> 1) & 1); };
  auto wait_vt = [&](int t) { mbar_wait(full_vt + (t & 1), (t >> 1) & 1); };

  if (ntiles > 0) {
    wait_k(0);
    fence_regs(s[0]);
    wgmma_fence();
    wg_gemm_rs_tf32<DP / 8, TK>(s[0], qa, k_addr, 0, false);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s[0]);
    mbar_arrive(empty_k);
    float alpha[2];
    softmax_tile(0, alpha);
    to_pa();
  }
  // As the 16-bit kernel: the last tile is peeled so every wgmma in the loop is unconditional.
  for (int it = 0; it + 1 < ntiles; ++it) {
    wait_k(it + 1);
    wait_vt(it);
    fence_regs(o[0]);
    fence_regs(s[0]);
    wgmma_fence();
    wg_gemm_rs_tf32<DP / 8, TK>(s[0], qa, k_addr + ((it + 1) & 1) * TK::kBytes, 0, false);
    wgmma_commit();
    wg_gemm_rs_tf32<NS, TVt>(o[0], pa, vt_addr + (it & 1) * TVt::kBytes, 0, true);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(s[0]);
    mbar_arrive(empty_k + ((it + 1) & 1));
    float alpha[2];
    softmax_tile(it + 1, alpha);
    wgmma_wait<0>();
    fence_regs(o[0]);
    mbar_arrive(empty_vt + (it & 1));
    rescale_rows(o[0], alpha);
    to_pa();
  }
  if (ntiles > 0) {
    const int it = ntiles - 1;
    wait_vt(it);
    fence_regs(o[0]);
    wgmma_fence();
    wg_gemm_rs_tf32<NS, TVt>(o[0], pa, vt_addr + (it & 1) * TVt::kBytes, 0, true);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o[0]);
    mbar_arrive(empty_vt + (it & 1));
  }

  // Epilogue: O /= l, LSE; O straight from the accumulators (each quad writes 32 contiguous
  // bytes of a row: whole sectors).
  bool sees[2];  // rows that see no key by the band: O = 0, LSE = -inf
  rows_in(row_w + g, rule.live_rows_begin(Sq), rule.live_rows_end(Sq, Skv), sees);
  float inv[2], lse[2];
  finish_rows(st, sees, inv, lse);
  normalize_rows(o[0], inv, sees);
  store_lse(p.lse, b, h, row_w, Sq, lse);
  float* out = static_cast<float*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + m0 * p.out.ss;
  store_rows(out, p.out.ss, 16 * warp, qb.rows, 0, static_cast<int>(p.shape.head_dim), o[0], 1.0f, true);
#endif
}

}  // namespace flashattn::cuda::dev
