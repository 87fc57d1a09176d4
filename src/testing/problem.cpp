#include "testing/problem.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>

#include "core/half.hpp"
#include "core/mask.hpp"

namespace flashattn::testing {

std::string ProblemConfig::describe() const {
  std::ostringstream os;
  os << "B=" << batch << " Hq=" << heads_q << " Hkv=" << heads_kv << " Sq=" << seq_q
     << " Skv=" << seq_kv << " D=" << head_dim << " mask=" << mask_name(mask)
     << " dtype=" << dtype_name(dtype) << " layout=" << layout_name(layout) << " seed=" << seed;
  if (has_window()) os << " window=(" << window_left << "," << window_right << ")";
  if (softcap != 0.0f) os << " softcap=" << softcap;
  if (alibi != AlibiKind::None) os << " alibi=" << alibi_name(alibi);
  return os.str();
}

float ProblemConfig::scale() const {
  return softmax_scale != 0.0f ? softmax_scale
                               : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

ProblemConfig make_config(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t seq_q,
                          int64_t seq_kv, int64_t head_dim, Mask mask, DType dtype, Layout layout,
                          float softmax_scale, uint64_t seed) {
  ProblemConfig c;
  c.batch = batch;
  c.heads_q = heads_q;
  c.heads_kv = heads_kv;
  c.seq_q = seq_q;
  c.seq_kv = seq_kv;
  c.head_dim = head_dim;
  c.mask = mask;
  c.dtype = dtype;
  c.layout = layout;
  c.softmax_scale = softmax_scale;
  c.seed = seed;
  return c;
}

double forward_flops(const ProblemConfig& c) {
  const double per_pair = 4.0 * c.batch * c.heads_q * static_cast<double>(c.head_dim);
  if (c.has_window()) {
    const MaskRule rule = make_mask_rule(static_cast<int32_t>(c.mask), c.seq_q, c.seq_kv,
                                         c.window_left, c.window_right);
    double pairs = 0;
    for (int64_t i = 0; i < c.seq_q; ++i)
      pairs += static_cast<double>(std::max<int64_t>(0, rule.key_end(i, c.seq_kv) - rule.key_begin(i)));
    return per_pair * pairs;
  }
  double f = per_pair * static_cast<double>(c.seq_q) * c.seq_kv;
  return c.mask == Mask::None ? f : f / 2;
}
double backward_flops(const ProblemConfig& c) { return 2.5 * forward_flops(c); }

const char* layout_name(Layout l) { return l == Layout::BHSD ? "bhsd" : "bshd"; }

const char* alibi_name(AlibiKind a) {
  switch (a) {
    case AlibiKind::None: return "none";
    case AlibiKind::Heads: return "[Hq]";
    case AlibiKind::BatchHeads: return "[B,Hq]";
  }
  return "?";
}

std::vector<float> standard_alibi_slopes(int64_t heads) {
  std::vector<float> s(static_cast<size_t>(heads));
  for (int64_t h = 0; h < heads; ++h)
    s[static_cast<size_t>(h)] =
        static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(heads)));
  return s;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < view.ndim; ++i) n *= view.shape[i];
  return n;
}

namespace {

HostTensor make4(DType dt, Layout layout, int64_t b, int64_t h, int64_t s, int64_t d) {
  HostTensor t;
  t.bytes.resize(static_cast<size_t>(b * h * s * d * dtype_size(dt)));
  t.view = layout == Layout::BHSD ? Tensor::contiguous(t.bytes.data(), dt, b, h, s, d)
                                  : Tensor::bshd(t.bytes.data(), dt, b, h, s, d);
  return t;
}

int64_t offset_of(const Tensor& t, const int64_t* idx) {
  int64_t off = 0;
  for (int i = 0; i < t.ndim; ++i) off += idx[i] * t.stride[i];
  return off;
}

// Visit every element in logical (row-major) order.
template <class F>
void for_each_index(const Tensor& t, F&& f) {
  int64_t idx[4] = {0, 0, 0, 0};
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  for (int64_t lin = 0; lin < n; ++lin) {
    int64_t r = lin;
    for (int i = t.ndim - 1; i >= 0; --i) {
      idx[i] = r % t.shape[i];
      r /= t.shape[i];
    }
    f(lin, offset_of(t, idx));
  }
}

void fill_normal(HostTensor& t, std::mt19937_64& rng) {
  // Box-Muller on our own uniform draws: identical streams on every platform.
  auto uniform = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };
  for_each_index(t.view, [&](int64_t, int64_t off) {
    double u1 = uniform(), u2 = uniform();
    double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    store_element(t.view.data, t.view.dtype, off, z);
  });
}

}  // namespace

double load_element(const void* base, DType dtype, int64_t off) {
  switch (dtype) {
    case DType::Float32: return static_cast<const float*>(base)[off];
    case DType::Float64: return static_cast<const double*>(base)[off];
    case DType::Float16: return fp16_to_float(static_cast<const uint16_t*>(base)[off]);
    case DType::BFloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[off]);
  }
  return std::numeric_limits<double>::quiet_NaN();
}

void store_element(void* base, DType dtype, int64_t off, double value) {
  switch (dtype) {
    case DType::Float32: static_cast<float*>(base)[off] = static_cast<float>(value); break;
    case DType::Float64: static_cast<double*>(base)[off] = value; break;
    case DType::Float16:
      static_cast<uint16_t*>(base)[off] = float_to_fp16(static_cast<float>(value));
      break;
    case DType::BFloat16:
      static_cast<uint16_t*>(base)[off] = float_to_bf16(static_cast<float>(value));
      break;
  }
}

