// Kernel selection of the CUDA backend: the single answer to "which kernel runs this problem on
// this device, and is it supported?". Host code only, no CUDA runtime calls, so that the rules can
// be unit-tested without a GPU (tests/cuda/test_select.cpp).
#pragma once

#include <string>

#include "core/params.hpp"
#include "cuda/common/config.hpp"

namespace flashattn::cuda {

struct KernelChoice {
  bool ok = false;
  std::string why;  // when !ok: the reason, for an Unsupported error
  int dp = 0;       // padded head dim
  Math math = Math::Tf32x3;  // float32 kernels
  bool half16 = false;       // float16/bfloat16 kernels (kernels16.cuh)
  Half16 h = Half16::BF16;
  bool atomic_bwd = false;   // 16-bit backward: single pass with float32 dQ atomics (else split)
  bool sm90_fwd = false;     // forward on an sm_90a kernel (16-bit: kernels_sm90.cuh; tf32: kernels_sm90_tf32.cuh;
                             // 3xtf32 at padded D = 128: kernels_sm90_3xtf32.cuh)
  bool sm90_bwd = false;     // backward on sm_90a kernels (16-bit: the single pass; tf32: both split passes)
  int sm90_variant = 0;      // its tile_config90 variant
  bool tf32_dkv_wgmma = false;  // tf32 backward: dK/dV on wgmma as well (else the mma.sync kernel)
  bool f32_pair = false;        // float32 sm_90a backward: the pair kernels (kernels_sm90_tf32_bwd_pair.cuh)
  int tf32_fwd_copies = 0;  // tf32 sm_90a forward: 0 V transposed in the kernel; by the operand pre-pass: 1 V, 2 K and V
};

// The choice for a problem on a device of compute capability cc_major.cc_minor, with the
// FLASHATTN_CUDA_* override variables applied (an unknown value throws InvalidArgument).
KernelChoice select_kernel(const Shape& s, const Numerics& n, int cc_major, int cc_minor);

// Whether the sm_90a 16-bit forward's two consumer warpgroups take turns issuing products.
bool use_pingpong(const Shape& s, int dp);

// The CTAs of the sm_90a pair kernels, which can walk several blocks each (taking each next block
// from a counter, BlockQueue), for `items` blocks: by default one per block - since the dK/dV pass
// runs beside the dQ pass, the hardware's block scheduler fills each pass's tail with the other's
// blocks, and one CTA per block measured 0-6% faster than one per multiprocessor walking (which had
// won 1-4% at S = 1k with the passes one after the other; docs/PERF.md float32 runs 10d, 11d).
// FLASHATTN_CUDA_PERSISTENT_CTAS=N runs min(items, N) CTAs (0: one per block; "sms": one per
// multiprocessor), for tests and measurement.
int persistent_ctas(int64_t items, int sms);

// The CTAs (one per multiprocessor) that write the tf32 copies of Q and dO of the float32 sm_90a
// backward on a side stream while the dQ pass, which does not read them, runs on the other
// multiprocessors; 0: no side stream - the copies, then both passes, in order on the caller's
// stream. Default: a quarter of the multiprocessors. FLASHATTN_CUDA_CONVERT_CTAS=N overrides, for
// measurement and tests.
int convert_ctas(int sms);

}  // namespace flashattn::cuda
