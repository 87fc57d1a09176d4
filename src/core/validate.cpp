#include "core/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include "core/backend.hpp"

namespace flashattn {
namespace {

constexpr int64_t kMaxHeadDim = 256;

[[noreturn]] void fail(const std::string& msg) { throw Error(Status::InvalidArgument, msg); }

struct Named {
  const Tensor* t;
  const char* name;
};

bool valid_dtype(DType d) {
  auto c = static_cast<int32_t>(d);
  return c >= FLASHATTN_FLOAT32 && c <= FLASHATTN_FLOAT64;
}

std::string dtype_str(DType d) {
  return valid_dtype(d) ? dtype_name(d) : "code " + std::to_string(static_cast<int32_t>(d));
}

std::string device_str(int32_t dev) { return dev < 0 ? "cpu" : "cuda:" + std::to_string(dev); }

// Basic facts of one tensor: ndim, positive shape, non-negative strides, unit head_dim stride,
// index arithmetic that fits in int64, pointer present and aligned.
void check_tensor(const Named& n, int32_t want_ndim) {
  const Tensor& t = *n.t;
  if (t.ndim != want_ndim)
    fail(std::string(n.name) + ".ndim = " + std::to_string(t.ndim) + ", expected " +
         std::to_string(want_ndim) + (want_ndim == 4 ? " ([B, H, S, D])" : " ([B, H, Sq])"));
  if (t.data == nullptr) fail(std::string(n.name) + ".data is NULL");
  if (!valid_dtype(t.dtype))
    fail(std::string(n.name) + ".dtype = " + dtype_str(t.dtype) +
         " is not a flashattn dtype (0 float32, 1 float16, 2 bfloat16, 3 float64)");
  if (t.device < -1)
    fail(std::string(n.name) + ".device = " + std::to_string(t.device) +
         " is invalid (-1 for the CPU, n >= 0 for CUDA device n)");
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] <= 0)
      fail(std::string(n.name) + ".shape = " + format_dims(t.shape, t.ndim) +
           " has a zero-size or negative dimension " + std::to_string(i));
    if (t.stride[i] < 0)
      fail(std::string(n.name) + ".stride = " + format_dims(t.stride, t.ndim) +
           " has a negative stride in dimension " + std::to_string(i) +
           " (negative strides are not supported)");
  }
  if (want_ndim == 4 && t.shape[3] > 1 && t.stride[3] != 1)
    fail(std::string(n.name) + ".stride[3] (head_dim) = " + std::to_string(t.stride[3]) +
         ", must be 1 (the head dimension must be contiguous); stride = " +
         format_dims(t.stride, t.ndim));
  // Element count and the largest byte offset must fit in int64 (and every product on the way).
  int64_t elems = 1, max_off = 0;
  const int64_t es = dtype_size(t.dtype);
  for (int i = 0; i < t.ndim; ++i) {
    int64_t term = 0;
    if (__builtin_mul_overflow(elems, t.shape[i], &elems) ||
        __builtin_mul_overflow(t.shape[i] - 1, t.stride[i], &term) ||
        __builtin_add_overflow(max_off, term, &max_off))
      fail(std::string(n.name) + " with shape " + format_dims(t.shape, t.ndim) + " and stride " +
           format_dims(t.stride, t.ndim) + " is too large: its index arithmetic overflows int64");
  }
  int64_t bytes = 0;
  if (__builtin_add_overflow(max_off, int64_t{1}, &bytes) || __builtin_mul_overflow(bytes, es, &bytes) ||
      __builtin_add_overflow(bytes, static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data) & 0xffff), &bytes))
    fail(std::string(n.name) + " with shape " + format_dims(t.shape, t.ndim) + " and stride " +
         format_dims(t.stride, t.ndim) + " is too large: its byte extent overflows int64");
  if (reinterpret_cast<uintptr_t>(t.data) % static_cast<uintptr_t>(es) != 0) {
    std::ostringstream os;
    os << n.name << ".data = " << t.data << " is not aligned to its element size (" << es
       << " bytes for " << dtype_name(t.dtype) << ")";
    fail(os.str());
  }
}

void expect_dim(const Named& n, int dim, int64_t want, const char* what, const Named& ref,
                int ref_dim) {
  if (n.t->shape[dim] != want)
    fail(std::string(n.name) + ".shape[" + std::to_string(dim) + "] (" + what + ") = " +
         std::to_string(n.t->shape[dim]) + " does not match " + ref.name + ".shape[" +
         std::to_string(ref_dim) + "] = " + std::to_string(want) + " (" + n.name + ".shape = " +
         format_dims(n.t->shape, n.t->ndim) + ", " + ref.name + ".shape = " +
         format_dims(ref.t->shape, ref.t->ndim) + ")");
}

void expect_same_shape(const Named& n, const Named& ref) {
  static const char* what4[] = {"batch", "heads", "seq", "head_dim"};
  for (int i = 0; i < ref.t->ndim; ++i) expect_dim(n, i, ref.t->shape[i], what4[i], ref, i);
}

// Byte interval [lo, hi) touched by a tensor.
struct Span {
  uintptr_t lo, hi;
};
Span span_of(const Tensor& t) {
  int64_t max_off = 0;
  for (int i = 0; i < t.ndim; ++i) max_off += (t.shape[i] - 1) * t.stride[i];
  auto lo = reinterpret_cast<uintptr_t>(t.data);
  return {lo, lo + static_cast<uintptr_t>((max_off + 1) * dtype_size(t.dtype))};
}

// True when the strides are "nested": each stride is larger than the span of all dims with
// smaller strides. That proves that no two indices share an element.
bool nested_strides(const Tensor& t) {
  // The dimensions of size > 1, by stride ascending (at most 4: no allocation per call).
  int dims[4], n = 0;
  for (int i = 0; i < t.ndim && i < 4; ++i)
    if (t.shape[i] > 1) dims[n++] = i;
  std::sort(dims, dims + n, [&](int a, int b) { return t.stride[a] < t.stride[b]; });
  int64_t extent = 0;  // max offset reachable by the dims seen so far
  for (int j = 0; j < n; ++j) {
    const int d = dims[j];
    if (t.stride[d] <= extent) return false;
    extent += (t.shape[d] - 1) * t.stride[d];
  }
  return true;
}

// Does sum_t x_t * step_t == target have an integer solution with lo_t <= x_t <= hi_t? A
// depth-first search over the terms, largest step first, that only visits values of x_t the
// remaining terms can still complete: exhaustive, so exact when it finishes. For the layouts of
// real tensors (nested strides) each level has at most a few candidates; a search that needs more
// than `budget` steps (strides chosen to defeat it) gives up and answers "maybe" (Unknown).
class BoundedLinearSearch {
 public:
  enum Result { No, Yes, Unknown };
  using i128 = __int128;
  struct Term {
    i128 step, lo, hi;
  };

  // Terms with equal steps are merged (x + y over [lo1 + lo2, hi1 + hi2] is again every integer
  // of that interval), which keeps views with equal strides exact and cheap.
  void add(i128 step, i128 lo, i128 hi) {
    if (step == 0 || lo == hi) {
      base_ += step * lo;
      return;
    }
    if (step < 0) {
      step = -step;
      std::swap(lo, hi);
      lo = -lo;
      hi = -hi;
    }
    for (Term& t : terms_)
      if (t.step == step) {
        t.lo += lo;
        t.hi += hi;
        return;
      }
    terms_.push_back({step, lo, hi});
  }

