// flashattn's eager PyTorch path in C++: the ops flashattn_eager::fwd (FlashAttention's
// [B, S, H, D] layout with bshd = true, else [B, H, S, D]), qkvpacked_fwd, kvpacked_fwd
// (flash_attn's packed layouts, gradients into one packed buffer) and varlen_fwd (packed
// variable-length batches), whose Autograd kernel is one C++ torch::autograd::Function calling
// the library directly, forward and backward.
//
// Why: a Python autograd node, the DLPack capsules and the Python glue around the two library
// calls cost a forward+backward 2.2x SDPA's host time at tiny shapes (bench/host_overhead.py,
// docs/PERF.md), while the library's own C++ path is 29 us of it (bench/host_calls.cpp). Here the
// node, the output allocations, the stream lookup and the scratch from torch's caching allocator
// are C++ as in PyTorch's own operators.
//
// Only the eager path: under torch.compile flashattn.torch keeps its Python custom ops
// (flashattn::fwd, bshd_fwd, ..., with fake implementations), which this library does not replace.
// Built against one PyTorch version (the C++ ABI of libtorch is not stable across versions):
// flashattn.torch loads it only when the version recorded beside it is the running torch's,
// and falls back to the Python path otherwise (python/flashattn/torch.py, _load_eager_ops).
//
// Nothing framework-specific reaches the library: tensors become flashattn::Tensor views, errors
// come back as the same Python exception types as the extension's (ValueError, TypeError for
// dtypes, NotImplementedError for what this build cannot serve), except that a failed scratch
// allocation is torch.OutOfMemoryError (a RuntimeError, as torch's own allocations raise) where
// the extension raises MemoryError.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch/version.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "torch_ops.hpp"

