// The small memory-bound passes around the KV-cache attention on CUDA (float16/bfloat16):
// before it, the append of the new keys and values into the caches (keys rotated) and the rotated
// copy of q; after it, when the key range was split over several CTAs, the merge of their partial
// results by their LSEs. One warp per row throughout: rows are head_dim elements, a few hundred
// bytes, and there are few of them (B * S_new * Hkv, B * Sq * Hq).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cuda/common/device.cuh"
#include "cuda/host/check.hpp"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {
namespace dev {

template <Half16 H>
__device__ __forceinline__ float half_to_float(uint16_t x) {
  if constexpr (H == Half16::BF16) return __bfloat162float(__ushort_as_bfloat16(x));
  else return __half2float(__ushort_as_half(x));
}
template <Half16 H>
__device__ __forceinline__ uint16_t float_to_half(float x) {
  if constexpr (H == Half16::BF16) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  else return __half_as_ushort(__float2half_rn(x));
}

// dst[0, D) = src[0, D) rotated at position pos (dims >= rotary_dim copied bit for bit), by the
// warp's lanes. The products round as the CPU's do (no fused multiply-add): the same cache bits.
template <Half16 H>
__device__ void rotate_row(const KvRotary& r, int64_t pos, const uint16_t* src, uint16_t* dst, int64_t D) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t rd = r.cos != nullptr ? r.rotary_dim : 0, half = r.rotary_dim / 2;
  const auto* cs = static_cast<const uint16_t*>(r.cos);
  const auto* sn = static_cast<const uint16_t*>(r.sin);
  for (int64_t i = lane; i < rd / 2; i += 32) {
    const float c = half_to_float<H>(cs[pos * r.cos_ss + i]), s = half_to_float<H>(sn[pos * r.sin_ss + i]);
    const int64_t i0 = r.interleaved ? 2 * i : i, i1 = r.interleaved ? 2 * i + 1 : i + half;
    const float x0 = half_to_float<H>(src[i0]), x1 = half_to_float<H>(src[i1]);
    dst[i0] = float_to_half<H>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
    dst[i1] = float_to_half<H>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
  }
  for (int64_t d = rd + lane; d < D; d += 32) dst[d] = src[d];
}

// Warp w of the grid: rows [0, B S_new Hkv) append (key and value row), then [.., + B Sq Hq) the
// rotated q rows (q_rot only).
template <Half16 H>
__global__ void kv_prepare_kernel(const __grid_constant__ KvPrepArgs a) {
  // (A dependent launch after the index check, whose verdict and derived arrays it reads; the
  // decode kernel waits for this one's completion before it reads anything.)
  pdl_wait();
  pdl_trigger();
  if (a.ok != nullptr && *a.ok == 0) return;  // (the index arrays broke a rule: nothing is written)
  const KvcacheParams& kp = a.kp;
  const KvMap kv = kv_map_at(a.kv, a.idx);
  const int32_t* first_new = a.idx.n > 0 ? a.idx.v + a.idx.at_first : a.first_new;
  const int32_t* pos0 = a.idx.n > 0 ? a.idx.v + a.idx.at_pos : a.pos0;
  const Shape& sh = kp.fwd.shape;
  const int64_t D = sh.head_dim;
  int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t appends = sh.batch * kp.s_new * sh.heads_kv;
  if (w < appends) {
    const int64_t hk = w % sh.heads_kv, j = w / sh.heads_kv % kp.s_new, b = w / (sh.heads_kv * kp.s_new);
    const int64_t row = first_new[b] + j;
    const auto* kn = static_cast<const uint16_t*>(kp.k_new.ptr) + b * kp.k_new.sb + hk * kp.k_new.sh + j * kp.k_new.ss;
    const auto* vn = static_cast<const uint16_t*>(kp.v_new.ptr) + b * kp.v_new.sb + hk * kp.v_new.sh + j * kp.v_new.ss;
    auto* kc = static_cast<uint16_t*>(kp.k_cache.ptr) + kv_offset(kv, kp.k_cache, b, hk, row);
    auto* vc = static_cast<uint16_t*>(kp.v_cache.ptr) + kv_offset(kv, kp.v_cache, b, hk, row);
    rotate_row<H>(kp.rotary, pos0[b] + j, kn, kc, D);
    KvRotary none = kp.rotary;
    none.cos = nullptr;
    rotate_row<H>(none, 0, vn, vc, D);
    return;
  }
  w -= appends;
  if (a.q_rot == nullptr || w >= sh.batch * sh.seq_q * sh.heads_q) return;
  const int64_t h = w % sh.heads_q, i = w / sh.heads_q % sh.seq_q, b = w / (sh.heads_q * sh.seq_q);
  const In4& q = kp.fwd.q;
  const auto* src = static_cast<const uint16_t*>(q.ptr) + b * q.sb + h * q.sh + i * q.ss;
  rotate_row<H>(kp.rotary, pos0[b] + (kp.rotary.q_advances ? i : 0), src,
                a.q_rot + ((b * sh.heads_q + h) * sh.seq_q + i) * a.q_rot_ld, D);
}