  Result solve(i128 target, int budget) {
    std::sort(terms_.begin(), terms_.end(),
              [](const Term& a, const Term& b) { return a.step > b.step; });
    const size_t n = terms_.size();
    min_.assign(n + 1, 0);
    max_.assign(n + 1, 0);
    for (size_t i = n; i-- > 0;) {
      min_[i] = min_[i + 1] + terms_[i].lo * terms_[i].step;
      max_[i] = max_[i + 1] + terms_[i].hi * terms_[i].step;
    }
    budget_ = budget;
    return search(0, target - base_);
  }

 private:
  static i128 floor_div(i128 a, i128 b) {  // b > 0
    i128 q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
  }
  static i128 ceil_div(i128 a, i128 b) { return -floor_div(-a, b); }

  Result search(size_t i, i128 rest) {
    if (rest < min_[i] || rest > max_[i]) return No;
    if (i == terms_.size()) return Yes;  // rest == 0: the bounds above are both 0
    const Term& t = terms_[i];
    if (i + 1 == terms_.size())
      return rest % t.step == 0 ? Yes : No;  // rest / step is within [lo, hi] by the bounds
    const i128 x_lo = std::max(t.lo, ceil_div(rest - max_[i + 1], t.step));
    const i128 x_hi = std::min(t.hi, floor_div(rest - min_[i + 1], t.step));
    bool unknown = false;
    for (i128 x = x_lo; x <= x_hi; ++x) {
      if (--budget_ < 0) return Unknown;
      const Result r = search(i + 1, rest - x * t.step);
      if (r == Yes) return Yes;
      unknown |= r == Unknown;
    }
    return unknown ? Unknown : No;
  }

  std::vector<Term> terms_;
  i128 base_ = 0;
  std::vector<i128> min_, max_;
  int budget_ = 0;
};

// Do two tensors share at least one byte? Element (i) of a covers the bytes
// a.data + es_a * sum_d i_d a.stride[d] + [0, es_a), and likewise for b, so they share a byte
// exactly when
//   sum_d i_d (es_a a.stride[d]) - sum_d j_d (es_b b.stride[d]) + u - w = b.data - a.data
// for some indices 0 <= i_d < a.shape[d], 0 <= j_d < b.shape[d], 0 <= u < es_a, 0 <= w < es_b:
// one bounded linear equation. BoundedLinearSearch answers it exactly for any shapes, strides,
// dtypes and offsets (e.g. the dq, dk and dv head ranges of one fused [B, S, Hq + 2 Hkv, D]
// gradient buffer, or the interleaved q, k, v of a packed [B, S, 3, H, D] one); only when its
// step budget runs out does it answer "overlap" without proof. It never misses a real overlap.
bool share_memory(const Tensor& a, const Tensor& b) {
  const Span sa = span_of(a), sb = span_of(b);
  if (sa.hi <= sb.lo || sb.hi <= sa.lo) return false;
  using i128 = BoundedLinearSearch::i128;
  const int64_t ea = dtype_size(a.dtype), eb = dtype_size(b.dtype);
  BoundedLinearSearch eq;
  for (int d = 0; d < a.ndim; ++d)
    eq.add(static_cast<i128>(a.stride[d]) * ea, 0, a.shape[d] - 1);
  for (int d = 0; d < b.ndim; ++d)
    eq.add(-static_cast<i128>(b.stride[d]) * eb, 0, b.shape[d] - 1);
  eq.add(1, -(eb - 1), ea - 1);  // u - w
  const i128 delta = static_cast<i128>(sb.lo) - static_cast<i128>(sa.lo);
  return eq.solve(delta, /*budget=*/1 << 14) != BoundedLinearSearch::No;
}

void check_outputs(const std::vector<Named>& inputs, const std::vector<Named>& outputs) {
  for (const Named& o : outputs)
    if (!nested_strides(*o.t))
      fail(std::string(o.name) + " has overlapping strides: shape " +
           format_dims(o.t->shape, o.t->ndim) + ", stride " + format_dims(o.t->stride, o.t->ndim) +
           " (an output must not write one element twice)");
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (const Named& in : inputs)
      if (share_memory(*outputs[i].t, *in.t))
        fail(std::string("output ") + outputs[i].name + " aliases input " + in.name +
             " (they share memory); outputs must not overlap inputs");
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (share_memory(*outputs[i].t, *outputs[j].t))
        fail(std::string("outputs ") + outputs[i].name + " and " + outputs[j].name +
             " overlap in memory");
  }
}

void check_devices(const std::vector<Named>& all) {
  const Named& first = all.front();
  for (const Named& n : all)
    if (n.t->device != first.t->device)
      fail(std::string("tensors are on different devices: ") + first.name + " is on " +
           device_str(first.t->device) + " but " + n.name + " is on " + device_str(n.t->device));
  int32_t dev = first.t->device;
  if (dev >= 0) {
    if (!cuda::built())
      throw Error(Status::Unsupported, std::string(first.name) + ".device = " +
                                           std::to_string(dev) +
                                           " (CUDA) but this build of flashattn has no CUDA backend");
    for (const Named& n : all) cuda::check_device_pointer(n.t->data, dev, n.name);
  } else if (cuda::available()) {
    for (const Named& n : all) cuda::check_device_pointer(n.t->data, -1, n.name);
  }
}

// ALiBi slopes: float32, [Hq] or [B, Hq], non-negative strides, data present and aligned (their
// device is checked with the other tensors').
void check_alibi(const Named& n, int64_t B, int64_t Hq) {
  const Tensor& t = *n.t;
  const std::string want = "[" + std::to_string(Hq) + "] or [" + std::to_string(B) + ", " + std::to_string(Hq) + "]";
  if (t.ndim != 1 && t.ndim != 2)
    fail("alibi_slopes.ndim = " + std::to_string(t.ndim) + ", expected 1 or 2 (shape " + want + ")");
  if (t.dtype != DType::Float32)
    fail("alibi_slopes.dtype = " + dtype_str(t.dtype) + ", expected float32");
  if (t.data == nullptr) fail("alibi_slopes.data is NULL");
  if (t.device < -1)
    fail("alibi_slopes.device = " + std::to_string(t.device) +
         " is invalid (-1 for the CPU, n >= 0 for CUDA device n)");
  if (t.shape[t.ndim - 1] != Hq || (t.ndim == 2 && t.shape[0] != B))
    fail("alibi_slopes.shape = " + format_dims(t.shape, t.ndim) + " does not match q: expected " + want);
  for (int i = 0; i < t.ndim; ++i)
    if (t.stride[i] < 0 || t.stride[i] > (int64_t{1} << 40))
      fail("alibi_slopes.stride = " + format_dims(t.stride, t.ndim) + " has a negative or huge stride");
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) {
    std::ostringstream os;
    os << "alibi_slopes.data = " << t.data << " is not aligned to 4 bytes (float32)";
    fail(os.str());
  }
}

