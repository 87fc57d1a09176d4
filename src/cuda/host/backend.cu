// The CUDA backend: device checks and capabilities, then per call the plan of select.cpp, its
// workspace, and the launches the plan names - a switch, no decisions.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "core/validate.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/seq_check.hpp"
#include "cuda/host/check.hpp"
#include "cuda/host/launch.hpp"
#include "cuda/host/overrides.hpp"
#include "cuda/host/resources.hpp"
#include "cuda/host/select.hpp"
#include "cuda/sm90/tma.hpp"

namespace flashattn::cuda {
namespace {

// Makes `device` current for the lifetime of the guard and restores the caller's device; a
// thread with no current context gets the device's primary one (bind_context: the driver calls).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLASHATTN_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) FLASHATTN_CUDA_CHECK(cudaSetDevice(device));
    changed_ = prev_ != device;
    if (!changed_) bind_context(device);
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
// Calls f(std::integral_constant<int, DP>) for the padded head dim `dp` of a list of
// common/head_dims.hpp (the generated table the instantiation files come from), so that only
// instantiated launchers are named.
template <const auto& Dims, size_t... I, class F>
void dispatch_dim(int dp, F&& f, std::index_sequence<I...>) {
  const bool found = ((dp == Dims[I] ? (f(std::integral_constant<int, Dims[I]>{}), true) : false) || ...);
  if (!found) throw Error(Status::Internal, "cuda dispatch: no kernel for padded head dim " + std::to_string(dp));
}
template <const auto& Dims, class F>
void dispatch_dim(int dp, F&& f) {
  dispatch_dim<Dims>(dp, f, std::make_index_sequence<std::extent_v<std::remove_reference_t<decltype(Dims)>>>{});
}
template <class F>
void dispatch_math(Math m, F&& f) {
  switch (m) {
    case Math::Fma: return f(std::integral_constant<Math, Math::Fma>{});
    case Math::Tf32: return f(std::integral_constant<Math, Math::Tf32>{});
    case Math::Tf32x3: return f(std::integral_constant<Math, Math::Tf32x3>{});
  }
}
template <class F>
void dispatch_half(Half16 h, F&& f) {
  if (h == Half16::BF16) return f(std::integral_constant<Half16, Half16::BF16>{});
  f(std::integral_constant<Half16, Half16::F16>{});
}
// The plan's xf: the kernels with the per-entry score step (softcap, ALiBi) or those without.
template <class F>
void dispatch_xf(bool xf, F&& f) {
  if (xf) return f(std::true_type{});
  f(std::false_type{});
}

// The device's capabilities, read once per device (a call asks for them every time).
DeviceCaps device_caps(int device) {
  static std::mutex mutex;
  static std::map<int, DeviceCaps> known;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(device);
    if (it != known.end()) return it->second;
  }
  DeviceCaps d;
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  FLASHATTN_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device));
  d.tma = tma_encoder_available();
  // Peak memory bandwidth (the KV-cache split rule, select.cpp kv_streams): unknown stays 0.
  int clock_khz = 0, bus_bits = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess)
    d.mem_gbps = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  else
    (void)cudaGetLastError();  // (a failed query only: a caller's pending error stays)
  // Under MPS this process may hold only a share of the SMs, which it cannot see: none assumed.
  // (A green context's share is the current context's: backward_plan_for.)
  int mps = 1;
  if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, device) != cudaSuccess) {
    (void)cudaGetLastError();
    mps = 1;
  }
  d.resident_sms = mps != 0 ? 0 : d.sms;
  const std::lock_guard<std::mutex> lock(mutex);
  return known.emplace(device, d).first->second;
}

template <class Plan>
Plan unwrap(Selected<Plan> r) {
  if (!r.ok) throw Error(Status::Unsupported, "CUDA backend: " + r.why);
  return r.plan;
}