// One CTA of kCombineWarps warps per output row (b, h, i): LSE = log sum_s exp(LSE_s),
// O = sum_s exp(LSE_s - LSE) O_s. Every warp loads all the splits' LSEs (lane t: splits t, t + 32,
// ..., at most kMaxKvSplits = 128) and reduces them with the same fixed butterfly, so every warp
// holds the same weights; warp w then sums the O rows of splits w, w + W, w + 2W, ... (16 bytes per
// lane, kCombineBatch rows loaded before any is used: the loads overlap), and the W partial sums
// are added in warp order through shared memory. Every sum has a fixed order: deterministic.
// (A warp walking the splits one dependent load at a time took ~0.3 us per split: 28 us of a
// 39 us decoding step at B = 1 with 32 splits.) NaN in any split's LSE makes the row's LSE and O
// NaN (the sum takes it); a row the band gives no key gets O = 0, LSE = -inf (as the single-pass
// kernel).
constexpr int kCombineWarps = 4, kCombineBatch = 8;
template <Half16 H>
__global__ void __launch_bounds__(32 * kCombineWarps) kv_combine_kernel(const __grid_constant__ DecodeArgs a) {
  constexpr int W = kCombineWarps, NB = kCombineBatch, kPerLane = (kMaxKvSplits + 31) / 32;
  constexpr int kMaxChunks = 2;  // float4 chunks per lane: head dims up to 256
  __shared__ float4 s_acc[W][32 * kMaxChunks];
  const int dp = a.dp;
  const ForwardParams& p = a.p;
  const int64_t D = p.shape.head_dim;
  // The row from launch constants (B Hq Sq < 2^31 where there are splits: select_kvcache), while
  // the decode kernel may still run.
  const uint32_t row32 = blockIdx.x, bh = a.sq_div.div(row32), b32 = a.hq_div.div(bh);
  const int64_t row = row32, i = row32 - bh * a.sq_div.d, h = bh - b32 * a.hq_div.d, b = b32;
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x / 32);
  // Lane t's columns: [4t, 4t + 4) and [128 + 4t, ..) where they start below D (the partials' rows
  // are dp floats, dp a multiple of 32: 16-byte aligned; the decode kernel writes their columns
  // below round8(D), so a chunk starting below D is written whole, and the rest is never read).
  bool col_ok[kMaxChunks];
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) col_ok[c] = 4 * (lane + 32 * c) < D;
  const float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  // The partials of splits s0 + W j (zero past the splits; every read is inside the workspace).
  auto load_batch = [&](int s0, float4 (&v)[NB][kMaxChunks]) {
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const int sp = s0 + W * j;
      const bool in = sp < a.splits;
      const float4* o = reinterpret_cast<const float4*>(a.o_part + ((in ? sp : 0) * a.part_rows + row) * dp);
#pragma unroll
      for (int c = 0; c < kMaxChunks; ++c) v[j][c] = in && col_ok[c] ? o[lane + 32 * c] : zero4;
    }
  };

  pdl_wait();  // (launched as a dependent of the decode kernel: its partials must be complete)
  // Every read the row needs first, all in flight together (each is a memory latency; one after
  // another they were most of this kernel's time at B = 1): the verdict, the sequence's length,
  // the splits' LSEs and the first batch of partial rows.
  const int ok = a.ok != nullptr ? *a.ok : 1;
  const int64_t Skv = kv_map_at(p.kv, a.idx).seqlen_k[b];
  float ls[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int sp = lane + 32 * k;
    ls[k] = sp < a.splits ? a.lse_part[sp * a.part_rows + row] : -INFINITY;
  }
  float4 v[NB][kMaxChunks];
  load_batch(warp, v);
  if (ok == 0) return;
  const int64_t Sq = p.shape.seq_q;
  const MaskRule rule = mask_rule(Shape{1, 1, 1, Sq, Skv, D}, p.num);
  const bool sees = i >= rule.live_rows_begin(Sq) && i < rule.live_rows_end(Sq, Skv);
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) m = fmaxf(m, ls[k]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float m_use = m == -INFINITY ? 0.0f : m;
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) sum += expf(ls[k] - m_use);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = sees ? m_use + logf(sum) : -INFINITY;
  float w[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) w[k] = sees ? expf(ls[k] - lse) : 0.0f;
  // The weight of split sp (warp-uniform): from lane sp % 32's w[sp / 32].
  auto weight = [&](int sp) {
    float x = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const float wl = __shfl_sync(0xffffffffu, w[k], sp & 31);
      if ((sp >> 5) == k) x = wl;
    }
    return x;
  };
  float4 acc[kMaxChunks] = {zero4, zero4};
  if (sees) {
    for (int s0 = warp; s0 < a.splits; s0 += W * NB) {
      if (s0 != warp) load_batch(s0, v);
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        const float wk = weight(s0 + W * j);  // (0 past the splits: their LSE is -inf)
#pragma unroll
        for (int c = 0; c < kMaxChunks; ++c)
          acc[c].x += wk * v[j][c].x, acc[c].y += wk * v[j][c].y, acc[c].z += wk * v[j][c].z, acc[c].w += wk * v[j][c].w;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) s_acc[warp][lane + 32 * c] = acc[c];
  __syncthreads();
  auto* out = static_cast<uint16_t*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.ss;
  for (int t = static_cast<int>(threadIdx.x); 4 * t < dp; t += 32 * W) {
    float4 r = s_acc[0][t];
#pragma unroll
    for (int k = 1; k < W; ++k) r.x += s_acc[k][t].x, r.y += s_acc[k][t].y, r.z += s_acc[k][t].z, r.w += s_acc[k][t].w;
    const float v[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (4 * t + e < D) out[4 * t + e] = float_to_half<H>(v[e]);
  }
  if (threadIdx.x == 0) p.lse.ptr[b * p.lse.sb + h * p.lse.sh + i * p.lse.ss] = lse;
}

}  // namespace dev