// The options every call shares (mask, precision, scale, threads, window, softcap).
void check_options(const Options& o) {
  auto mask = static_cast<int32_t>(o.mask);
  if (mask < FLASHATTN_MASK_NONE || mask > FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT)
    fail("options.mask = " + std::to_string(mask) +
         " is unknown (0 none, 1 causal top-left, 2 causal bottom-right)");
  auto prec = static_cast<int32_t>(o.precision);
  if (prec != FLASHATTN_PRECISION_FP32 && prec != FLASHATTN_PRECISION_TF32)
    fail("options.precision = " + std::to_string(prec) + " is unknown (0 fp32, 1 tf32)");
  if (!std::isfinite(o.softmax_scale)) {
    std::ostringstream os;
    os << "options.softmax_scale = " << o.softmax_scale << " is not finite";
    fail(os.str());
  }
  if (std::fabs(o.softmax_scale) > FLASHATTN_MAX_SOFTMAX_SCALE) {
    std::ostringstream os;
    os << "options.softmax_scale = " << o.softmax_scale << " is out of range: |softmax_scale| must be <= "
       << FLASHATTN_MAX_SOFTMAX_SCALE << " (FLASHATTN_MAX_SOFTMAX_SCALE: float32 scores that large "
          "are rounding noise and overflow in the backward)";
    fail(os.str());
  }
  if (o.num_threads < 0)
    fail("options.num_threads = " + std::to_string(o.num_threads) +
         " is negative (0 means all hardware threads)");
  if (o.num_threads > FLASHATTN_MAX_THREADS)
    fail("options.num_threads = " + std::to_string(o.num_threads) + " is too large (at most " +
         std::to_string(FLASHATTN_MAX_THREADS) + ", FLASHATTN_MAX_THREADS; 0 means all hardware threads)");

  for (const auto& [name, w] : {std::pair<const char*, int64_t>{"window_left", o.window_left},
                                 std::pair<const char*, int64_t>{"window_right", o.window_right}})
    if (w < -1)
      fail(std::string("options.") + name + " = " + std::to_string(w) +
           " is invalid (the window size must be >= 0, or -1 for unbounded)");
  if (!std::isfinite(o.softcap) || o.softcap < 0.0f) {
    std::ostringstream os;
    os << "options.softcap = " << o.softcap << " is invalid (0 for none, or a finite value > 0)";
    fail(os.str());
  }
  if (!std::isfinite(o.max_flops) || o.max_flops < 0.0) {
    std::ostringstream os;
    os << "options.max_flops = " << o.max_flops << " is invalid (0 for no bound, or a finite value > 0)";
    fail(os.str());
  }
}

struct Common {
  Shape shape;
  Numerics num;
  Exec exec;
};

// Shape, numerics and execution of a validated call (q: the operand that gives dtype and device).
Common make_common(const Named& q, const Shape& shape, const Options& o) {
  if (q.t->dtype == DType::Float64 && q.t->device >= 0)
    throw Error(Status::Unsupported, "q.dtype = float64 is supported on the CPU only (q.device = " +
                                         device_str(q.t->device) + ")");

  Common c{};
  c.shape = shape;
  float scale = o.softmax_scale != 0.0f ? o.softmax_scale
                                        : static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.head_dim)));
  c.num = Numerics{q.t->dtype, scale, o.mask, o.precision, o.deterministic, o.window_left, o.window_right,
                   o.softcap, Alibi{nullptr, 0, 0}};
  if (o.alibi_slopes != nullptr) {
    const Tensor& a = *o.alibi_slopes;
    c.num.alibi = Alibi{static_cast<const float*>(a.data), a.ndim == 2 ? a.stride[0] : 0, a.stride[a.ndim - 1]};
  }
  // num_threads = 0: all hardware threads, counted once per process (hardware_concurrency()
  // reads /sys/devices/system/cpu/online: three system calls on every call otherwise, CUDA
  // calls included).
  static const int32_t kAllThreads = static_cast<int32_t>(
      std::min<unsigned>(std::max(1u, std::thread::hardware_concurrency()), FLASHATTN_MAX_THREADS));
  const int32_t threads = o.num_threads != 0 ? o.num_threads : kAllThreads;
  c.exec = Exec{q.t->device, o.stream, threads, o.cancel, o.cancel_arg,
                q.t->device >= 0 ? o.workspace : nullptr, o.workspace_bytes};
  return c;
}

// extra: further inputs on the call's device (the varlen sequence arrays); alibi_batch: the batch
// the ALiBi slopes' [B, Hq] form must have (-1: q's; a packed call's views have batch 1).
Common check_common(const Named& q, const Named& k, const Named& v, const Named& lse,
                    const std::vector<Named>& same_as_q, const Options& o,
                    const std::vector<Named>& extra = {}, int64_t alibi_batch = -1) {
  for (const Named& n : {q, k, v}) check_tensor(n, 4);
  check_tensor(lse, 3);
  for (const Named& n : same_as_q) check_tensor(n, 4);

  // dtypes
  for (const Named& n : {k, v})
    if (n.t->dtype != q.t->dtype)
      fail(std::string("expected q, k and v to have the same dtype, but got q.dtype: ") +
           dtype_name(q.t->dtype) + ", " + n.name + ".dtype: " + dtype_name(n.t->dtype));
  for (const Named& n : same_as_q)
    if (n.t->dtype != q.t->dtype)
      fail(std::string(n.name) + ".dtype = " + dtype_name(n.t->dtype) + " must equal q.dtype = " +
           dtype_name(q.t->dtype));
  if (lse.t->dtype != DType::Float32)
    fail(std::string(lse.name) + ".dtype = " + dtype_name(lse.t->dtype) +
         ", expected float32 (the log-sum-exp is always float32)");

  // shapes
  const int64_t B = q.t->shape[0], Hq = q.t->shape[1], Sq = q.t->shape[2], D = q.t->shape[3];
  const int64_t Hkv = k.t->shape[1], Skv = k.t->shape[2];
  expect_dim(k, 0, B, "batch", q, 0);
  expect_dim(k, 3, D, "head_dim", q, 3);
  expect_same_shape(v, k);
  if (Hq % Hkv != 0)
    fail("k.shape[1] (kv heads) = " + std::to_string(Hkv) + " does not divide q.shape[1] (query heads) = " +
         std::to_string(Hq) + " (GQA needs Hq to be a multiple of Hkv)");
  for (const Named& n : same_as_q) {
    if (std::strcmp(n.name, "dk") == 0 || std::strcmp(n.name, "dv") == 0)
      expect_same_shape(n, k);
    else
      expect_same_shape(n, q);
  }
  expect_dim(lse, 0, B, "batch", q, 0);
  expect_dim(lse, 1, Hq, "heads", q, 1);
  expect_dim(lse, 2, Sq, "seq_q", q, 2);
  if (D > kMaxHeadDim)
    throw Error(Status::Unsupported, "q.shape[3] (head_dim) = " + std::to_string(D) +
                                         " is not supported (head_dim must be 1.." +
                                         std::to_string(kMaxHeadDim) + ")");

  check_options(o);

  std::vector<Named> all = {q, k, v, lse};
  all.insert(all.end(), same_as_q.begin(), same_as_q.end());
  Named alibi{o.alibi_slopes, "alibi_slopes"};
  if (o.alibi_slopes != nullptr) {
    check_alibi(alibi, alibi_batch >= 0 ? alibi_batch : B, Hq);
    all.push_back(alibi);
  }
  all.insert(all.end(), extra.begin(), extra.end());
  check_devices(all);
  return make_common(q, Shape{B, Hq, Hkv, Sq, Skv, D}, o);
}

// The inputs an output must not overlap: the call's tensors and the ALiBi slopes.
std::vector<Named> with_alibi(std::vector<Named> inputs, const Options& o) {
  if (o.alibi_slopes != nullptr) inputs.push_back(Named{o.alibi_slopes, "alibi_slopes"});
  return inputs;
}

template <class P>
P in4(const Tensor& t) {
  return P{t.data, t.stride[0], t.stride[1], t.stride[2]};
}

}  // namespace