// The backward's plan (the call and its workspace query). A plan whose ordered dQ starts its key
// blocks spread over the row (dq_rotate) needs them all resident: the context current on this
// thread may hold fewer SMs than the device (a green context), which costs two driver calls to
// ask - so only those plans ask, and are chosen again on the context's count when it is smaller.
BackwardPlan backward_plan_for(const BackwardParams& p) {
  DeviceCaps caps = device_caps(p.exec.device);
  BackwardPlan plan = unwrap(select_backward(p, caps, overrides()));
  if (plan.dq_rotate) {
    const int c = context_sms();
    if (c > 0 && c < caps.resident_sms) {
      caps.resident_sms = c;
      plan = unwrap(select_backward(p, caps, overrides()));
    }
  }
  return plan;
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

cudaMemPool_t workspace_pool(cudaStream_t stream) {
  int device = 0;
  FLASHATTN_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<int, cudaMemPool_t> pools;  // one per device, for the process's lifetime
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find(device);
  if (it != pools.end()) return it->second;
  if (capturing(stream)) return nullptr;  // (cudaMemPoolCreate is not permitted under capture)
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

void copy_to_host(void* dst, const void* src, size_t bytes, int32_t device, void* stream) {
  DeviceGuard guard(device);
  const auto st = static_cast<cudaStream_t>(stream);
  // A copy to the host and a wait cannot be recorded into a CUDA graph (they would break the
  // capture): say so instead.
  if (capturing(st))
    throw Error(Status::Unsupported,
                "the stream is being captured into a CUDA graph, and this KV-cache call reads its index tensors "
                "(block_table, cache_batch_idx, cache_leftpad without cache_seqlens, or any of them with "
                "FLASHATTN_CUDA_KV_CHECK=host) on the host to validate them before anything is written; pass "
                "cache_seqlens as a device tensor (then they are checked on the device, which a capture records), "
                "or make this call outside the capture");
  FLASHATTN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st));
  FLASHATTN_CUDA_CHECK(cudaStreamSynchronize(st));
}

bool kv_checks_on_device() { return overrides().kv_check != 0; }  // device unless asked otherwise

int64_t take_check_failures(int32_t device) {
  int n = 0;
  FLASHATTN_CUDA_CHECK(cudaGetDeviceCount(&n));
  if (device >= n)
    throw Error(Status::InvalidArgument,
                "device = " + std::to_string(device) + " but " + std::to_string(n) + " CUDA device(s) are visible");
  DeviceGuard guard(device);
  return take_captured_failures();
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

namespace {

// The forward of one plan (the device is current).
void forward_plan(const ForwardParams& p, const ForwardPlan& plan) {
  auto stream = static_cast<cudaStream_t>(p.exec.stream);
  Workspace ws(plan.workspace, stream, p.exec);
  FwdArgs a{};
  a.p = p;
  // A packed call whose arrays validation left unread: checked on the stream first, the kernels
  // reading the check's copies; the verdict is awaited once they are all queued.
  std::optional<SeqCheck> check;
  if (plan.seq_check >= 0) check.emplace(a.p.packing, p.shape, reinterpret_cast<char*>(ws.get()) + plan.seq_check, stream);
  a.score = ScoreTransform::make(p.shape, p.num);
  a.vec16 = plan.vec16;
  a.big = plan.big;
  a.pingpong = plan.pingpong;
  a.tf32_copies = plan.tf32_copies;
  a.workspace = ws.get();
  a.seq_maps = plan.seq_maps >= 0 ? reinterpret_cast<char*>(ws.get()) + plan.seq_maps : nullptr;
  a.block_table = plan.block_table >= 0 ? reinterpret_cast<int2*>(reinterpret_cast<char*>(ws.get()) + plan.block_table) : nullptr;
  a.grid_blocks = plan.grid_blocks;
  a.walk_ctas = plan.walk_ctas;
  [&] {  // (the launches; a case returns when its kernels are queued)
    switch (plan.kernel) {
      case FwdKernel::Sm80Mma32:
        return dispatch_dim<kHeadDims>(plan.dp, [&](auto dp) {
          dispatch_math(plan.math, [&](auto m) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_forward<decltype(dp)::value, decltype(m)::value, decltype(xf)::value>(a, stream);
            });
          });
        });
      case FwdKernel::Sm80Mma16:
        return dispatch_dim<kHeadDims16>(plan.dp, [&](auto dp) {
          dispatch_half(plan.h, [&](auto h) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_forward16<decltype(dp)::value, decltype(h)::value, decltype(xf)::value>(a, stream);
            });
          });
        });
      case FwdKernel::Sm90Wgmma16:
        return dispatch_dim<kSm90Forward16>(plan.dp, [&](auto dp) {
          dispatch_half(plan.h, [&](auto h) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_forward_sm90<decltype(dp)::value, decltype(h)::value, decltype(xf)::value>(a, stream);
            });
          });
        });
      case FwdKernel::Sm90Tf32:
        return dispatch_dim<kSm90Tf32Forward>(plan.dp, [&](auto dp) { launch_forward_tf32_sm90<decltype(dp)::value>(a, stream); });
      case FwdKernel::Sm90X3:
        return dispatch_dim<kSm90X3Forward>(plan.dp, [&](auto dp) { launch_forward_3xtf32_sm90<decltype(dp)::value>(a, stream); });
    }
  }();
  if (check) check->finish();
}

