// Tensor-map encoding through the driver's cuTensorMapEncodeTiled, looked up at run time through
// the runtime (so the library links no libcuda).
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <string>

#include "cuda/sm90/tma.hpp"

#include "cuda/host/check.hpp"
#include "cuda/host/select.hpp"

namespace flashattn::cuda {
namespace {

// A driver function, looked up through the runtime (nullptr where the driver lacks it); the
// callers keep it in a static.
template <class Fn>
Fn driver_entry(const char* name, int version) {
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &f, version, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    f = nullptr;
  }
  return reinterpret_cast<Fn>(f);
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const auto fn = driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled", 12000);
  return fn;
}

PFN_cuCtxGetCurrent_v4000 ctx_getter() {
  static const auto fn = driver_entry<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent", 4000);
  return fn;
}

}  // namespace

int context_sms() {
  static const auto res = driver_entry<PFN_cuCtxGetDevResource_v12040>("cuCtxGetDevResource", 12040);
  const PFN_cuCtxGetCurrent_v4000 get = ctx_getter();
  CUcontext ctx = nullptr;
  if (res == nullptr || get == nullptr || get(&ctx) != CUDA_SUCCESS || ctx == nullptr) return -1;
  CUdevResource r{};
  if (res(ctx, &r, CU_DEV_RESOURCE_TYPE_SM) != CUDA_SUCCESS || r.type != CU_DEV_RESOURCE_TYPE_SM) return -1;
  return static_cast<int>(r.sm.smCount);
}

void bind_context(int device) {
  const PFN_cuCtxGetCurrent_v4000 get = ctx_getter();
  CUcontext ctx = nullptr;
  if (get != nullptr && get(&ctx) == CUDA_SUCCESS && ctx != nullptr) return;
  // (cudaSetDevice binds the device's primary context to the thread, as the runtime's next call
  // needing a context would; a context the caller made current is never replaced: we only get
  // here without one.)
  FLASHATTN_CUDA_CHECK(cudaSetDevice(device));
}

namespace {
// What the last encode that failed on this thread was given (last_map_failure()).
thread_local std::string g_last_failure;

bool make_tensor_map(CUtensorMap* map, const In4& op, CUtensorMapDataType type, int elem_bytes, int64_t batch,
                     int64_t heads, int64_t seq, int64_t head_dim, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) {
    g_last_failure = "the driver has no cuTensorMapEncodeTiled";
    return false;
  }
  if (!tma_ok(op, elem_bytes, batch, heads, seq)) {
    g_last_failure = "operand at " + std::to_string(reinterpret_cast<uintptr_t>(op.ptr)) + " with strides (" +
                     std::to_string(op.sb) + ", " + std::to_string(op.sh) + ", " + std::to_string(op.ss) +
                     ") elements is not addressable by the copy engine";
    return false;
  }
  // Innermost first: head_dim (contiguous), sequence, head, batch; strides in bytes of dims 1..3.
  cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seq),
                        static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  cuuint64_t strides[3] = {static_cast<cuuint64_t>(op.ss) * elem_bytes, static_cast<cuuint64_t>(op.sh) * elem_bytes,
                           static_cast<cuuint64_t>(op.sb) * elem_bytes};
  // A dim of extent 1 is never stepped over; give it a legal stride whatever the caller's is.
  for (int i = 0; i < 3; ++i)
    if (dims[i + 1] == 1) strides[i] = 16;
  // One box row is 128 bytes: the 128-byte swizzle's span.
  cuuint32_t box[4] = {static_cast<cuuint32_t>(128 / elem_bytes), static_cast<cuuint32_t>(box_rows), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, type, 4, const_cast<void*>(op.ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    g_last_failure = "cuTensorMapEncodeTiled returned " + std::to_string(static_cast<int>(r)) + " for address " +
                     std::to_string(reinterpret_cast<uintptr_t>(op.ptr)) + ", dims (" + std::to_string(dims[0]) + ", " +
                     std::to_string(dims[1]) + ", " + std::to_string(dims[2]) + ", " + std::to_string(dims[3]) +
                     "), byte strides (" + std::to_string(strides[0]) + ", " + std::to_string(strides[1]) + ", " +
                     std::to_string(strides[2]) + "), box (" + std::to_string(box[0]) + ", " + std::to_string(box[1]) + ")";
    return false;
  }
  return true;
}
}  // namespace

std::string last_map_failure() { return g_last_failure; }

bool tma_encoder_available() { return encoder() != nullptr; }

bool make_tensor_map16(CUtensorMap* map, const In4& op, Half16 h, int64_t batch, int64_t heads, int64_t seq,
                       int64_t head_dim, int box_rows) {
  return make_tensor_map(map, op, h == Half16::BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                         2, batch, heads, seq, head_dim, box_rows);
}

bool make_tensor_map32(CUtensorMap* map, const In4& op, int64_t batch, int64_t heads, int64_t seq, int64_t head_dim,
                       int box_rows) {
  return make_tensor_map(map, op, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, batch, heads, seq, head_dim, box_rows);
}

}  // namespace flashattn::cuda