std::string format_dims(const int64_t* dims, int32_t ndim) {
  std::string s = "[";
  for (int i = 0; i < ndim && i < 4; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

ForwardParams make_forward_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Options& options) {
  Named nq{&q, "q"}, nk{&k, "k"}, nv{&v, "v"}, no{&out, "out"}, nl{&lse, "lse"};
  Common c = check_common(nq, nk, nv, nl, {no}, options);
  check_outputs(with_alibi({nq, nk, nv}, options), {no, nl});
  ForwardParams p{};
  p.shape = c.shape;
  p.num = c.num;
  p.exec = c.exec;
  p.q = in4<In4>(q);
  p.k = in4<In4>(k);
  p.v = in4<In4>(v);
  p.out = in4<Out4>(out);
  p.lse = OutLse{static_cast<float*>(lse.data), lse.stride[0], lse.stride[1], lse.stride[2]};
  return p;
}

BackwardParams make_backward_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& dout, const Tensor& lse,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                    const Options& options) {
  Named nq{&q, "q"}, nk{&k, "k"}, nv{&v, "v"}, no{&out, "out"}, ndo{&dout, "dout"},
      nl{&lse, "lse"}, ndq{&dq, "dq"}, ndk{&dk, "dk"}, ndv{&dv, "dv"};
  Common c = check_common(nq, nk, nv, nl, {no, ndo, ndq, ndk, ndv}, options);
  check_outputs(with_alibi({nq, nk, nv, no, ndo, nl}, options), {ndq, ndk, ndv});
  BackwardParams p{};
  p.shape = c.shape;
  p.num = c.num;
  p.exec = c.exec;
  p.q = in4<In4>(q);
  p.k = in4<In4>(k);
  p.v = in4<In4>(v);
  p.out = in4<In4>(out);
  p.dout = in4<In4>(dout);
  p.lse = InLse{static_cast<const float*>(lse.data), lse.stride[0], lse.stride[1], lse.stride[2]};
  p.dq = in4<Out4>(dq);
  p.dk = in4<Out4>(dk);
  p.dv = in4<Out4>(dv);
  return p;
}


// ---- packed variable-length calls -----------------------------------------------------------------
namespace {

// A packed [total, H, D] operand as the dense checks' logical [1, H, total, D] view; lse
// [H, total] as [1, H, total]. (Batch 1: the dense checks then see one long sequence, and the
// sequences' own bounds are checked by check_sequences.)
Tensor packed_as_dense(const Tensor& t) {
  Tensor r = t;
  if (t.ndim == 3) {
    r.ndim = 4;
    const int64_t sh[4] = {1, t.shape[1], t.shape[0], t.shape[2]}, st[4] = {0, t.stride[1], t.stride[0], t.stride[2]};
    for (int i = 0; i < 4; ++i) r.shape[i] = sh[i], r.stride[i] = st[i];
  } else if (t.ndim == 2) {
    r.ndim = 3;
    const int64_t sh[3] = {1, t.shape[0], t.shape[1]}, st[3] = {0, t.stride[0], t.stride[1]};
    for (int i = 0; i < 3; ++i) r.shape[i] = sh[i], r.stride[i] = st[i];
    r.shape[3] = r.stride[3] = 0;
  }
  return r;
}

// The packed layouts' own shape rules, with messages in the caller's terms.
void check_packed_shapes(const Named& q, const Named& k, const Named& v, const Named& lse,
                         const std::vector<Named>& like_q, const std::vector<Named>& like_k) {
  for (const Named& n : {q, k, v})
    if (n.t->ndim != 3)
      fail(std::string(n.name) + ".ndim = " + std::to_string(n.t->ndim) + ", expected 3 for a varlen call (" +
           (n.t == q.t ? "[total_q, Hq, D]" : "[total_k, Hkv, D]") + ")");
  for (const Named& n : like_q)
    if (n.t->ndim != 3) fail(std::string(n.name) + ".ndim = " + std::to_string(n.t->ndim) + ", expected 3 ([total_q, Hq, D])");
  for (const Named& n : like_k)
    if (n.t->ndim != 3) fail(std::string(n.name) + ".ndim = " + std::to_string(n.t->ndim) + ", expected 3 ([total_k, Hkv, D])");
  if (lse.t->ndim != 2)
    fail(std::string(lse.name) + ".ndim = " + std::to_string(lse.t->ndim) + ", expected 2 for a varlen call ([Hq, total_q])");
  auto same = [](const Named& n, const Named& ref) {
    for (int i = 0; i < 3; ++i)
      if (n.t->shape[i] != ref.t->shape[i])
        fail(std::string(n.name) + ".shape = " + format_dims(n.t->shape, 3) + " does not match " + ref.name +
             ".shape = " + format_dims(ref.t->shape, 3));
  };
  if (k.t->shape[2] != q.t->shape[2])
    fail("k.shape[2] (head_dim) = " + std::to_string(k.t->shape[2]) + " does not match q.shape[2] = " +
         std::to_string(q.t->shape[2]));
  same(v, k);
  for (const Named& n : like_q) same(n, q);
  for (const Named& n : like_k) same(n, k);
  if (lse.t->shape[0] != q.t->shape[1] || lse.t->shape[1] != q.t->shape[0])
    fail(std::string(lse.name) + ".shape = " + format_dims(lse.t->shape, 2) + ", expected [Hq, total_q] = [" +
         std::to_string(q.t->shape[1]) + ", " + std::to_string(q.t->shape[0]) + "]");
}

// An int32 index vector of n entries, unit stride (read as a plain array by the kernels).
void check_index_tensor(const Named& n, int64_t entries, const char* what) {
  const Tensor& t = *n.t;
  if (t.dtype != DType::Int32)
    fail(std::string(n.name) + ".dtype = " + dtype_str(t.dtype) + ", expected int32 (" + what + ")");
  if (t.ndim != 1)
    fail(std::string(n.name) + ".ndim = " + std::to_string(t.ndim) + ", expected 1 (" + what + ")");
  if (entries >= 0 && t.shape[0] != entries)
    fail(std::string(n.name) + ".shape = " + format_dims(t.shape, 1) + ", expected [" + std::to_string(entries) +
         "] (" + what + ")");
  if (t.shape[0] < 1) fail(std::string(n.name) + ".shape = " + format_dims(t.shape, 1) + " is empty");
  if (t.shape[0] > 1 && t.stride[0] != 1)
    fail(std::string(n.name) + ".stride = " + format_dims(t.stride, 1) + ", must be [1] (contiguous)");
  if (t.data == nullptr) fail(std::string(n.name) + ".data is NULL");
  if (t.device < -1)
    fail(std::string(n.name) + ".device = " + std::to_string(t.device) + " is invalid");
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) {
    std::ostringstream os;
    os << n.name << ".data = " << t.data << " is not aligned to 4 bytes (int32)";
    fail(os.str());
  }
}

std::vector<int32_t> read_index(const Tensor& t, void* stream) {
  std::vector<int32_t> h(static_cast<size_t>(t.shape[0]));
  if (t.device < 0)
    std::memcpy(h.data(), t.data, h.size() * sizeof(int32_t));
  else
    cuda::copy_to_host(h.data(), t.data, h.size() * sizeof(int32_t), t.device, stream);
  return h;
}

}  // namespace

void check_sequence_values(const int32_t* cq, const int32_t* ck, const int32_t* used, int64_t B, int64_t total_q,
                           int64_t total_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  auto prefix = [&](const int32_t* c, const char* name, int64_t total, const char* rows, int64_t max_len,
                    const char* max_name) {
    if (c[0] != 0) fail(std::string(name) + "[0] = " + std::to_string(c[0]) + ", expected 0");
    for (int64_t b = 0; b < B; ++b) {
      if (c[b + 1] < c[b])
        fail(std::string(name) + " is not non-decreasing: " + name + "[" + std::to_string(b + 1) + "] = " +
             std::to_string(c[b + 1]) + " < " + name + "[" + std::to_string(b) + "] = " + std::to_string(c[b]));
      const int64_t len = int64_t{c[b + 1]} - c[b];
      if (len > max_len)
        fail("sequence " + std::to_string(b) + " has " + std::to_string(len) + " " + rows + " (" + name + "[" +
             std::to_string(b + 1) + "] - " + name + "[" + std::to_string(b) + "]) > " + max_name + " = " +
             std::to_string(max_len));
    }
    if (c[B] != total)
      fail(std::string(name) + "[" + std::to_string(B) + "] = " + std::to_string(c[B]) + " does not match the " +
           rows + " of the packed tensors (" + std::to_string(total) + ")");
  };
  prefix(cq, "cu_seqlens_q", total_q, "queries", max_seqlen_q, "max_seqlen_q");
  prefix(ck, "cu_seqlens_k", total_k, "keys", max_seqlen_k, "max_seqlen_k");
  for (int64_t b = 0; used != nullptr && b < B; ++b)
    if (used[b] < 0 || int64_t{used[b]} > int64_t{ck[b + 1]} - ck[b])
      fail("seqused_k[" + std::to_string(b) + "] = " + std::to_string(used[b]) + " is outside [0, " +
           std::to_string(int64_t{ck[b + 1]} - ck[b]) + "] (the keys of sequence " + std::to_string(b) + ")");
}