namespace {

using namespace flashattn_torch;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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

// What a tensor argument may be, for the checks made before the library sees it (the messages
// are the extension's, python/src/flashattn_ext.cpp: convert): data tensors take flashattn's
// dtypes and up to 4 dims, the sequence arrays int32 with 1, the ALiBi slopes 1 or 2.
enum class Role { Data, Index, Slopes };

// "int64", "bfloat16", ...: the dtype as the extension names it (DLPack's spelling).
std::string dtype_name(at::ScalarType t) {
  if (t == at::kBool) return "bool";
  const char* base = c10::isComplexType(t)               ? "complex"
                     : t == at::kBFloat16                ? "bfloat"
                     : c10::isFloatingType(t)            ? "float"
                     : t == at::kByte                    ? "uint"
                                                          : "int";
  return base + std::to_string(c10::elementSize(t) * 8);
}

flashattn::DType dtype_of(const at::Tensor& t, const char* name, Role role) {
  switch (t.scalar_type()) {
    case at::kFloat: if (role != Role::Index) return flashattn::DType::Float32; break;
    case at::kHalf: if (role != Role::Index) return flashattn::DType::Float16; break;
    case at::kBFloat16: if (role != Role::Index) return flashattn::DType::BFloat16; break;
    case at::kDouble: if (role != Role::Index) return flashattn::DType::Float64; break;
    case at::kInt: if (role == Role::Index) return flashattn::DType::Int32; break;
    default: break;
  }
  TORCH_CHECK_TYPE(false, name, ".dtype = ", dtype_name(t.scalar_type()),
                   role == Role::Index    ? ", expected int32"
                   : role == Role::Slopes ? ", expected float32"
                                          : " is not supported (flashattn takes float32, float16, bfloat16, and "
                                            "float64 on the CPU)");
}

// dtype, device and data of a tensor's view.
flashattn::Tensor base_view(const at::Tensor& t, const char* name, Role role = Role::Data) {
  TORCH_CHECK_VALUE(t.defined(), name, " is an undefined tensor");
  flashattn::Tensor v;
  v.data = t.data_ptr();
  v.dtype = dtype_of(t, name, role);
  if (t.is_cuda()) {
    v.device = t.get_device();
  } else {
    TORCH_CHECK_VALUE(t.is_cpu(), name, " is on ", t.device(), "; flashattn supports CPU and CUDA memory");
    v.device = flashattn::kCpu;
  }
  return v;
}

// A tensor as the library's view; bshd: a 4-d [B, S, H, D] tensor read as [B, H, S, D].
flashattn::Tensor view_of(const at::Tensor& t, const char* name, bool bshd, Role role = Role::Data) {
  flashattn::Tensor v = base_view(t, name, role);
  const int64_t lo = role == Role::Data ? 0 : 1, hi = role == Role::Data ? 4 : role == Role::Index ? 1 : 2;
  TORCH_CHECK_VALUE(t.dim() >= lo && t.dim() <= hi, name, ".ndim = ", t.dim(), ", expected ",
                    role == Role::Index    ? "1"
                    : role == Role::Slopes ? "1 ([Hq]) or 2 ([B, Hq])"
                    : std::string(name) == "lse" ? "3"
                                                 : "4");
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

// Slice i of a packed [B, S, n, H, D] tensor (qkv, kv or their gradients) as the library's
// [B, H, S, D] view: the flash_attn functions' layouts (checked 5-d by their Python side).
flashattn::Tensor slice_of(const at::Tensor& t, int64_t i, const char* name) {
  flashattn::Tensor v = base_view(t, name);
  TORCH_CHECK_VALUE(t.dim() == 5 && i < t.size(2), name, " has shape ", t.sizes(), "; expected [B, S, n, H, D] with n > ",
                    i);
  v.data = static_cast<char*>(t.data_ptr()) + i * t.stride(2) * static_cast<int64_t>(t.element_size());
  v.ndim = 4;
  const int dims[4] = {0, 3, 1, 4};
  for (int j = 0; j < 4; ++j) {
    v.shape[j] = t.size(dims[j]);
    v.stride[j] = t.stride(dims[j]);
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
// signature. Bounded: cleared past 4096 entries. Each thread first compares with its last
// signature (a training loop repeats a few), without the lock and the map's walk.
std::mutex g_sizes_mutex;
std::map<std::vector<int64_t>, uint64_t> g_sizes;
struct LastSize {
  int kind = -1;
  std::vector<int64_t> key;
  uint64_t need = 0;
};
thread_local LastSize t_last[2];  // forward / backward kinds alternate in a training step

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
  std::vector<int64_t> key;
  key.reserve(160);  // (up to 8 tensors of 4 dims: 9 + 8 x 12)
  key.insert(key.end(), {kind, o.mask, o.precision, o.deterministic, o.window_left, o.window_right, o.max_q,
                         o.max_k, static_cast<int64_t>(x.softcap != 0.0f)});
  for (const flashattn::Tensor* v : views) {
    if (v != nullptr)
      add_key(key, *v);
    else
      key.push_back(-1);
  }
  uint64_t need = 0;
  bool known = false;
  LastSize& last = t_last[kind % 2];
  if (last.kind == kind && last.key == key) {
    need = last.need;
    known = true;
  } else {
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
  if (last.kind != kind || last.key != key) {
    last.kind = kind;
    last.key = key;
    last.need = need;
  }
  if (need == 0) return library_call([&] { call(x); });
  // 256 bytes more to align the start (the library takes 256-byte aligned scratch).
  at::Tensor buf = at::empty({static_cast<int64_t>(need + 255)}, q.options().dtype(at::kByte));
  const auto base = reinterpret_cast<uintptr_t>(buf.data_ptr());
  x.workspace = reinterpret_cast<void*>((base + 255) / 256 * 256);
  x.workspace_bytes = need;
  library_call([&] { call(x); });
}

// Their q, k, v views as the library's [B, H, S, D] (varlen: [total, H, D] as they are); the same
// for the gradients, which are laid out as the inputs (one packed buffer for a packed input).
std::array<flashattn::Tensor, 3> qkv_views(const Operands& in, const Opts& o, const char* const names[3]) {
  switch (o.pack) {
    case kQkv: return {slice_of(in.a, 0, names[0]), slice_of(in.a, 1, names[1]), slice_of(in.a, 2, names[2])};
    case kKv: return {view_of(in.a, names[0], true), slice_of(in.b, 0, names[1]), slice_of(in.b, 1, names[2])};
    default:
      return {view_of(in.a, names[0], o.bshd), view_of(in.b, names[1], o.bshd), view_of(in.c, names[2], o.bshd)};
  }
}

Operands unit_last(const Operands& in) {
  Operands r;
  for (auto [from, to] : {std::pair{&in.a, &r.a}, std::pair{&in.b, &r.b}, std::pair{&in.c, &r.c}})
    if (from->defined()) *to = unit_last(*from);
  return r;
}

Operands empty_like(const Operands& in) {
  Operands r;
  for (auto [from, to] : {std::pair{&in.a, &r.a}, std::pair{&in.b, &r.b}, std::pair{&in.c, &r.c}})
    if (from->defined()) *to = at::empty_like(*from);
  return r;
}

// Their views and the library's Varlen over them.
struct Seqs {
  flashattn::Tensor cu_q, cu_k, used_k;
  flashattn::Varlen v;
  Seqs(const SeqTensors& t, const Opts& o)
      : cu_q(view_of(t.cu_q, "cu_seqlens_q", false, Role::Index)),
        cu_k(view_of(t.cu_k, "cu_seqlens_k", false, Role::Index)) {
    v.cu_seqlens_q = &cu_q;
    v.cu_seqlens_k = &cu_k;
    if (t.used_k.defined()) {
      used_k = view_of(t.used_k, "seqused_k", false, Role::Index);
      v.seqused_k = &used_k;
    }
    v.max_seqlen_q = o.max_q;
    v.max_seqlen_k = o.max_k;
  }
  Seqs(const Seqs&) = delete;  // (v points at the members)
  Seqs& operator=(const Seqs&) = delete;
  const flashattn::Tensor* used() const { return v.seqused_k; }
};

// The ALiBi slopes' view, when given (get(): nullptr without them).
struct SlopesView {
  std::optional<flashattn::Tensor> view;
  explicit SlopesView(const at::Tensor& t) {
    if (t.defined()) view = view_of(t, "alibi_slopes", false, Role::Slopes);
  }
  const flashattn::Tensor* get() const { return view ? &*view : nullptr; }
};

const char* const kIn[3] = {"q", "k", "v"};
const char* const kGrad[3] = {"dq", "dk", "dv"};

// Whether out / dout are FlashAttention's [B, S, H, D] (read with two dims swapped).
bool rows_bshd(const Opts& o) { return o.bshd || o.pack != kSeparate; }

std::pair<at::Tensor, at::Tensor> forward_impl(const Operands& in_, const SeqTensors& sq, const at::Tensor& slopes,
                                               const Opts& o) {
  const Operands in = unit_last(in_);
  const at::Tensor& q0 = in.a;  // (qkv when packed)
  c10::OptionalDeviceGuard guard(q0.is_cuda() ? std::optional<c10::Device>(q0.device()) : std::nullopt);
  const std::array<flashattn::Tensor, 3> t = qkv_views(in, o, kIn);
  const flashattn::Tensor& tq = t[0];
  at::Tensor out, lse;
  if (o.varlen) {  // q [total_q, Hq, D]: out like it, lse [Hq, total_q]
    TORCH_CHECK_VALUE(q0.dim() == 3, "q has ", q0.dim(), " dims; expected 3 ([total_q, Hq, D])");
    out = at::empty_like(q0);
    lse = at::empty({q0.size(1), q0.size(0)}, q0.options().dtype(at::kFloat));
  } else {
    TORCH_CHECK_VALUE(tq.ndim == 4, "q has ", tq.ndim, " dims; expected 4 (", rows_bshd(o) ? "[B, S, H, D]" : "[B, H, S, D]",
                      ")");
    // out as the Python path makes it: [B, S, H, D] contiguous, or like q (its strides kept).
    out = rows_bshd(o) ? at::empty({tq.shape[0], tq.shape[2], tq.shape[1], tq.shape[3]}, q0.options())
                       : at::empty_like(q0);
    lse = at::empty({tq.shape[0], tq.shape[1], tq.shape[2]}, q0.options().dtype(at::kFloat));
  }
  const flashattn::Tensor to = view_of(out, "out", rows_bshd(o)), tl = view_of(lse, "lse", false);
  const SlopesView slope_view(slopes);
  const flashattn::Tensor* sl = slope_view.get();
  const flashattn::Options x = options_of(o, q0, sl);
  if (o.varlen) {
    const Seqs seqs(sq, o);
    with_scratch(2, o, q0, x, {&t[0], &t[1], &t[2], &to, &tl, &seqs.cu_q, &seqs.cu_k, seqs.used(), sl},
                 [&](const flashattn::Options& y) { flashattn::forward_varlen(t[0], t[1], t[2], to, tl, seqs.v, y); });
  } else {
    with_scratch(0, o, q0, x, {&t[0], &t[1], &t[2], &to, &tl, sl},
                 [&](const flashattn::Options& y) { flashattn::forward(t[0], t[1], t[2], to, tl, y); });
  }
  return {out, lse};
}

Operands backward_impl(const at::Tensor& dout_, const Operands& in_, const at::Tensor& out, const at::Tensor& lse,
                       const SeqTensors& sq, const at::Tensor& slopes, const Opts& o) {
  // (The node saves the inputs as given: a head dim of stride != 1 is made contiguous here again,
  // as in the forward; the gradients are laid out as those copies, as on the Python path.)
  const at::Tensor dout = unit_last(dout_);
  const Operands in = unit_last(in_);
  const at::Tensor& q0 = in.a;
  c10::OptionalDeviceGuard guard(q0.is_cuda() ? std::optional<c10::Device>(q0.device()) : std::nullopt);
  const Operands grads = empty_like(in);
  const std::array<flashattn::Tensor, 3> t = qkv_views(in, o, kIn), g = qkv_views(grads, o, kGrad);
  const flashattn::Tensor tdo = view_of(dout, "dout", rows_bshd(o)), to = view_of(out, "out", rows_bshd(o)),
                          tl = view_of(lse, "lse", false);
  const SlopesView slope_view(slopes);
  const flashattn::Tensor* sl = slope_view.get();
  const flashattn::Options x = options_of(o, q0, sl);
  if (o.varlen) {
    const Seqs seqs(sq, o);
    with_scratch(3, o, q0, x,
                 {&tdo, &t[0], &t[1], &t[2], &to, &tl, &g[0], &g[1], &g[2], &seqs.cu_q, &seqs.cu_k, seqs.used(), sl},
                 [&](const flashattn::Options& y) {
                   flashattn::backward_varlen(t[0], t[1], t[2], to, tdo, tl, g[0], g[1], g[2], seqs.v, y);
                 });
  } else {
    with_scratch(1, o, q0, x, {&tdo, &t[0], &t[1], &t[2], &to, &tl, &g[0], &g[1], &g[2], sl},
                 [&](const flashattn::Options& y) {
                   flashattn::backward(t[0], t[1], t[2], to, tdo, tl, g[0], g[1], g[2], y);
                 });
  }
  return grads;
}

// The autograd node of every op: saves the inputs, (out, lse), the slopes and the sequence arrays.
// Its one output is out: lse gets no gradient (as in FlashAttention) and is handed out through
// `lse_out`, so it is no output of the node at all (mark_non_differentiable would do the same for
// eager autograd, but compiled autograd refuses nodes that use it); no zero gradient is made for
// an unused out (set_materialize_grads(false)). Arguments: a, b, c, slopes, cu_seqlens_q,
// cu_seqlens_k, seqused_k (each nullopt where the call has none: autograd records input metadata
// of every tensor argument, and an undefined tensor has none), options, lse_out.
using Opt = std::optional<at::Tensor>;
Opt opt(const at::Tensor& t) { return t.defined() ? Opt(t) : std::nullopt; }

struct Attention : public torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const Opt& b, const Opt& c, const Opt& slopes,
                               const Opt& cu_q, const Opt& cu_k, const Opt& used_k, const Opts& o,
                               at::Tensor* lse_out) {
    const at::Tensor none;
    auto v = [&](const Opt& t) { return t.value_or(none); };
    auto [out, lse] = forward_impl({a, v(b), v(c)}, {v(cu_q), v(cu_k), v(used_k)}, v(slopes), o);
    ctx->save_for_backward({a, v(b), v(c), out, lse, v(slopes), v(cu_q), v(cu_k), v(used_k)});
    ctx->saved_data["f"] = c10::List<double>({o.scale, o.softcap});
    ctx->saved_data["i"] = o.ints();
    ctx->set_materialize_grads(false);
    *lse_out = lse;
    return {out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list g(9);  // one per forward argument; only a, b and c get gradients
    if (!grads[0].defined()) return g;  // out unused by the loss: nothing flows back
    const variable_list s = ctx->get_saved_variables();
    const c10::List<double> f = ctx->saved_data["f"].toDoubleList();
    const Opts o = Opts::from(f.get(0), f.get(1), ctx->saved_data["i"].toIntVector());
    const Operands d = backward_impl(grads[0], {s[0], s[1], s[2]}, s[3], s[4], {s[6], s[7], s[8]}, s[5], o);
    g[0] = d.a;
    g[1] = d.b;
    g[2] = d.c;
    return g;
  }
};

Opts opts(double scale, int64_t mask, int64_t precision, int64_t num_threads, bool deterministic, int64_t window_left,
          int64_t window_right, double softcap, bool torch_scratch) {
  // (The library takes int32 threads and refuses more than FLASHATTN_MAX_THREADS: refuse here what
  // a cast would wrap, with its message.)
  TORCH_CHECK_VALUE(num_threads <= FLASHATTN_MAX_THREADS, "options.num_threads = ", num_threads,
                    " is too large (at most ", FLASHATTN_MAX_THREADS,
                    ", FLASHATTN_MAX_THREADS; 0 means all hardware threads)");
  Opts o;
  o.scale = scale;
  o.mask = mask;
  o.precision = precision;
  o.num_threads = num_threads;
  o.deterministic = deterministic;
  o.window_left = window_left;
  o.window_right = window_right;
  o.softcap = softcap;
  o.torch_scratch = torch_scratch;
  return o;
}

using Result = std::tuple<at::Tensor, at::Tensor>;

// With autograd (Grad: the Autograd key, a node recorded when an input requires grad) or without
// (inference mode, or below the Autograd key).
template <bool Grad>
Result run(const Operands& in, const SeqTensors& sq, const std::optional<at::Tensor>& slopes, const Opts& o) {
  const at::Tensor sl = slopes.value_or(at::Tensor());
  if constexpr (Grad) {
    at::Tensor lse;
    const variable_list r =
        Attention::apply(in.a, opt(in.b), opt(in.c), opt(sl), opt(sq.cu_q), opt(sq.cu_k), opt(sq.used_k), o, &lse);
    return {r[0], lse};
  } else {
    auto [out, lse] = forward_impl(in, sq, sl, o);
    return {out, lse};
  }
}

// The ops: the tensors, then the options in flashattn.torch's op order, the slopes, the layout
// where it varies, and where the CUDA scratch comes from.
#define FLASHATTN_OPTION_PARAMS                                                                              \
  double scale, int64_t mask, int64_t precision, int64_t num_threads, bool deterministic, int64_t window_left, \
      int64_t window_right, double softcap, const std::optional<at::Tensor>&slopes
#define FLASHATTN_OPTION_ARGS scale, mask, precision, num_threads, deterministic, window_left, window_right, softcap

template <bool Grad>
Result fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, FLASHATTN_OPTION_PARAMS, bool bshd,
           bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.bshd = bshd;
  return run<Grad>({q, k, v}, {}, slopes, o);
}

template <bool Grad>
Result qkvpacked_fwd(const at::Tensor& qkv, FLASHATTN_OPTION_PARAMS, bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.pack = kQkv;
  return run<Grad>({qkv, {}, {}}, {}, slopes, o);
}

template <bool Grad>
Result kvpacked_fwd(const at::Tensor& q, const at::Tensor& kv, FLASHATTN_OPTION_PARAMS, bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.pack = kKv;
  return run<Grad>({q, kv, {}}, {}, slopes, o);
}

template <bool Grad>
Result varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                  const at::Tensor& cu_k, const std::optional<at::Tensor>& used_k, int64_t max_q, int64_t max_k,
                  FLASHATTN_OPTION_PARAMS, bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.varlen = true;
  o.max_q = max_q;
  o.max_k = max_k;
  return run<Grad>({q, k, v}, {cu_q, cu_k, used_k.value_or(at::Tensor())}, slopes, o);
}

// The backward ops (no autograd of their own, as flashattn.torch's Python ones): the custom ops
// flashattn::*_bwd run them under torch.compile where this library is loaded.
Operands bwd_call(const at::Tensor& dout, const Operands& in, const at::Tensor& out, const at::Tensor& lse,
                  const SeqTensors& sq, const std::optional<at::Tensor>& slopes, const Opts& o) {
  return backward_impl(dout, in, out, lse, sq, slopes.value_or(at::Tensor()), o);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                   FLASHATTN_OPTION_PARAMS, bool bshd, bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.bshd = bshd;
  const Operands g = bwd_call(dout, {q, k, v}, out, lse, {}, slopes, o);
  return {g.a, g.b, g.c};
}

at::Tensor qkvpacked_bwd(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& out, const at::Tensor& lse,
                         FLASHATTN_OPTION_PARAMS, bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.pack = kQkv;
  return bwd_call(dout, {qkv, {}, {}}, out, lse, {}, slopes, o).a;
}

std::tuple<at::Tensor, at::Tensor> kvpacked_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& kv,
                                                const at::Tensor& out, const at::Tensor& lse, FLASHATTN_OPTION_PARAMS,
                                                bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.pack = kKv;
  const Operands g = bwd_call(dout, {q, kv, {}}, out, lse, {}, slopes, o);
  return {g.a, g.b};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, const std::optional<at::Tensor>& used_k,
    int64_t max_q, int64_t max_k, FLASHATTN_OPTION_PARAMS, bool torch_scratch) {
  Opts o = opts(FLASHATTN_OPTION_ARGS, torch_scratch);
  o.varlen = true;
  o.max_q = max_q;
  o.max_k = max_k;
  const Operands g = bwd_call(dout, {q, k, v}, out, lse, {cu_q, cu_k, used_k.value_or(at::Tensor())}, slopes, o);
  return {g.a, g.b, g.c};
}

