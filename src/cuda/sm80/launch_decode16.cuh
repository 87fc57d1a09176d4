// Definitions of the KV-cache attention launchers declared in launch.hpp; included by the
// generated instantiation files only (inst/decode16*_d*.cu).
#pragma once

#include "cuda/host/check.hpp"
#include "cuda/host/launch.hpp"
#include "cuda/sm80/decode16.cuh"

namespace flashattn::cuda {

// Grid: x = row blocks of (query row, head) pairs x splits x kv heads (kv head fastest, then
// split), z = batch.
template <int DP, Half16 H, bool XF, int KW>
void launch_decode16(const DecodeArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  const int bm = DecodeShape::block_m(KW);
  const dim3 grid(grid_blocks(s.seq_q * s.group(), bm) * static_cast<unsigned>(a.splits) *
                      static_cast<unsigned>(s.heads_kv),
                  1u, static_cast<unsigned>(s.batch));
  launch_checked_pdl(dev::decode16_kernel<DP, H, XF, KW>, grid, DecodeShape::kThreads, decode_smem_bytes(DP, KW),
                     stream, a, "decode16 kernel launch", a.pdl && a.after_prepare);
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
