// Kernel selection of the CUDA backend (select.hpp). Host code only.
#include "cuda/host/select.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace flashattn::cuda {
namespace {

// The override variables below exist for testing and benchmarking and are read on every call:
// the index of the variable's value in `names`, or -1 when it is unset or empty; any other value
// is an InvalidArgument that lists the choices.
int env_choice(const char* var, std::initializer_list<const char*> names) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return -1;
  int i = 0;
  std::string list;
  for (const char* n : names) {
    if (std::strcmp(env, n) == 0) return i;
    list += (i == 0 ? "" : i + 1 == static_cast<int>(names.size()) ? " or " : ", ") + std::string(n);
    ++i;
  }
  throw Error(Status::InvalidArgument, std::string(var) + " = '" + env + "' is unknown (" + list + ")");
}

// A CTA-count override: -1 when `var` is unset or empty; "sms" (where allowed, sms >= 0) the
// multiprocessor count (at least 1); else a count in [0, max], or an InvalidArgument naming the
// variable, its value and `meaning`.
long env_count(const char* var, long max, int sms, const char* meaning) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return -1;
  if (sms >= 0 && std::strcmp(env, "sms") == 0) return sms > 0 ? sms : 1;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  if (*end != '\0' || v < 0 || v > max)
    throw Error(Status::InvalidArgument, std::string(var) + " = '" + env + "' is not " + meaning);
  return v;
}

// FLASHATTN_CUDA_MATH=fma|tf32|3xtf32 overrides the precision option's choice of arithmetic (the
// FMA kernels are the float32 baseline that the accuracy tests compare against).
bool math_override(Math* m) {
  const int i = env_choice("FLASHATTN_CUDA_MATH", {math_name(Math::Fma), math_name(Math::Tf32),
                                                   math_name(Math::Tf32x3)});
  if (i >= 0) *m = static_cast<Math>(i);
  return i >= 0;
}

// FLASHATTN_CUDA_BWD=split|atomic chooses the 16-bit backward design when the caller did not ask
// for a deterministic one (tests and benchmarks measure both).
bool bwd_override(bool* atomic) {
  const int i = env_choice("FLASHATTN_CUDA_BWD", {"split", "atomic"});
  if (i >= 0) *atomic = i == 1;
  return i >= 0;
}

// FLASHATTN_CUDA_ARCH=sm80 keeps a compute capability 9.0 device on the mma.sync (sm_80) kernels,
// so that tests and benchmarks can compare both families on one GPU.
bool sm90_disabled() { return env_choice("FLASHATTN_CUDA_ARCH", {"sm80", "sm90"}) == 0; }

// The sm_90a dK/dV kernel's CTA shape: variant 1 (D = 64: one consumer warpgroup, 64 keys, two
// CTAs per SM, so one CTA's prologue and epilogue overlap the other's main loop). Measured on the
// H200 (docs/PERF.md, run 7): 3-10% faster with a causal mask at S <= 1024, where CTAs have few
// and unequal tiles; 2-12% slower elsewhere (dQ is added twice as often per key).
// FLASHATTN_CUDA_SM90_VARIANT=0|1 overrides.
int sm90_bwd_variant(const Shape& s, Mask mask, int dp) {
  if (!has_sm90_variant(Pass::Dkv, dp, 1)) return 0;
  const int i = env_choice("FLASHATTN_CUDA_SM90_VARIANT", {"0", "1"});
  if (i >= 0) return i;
  return mask != Mask::None && s.seq_q <= 1024 && s.seq_kv <= 1024 ? 1 : 0;
}

// The tf32 sm_90a forward's operand copies (KernelChoice::tf32_fwd_copies). The kernel's producer
// warps transposing V were its limit: with V transposed by the pre-pass it runs 1.3-1.8x faster at
// every benchmark shape, S = 1k-16k (docs/PERF.md, float32 run 15). Rounding K there too saves the
// kernel another pass over each K tile in shared memory but costs a read and a write of K: 8-17%
// faster at S >= 4k, even at S = 1k non-causal, 6% slower at S = 1k causal. Each copy costs per
// key what the kernel gains per key times the query rows that see it (Sq x the GQA group, halved
// under a causal mask): V's pays from 256 such rows (run 15c: at 64-128 rows the call takes 10-22%
// longer with it, at 256 2-9% less time, at 512 22% less), K's from 2048.
// FLASHATTN_CUDA_TF32_FWD_COPIES=none|v|kv overrides.
int tf32_fwd_copies(const Shape& s, Mask mask) {
  const int i = env_choice("FLASHATTN_CUDA_TF32_FWD_COPIES", {"none", "v", "kv"});
  if (i >= 0) return i;
  const int64_t rows = s.seq_q * (s.heads_q / s.heads_kv) / (mask == Mask::None ? 1 : 2);
  return rows >= 2048 ? 2 : rows >= 256 ? 1 : 0;
}

}  // namespace