// Kernels of flashattn.torch's custom ops (flashattn::fwd, ...; torch.library.custom_op, whose
// own kernels are Python) at the CPU and CUDA keys: what their implementations run (the ops
// above without autograd), called from the dispatcher without the Python implementation, its
// table lookup and a second trip through the dispatcher (~9 us of a 19 us call of the custom op
// on the CPU). Under torch.compile these are what a compiled graph's op calls run. The torch
// scratch choice is flashattn.torch's (set_custom_kernels).
std::atomic<bool> g_torch_scratch{true};

template <bool Bshd>
Result custom_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, FLASHATTN_OPTION_PARAMS) {
  return fwd<false>(q, k, v, FLASHATTN_OPTION_ARGS, slopes, Bshd, g_torch_scratch.load(std::memory_order_relaxed));
}
template <bool Bshd>
std::tuple<at::Tensor, at::Tensor, at::Tensor> custom_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                          const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& out, const at::Tensor& lse,
                                                          FLASHATTN_OPTION_PARAMS) {
  return bwd(dout, q, k, v, out, lse, FLASHATTN_OPTION_ARGS, slopes, Bshd, g_torch_scratch.load(std::memory_order_relaxed));
}
Result custom_qkvpacked_fwd(const at::Tensor& qkv, FLASHATTN_OPTION_PARAMS) {
  return qkvpacked_fwd<false>(qkv, FLASHATTN_OPTION_ARGS, slopes, g_torch_scratch.load(std::memory_order_relaxed));
}
at::Tensor custom_qkvpacked_bwd(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& out,
                                const at::Tensor& lse, FLASHATTN_OPTION_PARAMS) {
  return qkvpacked_bwd(dout, qkv, out, lse, FLASHATTN_OPTION_ARGS, slopes, g_torch_scratch.load(std::memory_order_relaxed));
}
Result custom_kvpacked_fwd(const at::Tensor& q, const at::Tensor& kv, FLASHATTN_OPTION_PARAMS) {
  return kvpacked_fwd<false>(q, kv, FLASHATTN_OPTION_ARGS, slopes, g_torch_scratch.load(std::memory_order_relaxed));
}
std::tuple<at::Tensor, at::Tensor> custom_kvpacked_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                       const at::Tensor& kv, const at::Tensor& out,
                                                       const at::Tensor& lse, FLASHATTN_OPTION_PARAMS) {
  return kvpacked_bwd(dout, q, kv, out, lse, FLASHATTN_OPTION_ARGS, slopes,
                      g_torch_scratch.load(std::memory_order_relaxed));
}
Result custom_varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                         const at::Tensor& cu_k, const std::optional<at::Tensor>& used_k, int64_t max_q, int64_t max_k,
                         FLASHATTN_OPTION_PARAMS) {
  return varlen_fwd<false>(q, k, v, cu_q, cu_k, used_k, max_q, max_k, FLASHATTN_OPTION_ARGS, slopes,
                           g_torch_scratch.load(std::memory_order_relaxed));
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> custom_varlen_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k, const std::optional<at::Tensor>& used_k,
    int64_t max_q, int64_t max_k, FLASHATTN_OPTION_PARAMS) {
  return varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used_k, max_q, max_k, FLASHATTN_OPTION_ARGS, slopes,
                    g_torch_scratch.load(std::memory_order_relaxed));
}

