// flashattn's eager PyTorch path in C++: the ops flashattn_eager::fwd (FlashAttention's
// [B, S, H, D] layout with bshd = true, else [B, H, S, D]) whose Autograd kernel is a C++
// torch::autograd::Function calling the library directly, forward and backward.
//
// Why: a Python autograd node, the DLPack capsules and the Python glue around the two library
// calls cost a forward+backward 2.2x SDPA's host time at tiny shapes (bench/host_overhead.py,
// docs/PERF.md), while the library's own C++ path is 29 us of it (bench/host_calls.cpp). Here the
// node, the output allocations, the stream lookup and the scratch from torch's caching allocator
// are C++ as in PyTorch's own operators.
//
// Only the eager path: under torch.compile flashattn.torch keeps its Python custom ops
// (flashattn::fwd / bshd_fwd, with fake implementations), which this library does not replace.
// Built against one PyTorch version (the C++ ABI of libtorch is not stable across versions):
// flashattn.torch loads it only when the version recorded beside it is the running torch's,
// and falls back to the Python path otherwise (python/flashattn/torch.py, _load_eager_ops).
//
// Nothing framework-specific reaches the library: tensors become flashattn::Tensor views, errors
// come back as the same Python exception types as the extension's (ValueError, TypeError for
// dtypes, NotImplementedError for what this build cannot serve).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flashattn/flashattn.hpp"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The scalar options, in the ops' order (flashattn.torch._codes), plus the layout and where the
// CUDA scratch comes from.
struct Opts {
  double scale = 0.0;
  int64_t mask = 0, precision = 0, num_threads = 0;
  bool deterministic = false;
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  bool bshd = false;          // [B, S, H, D] tensors (dims 1 and 2 swapped in the views)
  bool torch_scratch = true;  // CUDA scratch from torch's caching allocator

  std::vector<int64_t> ints() const {
    return {mask, precision, num_threads, deterministic, window_left, window_right, bshd, torch_scratch};
  }
  static Opts from(double scale, double softcap, const std::vector<int64_t>& i) {
    Opts o;
    o.scale = scale;
    o.softcap = softcap;
    o.mask = i[0];
    o.precision = i[1];
    o.num_threads = i[2];
    o.deterministic = i[3] != 0;
    o.window_left = i[4];
    o.window_right = i[5];
    o.bshd = i[6] != 0;
    o.torch_scratch = i[7] != 0;
    return o;
  }
};

// flashattn::Error -> the extension's Python exception types (python/src/flashattn_ext.cpp,
// raise_status): torch turns c10::ValueError / TypeError / NotImplementedError into those.
template <class F>
void library_call(F&& f) {
  try {
    f();
  } catch (const flashattn::Error& e) {
    const std::string msg = e.what();
    switch (e.status()) {
      case flashattn::Status::InvalidArgument:
        if (msg.find(".dtype") != std::string::npos) TORCH_CHECK_TYPE(false, msg);
        TORCH_CHECK_VALUE(false, msg);
      case flashattn::Status::Unsupported:
        TORCH_CHECK_NOT_IMPLEMENTED(false, msg);
      case flashattn::Status::OutOfMemory:
        TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
      default:
        TORCH_CHECK(false, flashattn_status_string(static_cast<int>(e.status())), ": ", msg);
    }
  }
}

flashattn::DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return flashattn::DType::Float32;
    case at::kHalf: return flashattn::DType::Float16;
    case at::kBFloat16: return flashattn::DType::BFloat16;
    case at::kDouble: return flashattn::DType::Float64;
    case at::kInt: return flashattn::DType::Int32;
    default: TORCH_CHECK_TYPE(false, name, ".dtype = ", t.scalar_type(), ": flashattn takes float32, float16, bfloat16 or float64");
  }
}

// A tensor as the library's view; bshd: a 4-d [B, S, H, D] tensor read as [B, H, S, D].
flashattn::Tensor view_of(const at::Tensor& t, const char* name, bool bshd) {
  TORCH_CHECK_VALUE(t.defined(), name, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.dim() >= 1 && t.dim() <= 4, name, " has ", t.dim(), " dims; flashattn takes 1 to 4");
  flashattn::Tensor v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, name);
  if (t.is_cuda()) {
    v.device = t.get_device();
  } else {
    TORCH_CHECK_VALUE(t.is_cpu(), name, " is on ", t.device(), "; flashattn supports CPU and CUDA memory");
    v.device = flashattn::kCpu;
  }
  v.ndim = static_cast<int32_t>(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  if (bshd && v.ndim == 4) {
    std::swap(v.shape[1], v.shape[2]);
    std::swap(v.stride[1], v.stride[2]);
  }
  return v;
}

// The library reads any strides but needs a unit head-dim stride; autograd hands out gradients
// such as expanded scalars whose last stride is 0.
at::Tensor unit_last(const at::Tensor& t) { return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous(); }

