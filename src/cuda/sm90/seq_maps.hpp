// Per-sequence tensor maps of a packed batch for the sm_90a kernels (host and device parts).
//
// The sm_90a kernels stream their operands through the copy engine (TMA), which zero-fills a box's
// rows past the map's row extent: that is what ends a dense sequence inside a tile. A packed
// operand [total, H, D] has no such end between its sequences: a map of the whole tensor would
// copy the next sequence's rows into a sequence's last tile (masked, but 0 * Inf = NaN in the
// products, and its reads are another sequence's data). So each (sequence, operand) gets a map of
// its own: the map of the packed tensor (encoded on the host, batch 1) moved to the sequence's
// first row, with the sequence's length as its row extent. The host cannot write them without
// reading the sequence arrays back (a synchronisation), so a pre-pass kernel does it on the
// stream (tensormap.replace, CUTLASS's grouped-GEMM technique); the kernel then reads map
// (b, operand) at maps[b * n + operand] in the workspace, with batch coordinate 0.
// The same pre-pass can write the compact grid's block table: the dense grid over max_seqlen
// launches max_blocks x heads x batch CTAs of which those past their sequence's rows only return
// (about half of them at 28 sequences of 1..1024), each still taking a multiprocessor's slot.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/params.hpp"

namespace flashattn::cuda {

constexpr int kMaxSeqMapOperands = 4;
struct SeqMapsJob {
  CUtensorMap tmpl[kMaxSeqMapOperands];     // the packed operands' maps (row extent: all rows)
  const char* base[kMaxSeqMapOperands];     // their first rows
  int64_t row_bytes[kMaxSeqMapOperands];    // their sequence strides, bytes
  bool keys[kMaxSeqMapOperands];            // rows are keys (cu_seqlens_k, seqused_k), else queries
  int n;                                    // operands
  Shape shape;                              // batch = sequences
  Packing packing;
  CUtensorMap* out;                         // [batch][n], 128-byte aligned (workspace)
  // Optional (nullptr: none): the compact grid's table, nblocks entries: (b, x) for row block x
  // (launch index, as QueryBlock takes it) of sequence b (bm query rows each), sequences in
  // order, then {-1, 0} up to nblocks.
  int2* blocks;
  int64_t nblocks;
  int bm;
};
// Writes job.out on `stream` (sm_90a devices only).
void launch_seq_maps(const SeqMapsJob& job, cudaStream_t stream);

namespace dev {
// Before a kernel's first copy through maps the pre-pass wrote: the copy engine must not use a
// stale cached copy of the map's memory (the workspace is reused from call to call).
__device__ __forceinline__ void acquire_seq_maps(const CUtensorMap* maps, int n) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  for (int i = 0; i < n; ++i)
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(maps + i) : "memory");
#endif
}
}  // namespace dev

}  // namespace flashattn::cuda
