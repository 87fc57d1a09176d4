// The backward's small memory-bound passes, shared by every dtype: D = rowsum(dO * O) before the
// main loops and the float32 dQ accumulator -> dQ conversion after the atomic dK/dV pass. (The
// Hopper float32 kernels' operand copies: operand_copies.cu.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/sm80/launch_fp32.cuh"

namespace flashattn::cuda {
namespace dev {

__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_from_float(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_from_float(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// Both kernels map query rows of [B, Hq, Sq] (flat index, the D workspace's and the dQ
// accumulator's order) to threads in one of two ways:
// - vectorised (every row 16-byte aligned, head_dim a multiple of 16 bytes' elements): a group of
//   G threads (a power of two <= 32, at least the row's 16-byte chunks) per row, one chunk each, so
//   a warp reads 32 / G whole rows with 16-byte loads;
// - scalar (any strides): one warp per row, one element per lane at a time.
// The row decomposition uses 32-bit division (the host checks B*Hq*Sq < 2^31): the 64-bit one cost
// more than the loads at D = 64 (measured on an H200).
struct RowAt {
  int64_t b, h, i;
};
__device__ __forceinline__ RowAt row_at(const Shape& s, uint32_t row) {
  const uint32_t sq = static_cast<uint32_t>(s.seq_q), hq = static_cast<uint32_t>(s.heads_q);
  const uint32_t bh = row / sq;
  return {static_cast<int64_t>(bh / hq), static_cast<int64_t>(bh % hq), static_cast<int64_t>(row - bh * sq)};
}
__device__ __forceinline__ uint32_t row_count(const Shape& s) {
  return static_cast<uint32_t>(s.batch * s.heads_q * s.seq_q);
}

template <class T>
struct Chunk16;  // 16 bytes of T <-> float
template <>
struct Chunk16<float> {
  static constexpr int kN = 4;
  __device__ __forceinline__ static void load(const float* p, float (&x)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  }
};
template <class T2, class T>
struct Chunk16Half {
  static constexpr int kN = 8;
  __device__ __forceinline__ static void load(const T* p, float (&x)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = to_float2(*reinterpret_cast<const T2*>(&w[k]));
      x[2 * k] = f.x, x[2 * k + 1] = f.y;
    }
  }
  __device__ __forceinline__ static void store(T* p, const float (&x)[8]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const T2 h = from_float2(x[2 * k], x[2 * k + 1]);
      w[k] = *reinterpret_cast<const uint32_t*>(&h);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __device__ __forceinline__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __device__ __forceinline__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __device__ __forceinline__ static T2 from_float2(float a, float b) {
    if constexpr (std::is_same_v<T2, __half2>) return __floats2half2_rn(a, b);
    else return __floats2bfloat162_rn(a, b);
  }
};
template <>
struct Chunk16<__half> : Chunk16Half<__half2, __half> {};
template <>
struct Chunk16<__nv_bfloat16> : Chunk16Half<__nv_bfloat162, __nv_bfloat16> {};

// The atomic designs' float32 dQ accumulator row `row` set to zero, by `n` threads (the k-th of
// them here): this pass runs before the dK/dV kernel adds into it, so a memset is not needed.
__device__ __forceinline__ void zero_dq_accum_row(const BwdArgs& a, uint32_t row, int k, int n) {
  if (a.dq_accum == nullptr) return;
  float4* acc = reinterpret_cast<float4*>(a.dq_accum + static_cast<int64_t>(row) * a.dq_accum_ld);
  for (int x = k; x < a.dq_accum_ld / 4; x += n) acc[x] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// D_i = sum_d dO_id * O_id into a contiguous workspace (and the dQ accumulator's row zeroed).
template <class T, int G>
__global__ void __launch_bounds__(256) preprocess_vec_kernel(const __grid_constant__ BwdArgs a) {
  constexpr int E = Chunk16<T>::kN;
  const BackwardParams& p = a.p;
  const uint32_t t = blockIdx.x * 256u + threadIdx.x, row = t / G;
  const int c = static_cast<int>(t % G);
  if (row < row_count(p.shape)) zero_dq_accum_row(a, row, c, G);
  // A group never straddles a warp, so lanes past the last row only skip their loads: every lane
  // of the warp still takes part in the shuffles.
  const bool live = row < row_count(p.shape) && c * E < p.shape.head_dim;
  float acc = 0.0f;
  if (live) {
    const RowAt r = row_at(p.shape, row);
    float o[E], d[E];
    Chunk16<T>::load(static_cast<const T*>(p.out.ptr) + r.b * p.out.sb + r.h * p.out.sh + r.i * p.out.ss + c * E, o);
    Chunk16<T>::load(static_cast<const T*>(p.dout.ptr) + r.b * p.dout.sb + r.h * p.dout.sh + r.i * p.dout.ss + c * E, d);
#pragma unroll
    for (int k = 0; k < E; ++k) acc = fmaf(o[k], d[k], acc);
  }
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (c == 0 && row < row_count(p.shape)) a.delta[row] = acc;
}

template <class T>
__global__ void __launch_bounds__(256) preprocess_kernel(const __grid_constant__ BwdArgs a) {
  const BackwardParams& p = a.p;
  const uint32_t row = blockIdx.x * 8u + threadIdx.x / 32;
  if (row >= row_count(p.shape)) return;
  zero_dq_accum_row(a, row, lane_id(), 32);
  const RowAt r = row_at(p.shape, row);
  const T* o = static_cast<const T*>(p.out.ptr) + r.b * p.out.sb + r.h * p.out.sh + r.i * p.out.ss;
  const T* d = static_cast<const T*>(p.dout.ptr) + r.b * p.dout.sb + r.h * p.dout.sh + r.i * p.dout.ss;
  float acc = 0.0f;
  for (int64_t x = lane_id(); x < p.shape.head_dim; x += 32) acc = fmaf(load_as_float(o + x), load_as_float(d + x), acc);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane_id() == 0) a.delta[row] = acc;
}

// dq[b,h,i,:] = grad_scale * dq_accum[(b*Hq + h)*Sq + i, :D] (the score transform's factor on dQ,
// which the atomic dK/dV pass leaves out of its accumulator).
template <class T, int G>
__global__ void __launch_bounds__(256) dq_convert_vec_kernel(const __grid_constant__ BwdArgs a, int dp) {
  constexpr int E = Chunk16<T>::kN;
  const BackwardParams& p = a.p;
  const uint32_t t = blockIdx.x * 256u + threadIdx.x, row = t / G;
  const int c = static_cast<int>(t % G);
  if (row >= row_count(p.shape) || c * E >= p.shape.head_dim) return;
  if (a.seq_ok != nullptr && *a.seq_ok == 0) return;
  const RowAt r = row_at(p.shape, row);
  const float4* acc = reinterpret_cast<const float4*>(a.dq_accum + static_cast<int64_t>(row) * dp + c * E);
  const float gs = a.score.grad_scale();
  float x[E];
#pragma unroll
  for (int k = 0; k < E / 4; ++k) {
    const float4 v = acc[k];
    x[4 * k] = v.x * gs, x[4 * k + 1] = v.y * gs;
    x[4 * k + 2] = v.z * gs, x[4 * k + 3] = v.w * gs;
  }
  Chunk16<T>::store(static_cast<T*>(p.dq.ptr) + r.b * p.dq.sb + r.h * p.dq.sh + r.i * p.dq.ss + c * E, x);
}

template <class T>
__global__ void __launch_bounds__(256) dq_convert_kernel(const __grid_constant__ BwdArgs a, int dp) {
  const BackwardParams& p = a.p;
  const uint32_t row = blockIdx.x * 8u + threadIdx.x / 32;
  if (row >= row_count(p.shape)) return;
  if (a.seq_ok != nullptr && *a.seq_ok == 0) return;
  const RowAt r = row_at(p.shape, row);
  T* dq = static_cast<T*>(p.dq.ptr) + r.b * p.dq.sb + r.h * p.dq.sh + r.i * p.dq.ss;
  const float* acc = a.dq_accum + static_cast<int64_t>(row) * dp;
  const float gs = a.score.grad_scale();
  for (int64_t x = lane_id(); x < p.shape.head_dim; x += 32) store_from_float(dq + x, acc[x] * gs);
}

// dK = dV = 0 on the keys [used_k[b], cu_k[b+1] - cu_k[b]) of each sequence (no query attends
// them; the dK/dV grid covers only the used keys). CTA x = one (sequence, kv head); U is the
// element's bit pattern type (zero is all-zero bits in every dtype).
template <class U>
__global__ void __launch_bounds__(256) zero_unused_keys_kernel(const __grid_constant__ BwdArgs a) {
  const BackwardParams& p = a.p;
  const int64_t b = blockIdx.x / p.shape.heads_kv, hk = blockIdx.x % p.shape.heads_kv;
  const int64_t k0 = p.packing.cu_k[b] + p.packing.used_k[b], k1 = p.packing.cu_k[b + 1];
  const int64_t d = p.shape.head_dim, n = (k1 - k0) * d;
  U* dk = static_cast<U*>(p.dk.ptr) + hk * p.dk.sh;
  U* dv = static_cast<U*>(p.dv.ptr) + hk * p.dv.sh;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t row = k0 + e / d, c = e % d;
    dk[row * p.dk.ss + c] = U{0};
    dv[row * p.dv.ss + c] = U{0};
  }
}

}  // namespace dev

namespace {
int64_t row_count_checked(const BwdArgs& a, const char* what) {
  const Shape& s = a.p.shape;
  const int64_t rows = s.batch * s.heads_q * s.seq_q;
  // 32-bit row arithmetic in the kernels, and 8 rows of the scalar path per block.
  if (rows >= (int64_t{1} << 31))
    throw Error(Status::Unsupported,
                std::string("backward: B*Hq*Sq = ") + std::to_string(rows) + " is too large for the CUDA " + what + " pass (limit 2^31 - 1)");
  return rows;
}

// Threads per row on the vectorised path: a power of two covering the row's 16-byte chunks;
// 0 when the path does not apply (a row not 16-byte aligned, or head_dim not whole chunks).
template <class Op1, class Op2>
int vec_group(const BwdArgs& a, const Op1& o1, const Op2& o2, int per16) {
  const int64_t d = a.p.shape.head_dim;
  if (d % per16 != 0 || d / per16 > 32 || !vec_ok(o1, per16) || !vec_ok(o2, per16)) return 0;
  int g = 1;
  while (g < d / per16) g *= 2;
  // The kernels number threads in 32 bits: rows * g must stay below 2^32 (else the scalar path).
  const Shape& s = a.p.shape;
  if (s.batch * s.heads_q * s.seq_q * g >= (int64_t{1} << 32)) return 0;
  return g;
}

// Calls f(std::integral_constant<int, G>) for the group size g; the grid covers rows * g threads.
template <class F>
void with_group(int g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
}
unsigned vec_blocks(int64_t rows, int g) { return static_cast<unsigned>((rows * g + 255) / 256); }
}  // namespace

void launch_preprocess(const BwdArgs& a, cudaStream_t stream) {
  const int64_t rows = row_count_checked(a, "preprocess");
  const auto blocks = static_cast<unsigned>((rows + 7) / 8);
  const int per16 = 16 / static_cast<int>(dtype_size(a.p.num.dtype));
  const int g = vec_group(a, a.p.out, a.p.dout, per16);
  switch (a.p.num.dtype) {
    case DType::Float32:
      if (g > 0)
        with_group(g, [&](auto G) { dev::preprocess_vec_kernel<float, G()><<<vec_blocks(rows, G()), 256, 0, stream>>>(a); });
      else dev::preprocess_kernel<float><<<blocks, 256, 0, stream>>>(a);
      break;
    case DType::Float16:
      if (g > 0)
        with_group(g, [&](auto G) { dev::preprocess_vec_kernel<__half, G()><<<vec_blocks(rows, G()), 256, 0, stream>>>(a); });
      else dev::preprocess_kernel<__half><<<blocks, 256, 0, stream>>>(a);
      break;
    case DType::BFloat16:
      if (g > 0)
        with_group(g, [&](auto G) { dev::preprocess_vec_kernel<__nv_bfloat16, G()><<<vec_blocks(rows, G()), 256, 0, stream>>>(a); });
      else dev::preprocess_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a);
      break;
    default: throw Error(Status::Internal, "cuda preprocess: unexpected dtype");
  }
  check_launch("preprocess kernel launch");
}

void launch_zero_unused_keys(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const int64_t ctas = s.batch * s.heads_kv;
  if (ctas >= (int64_t{1} << 31))
    throw Error(Status::Unsupported, "backward: batch * Hkv = " + std::to_string(ctas) + " is too large for the CUDA seqused_k pass");
  const auto grid = static_cast<unsigned>(ctas);
  if (dtype_size(a.p.num.dtype) == 4) dev::zero_unused_keys_kernel<uint32_t><<<grid, 256, 0, stream>>>(a);
  else dev::zero_unused_keys_kernel<uint16_t><<<grid, 256, 0, stream>>>(a);
  check_launch("seqused_k dK/dV zero kernel launch");
}

void launch_dq_convert(const BwdArgs& a, int dp, cudaStream_t stream) {
  const int64_t rows = row_count_checked(a, "dq convert");
  const auto blocks = static_cast<unsigned>((rows + 7) / 8);
  // The accumulator's rows (dp floats, dp a multiple of 8) start 16-byte aligned.
  const int g = vec_group(a, a.p.dq, a.p.dq, 8);
  switch (a.p.num.dtype) {
    case DType::Float16:
      if (g > 0)
        with_group(g, [&](auto G) { dev::dq_convert_vec_kernel<__half, G()><<<vec_blocks(rows, G()), 256, 0, stream>>>(a, dp); });
      else dev::dq_convert_kernel<__half><<<blocks, 256, 0, stream>>>(a, dp);
      break;
    case DType::BFloat16:
      if (g > 0)
        with_group(g, [&](auto G) { dev::dq_convert_vec_kernel<__nv_bfloat16, G()><<<vec_blocks(rows, G()), 256, 0, stream>>>(a, dp); });
      else dev::dq_convert_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a, dp);
      break;
    default: throw Error(Status::Internal, "cuda dq convert: unexpected dtype");
  }
  check_launch("dq convert kernel launch");
}

}  // namespace flashattn::cuda
