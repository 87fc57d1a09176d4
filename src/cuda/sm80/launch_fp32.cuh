// Definitions of the launchers declared in launch.hpp; included by the instantiation files only.
#pragma once

#include "cuda/host/check.hpp"
#include "cuda/sm80/kernels_fp32.cuh"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {

namespace detail {
template <class Kernel, class Args>
void launch(Kernel kernel, Pass pass, int dp, bool big, Math m, dim3 grid, const Args& a,
            cudaStream_t stream, const char* name) {
  launch_checked(kernel, grid, tile_config(pass, dp, big).threads(),
                 smem_bytes(pass, dp, big) + split_smem_bytes(pass, dp, big, m), stream, a, name);
}
}  // namespace detail

template <int DP, Math M, bool XF>
void launch_forward(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const dim3 grid(grid_blocks(s.seq_q, tile_config(Pass::Forward, DP, a.big).block_m),
                  static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  detail::launch(dev::forward_kernel<DP, M, XF>, Pass::Forward, DP, a.big, M, grid, a, stream, "forward kernel launch");
}

template <int DP, Math M, bool XF>
void launch_dq(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const dim3 grid(grid_blocks(s.seq_q, tile_config(Pass::Dq, DP, a.big).block_m),
                  static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  detail::launch(dev::dq_kernel<DP, M, XF>, Pass::Dq, DP, a.big, M, grid, a, stream, "dq kernel launch");
}

template <int DP, Math M, bool XF>
void launch_dkv(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const dim3 grid(grid_blocks(s.seq_kv, tile_config(Pass::Dkv, DP, a.big).block_m),
                  static_cast<unsigned>(s.heads_kv), static_cast<unsigned>(s.batch));
  detail::launch(dev::dkv_kernel<DP, M, XF>, Pass::Dkv, DP, a.big, M, grid, a, stream, "dkv kernel launch");
}

// Every Math of one pass and head dim, without (FLASHATTN_INSTANTIATE) or with (_XF) the per-entry
// score step: three kernels per file.
#define FLASHATTN_INSTANTIATE_MATHS(PASS, DP, XF)                                            \
  template void launch_##PASS<DP, Math::Fma, XF>(const PASS##_args_t&, cudaStream_t);      \
  template void launch_##PASS<DP, Math::Tf32, XF>(const PASS##_args_t&, cudaStream_t);     \
  template void launch_##PASS<DP, Math::Tf32x3, XF>(const PASS##_args_t&, cudaStream_t);
#define FLASHATTN_INSTANTIATE(PASS, DP) FLASHATTN_INSTANTIATE_MATHS(PASS, DP, false)
#define FLASHATTN_INSTANTIATE_XF(PASS, DP) FLASHATTN_INSTANTIATE_MATHS(PASS, DP, true)

using forward_args_t = FwdArgs;
using dq_args_t = BwdArgs;
using dkv_args_t = BwdArgs;

}  // namespace flashattn::cuda