// Chunk c of a call chunked by `chunk` keys: its keys as the operands, its place in the whole
// sequence in Numerics (kv_offset, kv_total), so the band and ALiBi stay the whole call's.
ForwardParams key_chunk_params(const ForwardParams& p, int64_t chunk, int64_t c) {
  ForwardParams pc = p;
  const int64_t k0 = c * chunk;
  pc.shape.seq_kv = std::min(chunk, p.shape.seq_kv - k0);
  pc.k = rows_from(p.k, k0, element_bytes(p.num.dtype));
  pc.v = rows_from(p.v, k0, element_bytes(p.num.dtype));
  pc.num.kv_offset = k0;
  pc.num.kv_total = p.shape.seq_kv;
  return pc;
}

// A chunked call's scratch: the float64 row sums, then (256-byte aligned) the largest chunk's
// (the first one's) plan scratch.
size_t round256(size_t n) { return (n + 255) / 256 * 256; }
size_t key_chunk_workspace(const ForwardParams& p, int64_t chunk) {
  const ForwardPlan first = unwrap(select_forward(key_chunk_params(p, chunk, 0), device_caps(p.exec.device), overrides()));
  return round256(key_chunk_acc_bytes(p.shape)) + first.workspace;
}

// The forward over key chunks (ForwardPlan::key_chunk): each chunk's forward writes its (O, LSE)
// into out and lse, launch_key_chunk_merge folds them into float64 sums and the last merge writes
// the call's results. With the caller's workspace, the sums take its start and the chunks' own
// scratch the rest.
void forward_chunked(const ForwardParams& p, int64_t chunk) {
  auto stream = static_cast<cudaStream_t>(p.exec.stream);
  const size_t acc_bytes = round256(key_chunk_acc_bytes(p.shape));
  // (The caller's workspace is checked against the whole call's need, sums and chunk scratch; from
  // the pool, the sums alone: each chunk allocates its own.)
  Workspace acc(p.exec.workspace != nullptr ? key_chunk_workspace(p, chunk) : acc_bytes, stream, p.exec);
  Exec sub = p.exec;
  if (sub.workspace != nullptr) {
    sub.workspace = static_cast<char*>(sub.workspace) + acc_bytes;
    sub.workspace_bytes -= acc_bytes;
  }
  KeyChunkMerge m{};
  m.out = p.out;
  m.lse = p.lse;
  m.heads_q = p.shape.heads_q;
  m.seq_q = p.shape.seq_q;
  m.head_dim = p.shape.head_dim;
  m.rows = p.shape.batch * p.shape.heads_q * p.shape.seq_q;
  m.acc = reinterpret_cast<double*>(acc.get());
  const int64_t chunks = (p.shape.seq_kv + chunk - 1) / chunk;
  for (int64_t c = 0; c < chunks; ++c) {
    ForwardParams pc = key_chunk_params(p, chunk, c);
    pc.exec = sub;
    forward_plan(pc, unwrap(select_forward(pc, device_caps(p.exec.device), overrides())));
    m.first = c == 0;
    m.last = c + 1 == chunks;
    launch_key_chunk_merge(m, stream);
  }
}

}  // namespace

void forward(const ForwardParams& p) {
  DeviceGuard guard(p.exec.device);
  const ForwardPlan plan = unwrap(select_forward(p, device_caps(p.exec.device), overrides()));
  if (plan.key_chunk > 0) return forward_chunked(p, plan.key_chunk);
  forward_plan(p, plan);
}