void register_custom_kernels(torch::Library& m) {
  m.impl("fwd", &custom_fwd<false>);
  m.impl("bwd", &custom_bwd<false>);
  m.impl("bshd_fwd", &custom_fwd<true>);
  m.impl("bshd_bwd", &custom_bwd<true>);
  m.impl("qkvpacked_fwd", &custom_qkvpacked_fwd);
  m.impl("qkvpacked_bwd", &custom_qkvpacked_bwd);
  m.impl("kvpacked_fwd", &custom_kvpacked_fwd);
  m.impl("kvpacked_bwd", &custom_kvpacked_bwd);
  m.impl("varlen_fwd", &custom_varlen_fwd);
  m.impl("varlen_bwd", &custom_varlen_bwd);
}

// The custom ops' Autograd-key kernel in C++ (torch >= 2.9: the dispatcher hands out the kernel a
// key computes to, callable after another is registered over it). The custom op machinery's own
// Autograd kernel is a Python function that, when no gradient is needed - a compiled graph runs
// its ops under no_grad, and inference - only redispatches below autograd: ~3.5 us (forward op)
// and ~7 us (backward op) of Python per call on the 2-core VM. This kernel redispatches in C++ and
// hands every call that needs a gradient (eager calls with grad, AOTAutograd's tracing) to that
// Python kernel, so gradients and their error messages are the custom ops' own.
#if defined(TORCH_VERSION_MAJOR) && (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9))
#define FLASHATTN_CPP_AUTOGRAD 1
constexpr const char* kCustomOps[] = {"fwd", "bwd", "bshd_fwd", "bshd_bwd", "qkvpacked_fwd", "qkvpacked_bwd",
                                      "kvpacked_fwd", "kvpacked_bwd", "varlen_fwd", "varlen_bwd"};
