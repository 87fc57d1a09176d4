// The KV-cache attention kernel (flashattn_forward_kvcache on CUDA, float16/bfloat16): a forward
// over each sequence's cached keys, read through the call's row map (KvMap, core/params.hpp:
// contiguous caches with a batch row and a left pad, or pages of a block table), with the key
// range optionally split over several CTAs ("flash-decoding": split-KV, combined by their LSEs in
// common/kvcache.cu). docs/ALGORITHM.md ("CUDA KV-cache attention") has the pseudocode.
//
// Decoding has few query rows (Sq = 1 or a few draft tokens) per kv head, so the CTA's rows are
// the (query row, query head) pairs of one kv head: row R of the CTA's kv head is query row R / G
// of query head hk * G + R % G (G = Hq / Hkv), which makes the G heads of a GQA group share every
// K/V tile they read. Built from the 16-bit kernels' pieces (mma16.cuh: swizzled tiles, cp.async,
// ldmatrix, mma.sync products; device.cuh: online softmax, masks; work.hpp: the band's tiles).
// Two shapes of the same template:
//   KW = 4: 16 rows per CTA, the four warps split each 64-key tile (16 keys each) and merge their
//           softmax states at the end - decoding, where one m16 tile holds every row;
//   KW = 1: 64 rows per CTA, each warp 16 of them over the whole tile - more query rows
//           (speculative decoding, chunked prefill against a cache).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"
#include "cuda/common/mma16.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/mbarrier.cuh"

namespace flashattn::cuda::dev {

// The K/V tile layout of the bulk-copy loader: row-major rows padded by 16 bytes. A bulk copy
// writes a row as it is in memory (no swizzle), and with the 16-byte pad the 8 rows an ldmatrix
// reads start 4 banks apart (pitch DP * 2 + 16 bytes = DP / 2 + 4 words): no bank conflicts.
template <int ROWS, int COLS>
struct TilePad {
  static constexpr int kRows = ROWS;
  static constexpr int kChunks = COLS / 8;
  static constexpr int kPitch = COLS * 2 + 16;
  static constexpr int kBytes = ROWS * kPitch;
  __device__ __forceinline__ static uint32_t offset(int r, int c) { return static_cast<uint32_t>(r * kPitch + c * 16); }
};

// The bulk loader's sm_90 instructions (mbarrier.cuh), compiled only for sm_90 targets: the host
// picks that loader only where the kernel's binary is one (launch_decode16).
__device__ __forceinline__ void dec_bar_init(uint64_t* bars, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (int i = 0; i < n; ++i) mbar_init(bars + i, 1);
  mbar_init_fence();
#else
  __trap();
#endif
}
__device__ __forceinline__ void dec_expect_tx(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  mbar_expect_tx(bar, bytes);
#endif
}
__device__ __forceinline__ void dec_bulk_row(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  bulk_copy_g2s(dst, src, bytes, bar);
#endif
}
__device__ __forceinline__ void dec_bar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  mbar_wait(bar, parity);
#endif
}

// Loads ROWS x COLS of 16-bit rows whose addresses row_ptr(r) gives (r < rows; any order in
// memory: gathered query heads, the pages of a cache) into a swizzled tile, zero-filling rows
// >= rows and columns >= cols. vec16: every row 16-byte aligned, asynchronous 16-byte copies;
// otherwise 2-byte loads and shared stores. (The dense loader, load_tile16_as, keeps its
// straight-line address arithmetic: the sm_80 kernels sit at the register limit.)
// `any` is some valid global address (the operand's base): the source of the zero-byte copies.
template <class L, int THREADS, class RowPtr>
__device__ __forceinline__ void load_rows16(unsigned char* smem, RowPtr&& row_ptr, const void* any, int rows, int cols,
                                            bool vec16) {
  constexpr int N = L::kRows * L::kChunks;
  const uint32_t base = smem_addr(smem);
  for (int idx = static_cast<int>(threadIdx.x); idx < N; idx += THREADS) {
    const int r = idx / L::kChunks, c = idx % L::kChunks, col = c * 8;
    if (vec16) {
      int bytes = r < rows ? (cols - col) * 2 : 0;
      bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
      cp_async16_s(base + L::offset(r, c), bytes ? static_cast<const void*>(row_ptr(r) + col) : any, bytes);
    } else {
      uint16_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (r < rows) {
        const uint16_t* g = row_ptr(r);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (col + e < cols) v[e] = g[col + e];
      }
      uint4 w;
      w.x = v[0] | (uint32_t(v[1]) << 16);
      w.y = v[2] | (uint32_t(v[3]) << 16);
      w.z = v[4] | (uint32_t(v[5]) << 16);
      w.w = v[6] | (uint32_t(v[7]) << 16);
      *reinterpret_cast<uint4*>(smem + L::offset(r, c)) = w;
    }
  }
}