namespace {

// The sequences' contents, when the arrays are host memory; device arrays are left to the CUDA
// backend's check on the stream (Packing::unchecked): reading them here would stop the GPU at
// every call (a copy and a synchronisation; 17 us of idle GPU per call, docs/perf-log/varlen.md).
// Returns whether it checked them.
bool check_sequences(const Varlen& vl, int64_t total_q, int64_t total_k, void* stream) {
  if (vl.cu_seqlens_q->device >= 0) return false;  // (every index array is on q's device: check_common)
  const std::vector<int32_t> cq = read_index(*vl.cu_seqlens_q, stream), ck = read_index(*vl.cu_seqlens_k, stream);
  std::vector<int32_t> used;
  if (vl.seqused_k != nullptr) used = read_index(*vl.seqused_k, stream);
  check_sequence_values(cq.data(), ck.data(), used.empty() ? nullptr : used.data(),
                        static_cast<int64_t>(cq.size()) - 1, total_q, total_k, vl.max_seqlen_q, vl.max_seqlen_k);
  return true;
}

struct PackedCall {
  Common c;
  Packing packing;
};

// Everything a packed call checks; dense views in `views` (q first, as in the names) for the
// outputs' overlap checks and the params.
PackedCall check_packed(const std::vector<Named>& named, const std::vector<Named>& like_q, const std::vector<Named>& like_k,
                        const Varlen& vl, const Options& o, std::vector<Tensor>& views) {
  const Named &q = named[0], &k = named[1], &v = named[2], &lse = named[3];
  if (vl.cu_seqlens_q == nullptr) fail("varlen.cu_seqlens_q is NULL");
  if (vl.cu_seqlens_k == nullptr) fail("varlen.cu_seqlens_k is NULL");
  for (const Named& n : named)
    if (n.t->ndim < 0 || n.t->ndim > 4) fail(std::string(n.name) + ".ndim = " + std::to_string(n.t->ndim) + " is invalid");
  check_packed_shapes(q, k, v, lse, like_q, like_k);
  Named cq{vl.cu_seqlens_q, "cu_seqlens_q"}, ck{vl.cu_seqlens_k, "cu_seqlens_k"}, su{vl.seqused_k, "seqused_k"};
  check_index_tensor(cq, -1, "[batch + 1] prefix sums");
  const int64_t B = cq.t->shape[0] - 1;
  if (B < 1) fail("cu_seqlens_q.shape = " + format_dims(cq.t->shape, 1) + ": at least one sequence (2 entries) is needed");
  check_index_tensor(ck, B + 1, "[batch + 1] prefix sums, as cu_seqlens_q");
  if (vl.seqused_k != nullptr) check_index_tensor(su, B, "[batch]");
  if (vl.max_seqlen_q < 1 || vl.max_seqlen_k < 1)
    fail("varlen.max_seqlen_q = " + std::to_string(vl.max_seqlen_q) + ", max_seqlen_k = " +
         std::to_string(vl.max_seqlen_k) + ": both must be >= 1");
  views.clear();
  for (const Named& n : named) views.push_back(packed_as_dense(*n.t));
  std::vector<Named> dn;
  for (size_t i = 0; i < named.size(); ++i) dn.push_back(Named{&views[i], named[i].name});
  std::vector<Named> idx = {cq, ck};
  if (vl.seqused_k != nullptr) idx.push_back(su);
  std::vector<Named> rest(dn.begin() + 4, dn.end());
  PackedCall r;
  r.c = check_common(dn[0], dn[1], dn[2], dn[3], rest, o, idx, B);
  const bool checked = check_sequences(vl, q.t->shape[0], k.t->shape[0], o.stream);
  r.c.shape = Shape{B, q.t->shape[1], k.t->shape[1], vl.max_seqlen_q, vl.max_seqlen_k, q.t->shape[2]};
  r.packing = Packing{static_cast<const int32_t*>(cq.t->data), static_cast<const int32_t*>(ck.t->data),
                      vl.seqused_k != nullptr ? static_cast<const int32_t*>(su.t->data) : nullptr,
                      q.t->shape[0], k.t->shape[0], !checked};
  return r;
}

std::vector<Named> index_inputs(const Varlen& vl) {
  std::vector<Named> r = {Named{vl.cu_seqlens_q, "cu_seqlens_q"}, Named{vl.cu_seqlens_k, "cu_seqlens_k"}};
  if (vl.seqused_k != nullptr) r.push_back(Named{vl.seqused_k, "seqused_k"});
  return r;
}

}  // namespace

ForwardParams make_forward_params_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                         const Tensor& lse, const Varlen& varlen, const Options& options) {
  std::vector<Named> named = {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&lse, "lse"}, {&out, "out"}};
  std::vector<Tensor> views;
  PackedCall pc = check_packed(named, {named[4]}, {}, varlen, options, views);
  Named nq{&views[0], "q"}, nk{&views[1], "k"}, nv{&views[2], "v"}, nl{&views[3], "lse"}, no{&views[4], "out"};
  std::vector<Named> inputs = with_alibi({nq, nk, nv}, options);
  for (const Named& n : index_inputs(varlen)) inputs.push_back(n);
  check_outputs(inputs, {no, nl});
  ForwardParams p{};
  p.shape = pc.c.shape;
  p.num = pc.c.num;
  p.exec = pc.c.exec;
  p.packing = pc.packing;
  p.q = in4<In4>(views[0]);
  p.k = in4<In4>(views[1]);
  p.v = in4<In4>(views[2]);
  p.out = in4<Out4>(views[4]);
  p.lse = OutLse{static_cast<float*>(lse.data), 0, views[3].stride[1], views[3].stride[2]};
  return p;
}

BackwardParams make_backward_params_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                           const Tensor& dout, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                           const Tensor& dv, const Varlen& varlen, const Options& options) {
  std::vector<Named> named = {{&q, "q"},     {&k, "k"},     {&v, "v"},   {&lse, "lse"}, {&out, "out"},
                              {&dout, "dout"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}};
  std::vector<Tensor> views;
  PackedCall pc = check_packed(named, {named[4], named[5], named[6]}, {named[7], named[8]}, varlen, options, views);
  Named nq{&views[0], "q"}, nk{&views[1], "k"}, nv{&views[2], "v"}, nl{&views[3], "lse"}, no{&views[4], "out"},
      ndo{&views[5], "dout"}, ndq{&views[6], "dq"}, ndk{&views[7], "dk"}, ndv{&views[8], "dv"};
  std::vector<Named> inputs = with_alibi({nq, nk, nv, no, ndo, nl}, options);
  for (const Named& n : index_inputs(varlen)) inputs.push_back(n);
  check_outputs(inputs, {ndq, ndk, ndv});
  BackwardParams p{};
  p.shape = pc.c.shape;
  p.num = pc.c.num;
  p.exec = pc.c.exec;
  p.packing = pc.packing;
  p.q = in4<In4>(views[0]);
  p.k = in4<In4>(views[1]);
  p.v = in4<In4>(views[2]);
  p.out = in4<In4>(views[4]);
  p.dout = in4<In4>(views[5]);
  p.lse = InLse{static_cast<const float*>(lse.data), 0, views[3].stride[1], views[3].stride[2]};
  p.dq = in4<Out4>(views[6]);
  p.dk = in4<Out4>(views[7]);
  p.dv = in4<Out4>(views[8]);
  return p;
}