// op name -> the Python Autograd kernels at AutogradCPU and AutogradCUDA, taken before ours.
struct PyAutograd {
  c10::SafeKernelFunction cpu, cuda;
};
std::map<std::string, PyAutograd> g_py_autograd;

bool needs_grad(const torch::jit::Stack& stack, size_t n) {
  if (!at::GradMode::is_enabled()) return false;
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor() && v.toTensor().requires_grad()) return true;
  }
  return false;
}
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!needs_grad(*stack, op.schema().arguments().size())) {
    op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
    return;
  }
  // (Read under no lock: written only while custom kernels are off, see set_custom_kernels.)
  const PyAutograd& py = g_py_autograd.at(op.schema().name());
  (ks.has(c10::DispatchKey::AutogradCUDA) ? py.cuda : py.cpu).callBoxed(op, ks, stack);
}
#endif

std::mutex g_custom_mutex;
std::unique_ptr<torch::Library> g_custom_cpu, g_custom_cuda, g_custom_autograd;

}  // namespace

namespace flashattn_torch {

void set_custom_kernels(bool on, bool torch_scratch) {
  const std::lock_guard<std::mutex> lock(g_custom_mutex);
  g_torch_scratch.store(torch_scratch, std::memory_order_relaxed);
  if (on && !g_custom_cpu) {
    g_custom_cpu = std::make_unique<torch::Library>(torch::Library::IMPL, "flashattn", c10::DispatchKey::CPU,
                                                     __FILE__, __LINE__);
    g_custom_cuda = std::make_unique<torch::Library>(torch::Library::IMPL, "flashattn", c10::DispatchKey::CUDA,
                                                      __FILE__, __LINE__);
    register_custom_kernels(*g_custom_cpu);
    register_custom_kernels(*g_custom_cuda);
#if FLASHATTN_CPP_AUTOGRAD
    // The Python kernels first, while they are what the keys compute to. (Any failure here leaves
    // the Python kernels serving: slower, never wrong.)
    try {
      auto& dispatcher = c10::Dispatcher::singleton();
      std::map<std::string, PyAutograd> py;
      for (const char* name : kCustomOps) {
        const c10::OperatorHandle op = dispatcher.findSchemaOrThrow((std::string("flashattn::") + name).c_str(), "");
        py.insert_or_assign("flashattn::" + std::string(name),
                            PyAutograd{op.getComputedKernelForDispatchKey(c10::DispatchKey::AutogradCPU),
                                       op.getComputedKernelForDispatchKey(c10::DispatchKey::AutogradCUDA)});
      }
      g_py_autograd = std::move(py);
      auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "flashattn", c10::DispatchKey::Autograd,
                                                  __FILE__, __LINE__);
      for (const char* name : kCustomOps) lib->impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
      g_custom_autograd = std::move(lib);
    } catch (const std::exception&) {
      g_custom_autograd.reset();
    }
#endif
  } else if (!on) {
    g_custom_autograd.reset();
    g_custom_cpu.reset();
    g_custom_cuda.reset();
  }
}

