// The CUDA backend: device checks, the device-dependent half of kernel selection (shared memory;
// the rules are in select.cpp), workspace, launches.
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "core/backend.hpp"
#include "cuda/host/check.hpp"
#include "cuda/common/config.hpp"
#include "cuda/host/launch.hpp"
#include "cuda/host/select.hpp"

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
  int sms = 0;         // multiprocessors
  bool big() const { return cc_major >= 9; }
};

DeviceInfo device_info(int device) {
  DeviceInfo d;
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
  return d;
}

KernelChoice choose(const Shape& s, const Numerics& n, const DeviceInfo& d) {
  KernelChoice c = select_kernel(s, n, d.cc_major, d.cc_minor);
  if (c.ok) {
    for (Pass p : {Pass::Forward, Pass::Dq, Pass::Dkv}) {
      // The kernel each pass runs: 16-bit sm_90a forward / single-pass backward (no dQ pass);
      // float32 sm_90a forward (tf32 or 3xTF32) and tf32 backward passes; else mma.sync.
      int need = 0;
      if (c.half16) {
        const bool sm90 = (p == Pass::Forward && c.sm90_fwd) || (p == Pass::Dkv && c.sm90_bwd);
        need = sm90 ? smem_bytes90(p, c.dp, p == Pass::Dkv ? c.sm90_variant : 0)
                    : smem_bytes16(p, c.dp, d.big(), c.atomic_bwd);
      } else if (p == Pass::Forward && c.sm90_fwd) {
        need = c.math == Math::Tf32x3 ? smem_bytes90_3xtf32(c.dp) : smem_bytes90_tf32(c.dp);
      } else if ((p == Pass::Dq && c.sm90_bwd) || (p == Pass::Dkv && c.tf32_dkv_wgmma)) {
        need = smem_bytes90_tf32_bwd(p, c.dp, c.f32_pair, c.math == Math::Tf32x3);
      } else {
        need = smem_bytes(p, c.dp, d.big());
      }
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

}  // namespace

namespace {
void destroy(const SideSlot& s) {
  for (cudaEvent_t e : s.ev)
    if (e != nullptr) (void)cudaEventDestroy(e);
  if (s.stream != nullptr) (void)cudaStreamDestroy(s.stream);
}
// A thread's side streams, destroyed when the thread ends.
struct SideSlots {
  std::map<int, SideSlot> by_device;
  ~SideSlots() {
    for (auto& kv : by_device) destroy(kv.second);
  }
};
}  // namespace

const SideSlot& side_stream() {
  int device = 0;
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device));
  thread_local SideSlots slots;
  auto it = slots.by_device.find(device);
  if (it != slots.by_device.end()) return it->second;
  // Created whole before it is kept: a failure part way leaves nothing behind.
  SideSlot s;
  int least = 0, greatest = 0;
  cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e == cudaSuccess) e = cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, greatest);
  for (cudaEvent_t& ev : s.ev)
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    destroy(s);
    throw_cuda(e, "side stream of the float32 backward (cudaStreamCreateWithPriority / cudaEventCreateWithFlags)");
  }
  return slots.by_device.emplace(device, s).first->second;
}

void ensure_smem_limit(const void* kernel, int smem) {
  int device = 0;
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device));
  // (kernel, device) -> the limit set; a kernel's launches all ask for the same size, so a
  // larger request (a different configuration) sets it again.
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> set;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = set.try_emplace({kernel, device}, -1).first;
  if (it->second >= smem) return;
  FLASHATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  it->second = smem;
}