// ---- KV-cache calls ---------------------------------------------------------------------------------
namespace {

// A [B, S, H, D] tensor (FlashAttention's order) as the logical [B, H, S, D] view.
Tensor bshd_as_bhsd(const Tensor& t) {
  Tensor r = t;
  std::swap(r.shape[1], r.shape[2]);
  std::swap(r.stride[1], r.stride[2]);
  return r;
}

void expect_ndim(const Named& n, int32_t ndim, const char* layout) {
  if (n.t->ndim != ndim)
    fail(std::string(n.name) + ".ndim = " + std::to_string(n.t->ndim) + ", expected " + std::to_string(ndim) + " (" +
         layout + ")");
}

void expect_shape(const Named& n, std::initializer_list<int64_t> want, const char* layout) {
  int i = 0;
  bool ok = true;
  for (int64_t w : want) ok = ok && n.t->shape[i++] == w;
  if (!ok) {
    std::string w = "[";
    i = 0;
    for (int64_t x : want) w += (i++ ? ", " : "") + std::to_string(x);
    fail(std::string(n.name) + ".shape = " + format_dims(n.t->shape, n.t->ndim) + ", expected " + w + "] (" + layout +
         ")");
  }
}

void expect_dtype(const Named& n, DType want, const char* why) {
  if (n.t->dtype != want)
    fail(std::string(n.name) + ".dtype = " + dtype_str(n.t->dtype) + ", expected " + dtype_name(want) + " (" + why +
         ")");
}

// The block table: int32 [B, max_blocks], unit last stride, present and aligned.
void check_block_table(const Named& n, int64_t B) {
  const Tensor& t = *n.t;
  expect_ndim(n, 2, "[batch, max_blocks_per_seq]");
  expect_dtype(n, DType::Int32, "page indices");
  if (t.data == nullptr) fail("block_table.data is NULL");
  if (t.device < -1) fail("block_table.device = " + std::to_string(t.device) + " is invalid");
  if (t.shape[0] != B || t.shape[1] < 1)
    fail("block_table.shape = " + format_dims(t.shape, 2) + ", expected [" + std::to_string(B) +
         ", max_blocks_per_seq >= 1]");
  if (t.stride[0] < 0 || (t.shape[1] > 1 && t.stride[1] != 1) || t.stride[0] > (int64_t{1} << 40))
    fail("block_table.stride = " + format_dims(t.stride, 2) + ": the last stride must be 1 and the first >= 0");
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) fail("block_table.data is not aligned to 4 bytes (int32)");
}

// The rotary tables: [S_ro, rotary_dim / 2] in q's dtype, unit last stride.
void check_rotary(const Named& cos, const Named& sin, DType dtype, int64_t D) {
  for (const Named& n : {cos, sin}) {
    expect_ndim(n, 2, "[S_ro, rotary_dim / 2]");
    if (n.t->dtype != dtype)
      fail(std::string(n.name) + ".dtype = " + dtype_str(n.t->dtype) + " must equal q.dtype = " + dtype_name(dtype));
    if (n.t->data == nullptr) fail(std::string(n.name) + ".data is NULL");
    if (n.t->device < -1) fail(std::string(n.name) + ".device = " + std::to_string(n.t->device) + " is invalid");
    if (n.t->shape[0] < 1 || n.t->shape[1] < 1)
      fail(std::string(n.name) + ".shape = " + format_dims(n.t->shape, 2) + " has a zero-size or negative dimension");
    if (n.t->stride[0] < 0 || n.t->stride[0] > (int64_t{1} << 40) || (n.t->shape[1] > 1 && n.t->stride[1] != 1))
      fail(std::string(n.name) + ".stride = " + format_dims(n.t->stride, 2) +
           ": the last stride must be 1 and the first >= 0");
    if (reinterpret_cast<uintptr_t>(n.t->data) % static_cast<uintptr_t>(dtype_size(dtype)) != 0)
      fail(std::string(n.name) + ".data is not aligned to its element size");
  }
  if (sin.t->shape[0] != cos.t->shape[0] || sin.t->shape[1] != cos.t->shape[1])
    fail("rotary_sin.shape = " + format_dims(sin.t->shape, 2) + " does not match rotary_cos.shape = " +
         format_dims(cos.t->shape, 2));
  if (2 * cos.t->shape[1] > D)
    fail("rotary_dim = 2 * rotary_cos.shape[1] = " + std::to_string(2 * cos.t->shape[1]) + " exceeds head_dim = " +
         std::to_string(D) + " (rotary_dim must be even and <= head_dim)");
}

}  // namespace

std::vector<int32_t> read_index_rows(const int32_t* data, int64_t rows, int64_t stride, int64_t cols, int32_t device,
                                     void* stream) {
  std::vector<int32_t> h(static_cast<size_t>(rows * cols));
  const size_t row_bytes = static_cast<size_t>(cols) * sizeof(int32_t);
  for (int64_t r = 0; r < rows; ++r) {
    if (device < 0)
      std::memcpy(&h[static_cast<size_t>(r * cols)], data + r * stride, row_bytes);
    else
      cuda::copy_to_host(&h[static_cast<size_t>(r * cols)], data + r * stride, row_bytes, device, stream);
  }
  return h;
}

void check_kv_index_values(const KvCheck& f, int64_t s_new, bool append, const int32_t* seqlens, const int32_t* start,
                           const int32_t* batch_row, const int32_t* table) {
  const bool paged = table != nullptr;
  const int64_t B = f.batch, capacity = f.capacity;
  const char* cap_what = paged ? "max_blocks_per_seq * block_size" : "k_cache.shape[1], the cache length";
  for (int64_t b = 0; b < B; ++b) {
    const std::string sb = "[" + std::to_string(b) + "]";
    if (seqlens[b] < 0) fail("cache_seqlens" + sb + " = " + std::to_string(seqlens[b]) + " is negative");
    if (!f.fits(seqlens[b], s_new))
      fail("cache_seqlens" + sb + " + S_new = " + std::to_string(seqlens[b]) + " + " + std::to_string(s_new) + " = " +
           std::to_string(static_cast<unsigned long long>(seqlens[b]) + static_cast<unsigned long long>(s_new)) +
           " exceeds the cache capacity " + std::to_string(capacity) + " (" + cap_what + ")");
    if (!KvCheck::positions_fit(seqlens[b], s_new))
      fail("cache_seqlens" + sb + " + S_new = " + std::to_string(int64_t{seqlens[b]} + s_new) +
           " exceeds the int32 range of cache positions");
    if (start != nullptr && !KvCheck::start_ok(start[b], seqlens[b]))
      fail("cache_leftpad" + sb + " = " + std::to_string(start[b]) + " is outside [0, cache_seqlens" + sb + " = " +
           std::to_string(seqlens[b]) + "]");
    if (batch_row != nullptr && !f.row_ok(batch_row[b]))
      fail("cache_batch_idx" + sb + " = " + std::to_string(batch_row[b]) + " is outside [0, " +
           std::to_string(f.cache_batch) + ") (k_cache.shape[0])");
  }
  if (append && batch_row != nullptr) {
    std::vector<int32_t> sorted(batch_row, batch_row + B);
    std::sort(sorted.begin(), sorted.end());
    for (size_t i = 1; i < sorted.size(); ++i)
      if (sorted[i] == sorted[i - 1])
        fail("cache_batch_idx names cache row " + std::to_string(sorted[i]) +
             " for two sequences: appending would write it twice");
  }
  if (paged) {
    // The pages each sequence uses ([0, cache_seqlens + S_new) rows); table is [B, max_blocks].
    for (int64_t b = 0; b < B; ++b) {
      const int64_t used = f.pages_used(seqlens[b], s_new);
      for (int64_t i = 0; i < used; ++i) {
        const int32_t e = table[b * f.max_blocks + i];
        if (!f.row_ok(e))
          fail("block_table[" + std::to_string(b) + ", " + std::to_string(i) + "] = " + std::to_string(e) +
               " is outside [0, " + std::to_string(f.cache_batch) + ") (k_cache.shape[0], the number of blocks)");
      }
    }
  }
  if (f.rotary_rows > 0) {
    int64_t need = 0;
    bool short_tables = false;
    for (int64_t b = 0; b < B; ++b) {
      need = std::max(need, int64_t{seqlens[b]} + f.rotary_ahead);
      short_tables = short_tables || !f.rotary_ok(seqlens[b]);
    }
    if (short_tables)
      fail("rotary_cos.shape[0] = " + std::to_string(f.rotary_rows) + " is too short: positions up to " +
           std::to_string(need - 1) + " are used (max over b of cache_seqlens[b] + " + std::to_string(f.rotary_ahead) +
           " - 1)");
  }
}