namespace {
constexpr int kRowsPerBlock = 4;  // warps of 32 threads, a row each
template <class F>
void with_half(DType t, F&& f) {
  if (t == DType::BFloat16) f(std::integral_constant<Half16, Half16::BF16>{});
  else f(std::integral_constant<Half16, Half16::F16>{});
}
}  // namespace

bool launch_kv_prepare(const KvPrepArgs& a, cudaStream_t stream) {
  const Shape& s = a.kp.fwd.shape;
  const int64_t rows = s.batch * a.kp.s_new * s.heads_kv + (a.q_rot != nullptr ? s.batch * s.seq_q * s.heads_q : 0);
  if (rows == 0) return false;
  with_half(a.kp.fwd.num.dtype, [&](auto h) {
    launch_checked_pdl(dev::kv_prepare_kernel<decltype(h)::value>, dim3(grid_blocks(rows, kRowsPerBlock)),
                       32 * kRowsPerBlock, 0, stream, a, "KV-cache append / rotary kernel launch", a.pdl);
  });
  return true;
}

void launch_kv_combine(const DecodeArgs& a, cudaStream_t stream) {
  with_half(a.p.num.dtype, [&](auto h) {
    launch_checked_pdl(dev::kv_combine_kernel<decltype(h)::value>, dim3(static_cast<unsigned>(a.part_rows)),
                       32 * dev::kCombineWarps, 0, stream, a, "KV-cache split combine kernel launch", a.pdl);
  });
}

}  // namespace flashattn::cuda