// The common case of load_rows16: all L::kRows rows valid, every column (D = DP), rows 16-byte
// aligned at a fixed stride `ss` from g. A thread keeps one chunk column and steps down the rows,
// so each copy is one address add and one cp.async: the generic loader's per-chunk row lookup
// and bounds arithmetic made up about a third of the decoding loop's instructions, and this
// memory-bound loop is issue-latency-bound per CTA (few warps per SM).
template <class L, int THREADS>
__device__ __forceinline__ void load_rows16_full(unsigned char* smem, const uint16_t* g, int64_t ss) {
  constexpr int CH = L::kChunks, RS = THREADS / CH, N = L::kRows / RS;
  static_assert(THREADS % CH == 0 && L::kRows % RS == 0, "whole rows per pass");
  const int c = static_cast<int>(threadIdx.x) % CH, r0 = static_cast<int>(threadIdx.x) / CH;
  const uint32_t base = smem_addr(smem);
  const uint16_t* src = g + r0 * ss + c * 8;
  const int64_t step = RS * ss;
#pragma unroll
  for (int k = 0; k < N; ++k, src += step)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(base + L::offset(r0 + k * RS, c)), "l"(src));
}

// Row s (relative to the sequence's first valid row) of one kv head's cache, K or V.
struct CacheRows {
  const uint16_t* base;  // contiguous: the sequence's row 0; paged: the head's offset in page 0
  int64_t ss;            // row stride (elements)
  const int32_t* table;  // the sequence's block-table row (nullptr: contiguous)
  int64_t page;          // page stride (elements)
  int32_t block;         // rows per page
  __device__ __forceinline__ const uint16_t* row(int64_t s) const {
    if (table == nullptr) return base + s * ss;
    const int32_t si = static_cast<int32_t>(s);  // < 2^31: cache positions are int32
    return base + table[si / block] * page + (si % block) * ss;
  }
};
__device__ __forceinline__ CacheRows cache_rows(const KvMap& m, const In4& t, int64_t b, int64_t hk) {
  CacheRows c;
  c.ss = t.ss;
  c.page = t.sb;
  c.block = static_cast<int32_t>(m.block_size);
  if (m.block_table != nullptr) {
    c.base = static_cast<const uint16_t*>(t.ptr) + hk * t.sh;
    c.table = m.block_table + b * m.bt_stride;
  } else {
    const int64_t brow = m.batch_row != nullptr ? m.batch_row[b] : b;
    const int64_t s0 = m.start != nullptr ? m.start[b] : 0;
    c.base = static_cast<const uint16_t*>(t.ptr) + brow * t.sb + hk * t.sh + s0 * t.ss;
    c.table = nullptr;
  }
  return c;
}

