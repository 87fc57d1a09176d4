// mbarriers, the cross-proxy fence and the 1-D bulk copy of sm_90 (PTX ISA: mbarrier,
// fence.proxy.async, cp.async.bulk), shared by the wgmma kernels and the operand copies
// (operand_copies.cu). Only what a kernel calls is emitted, so the header compiles for sm_80 too.
#pragma once

#include <cstdint>

#include "cuda/common/mma16.cuh"

namespace flashattn::cuda::dev {

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// Makes initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of copies completing on this barrier's phase.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase with this parity has completed. (A fresh barrier counts its phase
// "parity 1" as complete, so a producer's first wait for a free buffer passes at once.)
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// Shared memory written by the threads' own stores or cp.async (the generic proxy) becomes
// visible to the tensor cores' reads (the async proxy) only through this fence, issued by every
// writing thread after its writes landed and before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory
// on the copy engine; the bytes complete on `bar`'s current phase (announced by mbar_expect_tx).
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// Adds `bytes` of float32 (a multiple of 16; both addresses 16-byte aligned) from shared memory
// into global memory on the copy engine, element by element at L2 as red.global.add would, in
// this thread's current bulk group. The source may be rewritten after bulk_wait_read<0>(); the
// adds are performed after bulk_wait<0>().
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace flashattn::cuda::dev
