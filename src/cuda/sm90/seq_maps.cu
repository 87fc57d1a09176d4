// The pre-pass writing a packed batch's per-sequence tensor maps and, for the compact grid, its
// block table (seq_maps.hpp); sm_90a only (tensormap.replace).
#include "cuda/sm90/seq_maps.hpp"

#include "cuda/host/check.hpp"
#include "cuda/host/select.hpp"

namespace flashattn::cuda {
namespace dev {

static_assert(sizeof(CUtensorMap) == kSeqMapBytes, "select.hpp sizes the maps' workspace with kSeqMapBytes");

constexpr int kSeqMapsThreads = 1024;

// Map i = (sequence b, operand m): the template copied into place, then its base address and row
// extent replaced (a zero-length sequence keeps extent 1: the kernels copy no tile of it).
__device__ __forceinline__ void write_seq_map(const SeqMapsJob& j, int64_t i) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
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

// Inclusive sum of v over the CTA's threads (kSeqMapsThreads), and the CTA's total in *total.
__device__ __forceinline__ int64_t cta_inclusive_sum(int64_t v, int64_t* warp_sums, int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kSeqMapsThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t u = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += u;
    }
    warp_sums[lane] = w;  // inclusive sums of the warps' totals
  }
  __syncthreads();
  const int64_t r = v + (warp > 0 ? warp_sums[warp - 1] : 0);
  *total = warp_sums[kSeqMapsThreads / 32 - 1];
  __syncthreads();  // (warp_sums is reused by the next call)
  return r;
}

// One thread per map over as many CTAs as the maps need (thousands of sequences must not queue on
// one multiprocessor); CTA 0 then also writes the block table, in chunks of one sequence per
// thread: the chunk's block counts scanned, each thread writing its sequence's entries, the
// running total carried from chunk to chunk; {-1, 0} after the last real block.
__global__ void __launch_bounds__(kSeqMapsThreads) seq_maps_kernel(const __grid_constant__ SeqMapsJob j) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kSeqMapsThreads + threadIdx.x;
  if (i < j.shape.batch * j.n) write_seq_map(j, i);
  if (j.blocks == nullptr || blockIdx.x != 0) return;
  __shared__ int64_t warp_sums[32];
  int64_t carry = 0;
  for (int64_t b0 = 0; b0 < j.shape.batch; b0 += kSeqMapsThreads) {
    const int64_t b = b0 + threadIdx.x;
    const int64_t rows = b < j.shape.batch ? seq_span(j.shape, j.packing, b).seq_q : 0;
    const int64_t count = (rows + j.bm - 1) / j.bm;
    int64_t chunk = 0;
    const int64_t first = carry + cta_inclusive_sum(count, warp_sums, &chunk) - count;
    for (int64_t x = 0; x < count && first + x < j.nblocks; ++x)
      j.blocks[first + x] = make_int2(static_cast<int>(b), static_cast<int>(x));
    carry += chunk;
  }
  for (int64_t i = carry + threadIdx.x; i < j.nblocks; i += kSeqMapsThreads) j.blocks[i] = make_int2(-1, 0);
}

}  // namespace dev

void launch_seq_maps(const SeqMapsJob& job, cudaStream_t stream) {
  if (job.shape.batch <= 0) return;
  launch_checked(dev::seq_maps_kernel, dim3(grid_blocks(job.shape.batch * job.n, dev::kSeqMapsThreads)),
                 dev::kSeqMapsThreads, 0, stream, job, "seq_maps kernel launch");
}

}  // namespace flashattn::cuda