// BULK: the K/V tiles by bulk copies (DecodeShape::kBulk; sm_90, D = DP, 16-byte rows), else by
// cp.async (kRows / kGeneric).
template <int DP, Half16 H, bool XF, int KW, bool BULK>
__global__ void __launch_bounds__(DecodeShape::kThreads) decode16_kernel(const __grid_constant__ DecodeArgs a) {
  constexpr int T = DecodeShape::kThreads, W = DecodeShape::kWarps, BN = DecodeShape::kBlockN;
  constexpr int BM = DecodeShape::block_m(KW), KN = BN / KW, NSW = KN / 8, NO = DP / 8;
  static_assert(NSW % 2 == 0, "each warp's key slice is a whole number of k16 steps");
  static_assert(!BULK || T == 2 * BN, "the bulk loader: a thread per K or V row of a tile");
  using TQ = Tile<BM, DP>;
  using TK = std::conditional_t<BULK, TilePad<BN, DP>, Tile<BN, DP>>;
  // NST stages of K and V tiles (decode_smem_bytes): tile t of the CTA's range [t_begin, t_end)
  // lands in stage (t - t_begin) % NST; NST - 1 tiles are in flight while one is computed on.
  const int NST = a.stages;
  extern __shared__ float4 smem4[];
  unsigned char* sQ = reinterpret_cast<unsigned char*>(smem4);
  unsigned char* sK = sQ + TQ::kBytes;        // [NST][BN x DP]
  unsigned char* sV = sK + NST * TK::kBytes;  // [NST][BN x DP]
  float* s_m = reinterpret_cast<float*>(sV + NST * TK::kBytes);  // [KW][BM] row max (log2 units)
  float* s_l = s_m + W * 16;                                      // [KW][BM] row sum
  uint64_t* bars = reinterpret_cast<uint64_t*>(s_l + W * 16);     // BULK: a barrier per stage

  // The prologue is this kernel's fixed cost (B = 1 decoding reads only a few tiles per CTA), so
  // it is ordered for latency: the CTA's place from launch constants (U32Div) while the previous
  // kernel may still run, then every index read at once (a verdict, the sequence's length and
  // cache row: each a dependent memory or parameter read), then the first K/V tiles' copies
  // before the Q gather.
  const ForwardParams& p = a.p;
  // x = (row block, split, kv head), the kv head fastest: CTAs launched together read the same
  // key range of every kv head, which in a [B, S, Hkv, D] cache is one contiguous span of rows
  // (each head's 2 D bytes of a row are a slice of it), not Hkv spans far apart.
  const int64_t Hkv = p.shape.heads_kv, b = blockIdx.z;
  const uint32_t xs = a.hkv_div.div(blockIdx.x), xb = a.split_div.div(xs);
  const int64_t hk = blockIdx.x - xs * a.hkv_div.d;
  const int split = static_cast<int>(xs - xb * a.split_div.d);
  const int64_t R0 = static_cast<int64_t>(xb) * BM;
  const int64_t G = a.rows32 ? static_cast<int64_t>(a.g_div.d) : p.shape.heads_q / Hkv, Sq = p.shape.seq_q;
  // (query row, head) pair R of the kv head -> query row R / G, head hk G + R % G.
  auto row_of = [&](int64_t R) -> int64_t { return a.rows32 ? a.g_div.div(static_cast<uint32_t>(R)) : R / G; };
  auto head_of = [&](int64_t R) -> int64_t {
    return hk * G + (a.rows32 ? a.g_div.mod(static_cast<uint32_t>(R)) : R % G);
  };
  if constexpr (BULK) {
    if (threadIdx.x == 0) dec_bar_init(bars, NST);
  }
  // (A dependent launch after the prepare pass: the appended rows and the rotated q must be
  // written. The combine kernel may start as soon as every CTA of this one has: it waits for
  // this kernel's completion itself.)
  pdl_wait();
  pdl_trigger();
  const int ok = a.ok != nullptr ? *a.ok : 1;
  const KvMap kv = kv_map_at(p.kv, a.idx);
  const int64_t Skv = kv.seqlen_k[b];
  const CacheRows kr = cache_rows(kv, p.k, b, hk), vr = cache_rows(kv, p.v, b, hk);
  if (ok == 0) return;  // (the index arrays broke a rule: nothing is written)
  const int D = static_cast<int>(p.shape.head_dim);
  const int rows = static_cast<int>(Sq * G - R0 < BM ? Sq * G - R0 : BM);
  const MaskRule rule = mask_rule(Shape{1, 1, 1, Sq, Skv, D}, p.num);
  // The query rows of this CTA and the key tiles they see, then this split's share of them.
  const int64_t i_first = row_of(R0), i_last = row_of(R0 + rows - 1);
  const TileRange all = key_tiles(rule, i_first, static_cast<int>(i_last - i_first + 1), Skv, BN);
  const int per = static_cast<int>(a.split_div.div(static_cast<uint32_t>(all.count + a.splits - 1)));
  const int t_begin = all.begin + split * per;
  const int t_end = t_begin + per < all.begin + all.count ? t_begin + per : all.begin + all.count;
  // Whole tiles at a fixed row stride: contiguous caches, or pages holding whole tiles.
  const bool full_rows =
      a.loader == DecodeShape::kRows && a.vec16 && D == DP && (kr.table == nullptr || kr.block % BN == 0);
  // BULK: thread t copies row t % BN of K (t < BN) or V with one bulk copy (D = DP: whole rows),
  // and zeroes the rows past Sk (their P is 0, and 0 x NaN would not be; only the last key tile
  // has such rows, and no bulk copy lands in its buffer after it - else a fence.proxy.async
  // would have to order the two writers); thread 0 announces the
  // tile's bytes on the stage's barrier (a copy may complete before that: the barrier's
  // transaction count goes negative meanwhile, and its phase needs thread 0's arrival too).
  auto load_kv_bulk = [&](int tile, int stage) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    const int n = static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
    uint64_t* bar = bars + stage;
    if (threadIdx.x == 0) dec_expect_tx(bar, static_cast<uint32_t>(2 * n * D * 2));
    const int r = static_cast<int>(threadIdx.x) % BN;
    const bool isv = static_cast<int>(threadIdx.x) >= BN;
    unsigned char* dst = (isv ? sV : sK) + stage * TK::kBytes + TK::offset(r, 0);  // (TilePad: whole rows)
    if (r < n) {
      dec_bulk_row(dst, (isv ? vr : kr).row(n0 + r), static_cast<uint32_t>(D * 2), bar);
    } else {
#pragma unroll
      for (int c = 0; c < TK::kChunks; ++c) reinterpret_cast<uint4*>(dst)[c] = make_uint4(0u, 0u, 0u, 0u);
    }
  };
  auto load_kv = [&](int tile, int stage) {
    const int64_t n0 = static_cast<int64_t>(tile) * BN;
    const int n = static_cast<int>(Skv - n0 < BN ? Skv - n0 : BN);
    if constexpr (T % TK::kChunks == 0) {  // (whole rows per pass: not at DP = 96)
      if (full_rows && n == BN) {
        load_rows16_full<TK, T>(sK + stage * TK::kBytes, kr.row(n0), kr.ss);  // (n0: a tile's first row)
        load_rows16_full<TK, T>(sV + stage * TK::kBytes, vr.row(n0), vr.ss);
        return;
      }
    }
    load_rows16<TK, T>(sK + stage * TK::kBytes, [&](int r) { return kr.row(n0 + r); }, p.k.ptr, n, D, a.vec16);
    load_rows16<TK, T>(sV + stage * TK::kBytes, [&](int r) { return vr.row(n0 + r); }, p.v.ptr, n, D, a.vec16);
  };
  if constexpr (BULK) __syncthreads();  // (the barriers' initialisation)
  // The pipeline's fill: tiles t_begin .. t_begin + NST - 2 (a cp.async group each, empty past
  // the range, so that group counting is the same in every iteration), the Q gather after the
  // first tile's copies and in its group (waited for with it).
  auto load_q = [&] {
    load_rows16<TQ, T>(
        sQ,
        [&](int r) {
          const int64_t R = R0 + r;
          return static_cast<const uint16_t*>(p.q.ptr) + b * p.q.sb + head_of(R) * p.q.sh + row_of(R) * p.q.ss;
        },
        p.q.ptr, rows, D, a.vec16);
  };
  for (int i = 0; i < NST - 1; ++i) {
    if constexpr (BULK) {
      if (t_begin + i < t_end) load_kv_bulk(t_begin + i, i);
      if (i == 0) load_q(), cp_async_commit();
    } else {
      if (t_begin + i < t_end) load_kv(t_begin + i, i);
      if (i == 0) load_q();
      cp_async_commit();
    }
  }

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = lane_id();
  const int kw = warp % KW, rw = warp / KW;
  // The lane's two rows (g and g + 8 of the warp's m16 tile): query row and head; rows past the
  // CTA's get query row Sq, which keep() hides everything from.
  int64_t qi[2];
  ScoreTransform sc = a.score;
  sc.diag = Skv - Sq;
  ScoreTransform::Head hd[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t R = R0 + rw * 16 + (lane >> 2) + 8 * r;
    const bool in = R < R0 + rows;
    qi[r] = in ? row_of(R) : Sq;
    if constexpr (XF) hd[r] = sc.head(b, in ? head_of(R) : hk * G);
  }
  float o[1][NO][4];
  zero(o);
  SoftmaxState st;

  int stage = 0, use = 0;  // tile t's stage, and how many tiles that stage held before it
  for (int t = t_begin; t < t_end; ++t) {
    // Tile t + NST - 1 into the stage tile t - 1 used (its readers ended with the barrier at the
    // end of iteration t - 1), then wait for tile t.
    const int ahead = t + NST - 1, ahead_stage = stage == 0 ? NST - 1 : stage - 1;
    if constexpr (BULK) {
      if (ahead < t_end) load_kv_bulk(ahead, ahead_stage);
      if (t == t_begin) cp_async_wait<0>();  // (the Q tile)
      dec_bar_wait(bars + stage, static_cast<uint32_t>(use & 1));
    } else {
      if (ahead < t_end) load_kv(ahead, ahead_stage);
      cp_async_commit();
      // Every group but the NST - 1 newest (tiles t + 1 .. t + NST - 1) is complete: tile t too.
      if (NST == 2) cp_async_wait<1>();
      else if (NST == 3) cp_async_wait<2>();
      else cp_async_wait<3>();
    }
    __syncthreads();
    const uint32_t kst = smem_addr(sK + stage * TK::kBytes), vst = smem_addr(sV + stage * TK::kBytes);
    float s[1][NSW][4];
    zero(s);
    gemm_ss<H, 1, NSW, DP, TQ, TK>(s, smem_addr(sQ), rw * 16, kst, kw * KN);
    const int64_t n0 = static_cast<int64_t>(t) * BN, c0 = n0 + kw * KN;
    if constexpr (XF) {
      for_each_entry<NSW>([&](int j, int e, int r, int c) {
        s[0][j][e] = hd[r >> 3].template logit2_at<true>(s[0][j][e], qi[r >> 3], c0 + c);
      });
    } else {
      scale_scores(s[0], sc);
    }
    if (n0 + BN > Skv || !rule.tile_inside(i_first, i_last + 1, n0, n0 + BN)) {
      for_each_entry<NSW>([&](int j, int e, int r, int c) {
        if (!keep(rule, qi[r >> 3], c0 + c, Sq, Skv)) s[0][j][e] = -INFINITY;
      });
    }
    online_softmax<NSW, NO, true>(st, s[0], o[0]);
    uint32_t pa[1][NSW / 2][4];
    to_afrag<H, 1, NSW / 2>(pa, s);
    gemm_rs<H, 1, NO, NSW / 2, TK>(o, pa, vst, kw * KN, 0);
    __syncthreads();  // (every read of this stage is done: the next iteration refills it)
    if (++stage == NST) stage = 0, ++use;
  }
  pipeline_drain();

  // Merge: every warp's unnormalised O slice (float32, over the K/V buffers, now free) and its
  // rows' (m, l); then each output element sums the KW slices in a fixed order (deterministic).
  constexpr int LDO = DP + 4;  // floats per staged row (+4: the fragment stores spread over banks)
  static_assert(KW * BM * LDO * 4 <= 4 * TK::kBytes, "staging fits the K/V buffers");
  float* sO = reinterpret_cast<float*>(sK);
  {
    const int g = lane >> 2, tq = lane & 3;
    float* mine = sO + (kw * BM + rw * 16) * LDO;
#pragma unroll
    for (int j = 0; j < NO; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<float2*>(mine + (g + 8 * r) * LDO + 8 * j + 2 * tq) =
            make_float2(o[0][j][2 * r], o[0][j][2 * r + 1]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(st.l[r]);
      if (tq == 0) {
        s_m[kw * BM + rw * 16 + g + 8 * r] = st.m[r];
        s_l[kw * BM + rw * 16 + g + 8 * r] = l;
      }
    }
  }
  __syncthreads();

  const int64_t live0 = rule.live_rows_begin(Sq), live1 = rule.live_rows_end(Sq, Skv);
  const bool partial = a.splits > 1;
  constexpr int CH = DP / 8;  // 8-column chunks per row
  for (int idx = static_cast<int>(threadIdx.x); idx < BM * CH; idx += T) {
    const int r = idx / CH, col = (idx % CH) * 8;
    if (r >= rows || col >= D) continue;
    // The row's statistics over the KW slices: m = max, l = sum l_k 2^(m_k - m).
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < KW; ++k) m = fmaxf(m, s_m[k * BM + r]);
    const float m_use = m == -INFINITY ? 0.0f : m;
    float f[KW], l = 0.0f;
#pragma unroll
    for (int k = 0; k < KW; ++k) {
      f[k] = exp2f(s_m[k * BM + r] - m_use);
      l += s_l[k * BM + r] * f[k];
    }
    const int64_t R = R0 + r, i = row_of(R), h = head_of(R);
    // A row no key is visible to by the band: O = 0, LSE = -inf (never decided from l). A split's
    // partial O of a row that saw none of its keys is 0 too (l = 0: its weight in the combine is
    // 0, and 0 * NaN would be NaN).
    const bool sees = i >= live0 && i < live1 && !(partial && l == 0.0f);
    const float inv = sees ? 1.0f / l : 0.0f;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float acc = 0.0f;
#pragma unroll
      for (int k = 0; k < KW; ++k) acc += sO[(k * BM + r) * LDO + col + e] * f[k];
      v[e] = sees ? acc * inv : 0.0f;
    }
    const float lse = sees ? (m + log2f(l)) * kLn2 : -INFINITY;
    if (partial) {
      const int64_t row = (b * p.shape.heads_q + h) * Sq + i;
      const int64_t prow = static_cast<int64_t>(split) * a.part_rows + row;
      float4* dst = reinterpret_cast<float4*>(a.o_part + prow * DP + col);
      dst[0] = make_float4(v[0], v[1], v[2], v[3]);
      dst[1] = make_float4(v[4], v[5], v[6], v[7]);
      if (col == 0) a.lse_part[prow] = lse;
    } else {
      uint16_t* dst = static_cast<uint16_t*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.ss + col;
      const uint32_t w[4] = {pack2<H>(v[0], v[1]), pack2<H>(v[2], v[3]), pack2<H>(v[4], v[5]), pack2<H>(v[6], v[7])};
      if (a.vec16 && col + 8 <= D) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (col + e < D) dst[e] = static_cast<uint16_t>(w[e / 2] >> (16 * (e & 1)));
      }
      if (col == 0) p.lse.ptr[b * p.lse.sb + h * p.lse.sh + i * p.lse.ss] = lse;
    }
  }
}

}  // namespace flashattn::cuda::dev
