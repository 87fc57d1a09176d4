// Definitions of the sm_90a launchers declared in launch.hpp; included by the generated
// instantiation files inst/*_sm90_d*.cu only, which are compiled for sm_90a alone.
#pragma once

#include "cuda/check.hpp"
#include "cuda/kernels_sm90.cuh"
#include "cuda/kernels_sm90_tf32.cuh"
#include "cuda/launch.hpp"
#include "cuda/tma.hpp"

namespace flashattn::cuda {

template <int DP, Half16 H>
bool launch_forward_sm90(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90(Pass::Forward, DP);
  dev::Sm90FwdArgs args;
  args.f = a;
  if (!make_tensor_map16(&args.tq, a.p.q, H, s.batch, s.heads_q, s.seq_q, s.head_dim, c.block_m) ||
      !make_tensor_map16(&args.tk, a.p.k, H, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_n) ||
      !make_tensor_map16(&args.tv, a.p.v, H, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_n))
    return false;
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::forward_sm90_kernel<DP, H>, grid, c.threads(), smem_bytes90(Pass::Forward, DP), stream, args,
                 "forward_sm90 kernel launch");
  return true;
}

template <int DP>
bool launch_forward_tf32_sm90(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90_tf32(DP);
  dev::Sm90Tf32FwdArgs args;
  args.f = a;
  if (!make_tensor_map32(&args.tq, a.p.q, s.batch, s.heads_q, s.seq_q, s.head_dim, c.block_m) ||
      !make_tensor_map32(&args.tk, a.p.k, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_n) ||
      !make_tensor_map32(&args.tv, a.p.v, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_n))
    return false;
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::forward_tf32_sm90_kernel<DP>, grid, c.threads(), smem_bytes90_tf32(DP), stream, args,
                 "forward_tf32_sm90 kernel launch");
  return true;
}

template <int DP, Half16 H, int V>
bool launch_dkv_sm90_variant(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90(Pass::Dkv, DP, V);
  dev::Sm90BwdArgs args;
  args.f = a;
  if (!make_tensor_map16(&args.tq, a.p.q, H, s.batch, s.heads_q, s.seq_q, s.head_dim, c.block_n) ||
      !make_tensor_map16(&args.tdo, a.p.dout, H, s.batch, s.heads_q, s.seq_q, s.head_dim, c.block_n) ||
      !make_tensor_map16(&args.tk, a.p.k, H, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_m) ||
      !make_tensor_map16(&args.tv, a.p.v, H, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_m))
    return false;
  const dim3 grid(grid_blocks(s.seq_kv, c.block_m), static_cast<unsigned>(s.heads_kv),
                  static_cast<unsigned>(s.batch));
  launch_checked(dev::dkv_sm90_kernel<DP, H, V>, grid, c.threads(), smem_bytes90(Pass::Dkv, DP, V), stream, args,
                 "dkv_sm90 kernel launch");
  return true;
}

template <int DP, Half16 H>
bool launch_dkv_sm90(const BwdArgs& a, cudaStream_t stream) {
  if constexpr (has_sm90_variant(Pass::Dkv, DP, 1)) {
    if (a.sm90_variant == 1) return launch_dkv_sm90_variant<DP, H, 1>(a, stream);
  }
  return launch_dkv_sm90_variant<DP, H, 0>(a, stream);
}

#define FLASHATTN_INSTANTIATE_SM90_dkv(DP)                                                   \
  template bool launch_dkv_sm90<DP, Half16::F16>(const BwdArgs&, cudaStream_t);             \
  template bool launch_dkv_sm90<DP, Half16::BF16>(const BwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_forward_tf32(DP) template bool launch_forward_tf32_sm90<DP>(const FwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_forward(DP)                                               \
  template bool launch_forward_sm90<DP, Half16::F16>(const FwdArgs&, cudaStream_t);         \
  template bool launch_forward_sm90<DP, Half16::BF16>(const FwdArgs&, cudaStream_t);

}  // namespace flashattn::cuda