Opts make_opts(double scale, int64_t mask, int64_t precision, int64_t num_threads, bool deterministic,
               int64_t window_left, int64_t window_right, double softcap, bool torch_scratch) {
  return opts(scale, mask, precision, num_threads, deterministic, window_left, window_right, softcap, torch_scratch);
}

std::tuple<at::Tensor, at::Tensor> forward_with_autograd(const Operands& in, const SeqTensors& sq,
                                                         const std::optional<at::Tensor>& slopes, const Opts& o) {
  return run<true>(in, sq, slopes, o);
}

}  // namespace flashattn_torch

#define FLASHATTN_OPTION_SCHEMA                                                                              \
  "float softmax_scale, int mask, int precision, int num_threads, bool deterministic, int window_left, " \
  "int window_right, float softcap, Tensor? alibi_slopes"

TORCH_LIBRARY(flashattn_eager, m) {
  m.def("fwd(Tensor q, Tensor k, Tensor v, " FLASHATTN_OPTION_SCHEMA
        ", bool bshd, bool torch_scratch) -> (Tensor, Tensor)");
  m.def("qkvpacked_fwd(Tensor qkv, " FLASHATTN_OPTION_SCHEMA ", bool torch_scratch) -> (Tensor, Tensor)");
  m.def("kvpacked_fwd(Tensor q, Tensor kv, " FLASHATTN_OPTION_SCHEMA ", bool torch_scratch) -> (Tensor, Tensor)");
  m.def("varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_k, "
        "int max_seqlen_q, int max_seqlen_k, " FLASHATTN_OPTION_SCHEMA ", bool torch_scratch) -> (Tensor, Tensor)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, " FLASHATTN_OPTION_SCHEMA
        ", bool bshd, bool torch_scratch) -> (Tensor, Tensor, Tensor)");
  m.def("qkvpacked_bwd(Tensor dout, Tensor qkv, Tensor out, Tensor lse, " FLASHATTN_OPTION_SCHEMA
        ", bool torch_scratch) -> Tensor");
  m.def("kvpacked_bwd(Tensor dout, Tensor q, Tensor kv, Tensor out, Tensor lse, " FLASHATTN_OPTION_SCHEMA
        ", bool torch_scratch) -> (Tensor, Tensor)");
  m.def("varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, " FLASHATTN_OPTION_SCHEMA
        ", bool torch_scratch) -> (Tensor, Tensor, Tensor)");
}