bool side_stream_free(cudaStream_t main) {
  cudaStreamCaptureStatus a = cudaStreamCaptureStatusNone, b = cudaStreamCaptureStatusNone;
  // (An error here - e.g. the legacy stream queried during another thread's global capture -
  // means "not free": the caller then keeps its work on its own stream.)
  if (cudaStreamIsCapturing(main, &a) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (cudaStreamIsCapturing(side_stream().stream, &b) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a == cudaStreamCaptureStatusNone && b == cudaStreamCaptureStatusNone;
}

cudaMemPool_t workspace_pool() {
  int device = 0;
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<int, cudaMemPool_t> pools;  // one per device, for the process's lifetime
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find(device);
  if (it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  FLASHATTN_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  uint64_t keep = UINT64_MAX;
  const cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
  if (e != cudaSuccess) {
    (void)cudaMemPoolDestroy(pool);
    throw_cuda(e, "cudaMemPoolSetAttribute(workspace pool, release threshold)");
  }
  pools.emplace(device, pool);
  return pool;
}

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
  // (The message is built only on the way out: this runs for every tensor of every call.)
  auto fail = [&](const std::string& why) {
    std::ostringstream os;
    os << what << ".data = " << ptr << why;
    throw Error(Status::InvalidArgument, os.str());
  };
  if (device < 0) {
    if (on_device && attr.type == cudaMemoryTypeDevice)
      fail(" is memory of CUDA device " + std::to_string(dev) + " but " + what + ".device = -1 (cpu)");
    return;
  }
  if (!on_device) fail(std::string(" is host memory but ") + what + ".device = " + std::to_string(device) + " (CUDA)");
  if (attr.type == cudaMemoryTypeDevice && dev != device)
    fail(" is memory of CUDA device " + std::to_string(dev) + " but " + what + ".device = " + std::to_string(device));
}

void forward(const ForwardParams& p) {
  DeviceGuard guard(p.exec.device);
  const DeviceInfo info = device_info(p.exec.device);
  const KernelChoice c = choose(p.shape, p.num, info);
  FwdArgs a{};
  a.big = info.big();
  a.p = p;
  a.score = ScoreTransform::make(p.num.scale);
  const int64_t e = 16 / dtype_size(p.num.dtype);  // elements per 16 bytes
  a.vec16 = vec_ok(p.q, e) && vec_ok(p.k, e) && vec_ok(p.v, e) && vec_ok(p.out, e);
  a.pingpong = c.sm90_fwd && use_pingpong(p.shape, c.dp);
  a.tf32_copies = c.tf32_fwd_copies;
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
    if constexpr (M == Math::Tf32x3 && has_sm90_3xtf32(DP)) {
      if (c.sm90_fwd && a.vec16 && launch_forward_3xtf32_sm90<DP>(a, stream)) return;
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
  a.score = ScoreTransform::make(p.num.scale);
  const int64_t e = 16 / dtype_size(p.num.dtype);  // elements per 16 bytes
  a.vec16 = vec_ok(p.q, e) && vec_ok(p.k, e) && vec_ok(p.v, e) && vec_ok(p.out, e) &&
            vec_ok(p.dout, e) && vec_ok(p.dq, e) && vec_ok(p.dk, e) && vec_ok(p.dv, e);
  a.delta = ws.get();
  a.dq_accum = c.atomic_bwd ? ws.get() + accum_at : nullptr;
  a.sm90_variant = c.sm90_variant;
  a.tf32_dkv_wgmma = c.tf32_dkv_wgmma;
  a.f32_pair = c.f32_pair;
  a.sms = info.sms;
  a.big = info.big();
  if (accum > 0) FLASHATTN_CUDA_CHECK(cudaMemsetAsync(a.dq_accum, 0, accum * sizeof(float), stream));
  if (c.half16) {
    launch_preprocess(a, stream);
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
    constexpr int DP = decltype(dp)::value;
    constexpr Math M = decltype(math)::value;
    if constexpr (M == Math::Tf32 && has_sm90_tf32_bwd(DP)) {
      if (c.sm90_bwd && a.vec16 && launch_bwd_tf32_sm90<DP>(a, stream)) return;
    }
    if constexpr (M == Math::Tf32x3 && has_sm90_3xtf32_bwd(DP)) {
      if (c.sm90_bwd && a.vec16 && launch_bwd_3xtf32_sm90<DP>(a, stream)) return;
    }
    // (The sm_90a kernels above launch the preprocess themselves, beside their operand copies.)
    launch_preprocess(a, stream);
    launch_dq<DP, M>(a, stream);
    launch_dkv<DP, M>(a, stream);
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
        "3xtf32 (precision fp32; on sm_90 the forward by wgmma for {64,128} (FLASHATTN_CUDA_FP32_FWD=mma "
        "keeps mma.sync) and the backward by wgmma for {64,128} "
        "(FLASHATTN_CUDA_FP32_BWD=mma keeps mma.sync)), tf32 (precision tf32; on sm_90 the forward and the backward by "
        "wgmma for {64,128}, FLASHATTN_CUDA_TF32_BWD=mma keeps the mma.sync backward), fma "
        "(fallback); float16/bfloat16 kernels "
        "(mma.sync m16n8k16, sm_80+) for head dims padded to {64,96,128,256}, forward on sm_90 "
        "by wgmma for {64,128,256} and single-pass backward by wgmma for {64,128,256} "
        "(FLASHATTN_CUDA_ARCH=sm80 keeps mma.sync), backward single pass with atomic dQ (default "
        "on sm_90 and at D <= 64 elsewhere) or split (deterministic = 1, and the default from "
        "D = 96 before sm_90; FLASHATTN_CUDA_BWD=split|atomic)";
  return os.str();
}

}  // namespace flashattn::cuda