float to_float32(double value, const char* name, const char* zero_means) {
  const float f = static_cast<float>(value);
  TORCH_CHECK_VALUE(value == 0.0 || f != 0.0f, name, " = ", value, " underflows to 0 in float32 (0 means ", zero_means,
                    ")");
  return f;
}

// The caller's current CUDA stream, through c10's device-guard interface (no link to c10_cuda, so
// the same build serves CPU-only and CUDA PyTorch).
void* current_stream(const at::Tensor& q) {
  if (!q.is_cuda()) return nullptr;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(q.device()).native_handle();
}

flashattn::Options options_of(const Opts& o, const at::Tensor& q, const flashattn::Tensor* slopes) {
  flashattn::Options x;
  x.softmax_scale = to_float32(o.scale, "softmax_scale", "1/sqrt(head_dim)");
  x.mask = static_cast<flashattn::Mask>(o.mask);
  x.precision = static_cast<flashattn::Precision>(o.precision);
  // On the CPU, torch's own thread setting unless told otherwise (as the Python path does).
  x.num_threads = static_cast<int32_t>(o.num_threads == 0 && !q.is_cuda() ? at::get_num_threads() : o.num_threads);
  x.deterministic = o.deterministic;
  x.window_left = o.window_left;
  x.window_right = o.window_right;
  x.softcap = to_float32(o.softcap, "softcap", "no softcap");
  x.alibi_slopes = slopes;
  x.stream = current_stream(q);
  return x;
}

// CUDA scratch sizes by call signature (the size depends on shapes, strides, alignment, dtype and
// options, never on data): the library's query (validation and planning, ~4 us) once per
// signature. Bounded: cleared past 4096 entries.
std::mutex g_sizes_mutex;
std::map<std::vector<int64_t>, uint64_t> g_sizes;

void add_key(std::vector<int64_t>& key, const flashattn::Tensor& t) {
  key.push_back(static_cast<int64_t>(t.dtype));
  key.push_back(t.device);
  key.push_back(t.ndim);
  for (int i = 0; i < t.ndim; ++i) {
    key.push_back(t.shape[i]);
    key.push_back(t.stride[i]);
  }
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data) % 256));
}

// Runs call(options) with the CUDA scratch from torch's caching allocator (so torch.cuda's memory
// statistics and limits see it), freed back to the cache in stream order after the call.
template <class Call>
void with_scratch(int kind, const Opts& o, const at::Tensor& q, flashattn::Options x,
                  std::initializer_list<const flashattn::Tensor*> views, Call&& call) {
  if (!q.is_cuda() || !o.torch_scratch) return library_call([&] { call(x); });
  std::vector<int64_t> key{kind, o.mask, o.precision, o.deterministic, o.window_left, o.window_right,
                           static_cast<int64_t>(x.softcap != 0.0f)};
  for (const flashattn::Tensor* v : views)
    if (v != nullptr) add_key(key, *v);
  uint64_t need = 0;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    auto it = g_sizes.find(key);
    if (it != g_sizes.end()) {
      need = it->second;
      known = true;
    }
  }
  if (!known) {
    flashattn::Options qx = x;
    qx.workspace_query = &need;
    library_call([&] { call(qx); });
    std::lock_guard<std::mutex> lock(g_sizes_mutex);
    if (g_sizes.size() > 4096) g_sizes.clear();
    g_sizes[key] = need;
  }
  if (need == 0) return library_call([&] { call(x); });
  // 256 bytes more to align the start (the library takes 256-byte aligned scratch).
  at::Tensor buf = at::empty({static_cast<int64_t>(need + 255)}, q.options().dtype(at::kByte));
  const auto base = reinterpret_cast<uintptr_t>(buf.data_ptr());
  x.workspace = reinterpret_cast<void*>((base + 255) / 256 * 256);
  x.workspace_bytes = need;
  library_call([&] { call(x); });
}

std::pair<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                               const std::optional<at::Tensor>& slopes, const Opts& o) {
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_);
  c10::OptionalDeviceGuard guard(q.is_cuda() ? std::optional<c10::Device>(q.device()) : std::nullopt);
  TORCH_CHECK_VALUE(q.dim() == 4, "q has ", q.dim(), " dims; expected 4 (", o.bshd ? "[B, S, H, D]" : "[B, H, S, D]",
                    ")");
  // out as the Python path makes it: [B, S, H, D] contiguous, or like q (its strides kept).
  const at::Tensor out = o.bshd ? at::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, q.options())
                                : at::empty_like(q);
  const int64_t h = o.bshd ? q.size(2) : q.size(1), s = o.bshd ? q.size(1) : q.size(2);
  const at::Tensor lse = at::empty({q.size(0), h, s}, q.options().dtype(at::kFloat));
  const flashattn::Tensor tq = view_of(q, "q", o.bshd), tk = view_of(k, "k", o.bshd), tv = view_of(v, "v", o.bshd),
                          to = view_of(out, "out", o.bshd), tl = view_of(lse, "lse", false);
  std::optional<flashattn::Tensor> ts;
  if (slopes.has_value() && slopes->defined()) ts = view_of(*slopes, "alibi_slopes", false);
  const flashattn::Options x = options_of(o, q, ts ? &*ts : nullptr);
  with_scratch(0, o, q, x, {&tq, &tk, &tv, &to, &tl, ts ? &*ts : nullptr},
               [&](const flashattn::Options& y) { flashattn::forward(tq, tk, tv, to, tl, y); });
  return {out, lse};
}