void make_kvcache_params(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& out,
                         const Tensor& lse, const KvCache& kv, const Options& o, KvcacheCall& call) {
  const Named nq{&q, "q"}, nkc{&k_cache, "k_cache"}, nvc{&v_cache, "v_cache"}, no{&out, "out"}, nl{&lse, "lse"};
  const Named nkn{kv.k_new, "k_new"}, nvn{kv.v_new, "v_new"};
  const bool paged = kv.block_table != nullptr, append = kv.k_new != nullptr;
  if ((kv.k_new == nullptr) != (kv.v_new == nullptr))
    fail(std::string("k_new is ") + (kv.k_new ? "given" : "NULL") + " but v_new is " + (kv.v_new ? "given" : "NULL") +
         ": pass both new keys and new values, or neither");
  if ((kv.rotary_cos == nullptr) != (kv.rotary_sin == nullptr))
    fail(std::string("rotary_cos is ") + (kv.rotary_cos ? "given" : "NULL") + " but rotary_sin is " +
         (kv.rotary_sin ? "given" : "NULL") + ": pass both rotary tables, or neither");
  if (kv.rotary_cos != nullptr && !append)
    fail("rotary_cos / rotary_sin are given but k_new / v_new are NULL: the rotary embedding applies to q and the "
         "appended keys together (as FlashAttention's); a cache is assumed to hold rotated keys");
  if (append && kv.cache_seqlens == nullptr)
    fail("k_new / v_new are given but cache_seqlens is NULL: the append position of each sequence is needed");
  if (paged && kv.cache_batch_idx != nullptr)
    fail("cache_batch_idx cannot be combined with block_table (a paged cache names its pages per sequence)");
  if (paged && kv.cache_leftpad != nullptr) fail("cache_leftpad cannot be combined with block_table");
  if (kv.num_splits < 0 || kv.num_splits > 128)
    fail("num_splits = " + std::to_string(kv.num_splits) + " is outside [0, 128] (0: the library's choice)");

  // The tensors' own facts, then shapes (the [B, S, H, D] order of FlashAttention).
  std::vector<Named> data = {nq, nkc, nvc, no};
  if (append) data.push_back(nkn), data.push_back(nvn);
  auto layout = [&](const Tensor* t) {
    if (t == &q || t == &out) return "[B, Sq, Hq, D]";
    if (t == kv.k_new || t == kv.v_new) return "[B, S_new, Hkv, D]";
    return paged ? "[num_blocks, block_size, Hkv, D]" : "[B_cache, S_cache, Hkv, D]";
  };
  for (const Named& n : data) expect_ndim(n, 4, layout(n.t));
  expect_ndim(nl, 3, "[B, Hq, Sq]");
  for (const Named& n : data) check_tensor(n, 4);
  check_tensor(nl, 3);
  for (const Named& n : data)
    if (n.t->dtype != q.dtype)
      fail(std::string(n.name) + ".dtype = " + dtype_name(n.t->dtype) + " must equal q.dtype = " + dtype_name(q.dtype));
  expect_dtype(nl, DType::Float32, "the log-sum-exp is always float32");
  const int64_t B = q.shape[0], Sq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const int64_t Bc = k_cache.shape[0], Sc = k_cache.shape[1], Hkv = k_cache.shape[2];
  expect_shape(no, {B, Sq, Hq, D}, "[B, Sq, Hq, D], as q");
  if (k_cache.shape[3] != D)
    fail("k_cache.shape[3] (head_dim) = " + std::to_string(k_cache.shape[3]) + " does not match q.shape[3] = " +
         std::to_string(D));
  expect_shape(nvc, {Bc, Sc, Hkv, D}, "as k_cache");
  if (Hq % Hkv != 0)
    fail("k_cache.shape[2] (kv heads) = " + std::to_string(Hkv) + " does not divide q.shape[2] (query heads) = " +
         std::to_string(Hq) + " (GQA needs Hq to be a multiple of Hkv)");
  expect_shape(nl, {B, Hq, Sq}, "[B, Hq, Sq]");
  if (D > kMaxHeadDim)
    throw Error(Status::Unsupported, "q.shape[3] (head_dim) = " + std::to_string(D) +
                                         " is not supported (head_dim must be 1.." + std::to_string(kMaxHeadDim) + ")");
  const int64_t s_new = append ? kv.k_new->shape[1] : 0;
  if (append) {
    expect_shape(nkn, {B, s_new, Hkv, D}, "[B, S_new, Hkv, D]: batch of q, heads and head_dim of k_cache");
    expect_shape(nvn, {B, s_new, Hkv, D}, "as k_new");
  }
  if (!paged && kv.cache_batch_idx == nullptr && Bc < B)
    fail("k_cache.shape[0] (cache batch) = " + std::to_string(Bc) + " is smaller than q.shape[0] (batch) = " +
         std::to_string(B) + " (without cache_batch_idx sequence b uses cache row b)");
  if (paged && Sc % 16 != 0)
    fail("k_cache.shape[1] (block_size) = " + std::to_string(Sc) + " is not a multiple of 16 (paged cache)");

  // Index tensors and rotary tables.
  const Named nsl{kv.cache_seqlens, "cache_seqlens"}, nbi{kv.cache_batch_idx, "cache_batch_idx"},
      nlp{kv.cache_leftpad, "cache_leftpad"}, nbt{kv.block_table, "block_table"}, ncos{kv.rotary_cos, "rotary_cos"},
      nsin{kv.rotary_sin, "rotary_sin"};
  std::vector<Named> idx;
  for (const Named& n : {nsl, nbi, nlp})
    if (n.t != nullptr) check_index_tensor(n, B, "[batch]"), idx.push_back(n);
  if (paged) check_block_table(nbt, B), idx.push_back(nbt);
  const bool rotary = kv.rotary_cos != nullptr;
  if (rotary) check_rotary(ncos, nsin, q.dtype, D), idx.push_back(ncos), idx.push_back(nsin);

  check_options(o);
  std::vector<Named> all = data;
  all.push_back(nl);
  all.insert(all.end(), idx.begin(), idx.end());
  if (o.alibi_slopes != nullptr) {
    check_alibi(Named{o.alibi_slopes, "alibi_slopes"}, B, Hq);
    all.push_back(Named{o.alibi_slopes, "alibi_slopes"});
  }
  check_devices(all);

  // Outputs: out and lse; the caches too when appending. Everything else is an input.
  std::vector<Named> inputs = with_alibi({nq}, o), outputs = {no, nl};
  inputs.insert(inputs.end(), idx.begin(), idx.end());
  if (append) {
    inputs.push_back(nkn), inputs.push_back(nvn);
    outputs.push_back(nkc), outputs.push_back(nvc);
  } else {
    inputs.push_back(nkc), inputs.push_back(nvc);
  }
  check_outputs(inputs, outputs);

  // The index contents, read on the host: every row and page a sequence uses lies in the cache.
  const int64_t max_blocks = paged ? kv.block_table->shape[1] : 0;
  int64_t capacity = Sc;
  if (paged && __builtin_mul_overflow(max_blocks, Sc, &capacity))
    fail("block_table.shape[1] * block_size = " + std::to_string(max_blocks) + " * " + std::to_string(Sc) +
         " overflows int64");
  Common c = make_common(nq, Shape{B, Hq, Hkv, Sq, 1, D}, o);
  const bool q_advances = o.mask != Mask::None || c.num.has_window();
  KvCheck facts{};
  facts.batch = B;
  facts.cache_batch = Bc;
  facts.block_rows = Sc;
  facts.capacity = capacity;
  facts.max_blocks = max_blocks;
  facts.rotary_rows = rotary ? kv.rotary_cos->shape[0] : 0;
  facts.rotary_ahead = std::max(s_new, q_advances ? Sq : 1);
  if (kv.cache_seqlens == nullptr && capacity > INT32_MAX)
    fail("the cache capacity " + std::to_string(capacity) + " exceeds the int32 range of sequence lengths");
  // Device arrays with the backend's check on (cuda::kv_checks_on_device): their contents are
  // checked on the stream by the same rules (check_kv_index_values) and nothing is read here.
  if (kv.cache_seqlens != nullptr && kv.cache_seqlens->device >= 0 && cuda::kv_checks_on_device()) {
    facts.on = true;
    facts.cache_seqlens = static_cast<const int32_t*>(kv.cache_seqlens->data);
    facts.start = kv.cache_leftpad ? static_cast<const int32_t*>(kv.cache_leftpad->data) : nullptr;
    facts.batch_row = kv.cache_batch_idx ? static_cast<const int32_t*>(kv.cache_batch_idx->data) : nullptr;
    facts.table = paged ? static_cast<const int32_t*>(kv.block_table->data) : nullptr;
    facts.table_stride = paged ? kv.block_table->stride[0] : 0;
    c.shape.seq_kv = std::max<int64_t>(std::min<int64_t>(capacity, INT32_MAX), 1);
  } else {
    std::vector<int32_t> seqlens = kv.cache_seqlens ? read_index(*kv.cache_seqlens, o.stream)
                                                    : std::vector<int32_t>(static_cast<size_t>(B), 0);
    if (kv.cache_seqlens == nullptr) std::fill(seqlens.begin(), seqlens.end(), static_cast<int32_t>(capacity));
    call.start = kv.cache_leftpad ? read_index(*kv.cache_leftpad, o.stream) : std::vector<int32_t>();
    call.batch_row = kv.cache_batch_idx ? read_index(*kv.cache_batch_idx, o.stream) : std::vector<int32_t>();
    if (paged) {  // (the entries of the pages each sequence may use, [B, max_blocks])
      const Tensor& t = *kv.block_table;
      call.table = read_index_rows(static_cast<const int32_t*>(t.data), B, t.stride[0], max_blocks, t.device, o.stream);
    }
    check_kv_index_values(facts, s_new, append, seqlens.data(), call.start.empty() ? nullptr : call.start.data(),
                          call.batch_row.empty() ? nullptr : call.batch_row.data(),
                          paged ? call.table.data() : nullptr);
    // Per sequence: keys attended after the append, and where the append starts (relative rows).
    call.seqlen_k.resize(static_cast<size_t>(B));
    call.first_new.resize(static_cast<size_t>(B));
    int64_t max_sk = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int32_t start = call.start.empty() ? 0 : call.start[b];
      call.first_new[b] = seqlens[b] - start;
      call.seqlen_k[b] = static_cast<int32_t>(seqlens[b] + s_new - start);
      max_sk = std::max<int64_t>(max_sk, call.seqlen_k[b]);
    }
    call.pos0 = std::move(seqlens);
    c.shape.seq_kv = std::max<int64_t>(max_sk, 1);
  }

  KvcacheParams& kp = call.params;
  kp = KvcacheParams{};
  ForwardParams& p = kp.fwd;
  p.shape = c.shape;
  p.num = c.num;
  p.exec = c.exec;
  const Tensor vq = bshd_as_bhsd(q), vo = bshd_as_bhsd(out), vk = bshd_as_bhsd(k_cache), vv = bshd_as_bhsd(v_cache);
  p.q = in4<In4>(vq);
  p.k = in4<In4>(vk);
  p.v = in4<In4>(vv);
  p.out = in4<Out4>(vo);
  p.lse = OutLse{static_cast<float*>(lse.data), lse.stride[0], lse.stride[1], lse.stride[2]};
  if (facts.on)  // (seqlen_k: the user's cache_seqlens until the backend's check derives it)
    p.kv = KvMap{facts.cache_seqlens, facts.batch_row, facts.start, facts.table, facts.table_stride, Sc};
  else
    p.kv = KvMap{call.seqlen_k.data(), call.batch_row.empty() ? nullptr : call.batch_row.data(),
                 call.start.empty() ? nullptr : call.start.data(), paged ? call.table.data() : nullptr, max_blocks, Sc};
  kp.k_cache = in4<Out4>(vk);
  kp.v_cache = in4<Out4>(vv);
  kp.s_new = s_new;
  if (append) {
    kp.k_new = in4<In4>(bshd_as_bhsd(*kv.k_new));
    kp.v_new = in4<In4>(bshd_as_bhsd(*kv.v_new));
  }
  kp.first_new = facts.on ? nullptr : call.first_new.data();
  kp.num_splits = kv.num_splits;
  kp.pos0 = facts.on ? nullptr : call.pos0.data();
  kp.check = facts;
  if (rotary)
    kp.rotary = KvRotary{kv.rotary_cos->data, kv.rotary_sin->data, kv.rotary_cos->stride[0], kv.rotary_sin->stride[0],
                         2 * kv.rotary_cos->shape[1], kv.rotary_interleaved, q_advances};
}