// (One set of functions for the CPU and CUDA keys: the library dispatches on the tensors' device.)
#define FLASHATTN_IMPLS(GRAD)                      \
  m.impl("fwd", &fwd<GRAD>);                       \
  m.impl("qkvpacked_fwd", &qkvpacked_fwd<GRAD>);   \
  m.impl("kvpacked_fwd", &kvpacked_fwd<GRAD>);     \
  m.impl("varlen_fwd", &varlen_fwd<GRAD>)
#define FLASHATTN_BWD_IMPLS                    \
  m.impl("bwd", &bwd);                         \
  m.impl("qkvpacked_bwd", &qkvpacked_bwd);     \
  m.impl("kvpacked_bwd", &kvpacked_bwd);       \
  m.impl("varlen_bwd", &varlen_bwd)

TORCH_LIBRARY_IMPL(flashattn_eager, Autograd, m) { FLASHATTN_IMPLS(true); }
TORCH_LIBRARY_IMPL(flashattn_eager, CPU, m) {
  FLASHATTN_IMPLS(false);
  FLASHATTN_BWD_IMPLS;
}
TORCH_LIBRARY_IMPL(flashattn_eager, CUDA, m) {
  FLASHATTN_IMPLS(false);
  FLASHATTN_BWD_IMPLS;
}
