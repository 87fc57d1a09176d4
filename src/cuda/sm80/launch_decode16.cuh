// Definitions of the KV-cache attention launchers declared in launch.hpp; included by the
// generated instantiation files only (inst/decode16*_d*.cu).
#pragma once

#include "cuda/host/check.hpp"
#include "cuda/host/launch.hpp"
#include "cuda/sm80/decode16.cuh"

namespace flashattn::cuda {

// Whether the bulk-copy kernel of this instantiation was compiled for sm_90 or later on the
// current device: its PTX too, not only the binary - a build without an sm_90 target runs on a
// 9.0 device from compute_80 PTX compiled there, whose bulk kernel is only a trap (the bulk
// instructions are compiled out below sm_90). Asked once per process.
template <int DP, Half16 H, bool XF, int KW>
bool decode16_bulk_built() {
  static const bool built = [] {
    cudaFuncAttributes at{};
    if (cudaFuncGetAttributes(&at, dev::decode16_kernel<DP, H, XF, KW, true>) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return at.binaryVersion >= 90 && at.ptxVersion >= 90;
  }();
  return built;
}

// Grid: x = row blocks of (query row, head) pairs x splits x kv heads (kv head fastest, then
// split), z = batch. The shared memory is the plan's (KvcachePlan::smem, for its loader); the
// cp.async kernel needs less when the bulk one is not built.
template <int DP, Half16 H, bool XF, int KW>
void launch_decode16(const DecodeArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const int bm = DecodeShape::block_m(KW);
  const dim3 grid(grid_blocks(s.seq_q * s.group(), bm) * static_cast<unsigned>(a.splits) *
                      static_cast<unsigned>(s.heads_kv),
                  1u, static_cast<unsigned>(s.batch));
  const bool pdl = a.pdl && a.after_own;
  if (a.loader == DecodeShape::kBulk && decode16_bulk_built<DP, H, XF, KW>()) {
    launch_checked_pdl(dev::decode16_kernel<DP, H, XF, KW, true>, grid, DecodeShape::kThreads,
                       decode_smem_bytes(DP, KW, true, a.stages), stream, a, "decode16 kernel launch", pdl);
  } else {
    DecodeArgs c = a;
    if (c.loader == DecodeShape::kBulk) c.loader = DecodeShape::kRows;
    launch_checked_pdl(dev::decode16_kernel<DP, H, XF, KW, false>, grid, DecodeShape::kThreads,
                       decode_smem_bytes(DP, KW, false, a.stages), stream, c, "decode16 kernel launch", pdl);
  }
}

// Both 16-bit types and both CTA shapes of one head dim, with or without the per-entry step.
#define FLASHATTN_INSTANTIATE_DECODE16(DP, XF)                                   \
  template void launch_decode16<DP, Half16::F16, XF, 4>(const DecodeArgs&, cudaStream_t);  \
  template void launch_decode16<DP, Half16::BF16, XF, 4>(const DecodeArgs&, cudaStream_t); \
  template void launch_decode16<DP, Half16::F16, XF, 1>(const DecodeArgs&, cudaStream_t);  \
  template void launch_decode16<DP, Half16::BF16, XF, 1>(const DecodeArgs&, cudaStream_t);
#define FLASHATTN_INSTANTIATE_decode16(DP) FLASHATTN_INSTANTIATE_DECODE16(DP, false)
#define FLASHATTN_INSTANTIATE_decode16_xf(DP) FLASHATTN_INSTANTIATE_DECODE16(DP, true)

}  // namespace flashattn::cuda