void backward(const BackwardParams& p) {
  DeviceGuard guard(p.exec.device);
  const BackwardPlan plan = backward_plan_for(p);
  auto stream = static_cast<cudaStream_t>(p.exec.stream);
  const Shape& s = p.shape;
  // Workspace (BackwardPlan::workspace): D [B*Hq*Sq] floats, then, 16-byte aligned, the float32 dQ
  // accumulator [B*Hq*Sq, DP] of the atomic design (zeroed on the stream) or the float32 sm_90a
  // backward's operand copies.
  Workspace ws(plan.workspace, stream, p.exec);
  const bool packed = p.packing.on();
  const size_t after_delta = delta_floats(s, p.packing);
  BwdArgs a{};
  a.p = p;
  // As the forward's (forward_plan); the passes over all packed rows read the device's verdict.
  std::optional<SeqCheck> check;
  if (plan.seq_check >= 0) {
    check.emplace(a.p.packing, s, reinterpret_cast<char*>(ws.get()) + plan.seq_check, stream);
    a.seq_ok = check->device_ok();
  }
  a.score = ScoreTransform::make(p.shape, p.num);
  a.vec16 = plan.vec16;
  a.big = plan.big;
  a.delta = ws.get();
  a.dq_accum = plan.atomic_dq() ? ws.get() + after_delta : nullptr;
  a.dq_accum_ld = plan.dp;  // (zeroed by the preprocess pass every atomic design runs first: no memset)
  a.copies = plan.kernel == BwdKernel::Sm90Wgmma32 ? ws.get() + after_delta : nullptr;
  a.sm90_variant = plan.sm90_variant;
  a.tf32_dkv_wgmma = plan.dkv_wgmma;
  a.f32_pair = plan.pair;
  a.persistent_cap = plan.persistent_cap;
  a.convert_ctas = plan.convert_ctas;
  a.seq_maps = plan.seq_maps >= 0 ? reinterpret_cast<char*>(ws.get()) + plan.seq_maps : nullptr;
  a.dq_locks = plan.dq_locks >= 0 ? reinterpret_cast<int*>(reinterpret_cast<char*>(ws.get()) + plan.dq_locks) : nullptr;
  a.dq_rotate = plan.dq_rotate;
  a.dkv_acc = plan.dkv_acc >= 0 ? reinterpret_cast<float*>(reinterpret_cast<char*>(ws.get()) + plan.dkv_acc) : nullptr;
  a.dkv_acc_rows = plan.dkv_acc_rows;
  a.dkv_locks = plan.dkv_locks >= 0 ? reinterpret_cast<int*>(reinterpret_cast<char*>(ws.get()) + plan.dkv_locks) : nullptr;
  a.ws_sb = packed ? 0 : s.heads_q * s.seq_q;
  a.ws_sh = packed ? p.packing.total_q : s.seq_q;
  // The row passes (D, dQ conversion) see a packed batch as one sequence of total_q rows: its
  // views have batch stride 0 and the workspaces are [Hq, total_q].
  BwdArgs rows_args = a;
  if (packed) {
    rows_args.p.shape.batch = 1;
    rows_args.p.shape.seq_q = p.packing.total_q;
    // Keys past seqused_k are attended by no query: dK = dV = 0 there.
    if (p.packing.used_k != nullptr) launch_zero_unused_keys(a, stream);
  }
  // The counters (BackwardPlan::dq_lock_count from the first: the dQ turns' and the head split's,
  // or the head split's alone in the default design).
  if (int* first = a.dq_locks != nullptr ? a.dq_locks : a.dkv_locks)
    FLASHATTN_CUDA_CHECK(cudaMemsetAsync(first, 0, static_cast<size_t>(plan.dq_lock_count) * sizeof(int), stream));
  [&] {  // (the launches; a case returns when its kernels are queued)
    switch (plan.kernel) {
      case BwdKernel::Sm80Mma32Split:
        launch_preprocess(rows_args, stream);
        return dispatch_dim<kHeadDims>(plan.dp, [&](auto dp) {
          dispatch_math(plan.math, [&](auto m) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_dq<decltype(dp)::value, decltype(m)::value, decltype(xf)::value>(a, stream);
              launch_dkv<decltype(dp)::value, decltype(m)::value, decltype(xf)::value>(a, stream);
            });
          });
        });
      case BwdKernel::Sm80Mma16Split:
        launch_preprocess(rows_args, stream);
        return dispatch_dim<kHeadDims16>(plan.dp, [&](auto dp) {
          dispatch_half(plan.h, [&](auto h) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_dq16<decltype(dp)::value, decltype(h)::value, decltype(xf)::value>(a, stream);
              launch_dkv16<decltype(dp)::value, decltype(h)::value, false, decltype(xf)::value>(a, stream);
            });
          });
        });
      case BwdKernel::Sm80Mma16Atomic:
        launch_preprocess(rows_args, stream);
        dispatch_dim<kHeadDims16>(plan.dp, [&](auto dp) {
          dispatch_half(plan.h, [&](auto h) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_dkv16<decltype(dp)::value, decltype(h)::value, true, decltype(xf)::value>(a, stream);
            });
          });
        });
        return launch_dq_convert(rows_args, plan.dp, stream);
      case BwdKernel::Sm90Wgmma16Atomic:
        launch_preprocess(rows_args, stream);
        dispatch_dim<kSm90Dkv16>(plan.dp, [&](auto dp) {
          dispatch_half(plan.h, [&](auto h) {
            dispatch_xf(plan.xf, [&](auto xf) {
              launch_dkv_sm90<decltype(dp)::value, decltype(h)::value, decltype(xf)::value>(a, stream);
            });
          });
        });
        return launch_dq_convert(rows_args, plan.dp, stream);
      case BwdKernel::Sm90Wgmma32:
        // (These launch the preprocess themselves, beside their operand copies.)
        if (plan.math == Math::Tf32x3)
          return dispatch_dim<kSm90X3Backward>(plan.dp, [&](auto dp) { launch_bwd_3xtf32_sm90<decltype(dp)::value>(a, stream); });
        return dispatch_dim<kSm90Tf32Backward>(plan.dp, [&](auto dp) { launch_bwd_tf32_sm90<decltype(dp)::value>(a, stream); });
    }
  }();
  if (check) check->finish();
}


