// Tensor maps for the copy engine (TMA) of the sm_90 kernels: host code only.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "core/params.hpp"
#include "cuda/common/config.hpp"

namespace flashattn::cuda {

// Whether the driver's tensor-map encoder was found (DeviceCaps::tma).
bool tma_encoder_available();
// A map of a 16-bit [B, H, S, D] operand (unit head_dim stride) whose boxes are 64 columns x
// `box_rows` rows of one (batch, head), copied into 128-byte-swizzled shared memory (TileSw128's
// column blocks); elements past S or D read as zero. False when the copy engine cannot address
// the operand (a stride that is not a multiple of 16 bytes, an unaligned base, a dim too large):
// the caller then uses kernels that need no map.
bool make_tensor_map16(CUtensorMap* map, const In4& op, Half16 h, int64_t batch, int64_t heads, int64_t seq,
                       int64_t head_dim, int box_rows);
// The same for a float32 operand: boxes of 32 columns (128 bytes) x `box_rows` rows.
bool make_tensor_map32(CUtensorMap* map, const In4& op, int64_t batch, int64_t heads, int64_t seq, int64_t head_dim,
                       int box_rows);

}  // namespace flashattn::cuda
