// Tensor maps for the copy engine (TMA) of the sm_90 kernels: host code only.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

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

// Makes sure a context is current on the calling thread (else binds `device`'s primary context).
// The driver's tensor-map encoder needs one, and the runtime binds it lazily, at a thread's first
// call that needs a context: a thread whose first CUDA work is a library call given the caller's
// workspace (so no allocation first), e.g. PyTorch's autograd thread with torch's scratch, has
// none, and cuTensorMapEncodeTiled returned CUDA_ERROR_INVALID_CONTEXT (201) there on an H100.
void bind_context(int device);
// The multiprocessors of the context current on the calling thread (a green context's share, the
// device's for its primary context); -1 when there is none or the driver cannot say.
int context_sms();
// What the last failed make_tensor_map* call of this thread was given and why it failed (the
// driver's result, the address, dims and strides): the detail of an internal error's message.
std::string last_map_failure();

}  // namespace flashattn::cuda