variable_list backward_impl(const at::Tensor& dout_, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& slopes,
                            const Opts& o) {
  const at::Tensor dout = unit_last(dout_);
  c10::OptionalDeviceGuard guard(q.is_cuda() ? std::optional<c10::Device>(q.device()) : std::nullopt);
  const at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const flashattn::Tensor tdo = view_of(dout, "dout", o.bshd), tq = view_of(q, "q", o.bshd), tk = view_of(k, "k", o.bshd),
                          tv = view_of(v, "v", o.bshd), to = view_of(out, "out", o.bshd),
                          tl = view_of(lse, "lse", false), tdq = view_of(dq, "dq", o.bshd),
                          tdk = view_of(dk, "dk", o.bshd), tdv = view_of(dv, "dv", o.bshd);
  std::optional<flashattn::Tensor> ts;
  if (slopes.has_value() && slopes->defined()) ts = view_of(*slopes, "alibi_slopes", false);
  const flashattn::Options x = options_of(o, q, ts ? &*ts : nullptr);
  with_scratch(1, o, q, x, {&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, ts ? &*ts : nullptr},
               [&](const flashattn::Options& y) { flashattn::backward(tq, tk, tv, to, tdo, tl, tdq, tdk, tdv, y); });
  return {dq, dk, dv};
}

// The autograd node: saves q, k, v, (out, lse) and the slopes; lse gets no gradient (as in
// FlashAttention), and no zero tensor is made for it (set_materialize_grads(false)).
struct Attention : public torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const std::optional<at::Tensor>& slopes, const Opts& o) {
    auto [out, lse] = forward_impl(q, k, v, slopes, o);
    ctx->save_for_backward({q, k, v, out, lse, slopes.value_or(at::Tensor())});
    ctx->saved_data["f"] = c10::List<double>({o.scale, o.softcap});
    ctx->saved_data["i"] = o.ints();
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    return {out, lse};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    if (!grads[0].defined())  // out unused by the loss: nothing flows back
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const c10::List<double> f = ctx->saved_data["f"].toDoubleList();
    const Opts o = Opts::from(f.get(0), f.get(1), ctx->saved_data["i"].toIntVector());
    const std::optional<at::Tensor> slopes = s[5].defined() ? std::optional<at::Tensor>(s[5]) : std::nullopt;
    variable_list g = backward_impl(grads[0], s[0], s[1], s[2], s[3], s[4], slopes, o);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor()};
  }
};

Opts opts(double scale, int64_t mask, int64_t precision, int64_t num_threads, bool deterministic, int64_t window_left,
          int64_t window_right, double softcap, bool bshd, bool torch_scratch) {
  Opts o;
  o.scale = scale;
  o.mask = mask;
  o.precision = precision;
  o.num_threads = num_threads;
  o.deterministic = deterministic;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = softcap;
  o.bshd = bshd;
  o.torch_scratch = torch_scratch;
  return o;
}

// With autograd (grad mode on, some input requiring grad: a node is recorded).
std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                double scale, int64_t mask, int64_t precision, int64_t num_threads,
                                                bool deterministic, int64_t window_left, int64_t window_right,
                                                double softcap, const std::optional<at::Tensor>& slopes, bool bshd,
                                                bool torch_scratch) {
  const variable_list r = Attention::apply(q, k, v, slopes, opts(scale, mask, precision, num_threads, deterministic,
                                                                 window_left, window_right, softcap, bshd, torch_scratch));
  return {r[0], r[1]};
}

// Without (inference mode, or below the Autograd key).
std::tuple<at::Tensor, at::Tensor> fwd_plain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                             int64_t mask, int64_t precision, int64_t num_threads, bool deterministic,
                                             int64_t window_left, int64_t window_right, double softcap,
                                             const std::optional<at::Tensor>& slopes, bool bshd, bool torch_scratch) {
  auto [out, lse] = forward_impl(q, k, v, slopes, opts(scale, mask, precision, num_threads, deterministic, window_left,
                                                       window_right, softcap, bshd, torch_scratch));
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(flashattn_eager, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, int mask, int precision, int num_threads, "
      "bool deterministic, int window_left, int window_right, float softcap, Tensor? alibi_slopes, bool bshd, "
      "bool torch_scratch) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flashattn_eager, Autograd, m) { m.impl("fwd", &fwd_autograd); }
TORCH_LIBRARY_IMPL(flashattn_eager, CPU, m) { m.impl("fwd", &fwd_plain); }
TORCH_LIBRARY_IMPL(flashattn_eager, CUDA, m) { m.impl("fwd", &fwd_plain); }
