// The CUDA backend: device checks, kernel selection, workspace, launches.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>

#include "core/backend.hpp"
#include "cuda/check.hpp"
#include "cuda/config.hpp"
#include "cuda/launch.hpp"

namespace flashattn::cuda {
namespace {

// Makes `device` current for the lifetime of the guard and restores the caller's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLASHATTN_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) FLASHATTN_CUDA_CHECK(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(prev_);  // best effort: destructors must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// ---- kernel selection: the single answer to "which kernel?" and "is it supported?" -----------
struct KernelChoice {
  bool ok = false;
  std::string why;  // when !ok: the reason, for an Unsupported error
  int dp = 0;       // padded head dim
  Math math = Math::Tf32x3;  // float32 kernels
  bool half16 = false;       // float16/bfloat16 kernels (kernels16.cuh)
  Half16 h = Half16::BF16;
  bool atomic_bwd = false;   // 16-bit backward: single pass with float32 dQ atomics (else split)
  bool sm90_fwd = false;     // forward on an sm_90a kernel (16-bit: kernels_sm90.cuh; tf32: kernels_sm90_tf32.cuh)
  bool sm90_bwd = false;     // 16-bit single-pass backward on the sm_90a kernel
  int sm90_variant = 0;      // its tile_config90 variant
};

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

// Ping-pong scheduling of the sm_90a forward's two consumer warpgroups: measured faster at
// D = 64 at every length and at Skv <= 4096 for D = 128 and 256, slower beyond (docs/PERF.md,
// 16-bit run 6). FLASHATTN_CUDA_PINGPONG=0|1 overrides, for measurement.
bool use_pingpong(const Shape& s, int dp) {
  const int i = env_choice("FLASHATTN_CUDA_PINGPONG", {"0", "1"});
  if (i >= 0) return i == 1;
  return dp <= 64 || s.seq_kv <= 4096;
}

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
  // tf32 mode's forward on Hopper: the wgmma kernel (the 3xTF32 and FMA arithmetics, and the
  // backward, stay on the mma.sync / CUDA-core kernels).
  c.sm90_fwd = cc_major == 9 && cc_minor == 0 && !sm90_disabled() && c.math == Math::Tf32 && has_sm90_tf32(c.dp);
  c.ok = true;
  return c;
}

// ---- runtime -> compile-time, in one place ------------------------------------------------------
template <class F>
void dispatch(const KernelChoice& c, F&& f) {
  auto with_math = [&](auto dp) {
    switch (c.math) {
      case Math::Fma: return f(dp, std::integral_constant<Math, Math::Fma>{});
      case Math::Tf32: return f(dp, std::integral_constant<Math, Math::Tf32>{});
      case Math::Tf32x3: return f(dp, std::integral_constant<Math, Math::Tf32x3>{});
    }
  };
  switch (c.dp) {
    case 64: return with_math(std::integral_constant<int, 64>{});
    case 128: return with_math(std::integral_constant<int, 128>{});
    case 256: return with_math(std::integral_constant<int, 256>{});
  }
  throw Error(Status::Internal, "cuda dispatch: no kernel for padded head dim " + std::to_string(c.dp));
}

template <class F>
void dispatch16(const KernelChoice& c, F&& f) {
  auto with_type = [&](auto dp) {
    if (c.h == Half16::BF16) return f(dp, std::integral_constant<Half16, Half16::BF16>{});
    return f(dp, std::integral_constant<Half16, Half16::F16>{});
  };
  switch (c.dp) {
    case 64: return with_type(std::integral_constant<int, 64>{});
    case 96: return with_type(std::integral_constant<int, 96>{});
    case 128: return with_type(std::integral_constant<int, 128>{});
    case 256: return with_type(std::integral_constant<int, 256>{});
  }
  throw Error(Status::Internal, "cuda dispatch16: no kernel for padded head dim " + std::to_string(c.dp));
}

struct DeviceInfo {
  int cc_major = 0;
  int cc_minor = 0;
  int smem_optin = 0;  // bytes of shared memory one block may opt into
  bool big() const { return cc_major >= 9; }
};

DeviceInfo device_info(int device) {
  DeviceInfo d;
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return d;
}

KernelChoice choose(const Shape& s, const Numerics& n, const DeviceInfo& d) {
  KernelChoice c = select_kernel(s, n, d.cc_major, d.cc_minor);
  if (c.ok) {
    for (Pass p : {Pass::Forward, Pass::Dq, Pass::Dkv}) {
      const bool sm90 = (p == Pass::Forward && c.sm90_fwd) || (p == Pass::Dkv && c.sm90_bwd);
      const int need = c.half16 ? (sm90 ? smem_bytes90(p, c.dp, p == Pass::Dkv ? c.sm90_variant : 0)
                                        : smem_bytes16(p, c.dp, d.big(), c.atomic_bwd))
                                : (sm90 ? smem_bytes90_tf32(c.dp) : smem_bytes(p, c.dp, d.big()));
      if (need > d.smem_optin) {
        c.ok = false;
        c.why = "head_dim = " + std::to_string(s.head_dim) + " needs " + std::to_string(need) +
                " bytes of shared memory per block; this device allows " + std::to_string(d.smem_optin);
      }
    }
  }
  if (!c.ok) throw Error(Status::Unsupported, "CUDA backend: " + c.why);
  return c;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
// 16-byte copies need an aligned base and strides that are whole multiples of 16 bytes
// (`per16` elements).
template <class Op>
bool vec_ok(const Op& o, int64_t per16) {
  return aligned16(o.ptr) && o.sb % per16 == 0 && o.sh % per16 == 0 && o.ss % per16 == 0;
}

// The backward's D workspace, freed on the stream on every path out.
class Workspace {
 public:
  Workspace(size_t bytes, cudaStream_t stream) : stream_(stream) {
    FLASHATTN_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~Workspace() {
    if (ptr_ != nullptr) (void)cudaFreeAsync(ptr_, stream_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  float* get() const { return static_cast<float*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace

bool built() { return true; }

bool available() {
  // Cached: validation asks this for every CPU call too.
  static const bool ok = [] {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return ok;
}

void check_device_pointer(const void* ptr, int32_t device, const char* what) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  bool on_device = false;
  int dev = -1;
  if (e == cudaSuccess) {
    on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
    dev = attr.device;
  } else {
    (void)cudaGetLastError();  // unknown to CUDA: plain host memory
  }
  std::ostringstream os;
  os << what << ".data = " << ptr;
  if (device < 0) {
    if (on_device && attr.type == cudaMemoryTypeDevice) {
      os << " is memory of CUDA device " << dev << " but " << what << ".device = -1 (cpu)";
      throw Error(Status::InvalidArgument, os.str());
    }
    return;
  }
  if (!on_device) {
    os << " is host memory but " << what << ".device = " << device << " (CUDA)";
    throw Error(Status::InvalidArgument, os.str());
  }
  if (attr.type == cudaMemoryTypeDevice && dev != device) {
    os << " is memory of CUDA device " << dev << " but " << what << ".device = " << device;
    throw Error(Status::InvalidArgument, os.str());
  }
}

void forward(const ForwardParams& p) {
  DeviceGuard guard(p.exec.device);
  const DeviceInfo info = device_info(p.exec.device);
  const KernelChoice c = choose(p.shape, p.num, info);
  FwdArgs a{};
  a.big = info.big();
  a.p = p;
  a.sl2 = p.num.scale * 1.4426950408889634f;
  const int64_t e = 16 / dtype_size(p.num.dtype);  // elements per 16 bytes
  a.vec16 = vec_ok(p.q, e) && vec_ok(p.k, e) && vec_ok(p.v, e) && vec_ok(p.out, e);
  a.pingpong = c.sm90_fwd && use_pingpong(p.shape, c.dp);
  auto stream = static_cast<cudaStream_t>(p.exec.stream);
  if (c.half16) {
    dispatch16(c, [&](auto dp, auto h) {
      constexpr int DP = decltype(dp)::value;
      if constexpr (has_sm90(Pass::Forward, DP)) {
        if (c.sm90_fwd && a.vec16 && launch_forward_sm90<DP, decltype(h)::value>(a, stream)) return;
      }
      launch_forward16<DP, decltype(h)::value>(a, stream);
    });
    return;
  }
  dispatch(c, [&](auto dp, auto math) {
    constexpr int DP = decltype(dp)::value;
    constexpr Math M = decltype(math)::value;
    if constexpr (M == Math::Tf32 && has_sm90_tf32(DP)) {
      if (c.sm90_fwd && a.vec16 && launch_forward_tf32_sm90<DP>(a, stream)) return;
    }
    launch_forward<DP, M>(a, stream);
  });
}

void backward(const BackwardParams& p) {
  DeviceGuard guard(p.exec.device);
  const DeviceInfo info = device_info(p.exec.device);
  const KernelChoice c = choose(p.shape, p.num, info);
  auto stream = static_cast<cudaStream_t>(p.exec.stream);
  const Shape& s = p.shape;
  // Workspace: D [B*Hq*Sq] floats, then (atomic design) the float32 dQ accumulator
  // [B*Hq*Sq, DP], zeroed on the stream.
  const size_t rows = static_cast<size_t>(s.batch * s.heads_q * s.seq_q);
  const size_t accum = c.atomic_bwd ? rows * static_cast<size_t>(c.dp) : 0;
  // The accumulator starts 16-byte aligned (vector reductions of the sm_90 kernel need 8).
  const size_t accum_at = (rows + 3) / 4 * 4;
  Workspace ws((accum_at + accum) * sizeof(float), stream);
  BwdArgs a{};
  a.p = p;
  a.sl2 = p.num.scale * 1.4426950408889634f;
  const int64_t e = 16 / dtype_size(p.num.dtype);  // elements per 16 bytes
  a.vec16 = vec_ok(p.q, e) && vec_ok(p.k, e) && vec_ok(p.v, e) && vec_ok(p.out, e) &&
            vec_ok(p.dout, e) && vec_ok(p.dq, e) && vec_ok(p.dk, e) && vec_ok(p.dv, e);
  a.delta = ws.get();
  a.dq_accum = c.atomic_bwd ? ws.get() + accum_at : nullptr;
  a.sm90_variant = c.sm90_variant;
  a.big = info.big();
  if (accum > 0) FLASHATTN_CUDA_CHECK(cudaMemsetAsync(a.dq_accum, 0, accum * sizeof(float), stream));
  launch_preprocess(a, stream);
  if (c.half16) {
    dispatch16(c, [&](auto dp, auto h) {
      constexpr int DP = decltype(dp)::value;
      constexpr Half16 H = decltype(h)::value;
      if (c.atomic_bwd) {
        bool done = false;
        if constexpr (has_sm90(Pass::Dkv, DP)) done = c.sm90_bwd && a.vec16 && launch_dkv_sm90<DP, H>(a, stream);
        if (!done) launch_dkv16<DP, H, true>(a, stream);
        launch_dq_convert(a, DP, stream);
      } else {
        launch_dq16<DP, H>(a, stream);
        launch_dkv16<DP, H, false>(a, stream);
      }
    });
    return;
  }
  dispatch(c, [&](auto dp, auto math) {
    launch_dq<decltype(dp)::value, decltype(math)::value>(a, stream);
    launch_dkv<decltype(dp)::value, decltype(math)::value>(a, stream);
  });
}

std::string describe() {
  std::ostringstream os;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  os << "cuda: " << n << " device(s)";
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess)
      os << "; " << d << ": " << prop.name << " (sm_" << prop.major << prop.minor << ", "
         << prop.multiProcessorCount << " SMs)";
  }
  os << "; float32 kernels forward/dq/dkv for head dims padded to {64,128,256}, math "
        "3xtf32 (precision fp32), tf32 (precision tf32), fma (fallback); float16/bfloat16 kernels "
        "(mma.sync m16n8k16, sm_80+) for head dims padded to {64,96,128,256}, forward on sm_90 "
        "by wgmma for {64,128,256} and single-pass backward by wgmma for {64,128,256} "
        "(FLASHATTN_CUDA_ARCH=sm80 keeps mma.sync), backward single pass with atomic dQ (default "
        "on sm_90 and at D <= 64 elsewhere) or split (deterministic = 1, and the default from "
        "D = 96 before sm_90; FLASHATTN_CUDA_BWD=split|atomic)";
  return os.str();
}

}  // namespace flashattn::cuda