Problem::Problem(const ProblemConfig& c) : cfg(c) {
  const DType dt = c.dtype;
  q = make4(dt, c.layout, c.batch, c.heads_q, c.seq_q, c.head_dim);
  k = make4(dt, c.layout, c.batch, c.heads_kv, c.seq_kv, c.head_dim);
  v = make4(dt, c.layout, c.batch, c.heads_kv, c.seq_kv, c.head_dim);
  dout = make4(dt, c.layout, c.batch, c.heads_q, c.seq_q, c.head_dim);
  out = make4(dt, c.layout, c.batch, c.heads_q, c.seq_q, c.head_dim);
  dq = make4(dt, c.layout, c.batch, c.heads_q, c.seq_q, c.head_dim);
  dk = make4(dt, c.layout, c.batch, c.heads_kv, c.seq_kv, c.head_dim);
  dv = make4(dt, c.layout, c.batch, c.heads_kv, c.seq_kv, c.head_dim);
  lse.bytes.resize(static_cast<size_t>(c.batch * c.heads_q * c.seq_q * 4));
  lse.view = Tensor::lse(reinterpret_cast<float*>(lse.bytes.data()), c.batch, c.heads_q, c.seq_q);
  std::mt19937_64 rng(c.seed * 0x9E3779B97F4A7C15ull + 12345);
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  fill_normal(dout, rng);
  poison_outputs();
  if (c.alibi != AlibiKind::None) {
    const std::vector<float> base = standard_alibi_slopes(c.heads_q);
    const int64_t rows = c.alibi == AlibiKind::BatchHeads ? c.batch : 1;
    alibi.bytes.resize(static_cast<size_t>(rows * c.heads_q * 4));
    float* s = reinterpret_cast<float*>(alibi.bytes.data());
    for (int64_t b = 0; b < rows; ++b)
      for (int64_t h = 0; h < c.heads_q; ++h)
        s[b * c.heads_q + h] = base[static_cast<size_t>(h)] * (1.0f + 0.5f * static_cast<float>(b));
    alibi.view.data = s;
    alibi.view.dtype = DType::Float32;
    alibi.view.device = kCpu;
    if (rows == 1) {
      alibi.view.ndim = 1;
      alibi.view.shape[0] = c.heads_q;
      alibi.view.stride[0] = 1;
    } else {
      alibi.view.ndim = 2;
      alibi.view.shape[0] = c.batch;
      alibi.view.shape[1] = c.heads_q;
      alibi.view.stride[0] = c.heads_q;
      alibi.view.stride[1] = 1;
    }
  } else {
    alibi.view.ndim = 0;
  }
}

Options Problem::options(int32_t num_threads) const {
  Options o;
  o.mask = cfg.mask;
  o.softmax_scale = cfg.softmax_scale;
  o.num_threads = num_threads;
  o.window_left = cfg.window_left;
  o.window_right = cfg.window_right;
  o.softcap = cfg.softcap;
  o.alibi_slopes = cfg.alibi != AlibiKind::None ? &alibi.view : nullptr;
  return o;
}

RefMods Problem::ref_mods() const {
  RefMods m;
  m.window_left = cfg.window_left;
  m.window_right = cfg.window_right;
  m.softcap = static_cast<double>(cfg.softcap);
  if (cfg.alibi != AlibiKind::None) {
    const Tensor& a = alibi.view;
    const float* s = static_cast<const float*>(a.data);
    const int64_t sb = a.ndim == 2 ? a.stride[0] : 0, sh = a.stride[a.ndim - 1];
    m.alibi.resize(static_cast<size_t>(cfg.batch * cfg.heads_q));
    for (int64_t b = 0; b < cfg.batch; ++b)
      for (int64_t h = 0; h < cfg.heads_q; ++h)
        m.alibi[static_cast<size_t>(b * cfg.heads_q + h)] = s[b * sb + h * sh];
  }
  return m;
}

void Problem::poison_outputs() {
  for (HostTensor* t : {&out, &lse, &dq, &dk, &dv})
    for_each_index(t->view, [&](int64_t, int64_t off) {
      store_element(t->view.data, t->view.dtype, off, std::numeric_limits<double>::quiet_NaN());
    });
}

std::vector<double> Problem::to_double(const HostTensor& t) const {
  std::vector<double> r(static_cast<size_t>(t.numel()));
  for_each_index(t.view, [&](int64_t lin, int64_t off) {
    r[static_cast<size_t>(lin)] = load_element(t.view.data, t.view.dtype, off);
  });
  return r;
}

Tensor rebind(const Tensor& like, void* data, int32_t device) {
  Tensor t = like;
  t.data = data;
  t.device = device;
  return t;
}

std::string ErrorStats::str() const {
  std::ostringstream os;
  os << "max_abs=" << max_abs << " rel=" << rel << " max|ref|=" << max_ref << " nan=" << nan
     << " n=" << count;
  return os.str();
}

ErrorStats compare(const std::vector<double>& got, const std::vector<double>& ref) {
  ErrorStats e;
  e.count = static_cast<int64_t>(got.size());
  if (got.size() != ref.size()) {
    e.nan = e.count > 0 ? e.count : 1;
    return e;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], r = ref[i];
    if (std::isinf(r) && g == r) continue;  // -inf LSE of a fully masked row
    if (!std::isfinite(g) || !std::isfinite(r)) {
      ++e.nan;
      continue;
    }
    e.max_abs = std::max(e.max_abs, std::fabs(g - r));
    e.max_ref = std::max(e.max_ref, std::fabs(r));
  }
  e.rel = e.max_abs / std::max(e.max_ref, 1e-30);
  return e;
}

}  // namespace flashattn::testing