KernelChoice select_kernel(const Shape& s, const Numerics& n, int cc_major, int cc_minor) {
  KernelChoice c;
  if (n.dtype == DType::Float16 || n.dtype == DType::BFloat16) {
    if (cc_major < 8) {
      c.why = std::string("q.dtype = ") + dtype_name(n.dtype) +
              ": the float16/bfloat16 kernels need sm_80 or newer (this device is sm_" +
              std::to_string(cc_major) + "x)";
      return c;
    }
    c.half16 = true;
    c.h = n.dtype == DType::BFloat16 ? Half16::BF16 : Half16::F16;
    c.dp = padded_head_dim16(s.head_dim);
    // Default: the faster design per head dim on the H200 (bench/gpu.py, docs/PERF.md run 4):
    // the single pass with atomic dQ at D <= 64 (+2-6%), the split passes (dQ pass + dK/dV pass)
    // from D = 96 up (+3-7%). FLASHATTN_CUDA_BWD overrides it; a deterministic caller always gets
    // the split passes, whose every sum has a fixed order.
    // On compute capability 9.0 the sm_90a kernels (the "a" features are not forward compatible,
    // so exactly 9.0) take the forward and, where compiled, the single-pass backward.
    const bool sm90 = cc_major == 9 && cc_minor == 0 && !sm90_disabled();
    c.atomic_bwd = c.dp <= 64 || (sm90 && has_sm90(Pass::Dkv, c.dp));
    bool forced;
    if (bwd_override(&forced)) c.atomic_bwd = forced;
    if (n.deterministic) c.atomic_bwd = false;
    c.sm90_fwd = sm90 && has_sm90(Pass::Forward, c.dp);
    c.sm90_bwd = sm90 && c.atomic_bwd && has_sm90(Pass::Dkv, c.dp);
    if (c.sm90_bwd) c.sm90_variant = sm90_bwd_variant(s, n.mask, c.dp);
  } else if (n.dtype != DType::Float32) {
    c.why = std::string("q.dtype = ") + dtype_name(n.dtype) + " is not supported on CUDA";
    return c;
  } else {
    c.dp = padded_head_dim(s.head_dim);
  }
  if (c.dp == 0) {
    c.why = "head_dim = " + std::to_string(s.head_dim) + " is not supported on CUDA (1..256)";
    return c;
  }
  if (s.batch > 65535 || s.heads_q > 65535) {
    c.why = "batch = " + std::to_string(s.batch) + ", heads = " + std::to_string(s.heads_q) +
            ": the CUDA grid allows at most 65535 of each";
    return c;
  }
  if ((s.seq_q + 15) / 16 > 0x7fffffff || (s.seq_kv + 15) / 16 > 0x7fffffff) {
    c.why = "sequence too long for the CUDA grid";
    return c;
  }
  if (c.half16) {
    c.ok = true;
    return c;
  }
  // TF32 mma.sync needs sm_80; older devices get the FMA kernels in both precisions.
  c.math = cc_major < 8 ? Math::Fma : n.precision == Precision::Tf32 ? Math::Tf32 : Math::Tf32x3;
  Math forced;
  if (math_override(&forced)) {
    if (forced != Math::Fma && cc_major < 8) {
      c.why = std::string("FLASHATTN_CUDA_MATH = ") + math_name(forced) + " needs sm_80 or newer";
      return c;
    }
    c.math = forced;
  }
  // tf32 mode on Hopper: the wgmma forward, and at padded D = 64 and 128 the wgmma backward (dQ
  // pass and dK/dV pass on wgmma after the operand pre-pass; at D = 64 1.4-2.3x faster than the
  // mma.sync kernels at every benchmark shape, docs/PERF.md float32 runs 7 and 7b). The 3xTF32 and
  // FMA arithmetics stay on the mma.sync / CUDA-core kernels. FLASHATTN_CUDA_TF32_BWD=mma|wgmma-dq|
  // wgmma overrides the backward (wgmma-dq: the dK/dV pass on mma.sync, at D = 64 only), for tests
  // and measurement.
  const bool sm90 = cc_major == 9 && cc_minor == 0 && !sm90_disabled();
  c.sm90_fwd = sm90 && c.math == Math::Tf32 && has_sm90_tf32(c.dp);
  if (c.sm90_fwd) c.tf32_fwd_copies = tf32_fwd_copies(s, n.mask);
  // The fp32-accurate forward on wgmma (padded D = 64 and 128, streaming the pre-pass's split
  // copies): the default at both, at 128 1.3-1.5x the mma.sync 3xTF32 kernel (docs/PERF.md, float32
  // run 9), at 64 4-17% faster once its descriptors stayed on the uniform datapath (run 14b; before,
  // 5-6% slower at S = 1k: run 10).
  // FLASHATTN_CUDA_FP32_FWD=mma|wgmma overrides.
  if (sm90 && c.math == Math::Tf32x3 && has_sm90_3xtf32(c.dp)) {
    const int fwd = env_choice("FLASHATTN_CUDA_FP32_FWD", {"mma", "wgmma"});
    c.sm90_fwd = fwd == 1 || (fwd < 0 && fp32_fwd_wgmma_default(c.dp));
  }
  // =pair: at D = 64 the pair kernels (as at D = 128) instead of the 128-row split kernels.
  int tf32_bwd = env_choice("FLASHATTN_CUDA_TF32_BWD", {"mma", "wgmma-dq", "wgmma", "pair"});
  if (tf32_bwd < 0) tf32_bwd = 2;
  c.sm90_bwd = sm90 && c.math == Math::Tf32 && has_sm90_tf32_bwd(c.dp) && tf32_bwd >= 1;
  // (D = 128 has no mma.sync-dK/dV variant of the wgmma backward: wgmma-dq is a D = 64 choice.)
  c.f32_pair = c.sm90_bwd && (tf32_bwd_pair(c.dp) || tf32_bwd == 3);
  c.tf32_dkv_wgmma = c.sm90_bwd && (tf32_bwd >= 2 || c.f32_pair);
  // The fp32-accurate backward on wgmma (padded D = 64 and 128, the pair kernels in 3xTF32): the
  // default there, at D = 64 1.1-1.4x the mma.sync 3xTF32 kernels (docs/PERF.md, float32 run 8);
  // FLASHATTN_CUDA_FP32_BWD=mma keeps those.
  if (sm90 && c.math == Math::Tf32x3 && has_sm90_3xtf32_bwd(c.dp) &&
      env_choice("FLASHATTN_CUDA_FP32_BWD", {"mma", "wgmma"}) != 0)
    c.sm90_bwd = c.tf32_dkv_wgmma = c.f32_pair = true;
  c.ok = true;
  return c;
}

