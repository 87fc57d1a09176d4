// The backward's small memory-bound passes, shared by every dtype: D = rowsum(dO * O) before the
// main loops, and the float32 dQ accumulator -> dQ conversion after the atomic dK/dV pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/launch.cuh"

namespace flashattn::cuda {
namespace dev {

__device__ __forceinline__ float load_as_float(const float* p) { return *p; }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_from_float(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_from_float(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// Both kernels give each warp one query row of [B, Hq, Sq] (8 warps per block): its flat index
// and coordinates; false past the last row.
__device__ __forceinline__ bool warp_row(const Shape& s, int64_t* row, int64_t* b, int64_t* h, int64_t* i) {
  *row = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  if (*row >= s.batch * s.heads_q * s.seq_q) return false;
  *i = *row % s.seq_q;
  const int64_t bh = *row / s.seq_q;
  *h = bh % s.heads_q;
  *b = bh / s.heads_q;
  return true;
}

// D_i = sum_d dO_id * O_id, one warp per row, into a contiguous workspace.
template <class T>
__global__ void __launch_bounds__(256) preprocess_kernel(const __grid_constant__ BwdArgs a) {
  const BackwardParams& p = a.p;
  int64_t row, b, h, i;
  if (!warp_row(p.shape, &row, &b, &h, &i)) return;
  const T* o = static_cast<const T*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.ss;
  const T* d = static_cast<const T*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh + i * p.dout.ss;
  float acc = 0.0f;
  for (int64_t x = lane_id(); x < p.shape.head_dim; x += 32) acc = fmaf(load_as_float(o + x), load_as_float(d + x), acc);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane_id() == 0) a.delta[row] = acc;
}

// dq[b,h,i,:] = scale * dq_accum[(b*Hq + h)*Sq + i, :D], one warp per row.
template <class T>
__global__ void __launch_bounds__(256) dq_convert_kernel(const __grid_constant__ BwdArgs a, int dp) {
  const BackwardParams& p = a.p;
  int64_t row, b, h, i;
  if (!warp_row(p.shape, &row, &b, &h, &i)) return;
  T* dq = static_cast<T*>(p.dq.ptr) + b * p.dq.sb + h * p.dq.sh + i * p.dq.ss;
  const float* acc = a.dq_accum + row * dp;
  for (int64_t x = lane_id(); x < p.shape.head_dim; x += 32) store_from_float(dq + x, acc[x] * p.num.scale);
}

}  // namespace dev

namespace {
unsigned row_blocks(const BwdArgs& a, const char* what) {
  const Shape& s = a.p.shape;
  const int64_t blocks = (s.batch * s.heads_q * s.seq_q + 7) / 8;  // 8 warps of 256 threads, one row each
  if (blocks > 0x7fffffff)
    throw Error(Status::Unsupported, std::string("backward: B*Hq*Sq is too large for the CUDA ") + what + " grid");
  return static_cast<unsigned>(blocks);
}
}  // namespace

void launch_preprocess(const BwdArgs& a, cudaStream_t stream) {
  const unsigned blocks = row_blocks(a, "preprocess");
  switch (a.p.num.dtype) {
    case DType::Float32: dev::preprocess_kernel<float><<<blocks, 256, 0, stream>>>(a); break;
    case DType::Float16: dev::preprocess_kernel<__half><<<blocks, 256, 0, stream>>>(a); break;
    case DType::BFloat16: dev::preprocess_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a); break;
    default: throw Error(Status::Internal, "cuda preprocess: unexpected dtype");
  }
  check_launch("preprocess kernel launch");
}

void launch_dq_convert(const BwdArgs& a, int dp, cudaStream_t stream) {
  const unsigned blocks = row_blocks(a, "dq convert");
  switch (a.p.num.dtype) {
    case DType::Float16: dev::dq_convert_kernel<__half><<<blocks, 256, 0, stream>>>(a, dp); break;
    case DType::BFloat16: dev::dq_convert_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(a, dp); break;
    default: throw Error(Status::Internal, "cuda dq convert: unexpected dtype");
  }
  check_launch("dq convert kernel launch");
}

}  // namespace flashattn::cuda
