// Interface between the CPU backend's driver (cpu_backend.cpp, baseline ISA) and its kernels
// (kernels_impl.hpp, compiled once per instruction set into its own namespace).
//
// Only plain structs and function pointers cross this boundary: the kernel translation units are
// built with -mavx512f / -mavx2 and must not emit out-of-line copies of inline functions that a
// baseline caller could end up linked against.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/mask.hpp"
#include "core/params.hpp"

namespace flashattn::cpu {

// Provided by the driver: parallel execution with per-thread scratch, and call-scoped buffers.
class Parallel {
 public:
  using TaskFn = void (*)(const void* ctx, int64_t task, void* scratch);
  // Runs fn(ctx, task, scratch) for task in [0, num_tasks); scratch is 64-byte aligned,
  // scratch_bytes long, private to the running thread, and uninitialised.
  virtual void run(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) = 0;
  // 64-byte aligned memory that lives until the backend call returns.
  virtual void* alloc(size_t bytes) = 0;
  // The threads run() spreads tasks over (the kernels' choice between designs that give the same
  // bits, e.g. the backward's split and fused forms, may depend on it; results never do).
  int threads() const { return threads_; }
  // The backward's design: kAuto (the cost model's choice), kSplit or kFused (FLASHATTN_CPU_BWD =
  // split / fused: tests and benchmarks compare the two).
  enum Design : int { kAuto = 0, kSplit = 1, kFused = 2 };
  int backward_design() const { return design_; }

 protected:
  Parallel(int threads, int design) : threads_(threads < 1 ? 1 : threads), design_(design) {}
  ~Parallel() = default;

 private:
  int threads_;
  int design_;
};

// The kernels take the mask as a MaskRule (core/mask.hpp) that the driver builds once from
// p.num.mask, the sliding window and the sequence lengths; for dense calls they never read
// p.num.mask, and any band works (tests/test_cpu_mask_band.cpp passes bands directly). Packed
// calls (p.packing.on()) have one band per sequence, over its own lengths: the kernels build it
// from p.num per sequence and the rule passed is unused. The score transform (scale, softcap,
// ALiBi slopes) they read from p.num.
struct KernelSet {
  const char* name;       // "avx512", "avx2", "generic"
  int vector_bytes;       // SIMD register width the kernels were built for
  int block_q, block_kv;  // float32 tile sizes (rows of Q, rows of K/V)
  void (*forward)(const ForwardParams& p, const MaskRule& rule, Parallel& par);
  void (*backward)(const BackwardParams& p, const MaskRule& rule, Parallel& par);
  // y[i] = tanh(x[i]) as the float32 softcap computes it (its accuracy test reaches it here).
  void (*tanh)(const float* x, float* y, int64_t n);
};

// Whether this CPU can run the set (defined by the driver).
bool supported(const KernelSet& k);

#if defined(__x86_64__) || defined(_M_X64)
#define FLASHATTN_CPU_X86 1
namespace avx512 {
extern const KernelSet kernels;
}
namespace avx2 {
extern const KernelSet kernels;
}
#endif
namespace generic {
extern const KernelSet kernels;
}

}  // namespace flashattn::cpu