// Ping-pong scheduling of the sm_90a forward's two consumer warpgroups: measured faster at
// D = 64 at every length and at Skv <= 4096 for D = 128 and 256, slower beyond (docs/PERF.md,
// 16-bit run 6). FLASHATTN_CUDA_PINGPONG=0|1 overrides, for measurement.
bool use_pingpong(const Shape& s, int dp) {
  const int i = env_choice("FLASHATTN_CUDA_PINGPONG", {"0", "1"});
  if (i >= 0) return i == 1;
  return dp <= 64 || s.seq_kv <= 4096;
}

int persistent_ctas(int64_t items, int sms) {
  int64_t n = items;
  const long v = env_count("FLASHATTN_CUDA_PERSISTENT_CTAS", 1000000, sms,
                           "a count or 'sms' (0: one CTA per block)");
  if (v >= 0) n = v > 0 ? v : items;
  // (A grid dimension holds 2^31 - 1 blocks; select_kernel bounds the block counts far below.)
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, n)));
}

int convert_ctas(int sms) {
  const long v = env_count("FLASHATTN_CUDA_CONVERT_CTAS", 100000, -1, "a count (0: no side stream)");
  return v >= 0 ? static_cast<int>(v) : std::max(0, sms / 4);
}

}  // namespace flashattn::cuda
