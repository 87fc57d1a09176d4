// Definitions of the 16-bit launchers declared in launch.hpp; included by the generated
// instantiation files only (inst/*16_d*.cu).
#pragma once

#include "cuda/host/check.hpp"
#include "cuda/sm80/kernels16.cuh"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {

template <int DP, Half16 H, bool XF>
void launch_forward16(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const TileConfig16 c = tile_config16(Pass::Forward, DP, a.big);
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::forward16_kernel<DP, H, XF>, grid, c.threads(), smem_bytes16(Pass::Forward, DP, a.big),
                 stream, a, "forward16 kernel launch");
}

template <int DP, Half16 H, bool XF>
void launch_dq16(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const TileConfig16 c = tile_config16(Pass::Dq, DP, a.big);
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::dq16_kernel<DP, H, XF>, grid, c.threads(), smem_bytes16(Pass::Dq, DP, a.big), stream, a,
                 "dq16 kernel launch");
}

template <int DP, Half16 H, bool ATOMIC, bool XF>
void launch_dkv16(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const TileConfig16 c = tile_config16(Pass::Dkv, DP, a.big);
  const dim3 grid(grid_blocks(s.seq_kv, c.block_m), static_cast<unsigned>(s.heads_kv),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::dkv16_kernel<DP, H, ATOMIC, XF>, grid, c.threads(),
                 smem_bytes16(Pass::Dkv, DP, a.big, ATOMIC), stream, a, "dkv16 kernel launch");
}

// One pass and head dim in both 16-bit types (the dK/dV pass also in both designs), without
// (FLASHATTN_INSTANTIATE16_<pass>) or with (_xf) the per-entry score step: at most four kernels
// per file.
#define FLASHATTN_INSTANTIATE16_FORWARD(DP, XF)                                               \
  template void launch_forward16<DP, Half16::F16, XF>(const FwdArgs&, cudaStream_t);         \
  template void launch_forward16<DP, Half16::BF16, XF>(const FwdArgs&, cudaStream_t);
#define FLASHATTN_INSTANTIATE16_DQ(DP, XF)                                                    \
  template void launch_dq16<DP, Half16::F16, XF>(const BwdArgs&, cudaStream_t);              \
  template void launch_dq16<DP, Half16::BF16, XF>(const BwdArgs&, cudaStream_t);
#define FLASHATTN_INSTANTIATE16_DKV(DP, XF)                                                   \
  template void launch_dkv16<DP, Half16::F16, false, XF>(const BwdArgs&, cudaStream_t);      \
  template void launch_dkv16<DP, Half16::BF16, false, XF>(const BwdArgs&, cudaStream_t);     \
  template void launch_dkv16<DP, Half16::F16, true, XF>(const BwdArgs&, cudaStream_t);       \
  template void launch_dkv16<DP, Half16::BF16, true, XF>(const BwdArgs&, cudaStream_t);
#define FLASHATTN_INSTANTIATE16_forward(DP) FLASHATTN_INSTANTIATE16_FORWARD(DP, false)
#define FLASHATTN_INSTANTIATE16_dq(DP) FLASHATTN_INSTANTIATE16_DQ(DP, false)
#define FLASHATTN_INSTANTIATE16_dkv(DP) FLASHATTN_INSTANTIATE16_DKV(DP, false)
#define FLASHATTN_INSTANTIATE16_forward_xf(DP) FLASHATTN_INSTANTIATE16_FORWARD(DP, true)
#define FLASHATTN_INSTANTIATE16_dq_xf(DP) FLASHATTN_INSTANTIATE16_DQ(DP, true)
#define FLASHATTN_INSTANTIATE16_dkv_xf(DP) FLASHATTN_INSTANTIATE16_DKV(DP, true)

}  // namespace flashattn::cuda
