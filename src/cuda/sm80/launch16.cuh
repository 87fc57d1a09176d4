// Definitions of the 16-bit launchers declared in launch.hpp; included by the generated
// instantiation files only (inst/*16_d*.cu).
#pragma once

#include "cuda/host/check.hpp"
#include "cuda/sm80/kernels16.cuh"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {

template <int DP, Half16 H>
void launch_forward16(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const TileConfig16 c = tile_config16(Pass::Forward, DP, a.big);
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::forward16_kernel<DP, H>, grid, c.threads(), smem_bytes16(Pass::Forward, DP, a.big),
                 stream, a, "forward16 kernel launch");
}

template <int DP, Half16 H>
void launch_dq16(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const TileConfig16 c = tile_config16(Pass::Dq, DP, a.big);
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::dq16_kernel<DP, H>, grid, c.threads(), smem_bytes16(Pass::Dq, DP, a.big), stream, a,
                 "dq16 kernel launch");
}

template <int DP, Half16 H, bool ATOMIC>
void launch_dkv16(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const TileConfig16 c = tile_config16(Pass::Dkv, DP, a.big);
  const dim3 grid(grid_blocks(s.seq_kv, c.block_m), static_cast<unsigned>(s.heads_kv),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::dkv16_kernel<DP, H, ATOMIC>, grid, c.threads(),
                 smem_bytes16(Pass::Dkv, DP, a.big, ATOMIC), stream, a, "dkv16 kernel launch");
}

#define FLASHATTN_INSTANTIATE16_forward(DP)                                                  \
  template void launch_forward16<DP, Half16::F16>(const FwdArgs&, cudaStream_t);            \
  template void launch_forward16<DP, Half16::BF16>(const FwdArgs&, cudaStream_t);
#define FLASHATTN_INSTANTIATE16_dq(DP)                                                       \
  template void launch_dq16<DP, Half16::F16>(const BwdArgs&, cudaStream_t);                 \
  template void launch_dq16<DP, Half16::BF16>(const BwdArgs&, cudaStream_t);
#define FLASHATTN_INSTANTIATE16_dkv(DP)                                                      \
  template void launch_dkv16<DP, Half16::F16, false>(const BwdArgs&, cudaStream_t);         \
  template void launch_dkv16<DP, Half16::BF16, false>(const BwdArgs&, cudaStream_t);        \
  template void launch_dkv16<DP, Half16::F16, true>(const BwdArgs&, cudaStream_t);          \
  template void launch_dkv16<DP, Half16::BF16, true>(const BwdArgs&, cudaStream_t);

}  // namespace flashattn::cuda