void check_workspace(const Options& o, int32_t device, const std::vector<const Tensor*>& tensors) {
  if (o.workspace == nullptr || device < 0) return;
  // (The message's start is built only on the way out: this runs on every call given scratch.)
  auto what = [&] {
    std::ostringstream os;
    os << "options.workspace = " << o.workspace;
    return os.str();
  };
  if (reinterpret_cast<uintptr_t>(o.workspace) % 256 != 0) fail(what() + " is not aligned to 256 bytes");
  cuda::check_device_pointer(o.workspace, device, "options.workspace");
  const auto lo = reinterpret_cast<uintptr_t>(o.workspace);
  const uintptr_t hi = lo + o.workspace_bytes;
  if (hi < lo) fail(what() + " + options.workspace_bytes = " + std::to_string(o.workspace_bytes) + " wraps around");
  for (const Tensor* t : tensors) {
    if (t == nullptr || t->data == nullptr) continue;
    const Span s = span_of(*t);
    if (s.lo < hi && lo < s.hi) {
      std::ostringstream m;
      m << what() << " (" << o.workspace_bytes << " bytes) overlaps a tensor of the call at " << t->data
        << " (shape " << format_dims(t->shape, t->ndim) << "): the scratch must be memory of its own";
      fail(m.str());
    }
  }
}

}  // namespace flashattn