// A KV-cache call whose index arrays failed the check on the stream: they are read back (an error
// path) for validation's own message; nothing was written.
[[noreturn]] void kv_index_error(const KvcacheParams& kp, cudaStream_t stream) {
  const KvCheck& f = kp.check;
  const int32_t device = kp.fwd.exec.device;
  auto read = [&](const int32_t* a) {  // ([B] int32 on the device)
    return a != nullptr ? read_index_rows(a, 1, 0, f.batch, device, stream) : std::vector<int32_t>();
  };
  const std::vector<int32_t> seqlens = read(f.cache_seqlens), start = read(f.start), batch_row = read(f.batch_row);
  std::vector<int32_t> table;
  if (f.table != nullptr) table = read_index_rows(f.table, f.batch, f.table_stride, f.max_blocks, device, stream);
  check_kv_index_values(f, kp.s_new, kp.k_new.ptr != nullptr, seqlens.data(), start.empty() ? nullptr : start.data(),
                        batch_row.empty() ? nullptr : batch_row.data(), table.empty() ? nullptr : table.data());
  throw Error(Status::InvalidArgument,
              "the KV-cache index arrays (cache_seqlens, cache_leftpad, cache_batch_idx, block_table) failed the "
              "check of their contents on the device but passed when read again: were they written during the "
              "call? Nothing was written.");
}

