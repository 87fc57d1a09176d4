// The pre-pass writing a packed batch's per-sequence tensor maps (seq_maps.hpp); sm_90a only
// (tensormap.replace).
#include "cuda/sm90/seq_maps.hpp"

#include "cuda/host/check.hpp"
#include "cuda/host/select.hpp"

namespace flashattn::cuda {
namespace dev {

static_assert(sizeof(CUtensorMap) == kSeqMapBytes, "select.hpp sizes the maps' workspace with kSeqMapBytes");

// One thread per (sequence, operand): the template copied into place, then its base address and
// row extent replaced (a zero-length sequence keeps extent 1: the kernels copy no tile of it).
__global__ void seq_maps_kernel(const __grid_constant__ SeqMapsJob j) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= j.shape.batch * j.n) return;
  const int64_t b = i / j.n;
  const int m = static_cast<int>(i % j.n);
  const SeqSpan sp = seq_span(j.shape, j.packing, b);
  const int64_t r0 = j.keys[m] ? sp.k0 : sp.q0, len = j.keys[m] ? sp.seq_kv : sp.seq_q;
  CUtensorMap* dst = j.out + i;
  const uint4* src = reinterpret_cast<const uint4*>(&j.tmpl[m]);
#pragma unroll
  for (int w = 0; w < 8; ++w) reinterpret_cast<uint4*>(dst)[w] = src[w];
  const uint64_t addr = reinterpret_cast<uint64_t>(j.base[m] + r0 * j.row_bytes[m]);
  const uint32_t rows = len > 0 ? static_cast<uint32_t>(len) : 1u;
  const uint64_t g = static_cast<uint64_t>(__cvta_generic_to_global(dst));
  asm volatile("tensormap.replace.tile.global_address.global.b1024.b64 [%0], %1;\n" ::"l"(g), "l"(addr) : "memory");
  asm volatile("tensormap.replace.tile.global_dim.global.b1024.b32 [%0], 1, %1;\n" ::"l"(g), "r"(rows) : "memory");
  asm volatile("fence.proxy.tensormap::generic.release.gpu;\n" ::: "memory");
#endif
}

}  // namespace dev

void launch_seq_maps(const SeqMapsJob& job, cudaStream_t stream) {
  const int64_t n = job.shape.batch * job.n;
  if (n <= 0) return;
  const int threads = 128;
  launch_checked(dev::seq_maps_kernel, dim3(grid_blocks(n, threads)), threads, 0, stream, job, "seq_maps kernel launch");
}

}  // namespace flashattn::cuda
