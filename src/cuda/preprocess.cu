#include "cuda/launch.cuh"

namespace flashattn::cuda {
namespace dev {

// ================================================================================================
// Backward preprocess: D_i = sum_d dO_id * O_id, one warp per row, into a contiguous workspace.
// ================================================================================================
__global__ void __launch_bounds__(256) preprocess_kernel(const __grid_constant__ BwdArgs a) {
  const BackwardParams& p = a.p;
  const int64_t rows = p.shape.batch * p.shape.heads_q * p.shape.seq_q;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t i = row % p.shape.seq_q, bh = row / p.shape.seq_q;
  const int64_t h = bh % p.shape.heads_q, b = bh / p.shape.heads_q;
  const float* o = static_cast<const float*>(p.out.ptr) + b * p.out.sb + h * p.out.sh + i * p.out.ss;
  const float* d = static_cast<const float*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh + i * p.dout.ss;
  float acc = 0.0f;
  for (int64_t x = lane_id(); x < p.shape.head_dim; x += 32) acc = fmaf(o[x], d[x], acc);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane_id() == 0) a.delta[row] = acc;
}

}  // namespace dev

void launch_preprocess(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const int64_t rows = s.batch * s.heads_q * s.seq_q;
  const int64_t blocks = (rows + 7) / 8;  // 8 warps of 256 threads, one row each
  if (blocks > 0x7fffffff) throw Error(Status::Unsupported, "backward: B*Hq*Sq is too large for the CUDA preprocess grid");
  dev::preprocess_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(a);
  check_launch("preprocess kernel launch");
}

}  // namespace flashattn::cuda