// A KV-cache call: the index arrays checked on the stream, or in the parameters, or copied to the
// device once; the append and rotated q, the attention over the caches, the merge of its splits.
void forward_kvcache(const KvcacheParams& kp) {
  const ForwardParams& p = kp.fwd;
  DeviceGuard guard(p.exec.device);
  const DeviceCaps caps = device_caps(p.exec.device);
  const KvcachePlan plan = unwrap(select_kvcache(kp, caps, overrides()));
  auto stream = static_cast<cudaStream_t>(p.exec.stream);
  const Shape& s = p.shape;
  const KvMap& m = p.kv;
  const bool check = kp.check.on;
  // The host's index arrays (validation read them), for the kernels' parameters or one copy.
  std::vector<int32_t> idx;
  size_t at_sk = 0, at_first = 0, at_pos = 0, at_row = 0, at_start = 0, at_table = 0;
  if (!check) {
    idx.reserve(plan.idx_ints);
    auto put = [&](const int32_t* a, int64_t n) -> size_t {
      const size_t at = idx.size();
      idx.insert(idx.end(), a, a + n);
      return at;
    };
    at_sk = put(m.seqlen_k, s.batch), at_first = put(kp.first_new, s.batch), at_pos = put(kp.pos0, s.batch);
    at_row = m.batch_row ? put(m.batch_row, s.batch) : 0, at_start = m.start ? put(m.start, s.batch) : 0;
    at_table = m.block_table ? put(m.block_table, s.batch * m.bt_stride) : 0;
  }
  Workspace ws(plan.workspace, stream, p.exec);
  char* base = reinterpret_cast<char*>(ws.get());
  KvMap dm = m;
  KvPrepArgs prep{};
  // KvCheck: the arrays checked on the stream first; the kernels read the derived arrays it writes
  // and its verdict, and the host waits for that verdict once they are all queued.
  std::optional<PendingVerdict> verdict;
  const int* ok = nullptr;
  if (check) {
    // (Under capture nothing waits for the verdict: a replay whose arrays break a rule writes
    // nothing and counts a failure, take_captured_failures.)
    auto* d = reinterpret_cast<int32_t*>(base + plan.check);
    launch_with_verdict(verdict, stream, [&](volatile int* host) {
      launch_kv_check(KvCheckJob{kp.check, kp.s_new, kp.k_new.ptr != nullptr, d, host}, stream);
    });
    dm.seqlen_k = d;
    prep.first_new = d + s.batch;
    prep.pos0 = d + 2 * s.batch;
    ok = d + 3 * s.batch;
    prep.ok = ok;
  } else if (plan.idx_inline) {  // in the kernels' parameters: nothing to copy
    KvIndex& x = prep.idx;
    x.n = static_cast<int32_t>(idx.size());
    std::copy(idx.begin(), idx.end(), x.v);
    x.at_sk = static_cast<int32_t>(at_sk);
    x.at_first = static_cast<int32_t>(at_first);
    x.at_pos = static_cast<int32_t>(at_pos);
    x.at_row = m.batch_row ? static_cast<int32_t>(at_row) : -1;
    x.at_start = m.start ? static_cast<int32_t>(at_start) : -1;
  } else {
    // A graph would replay this copy from host memory the call frees on return: refused, before
    // anything is written. (Calls whose arrays fit the parameters are captured with their values.)
    if (capturing(stream))
      throw Error(Status::Unsupported,
                  "the stream is being captured into a CUDA graph, and this KV-cache call's index arrays (" +
                      std::to_string(idx.size()) + " entries" + (m.block_table ? ", with a block table" : "") +
                      ") are copied to the device from host memory that the call frees; capture calls without a "
                      "block table and with at most " + std::to_string(kKvIndexMax) +
                      " index entries (3 per sequence, 5 with cache_batch_idx and cache_leftpad), or make this call "
                      "outside the capture");
    auto* dev_idx = reinterpret_cast<int32_t*>(base);
    FLASHATTN_CUDA_CHECK(
        cudaMemcpyAsync(dev_idx, idx.data(), idx.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    dm.seqlen_k = dev_idx + at_sk;
    dm.batch_row = m.batch_row ? dev_idx + at_row : nullptr;
    dm.start = m.start ? dev_idx + at_start : nullptr;
    dm.block_table = m.block_table ? dev_idx + at_table : nullptr;
    prep.first_new = dev_idx + at_first;
    prep.pos0 = dev_idx + at_pos;
  }

  prep.kp = kp;
  prep.kv = dm;
  prep.q_rot = plan.q_rot >= 0 ? reinterpret_cast<uint16_t*>(base + plan.q_rot) : nullptr;
  prep.q_rot_ld = plan.q_rot_ld;
  prep.pdl = check && caps.cc_major >= 9;
  const bool prepared = launch_kv_prepare(prep, stream);

  DecodeArgs a{};
  a.p = p;
  a.p.kv = dm;
  if (prep.q_rot != nullptr)
    a.p.q = In4{prep.q_rot, s.heads_q * s.seq_q * plan.q_rot_ld, s.seq_q * plan.q_rot_ld, plan.q_rot_ld};
  a.score = ScoreTransform::make(s, p.num);
  a.vec16 = plan.vec16;
  a.loader = plan.loader;
  a.stages = plan.stages;
  a.splits = plan.splits;
  a.o_part = plan.o_part >= 0 ? reinterpret_cast<float*>(base + plan.o_part) : nullptr;
  a.lse_part = plan.lse_part >= 0 ? reinterpret_cast<float*>(base + plan.lse_part) : nullptr;
  a.part_rows = s.batch * s.heads_q * s.seq_q;
  a.dp = plan.dp;
  a.idx = prep.idx;
  a.pdl = caps.cc_major >= 9;
  a.after_own = prepared || check;
  a.ok = ok;
  // (Grid x is at most 2^31 - 1 (select_kvcache), and so are the splits and head counts.)
  a.hkv_div = dev::U32Div::make(static_cast<uint32_t>(s.heads_kv));
  a.split_div = dev::U32Div::make(static_cast<uint32_t>(plan.splits));
  a.g_div = dev::U32Div::make(static_cast<uint32_t>(s.group()));
  a.sq_div = dev::U32Div::make(static_cast<uint32_t>(std::max<int64_t>(1, std::min<int64_t>(s.seq_q, 0x7fffffff))));
  a.hq_div = dev::U32Div::make(static_cast<uint32_t>(s.heads_q));
  a.rows32 = s.seq_q * s.heads_q < 0x7fffffff;
  dispatch_dim<kDecodeHeadDims16>(plan.dp, [&](auto dp) {
    dispatch_half(plan.h, [&](auto h) {
      dispatch_xf(plan.xf, [&](auto xf) {
        if (plan.kw == 4)
          launch_decode16<decltype(dp)::value, decltype(h)::value, decltype(xf)::value, 4>(a, stream);
        else
          launch_decode16<decltype(dp)::value, decltype(h)::value, decltype(xf)::value, 1>(a, stream);
      });
    });
  });
  if (plan.splits > 1) launch_kv_combine(a, stream);
  if (verdict) {
    const int v = verdict->wait();
    if (v == 1) return;
    if (v != 2)
      throw Error(Status::Backend, "the check of the KV-cache index arrays completed without a verdict (" +
                                       std::to_string(v) + ")");
    kv_index_error(kp, stream);
  }
}

uint64_t forward_workspace(const ForwardParams& p) {
  DeviceGuard guard(p.exec.device);
  const ForwardPlan plan = unwrap(select_forward(p, device_caps(p.exec.device), overrides()));
  return plan.key_chunk > 0 ? key_chunk_workspace(p, plan.key_chunk) : plan.workspace;
}
uint64_t backward_workspace(const BackwardParams& p) {
  DeviceGuard guard(p.exec.device);
  return backward_plan_for(p).workspace;
}
uint64_t kvcache_workspace(const KvcacheParams& p) {
  DeviceGuard guard(p.fwd.exec.device);
  return unwrap(select_kvcache(p, device_caps(p.fwd.exec.device))).workspace;
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
  os << "; float32 (precision fp32: 3xTF32 tensor cores, tf32, FMA before sm_80) and float16/bfloat16 "
        "(sm_80+) kernels; on sm_90 the wgmma + TMA kernels (16-bit forward and atomic-dQ backward at "
        "D = 64/128/256, float32 forward and backward at D = 64/128); deterministic = 1 takes the split "
        "backward; softcap / ALiBi on the mma.sync kernels and the 16-bit sm_90 kernels (float32 on "
        "mma.sync only); packed variable-length batches on the mma.sync kernels and the 16-bit sm_90 kernels "
        "(per-sequence tensor maps; float32 on mma.sync only); KV-cache attention (append, rotary, paged "
        "caches, split-KV) in float16/bfloat16";
  if (overrides_enabled()) os << "; kernel-selection overrides FLASHATTN_CUDA_* enabled (developer build)";
  return os.str();
}

}  // namespace flashattn::cuda
