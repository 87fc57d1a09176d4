// Sliding windows, logit softcap and ALiBi on the CUDA backend, forward (out, lse) and backward
// (dq, dk, dv), against the float64 reference with the same modifications (RefMods,
// src/testing/reference.hpp), through the public API, on every kernel route that serves them:
//   float32, softcap / ALiBi: the mma.sync kernels with the per-entry step (XF) in FMA (forced),
//     3xTF32 (precision fp32) and tf32 arithmetic; the float32 sm_90a kernels have no such step,
//     selection keeps these calls off them.
//   float32, window only: every float32 kernel, the sm_90a tf32 / 3xTF32 ones included (they
//     iterate the band): the default choices and each FLASHATTN_CUDA_* alternative.
//   float16 / bfloat16: the forward on mma.sync (FLASHATTN_CUDA_ARCH=sm80) and by default (sm_90a
//     wgmma on compute capability 9.0, both ping-pong settings); the backward split
//     (deterministic = 1), atomic by default (the sm_90a dK/dV kernel on 9.0, both CTA shapes at
//     D = 64) and atomic on mma.sync.
//
// Accuracy criteria are those of the plain tests:
//   float32 (test_cuda.cpp): relative to max(max |ref|, 0.1), gradients against the largest of
//     the three; FMA <= kFmaTol; fp32 (3xTF32) <= kFmaTol and <= 2x (dq, dk: 3x) the FMA kernel's
//     error on the same problem (floor 3e-7); tf32 <= kTf32Tol. kFmaTol grows by the float32
//     rounding of large logits (fp32_tol below): an ALiBi bias of hundreds far from the diagonal.
//   16-bit (test_cuda16.cpp, FlashAttention's): max |got - ref| <= 2x (out) / 3x (dq, dk, dv) the
//     error of the same computation done naively in the 16-bit type (naive_mods below: PyTorch
//     eager's attention with FlashAttention's softcap and bias steps), with the same floors; lse
//     within kLseTol.
// Everywhere: outputs poisoned with NaN before each call and every element checked (NaN never
// passes); rows that see no key give exactly out = 0, lse = -inf, dq = 0 and keys no query sees
// exactly dk = dv = 0; inputs unchanged. Without a CUDA device every test reports SKIPPED.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/mask.hpp"
#include "cuda_test_util.hpp"
#include "testing/naive_lowp.hpp"
#include "testing/parallel.hpp"

namespace flashattn::test {
namespace {

constexpr double kFmaTol = 1e-5;   // test_cuda.cpp
constexpr double kTf32Tol = 5e-3;  // test_cuda.cpp
constexpr double kLseTol = 1e-3;   // test_cuda16.cpp (relative to max(1, max |lse|))
constexpr const char* kNames[5] = {"out", "lse", "dq", "dk", "dv"};

// ---- the modifications of one problem ----------------------------------------------------------
struct Mods {
  int64_t left = -1, right = -1;  // window_size
  float softcap = 0.0f;
  int alibi = 0;          // 0 none, 1 slopes [Hq], 2 slopes [B, Hq] (a strided view)
  float slope_mul = 1.0f;  // scales the slopes (large: attention concentrated near the diagonal)
  bool elementwise() const { return softcap > 0.0f || alibi != 0; }
  std::string name() const {
    std::ostringstream n;
    if (left >= 0 || right >= 0) n << "_win" << (left < 0 ? std::string("inf") : std::to_string(left)) << "x"
                                   << (right < 0 ? std::string("inf") : std::to_string(right));
    if (softcap > 0.0f) n << "_cap" << softcap;
    if (alibi) n << (alibi == 1 ? "_alibiH" : "_alibiBH");
    if (alibi && slope_mul != 1.0f) n << "x" << slope_mul;
    std::string s = n.str();
    for (char& ch : s)
      if (ch == '.') ch = 'p';
    return s;
  }
};

struct ModCase {
  ProblemConfig cfg;
  Mods mods;
  std::string name;
};
void PrintTo(const ModCase& c, std::ostream* os) { *os << c.cfg.describe() << c.mods.name(); }

// The slope of (batch b, head h): FlashAttention's geometric sequence 2^(-8 (h + 1) / H) over
// at least 4 heads (so that one head still gets a slope of weight), different per batch for
// [B, Hq] slopes.
float slope_of(const ProblemConfig& c, const Mods& m, int64_t b, int64_t h) {
  const double hn = static_cast<double>(std::max<int64_t>(c.heads_q, 4));
  const double base = std::exp2(-8.0 * static_cast<double>(h + 1) / hn);
  return static_cast<float>(base * m.slope_mul * (m.alibi == 2 ? 1.0 + 0.75 * static_cast<double>(b) : 1.0));
}

// The slopes on the device: [Hq] contiguous, or [B, Hq] with a padded row (stride Hq + 3), so that
// the kernels' (sb, sh) addressing is exercised; `per_head` gets slope (b, h) at b * Hq + h.
struct DeviceSlopes {
  std::unique_ptr<DeviceBuffer> buf;
  Tensor view;
  std::vector<double> per_head;
  DeviceSlopes(const ProblemConfig& c, const Mods& m) {
    if (m.alibi == 0) return;
    const int64_t B = c.batch, H = c.heads_q, row = m.alibi == 2 ? H + 3 : H;
    std::vector<float> host(static_cast<size_t>(m.alibi == 2 ? B * row : H), -1e30f);  // gaps: never read
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const float s = slope_of(c, m, m.alibi == 2 ? b : 0, h);
        if (m.alibi == 2 || b == 0) host[static_cast<size_t>((m.alibi == 2 ? b * row : 0) + h)] = s;
        per_head.push_back(s);
      }
    buf = std::make_unique<DeviceBuffer>(host.size() * sizeof(float));
    if (!buf->ptr) return;
    cudaMemcpy(buf->ptr, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
    view.data = buf->ptr;
    view.dtype = DType::Float32;
    view.device = 0;
    view.ndim = m.alibi == 2 ? 2 : 1;
    if (m.alibi == 2) {
      view.shape[0] = B, view.shape[1] = H;
      view.stride[0] = row, view.stride[1] = 1;
    } else {
      view.shape[0] = H;
      view.stride[0] = 1;
    }
  }
  bool ok() const { return per_head.empty() || (buf && buf->ptr); }
  const Tensor* tensor() const { return per_head.empty() ? nullptr : &view; }
};

Options options_with(const ProblemConfig& c, const Mods& m, const DeviceSlopes& sl, Precision prec = Precision::Fp32,
                     bool deterministic = false) {
  Options o = options_for(c);
  o.precision = prec;
  o.deterministic = deterministic;
  o.window_left = m.left;
  o.window_right = m.right;
  o.softcap = m.softcap;
  o.alibi_slopes = sl.tensor();
  return o;
}

MaskRule rule_of(const ProblemConfig& c, const Mods& m) {
  return make_mask_rule(static_cast<int32_t>(c.mask), c.seq_q, c.seq_kv, m.left, m.right);
}

// ---- the float64 reference, per query head on all cores ---------------------------------------
// ref[0..4] = out, lse, dq, dk, dv (logical, contiguous); dk, dv summed over each kv group.
struct Ref64 {
  std::vector<double> r[5];
};
Ref64 reference_mods(const Problem& p, const Mods& m, const std::vector<double>& slopes) {
  const ProblemConfig& c = p.cfg;
  const int64_t Sq = c.seq_q, Skv = c.seq_kv, D = c.head_dim, group = c.heads_q / c.heads_kv;
  const auto q = p.to_double(p.q), k = p.to_double(p.k), v = p.to_double(p.v), dout = p.to_double(p.dout);
  const double scale = static_cast<double>(c.scale());
  const int64_t heads = c.batch * c.heads_q;
  Ref64 e;
  for (int i : {0, 2}) e.r[i].assign(q.size(), 0.0);
  e.r[1].assign(heads * Sq, 0.0);
  std::vector<std::vector<double>> dk_h(heads), dv_h(heads);
  testing::parallel_for(heads, testing::resolve_threads(0), [&](int64_t bh) {
    const int64_t kvh = (bh / c.heads_q) * c.heads_kv + (bh % c.heads_q) / group;
    const int64_t qo = bh * Sq * D, ko = kvh * Skv * D;
    const std::vector<double> qh(q.begin() + qo, q.begin() + qo + Sq * D),
        oh(dout.begin() + qo, dout.begin() + qo + Sq * D), kh(k.begin() + ko, k.begin() + ko + Skv * D),
        vh(v.begin() + ko, v.begin() + ko + Skv * D);
    const testing::RefShape one{1, 1, 1, Sq, Skv, D};
    testing::RefMods rm;
    rm.window_left = m.left;
    rm.window_right = m.right;
    rm.softcap = m.softcap;
    if (!slopes.empty()) rm.alibi = {slopes[bh]};
    const testing::RefForward f = testing::reference_forward(one, qh, kh, vh, scale, c.mask, rm);
    testing::RefBackward b = testing::reference_backward(one, qh, kh, vh, oh, scale, c.mask, rm);
    std::copy(f.out.begin(), f.out.end(), e.r[0].begin() + qo);
    std::copy(f.lse.begin(), f.lse.end(), e.r[1].begin() + bh * Sq);
    std::copy(b.dq.begin(), b.dq.end(), e.r[2].begin() + qo);
    dk_h[bh] = std::move(b.dk);
    dv_h[bh] = std::move(b.dv);
  });
  for (int i : {3, 4}) e.r[i].assign(k.size(), 0.0);
  for (int64_t bh = 0; bh < heads; ++bh) {
    const int64_t ko = ((bh / c.heads_q) * c.heads_kv + (bh % c.heads_q) / group) * Skv * D;
    for (int64_t x = 0; x < Skv * D; ++x) {
      e.r[3][ko + x] += dk_h[bh][x];
      e.r[4][ko + x] += dv_h[bh][x];
    }
  }
  return e;
}

// ---- the 16-bit naive baseline with the modifications ------------------------------------------
// testing::naive_lowp's emulation of PyTorch eager attention in float16 / bfloat16 (every product
// accumulated in float32 and rounded once, every elementwise step rounded once), extended with
// FlashAttention's reference steps for the modifications (flash_attn's tests, attention_ref):
//   softcap:  S = r(c * r(tanh(r(S / c))))       autograd: g = r(r(r(g * c) * (1 - t^2)) / c)
//   ALiBi:    S = S - slope * |i + Skv - Sq - j|   (a float32 bias: the sum and the softmax in
//                                                   float32, P rounded once)
//   window:   masked entries -inf (rows with no visible key: P = 0, O = 0)
// Returns out, dq, dk, dv (index 0, 2, 3, 4; lse is judged by a fixed tolerance).
struct Naive {
  std::vector<float> r[5];
};
Naive naive_mods(const Problem& p, const Mods& m, const std::vector<double>& slopes) {
  const ProblemConfig& c = p.cfg;
  const DType dt = c.dtype;
  const int64_t B = c.batch, Hq = c.heads_q, Hkv = c.heads_kv, Sq = c.seq_q, Skv = c.seq_kv, D = c.head_dim,
                group = Hq / Hkv;
  auto r = [dt](float x) { return testing::round_to(dt, x); };
  auto as_float = [&](const testing::HostTensor& t) {
    const std::vector<double> d = p.to_double(t);
    return std::vector<float>(d.begin(), d.end());  // exact: the values are 16-bit
  };
  const std::vector<float> Q = as_float(p.q), K = as_float(p.k), V = as_float(p.v), dO = as_float(p.dout);
  const MaskRule rule = rule_of(c, m);
  const float scale = c.scale(), cap = m.softcap;
  Naive n;
  n.r[0].assign(Q.size(), 0.0f);
  n.r[2].assign(Q.size(), 0.0f);
  n.r[3].assign(K.size(), 0.0f);
  n.r[4].assign(K.size(), 0.0f);
  std::vector<float> dk_h(B * Hq * Skv * D), dv_h(B * Hq * Skv * D);
  testing::parallel_for(B * Hq, testing::resolve_threads(0), [&](int64_t bh) {
    const int64_t kvh = (bh / Hq) * Hkv + (bh % Hq) / group;
    const float* Qh = Q.data() + bh * Sq * D;
    const float* dOh = dO.data() + bh * Sq * D;
    const float* Kh = K.data() + kvh * Skv * D;
    const float* Vh = V.data() + kvh * Skv * D;
    const float slope = slopes.empty() ? 0.0f : static_cast<float>(slopes[bh]);
    std::vector<float> P(Sq * Skv, 0.0f), T(Sq * Skv, 0.0f), dS(Sq * Skv, 0.0f), acc(D);
    auto dot = [D](const float* a, const float* b) {
      float s = 0.0f;
      for (int64_t x = 0; x < D; ++x) s += a[x] * b[x];
      return s;
    };
    for (int64_t i = 0; i < Sq; ++i) {
      const int64_t j0 = rule.key_begin(i), j1 = rule.key_end(i, Skv);
      if (j0 >= j1) continue;
      float* row = P.data() + i * Skv;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = j0; j < j1; ++j) {
        float s = r(scale * r(dot(Qh + i * D, Kh + j * D)));
        if (cap > 0.0f) {
          const float t = r(std::tanh(r(s / cap)));
          T[i * Skv + j] = t;
          s = r(cap * t);
        }
        if (slope != 0.0f) s -= slope * static_cast<float>(std::llabs(j - i - (Skv - Sq)));
        row[j] = s;
        mx = std::max(mx, s);
      }
      float sum = 0.0f;
      for (int64_t j = j0; j < j1; ++j) sum += std::exp(row[j] - mx);
      for (int64_t j = j0; j < j1; ++j) row[j] = r(std::exp(row[j] - mx) / sum);
      // out = r(P V)
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t x = 0; x < D; ++x) acc[x] += row[j] * Vh[j * D + x];
      for (int64_t x = 0; x < D; ++x) n.r[0][bh * Sq * D + i * D + x] = r(acc[x]);
      // dS0 = r(scale * softcap'(r(P (dP - rowsum(P dP)))))
      float rs = 0.0f;
      std::vector<float> dP(j1 - j0);
      for (int64_t j = j0; j < j1; ++j) {
        dP[j - j0] = r(dot(dOh + i * D, Vh + j * D));
        rs += row[j] * dP[j - j0];
      }
      for (int64_t j = j0; j < j1; ++j) {
        float g = r(row[j] * (dP[j - j0] - rs));
        if (cap > 0.0f) {
          const float t = T[i * Skv + j];
          g = r(r(r(g * cap) * (1.0f - t * t)) / cap);
        }
        dS[i * Skv + j] = r(scale * g);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t x = 0; x < D; ++x) acc[x] += dS[i * Skv + j] * Kh[j * D + x];
      for (int64_t x = 0; x < D; ++x) n.r[2][bh * Sq * D + i * D + x] = r(acc[x]);
    }
    for (int64_t j = 0; j < Skv; ++j) {
      std::vector<float> ak(D, 0.0f), av(D, 0.0f);
      for (int64_t i = 0; i < Sq; ++i) {
        const float ds = dS[i * Skv + j], pe = P[i * Skv + j];
        if (ds == 0.0f && pe == 0.0f) continue;
        for (int64_t x = 0; x < D; ++x) {
          ak[x] += ds * Qh[i * D + x];
          av[x] += pe * dOh[i * D + x];
        }
      }
      for (int64_t x = 0; x < D; ++x) {
        dk_h[(bh * Skv + j) * D + x] = r(ak[x]);
        dv_h[(bh * Skv + j) * D + x] = r(av[x]);
      }
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t e = 0; e < Skv * D; ++e) {
        float sk = 0.0f, sv = 0.0f;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t bh = b * Hq + hk * group + g;
          sk += dk_h[bh * Skv * D + e];
          sv += dv_h[bh * Skv * D + e];
        }
        n.r[3][(b * Hkv + hk) * Skv * D + e] = r(sk);
        n.r[4][(b * Hkv + hk) * Skv * D + e] = r(sv);
      }
  return n;
}

// Exact values forced by the band: out = 0 and dq = 0 on rows that see no key (lse = -inf is
// checked by compare()), dk = dv = 0 on keys no query sees. The number of elements of
// got[first..last] that differ.
int64_t band_violations(const ProblemConfig& c, const Mods& m, const std::vector<double>* got, int first, int last) {
  const MaskRule rule = rule_of(c, m);
  const int64_t D = c.head_dim;
  int64_t bad = 0;
  for (int64_t bh = 0; bh < c.batch * c.heads_q; ++bh)
    for (int64_t i = 0; i < c.seq_q; ++i) {
      if (rule.key_begin(i) < rule.key_end(i, c.seq_kv)) continue;
      for (int t : {0, 2})
        if (t >= first && t <= last)
          for (int64_t x = 0; x < D; ++x) bad += got[t][(bh * c.seq_q + i) * D + x] != 0.0;
    }
  for (int64_t bh = 0; bh < c.batch * c.heads_kv; ++bh)
    for (int64_t j = 0; j < c.seq_kv; ++j) {
      if (rule.row_begin(j) < rule.row_end(j, c.seq_q)) continue;
      for (int t : {3, 4})
        if (t >= first && t <= last)
          for (int64_t x = 0; x < D; ++x) bad += got[t][(bh * c.seq_kv + j) * D + x] != 0.0;
    }
  return bad;
}

// Calls f; a flashattn::Error becomes a test failure naming the call, and false.
template <class F>
bool call(const char* what, const std::string& info, F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    ADD_FAILURE() << what << " threw (status " << static_cast<int>(e.status()) << "): " << e.what() << "\n" << info;
    return false;
  }
}

// The FLASHATTN_CUDA_* overrides of one run, set for its lifetime.
using Env = std::vector<std::pair<const char*, const char*>>;
struct EnvSet {
  std::vector<std::unique_ptr<EnvScope>> scopes;
  explicit EnvSet(const Env& env) {
    for (const auto& [k, v] : env) scopes.push_back(std::make_unique<EnvScope>(k, v));
  }
};
std::string env_str(const Env& env) {
  std::string s;
  for (const auto& [k, v] : env) s += std::string(" ") + k + "=" + (v ? v : "(default)");
  return s.empty() ? " (defaults)" : s;
}

// ================================================================================================
// float32
// ================================================================================================
// Errors relative to max(max |ref|, 0.1); gradients against the largest of the three (test_cuda.cpp).
double rel(const testing::ErrorStats& e) { return e.max_abs / std::max(e.max_ref, 0.1); }

// The float32 kernels' tolerance. A logit l = c tanh(x / c) - slope |i + Skv - Sq - j| is a float32
// of magnitude |l|: rounded to 2^-24 |l|, the tanh within 2 ulp, the bias's product rounded too,
// and the row max, which every P is taken against, likewise; so each P = exp(l - lse) carries a
// relative error of about 4 x 2^-24 |l|, which reaches out and the gradients through sums of P.
// Plain scaled scores of the test data stay in the units kFmaTol was measured with; the bias need
// not: a row whose diagonal is hidden (a top-left causal mask with Skv > Sq) sees only keys
// hundreds of positions from it, and every logit that counts is then hundreds. Entries whose bias
// exceeds the row's smallest by more than ~40 have P < e^-40 and do not count. Hence kFmaTol +
// 8 x 2^-24 x (the largest smallest-bias of a row + up to 40 more + the softcap).
double fp32_tol(const ProblemConfig& c, const Mods& m, const std::vector<double>& slopes) {
  const MaskRule rule = rule_of(c, m);
  double biggest = 0;
  for (double slope : slopes)
    for (int64_t i = 0; i < c.seq_q; ++i) {
      const int64_t j0 = rule.key_begin(i), j1 = rule.key_end(i, c.seq_kv);
      if (j0 >= j1) continue;
      const int64_t diag = i + c.seq_kv - c.seq_q;
      const int64_t near = diag < j0 ? j0 - diag : diag >= j1 ? diag - (j1 - 1) : 0;
      const int64_t far = std::max(std::llabs(j0 - diag), std::llabs(j1 - 1 - diag));
      const double lo = slope * static_cast<double>(near), hi = slope * static_cast<double>(far);
      biggest = std::max(biggest, std::min(hi, lo + 40.0));
    }
  return kFmaTol + 8.0 * std::ldexp(biggest + m.softcap, -24);
}

struct Run32 {
  std::string label;
  Precision prec;
  Env env;
  enum Kind { Fma, Fp32, Tf32 } kind;
};
struct Result32 {
  testing::ErrorStats e[5];
  int64_t band_bad = 0;
  bool ran = false;
  double worst() const {
    double w = 0;
    for (const auto& x : e) w = std::max(w, rel(x));
    return w;
  }
  std::string str() const {
    std::ostringstream os;
    for (int i = 0; i < 5; ++i) os << "  " << kNames[i] << ": " << e[i].str() << " rel0.1=" << rel(e[i]) << "\n";
    return os.str();
  }
};

Result32 run32(Problem& p, const Mods& m, const DeviceSlopes& sl, const Ref64& ref, const Run32& run,
               const std::string& info) {
  EnvSet env(run.env);
  DeviceProblem d(p);
  Result32 r;
  if (!d.ok()) {
    ADD_FAILURE() << "cudaMalloc failed";
    return r;
  }
  const Options o = options_with(p.cfg, m, sl, run.prec);
  if (!call("forward", run.label + "\n" + info, [&] { d.forward(o); })) return r;
  if (!call("backward", run.label + "\n" + info, [&] { d.backward(o); })) return r;
  p.poison_outputs();
  d.download();
  EXPECT_TRUE(d.inputs_unchanged()) << run.label << ": q, k, v or dout was modified\n" << info;
  const testing::HostTensor* got[5] = {&p.out, &p.lse, &p.dq, &p.dk, &p.dv};
  std::vector<double> g[5];
  for (int i = 0; i < 5; ++i) {
    g[i] = p.to_double(*got[i]);
    r.e[i] = testing::compare(g[i], ref.r[i]);
  }
  const double grad_scale = std::max({r.e[2].max_ref, r.e[3].max_ref, r.e[4].max_ref});
  for (int i = 2; i < 5; ++i) r.e[i].max_ref = grad_scale;
  r.band_bad = band_violations(p.cfg, m, g, 0, 4);
  r.ran = true;
  return r;
}

// The runs of a float32 problem. With a softcap or ALiBi every one lands on the mma.sync kernels
// with XF; with a window only, the sm_90a kernels are the defaults at padded D = 64 and 128 on
// compute capability 9.0 and each alternative is forced once.
std::vector<Run32> runs32(const ProblemConfig& c, const Mods& m) {
  using P = Precision;
  std::vector<Run32> r = {
      {"fma", P::Fp32, {{"FLASHATTN_CUDA_MATH", "fma"}}, Run32::Fma},
      {"fp32", P::Fp32, {}, Run32::Fp32},
      {"tf32", P::Tf32, {}, Run32::Tf32},
  };
  if (m.elementwise()) return r;
  r.push_back({"tf32 mma.sync", P::Tf32, {{"FLASHATTN_CUDA_ARCH", "sm80"}}, Run32::Tf32});
  if (c.head_dim <= 128) {
    r.push_back({"fp32 mma.sync", P::Fp32, {{"FLASHATTN_CUDA_FP32_FWD", "mma"}, {"FLASHATTN_CUDA_FP32_BWD", "mma"}},
                 Run32::Fp32});
    r.push_back({"tf32 bwd mma, fwd copies v", P::Tf32,
                 {{"FLASHATTN_CUDA_TF32_BWD", "mma"}, {"FLASHATTN_CUDA_TF32_FWD_COPIES", "v"}}, Run32::Tf32});
    r.push_back({"tf32 fwd copies kv", P::Tf32, {{"FLASHATTN_CUDA_TF32_FWD_COPIES", "kv"}}, Run32::Tf32});
    r.push_back({"tf32 fwd copies none", P::Tf32, {{"FLASHATTN_CUDA_TF32_FWD_COPIES", "none"}}, Run32::Tf32});
  }
  if (c.head_dim <= 64) {
    r.push_back({"tf32 pair", P::Tf32, {{"FLASHATTN_CUDA_TF32_BWD", "pair"}}, Run32::Tf32});
    r.push_back({"tf32 wgmma-dq", P::Tf32, {{"FLASHATTN_CUDA_TF32_BWD", "wgmma-dq"}}, Run32::Tf32});
  }
  return r;
}

void check32(const ProblemConfig& cfg, const Mods& m) {
  Problem p(cfg);
  DeviceSlopes sl(cfg, m);
  ASSERT_TRUE(sl.ok()) << "cudaMalloc failed";
  const Ref64 ref = reference_mods(p, m, sl.per_head);
  const std::string info = cfg.describe() + m.name();
  std::vector<Run32> runs = runs32(cfg, m);
  std::vector<Result32> res;
  for (const Run32& run : runs) res.push_back(run32(p, m, sl, ref, run, info));
  std::ostringstream all;
  for (size_t k = 0; k < runs.size(); ++k) all << runs[k].label << env_str(runs[k].env) << ":\n" << res[k].str();
  const double tol = fp32_tol(cfg, m, sl.per_head);
  const std::string details = info + " (fma / fp32 tolerance " + std::to_string(tol) + ")\n" + all.str();
  const Result32& fma = res[0];
  for (size_t k = 0; k < runs.size(); ++k) {
    const Result32& x = res[k];
    if (!x.ran) continue;
    const char* label = runs[k].label.c_str();
    EXPECT_EQ(0, x.band_bad) << label << ": elements not exactly 0 on rows that see no key / keys no query sees\n"
                             << details;
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(0, x.e[i].nan) << label << " " << kNames[i] << " has NaN / unwritten elements\n" << details;
      if (runs[k].kind == Run32::Tf32) {
        EXPECT_LE(rel(x.e[i]), kTf32Tol) << label << " " << kNames[i] << "\n" << details;
        continue;
      }
      EXPECT_LE(rel(x.e[i]), tol) << label << " " << kNames[i] << "\n" << details;
      if (runs[k].kind == Run32::Fp32 && fma.ran) {
        // As in test_cuda.cpp: dQ and dK come from dS = P (dP - D), a cancellation that magnifies
        // the per-product error of 3xTF32 (~2^-22) over FMA's (2^-24).
        const double factor = (i == 2 || i == 3) ? 3.0 : 2.0;
        EXPECT_LE(rel(x.e[i]), factor * std::max(rel(fma.e[i]), 3e-7))
            << label << " " << kNames[i] << " (vs fma)\n" << details;
      }
    }
  }
  std::printf("[ ACCURACY MODS ] %s |", info.c_str());
  for (size_t k = 0; k < runs.size(); ++k) std::printf(" %s %.2e |", runs[k].label.c_str(), res[k].worst());
  std::printf("\n");
}

// ================================================================================================
// float16 / bfloat16
// ================================================================================================
int significand_bits(DType d) { return d == DType::BFloat16 ? 8 : 11; }
const char* short_dtype(DType d) {
  return d == DType::BFloat16 ? "bf16" : d == DType::Float16 ? "fp16" : "fp32";
}

struct Expected16 {
  Ref64 ref;
  double naive_err[5] = {0, 0, 0, 0, 0};
  double max_ref[5] = {0, 0, 0, 0, 0};
  double grad_scale = 0;
};
Expected16 expected16(const Problem& p, const Mods& m, const std::vector<double>& slopes) {
  Expected16 e;
  e.ref = reference_mods(p, m, slopes);
  const Naive n = naive_mods(p, m, slopes);
  for (int i = 0; i < 5; ++i) {
    e.max_ref[i] = testing::compare(e.ref.r[i], e.ref.r[i]).max_ref;
    if (i == 1) continue;
    const testing::ErrorStats s = testing::compare(std::vector<double>(n.r[i].begin(), n.r[i].end()), e.ref.r[i]);
    EXPECT_EQ(0, s.nan) << "naive " << kNames[i] << " " << p.cfg.describe() << m.name();
    e.naive_err[i] = s.max_abs;
  }
  e.grad_scale = std::max({e.max_ref[2], e.max_ref[3], e.max_ref[4]});
  return e;
}

// test_cuda16.cpp's bound: factor x max(naive error, floor), 2 for out and 3 for dq, dk, dv; the
// floor is the rounding of one output element to the 16-bit type (plus 2^-16 of the gradients'
// scale for the gradients, whose exact zeros the naive hits to the bit and a float32 D does not).
double bound16(const Expected16& e, int i, DType dt) {
  if (i == 1) return kLseTol * std::max(1.0, e.max_ref[1]);
  const double factor = i == 0 ? 2.0 : 3.0;
  double floor = std::ldexp(e.max_ref[i], -significand_bits(dt));
  if (i >= 2) floor += std::ldexp(e.grad_scale, -16);
  return factor * std::max(e.naive_err[i], floor);
}

// got[first..last] against the expectation; one line per tensor into rep.
void check16(const ProblemConfig& c, const Mods& m, const Expected16& e, const std::vector<double>* got, int first,
             int last, const std::string& label, const std::string& info, std::ostringstream& rep) {
  for (int i = first; i <= last; ++i) {
    const testing::ErrorStats s = testing::compare(got[i], e.ref.r[i]);
    const double b = bound16(e, i, c.dtype);
    rep << " " << label << ":" << kNames[i] << " " << s.max_abs << "/" << b;
    EXPECT_EQ(0, s.nan) << label << " " << kNames[i] << ": NaN / inf / unwritten elements\n" << info;
    EXPECT_LE(s.max_abs, b) << label << " " << kNames[i] << ": " << s.str() << ", naive max_abs " << e.naive_err[i]
                            << "\n" << info;
  }
  EXPECT_EQ(0, band_violations(c, m, got, first, last))
      << label << ": elements not exactly 0 on rows that see no key / keys no query sees\n" << info;
}

struct Run16 {
  const char* label;
  bool deterministic;
  Env env;
};

void check16_problem(const ProblemConfig& cfg, const Mods& m) {
  Problem p(cfg);
  DeviceSlopes sl(cfg, m);
  ASSERT_TRUE(sl.ok()) << "cudaMalloc failed";
  const Expected16 e = expected16(p, m, sl.per_head);
  DeviceProblem d(p);
  ASSERT_TRUE(d.ok()) << "cudaMalloc failed";
  const std::string info = cfg.describe() + m.name();
  std::ostringstream rep;
  std::vector<double> got[5];
  // The forwards: mma.sync, then the default (sm_90a wgmma on 9.0) in both ping-pong settings;
  // the backward below starts from the last one's out and lse.
  const Run16 fwd_runs[] = {{"fwd80", false, {{"FLASHATTN_CUDA_ARCH", "sm80"}}},
                            {"fwd-pp0", false, {{"FLASHATTN_CUDA_PINGPONG", "0"}}},
                            {"fwd-pp1", false, {{"FLASHATTN_CUDA_PINGPONG", "1"}}}};
  for (const Run16& run : fwd_runs) {
    EnvSet env(run.env);
    d.poison_outputs();
    if (!call("forward", std::string(run.label) + "\n" + info, [&] { d.forward(options_with(cfg, m, sl)); })) return;
    p.poison_outputs();
    d.download();
    got[0] = p.to_double(p.out);
    got[1] = p.to_double(p.lse);
    check16(cfg, m, e, got, 0, 1, run.label, info, rep);
  }
  const std::vector<unsigned char> out_bytes = p.out.bytes, lse_bytes = p.lse.bytes;
  // The backwards: deterministic (deterministic wins over the knob: the ordered sm_90a pass for a
  // window alone, the split passes with the per-entry step), atomic by default (sm_90a on 9.0; at
  // padded D = 64 in both CTA shapes), atomic on mma.sync, and the split passes.
  std::vector<Run16> bwd_runs = {{"deterministic", true, {{"FLASHATTN_CUDA_BWD", "atomic"}}},
                                 {"atomic", false, {{"FLASHATTN_CUDA_BWD", "atomic"}}},
                                 {"atomic80", false,
                                  {{"FLASHATTN_CUDA_BWD", "atomic"}, {"FLASHATTN_CUDA_ARCH", "sm80"}}},
                                 {"split-nondet", false, {{"FLASHATTN_CUDA_BWD", "split"}}}};
  if (cfg.head_dim <= 64) {
    bwd_runs.push_back({"atomic-v0", false, {{"FLASHATTN_CUDA_BWD", "atomic"}, {"FLASHATTN_CUDA_SM90_VARIANT", "0"}}});
    bwd_runs.push_back({"atomic-v1", false, {{"FLASHATTN_CUDA_BWD", "atomic"}, {"FLASHATTN_CUDA_SM90_VARIANT", "1"}}});
  }
  for (const Run16& run : bwd_runs) {
    EnvSet env(run.env);
    d.poison_grads();
    const Options o = options_with(cfg, m, sl, Precision::Fp32, run.deterministic);
    if (!call("backward", std::string(run.label) + "\n" + info, [&] { d.backward(o); })) continue;
    p.poison_outputs();
    d.download();
    got[2] = p.to_double(p.dq);
    got[3] = p.to_double(p.dk);
    got[4] = p.to_double(p.dv);
    check16(cfg, m, e, got, 2, 4, run.label, info, rep);
    EXPECT_TRUE(p.out.bytes == out_bytes && p.lse.bytes == lse_bytes)
        << run.label << ": the backward wrote to out or lse\n" << info;
  }
  EXPECT_TRUE(d.inputs_unchanged()) << "q, k, v or dout was modified\n" << info;
  std::printf("[ ACCURACY16 MODS ] %s |%s\n", info.c_str(), rep.str().c_str());
}

// ================================================================================================
// The cases
// ================================================================================================
std::string case_name(const ProblemConfig& c, const Mods& m) {
  std::ostringstream n;
  n << short_dtype(c.dtype) << "_D" << c.head_dim << "_" << mask_name(c.mask) << "_" << testing::layout_name(c.layout)
    << "_B" << c.batch << "_H" << c.heads_q << "x" << c.heads_kv << "_S" << c.seq_q << "x" << c.seq_kv << m.name();
  if (c.softmax_scale != 0.0f) n << "_scale" << static_cast<int>(c.softmax_scale * 100);
  std::string s = n.str();
  for (char& ch : s)
    if (ch == '-' || ch == '.') ch = '_';
  return s;
}

bool any_visible(const ProblemConfig& c, const Mods& m) {
  const MaskRule rule = rule_of(c, m);
  for (int64_t i = 0; i < c.seq_q; ++i)
    if (rule.key_begin(i) < rule.key_end(i, c.seq_kv)) return true;
  return false;
}

// The modifications the grid rotates through: windows alone (both sides, one side, zero-width
// sides, with and without causal), softcap alone (mild and saturating), ALiBi alone ([Hq] and
// [B, Hq]), and their combinations.
std::vector<Mods> mod_list() {
  std::vector<Mods> v;
  auto add = [&](int64_t l, int64_t r, float cap, int alibi, float mul = 1.0f) {
    Mods m;
    m.left = l, m.right = r, m.softcap = cap, m.alibi = alibi, m.slope_mul = mul;
    v.push_back(m);
  };
  add(16, 8, 0, 0);
  add(0, 0, 0, 0);      // the diagonal only
  add(-1, 0, 0, 0);     // right side only (causal-like)
  add(5, -1, 0, 0);     // left side only
  add(0, 33, 0, 0);
  add(-1, -1, 30.0f, 0);
  add(-1, -1, 2.5f, 0);  // saturating
  add(-1, -1, 0, 1);
  add(-1, -1, 0, 2);
  add(-1, -1, 0, 1, 8.0f);  // steep slopes: every row dominated by its nearest keys
  add(40, 7, 10.0f, 0);
  add(20, -1, 0, 2);
  add(-1, -1, 5.0f, 1);
  add(64, 0, 3.0f, 2);
  add(3, 3, 1.5f, 1, 4.0f);
  return v;
}

std::vector<ModCase> grid_cases(bool half) {
  const std::vector<Mods> mods = mod_list();
  const std::vector<int64_t> dims = half ? std::vector<int64_t>{40, 64, 72, 96, 128, 200, 256}
                                         : std::vector<int64_t>{40, 64, 72, 128, 200, 256};
  const int64_t heads[][2] = {{1, 1}, {4, 2}, {6, 1}, {2, 2}};
  const int64_t lens[][2] = {{1, 1}, {17, 97}, {97, 17}, {128, 128}, {1, 17}, {1031, 97},
                             {97, 128}, {17, 1}, {130, 97}, {97, 1031}, {17, 17}, {300, 300}};
  const Mask masks[] = {Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight};
  const DType dts[] = {DType::BFloat16, DType::Float16};
  std::vector<ModCase> out;
  int i = 0;
  for (size_t di = 0; di < dims.size(); ++di)
    for (int mi = 0; mi < 3; ++mi, ++i) {
      ProblemConfig c;
      c.dtype = half ? dts[i % 2] : DType::Float32;
      c.head_dim = dims[di];
      c.mask = masks[mi];
      c.layout = (di + mi) % 2 ? testing::Layout::BSHD : testing::Layout::BHSD;
      c.heads_q = heads[i % 4][0];
      c.heads_kv = heads[i % 4][1];
      c.seq_q = lens[i % 12][0];
      c.seq_kv = lens[i % 12][1];
      c.batch = (i / 4) % 2 ? 2 : 1;
      if (c.seq_q * c.seq_kv > 60000) {  // long: keep the float64 reference cheap
        c.batch = 1;
        c.heads_kv = 1;
        c.heads_q = c.heads_q > 1 ? 2 : 1;
      }
      c.seed = (half ? 2600 : 2500) + static_cast<uint64_t>(i);
      Mods m = mods[static_cast<size_t>(i) % mods.size()];
      // A window is placed around the bottom-right diagonal: with a top-left causal mask and
      // Skv > Sq it can hide every key. Such a case is hand-picked below; here the left edge goes.
      if (!any_visible(c, m)) m.left = -1;
      out.push_back({c, m, case_name(c, m)});
    }
  // Hand-picked: long rows, rows outside every window (bottom-right with Sq > Skv; a window left of
  // a top-left causal diagonal hides everything), keys no query sees, a large softmax scale with a
  // softcap (tanh saturated), a negative scale, and every modification at once.
  auto add = [&](DType dt, int64_t b, int64_t hq, int64_t hkv, int64_t sq, int64_t skv, int64_t d, Mask mk,
                 testing::Layout l, float scale, Mods m) {
    if (!half) dt = DType::Float32;
    const ProblemConfig c = make_config(b, hq, hkv, sq, skv, d, mk, dt, l, scale, (half ? 2800 : 2700) + out.size());
    out.push_back({c, m, case_name(c, m)});
  };
  using L = testing::Layout;
  const DType bf = DType::BFloat16, fp = DType::Float16;
  Mods all;
  all.left = 100, all.right = 0, all.softcap = 4.0f, all.alibi = 2;
  Mods win_rows;  // rows i < 200 - 4 see no key: Sq - Skv = 200 rows above the band
  win_rows.left = 4, win_rows.right = 2;
  Mods empty_band;  // top-left causal, left edge 80 - 10 = 70 keys right of the diagonal: nothing
  empty_band.left = 10;
  Mods cap_alibi;
  cap_alibi.softcap = 6.0f, cap_alibi.alibi = 1;
  Mods cap_strong;
  cap_strong.softcap = 3.0f;
  Mods alibi_win;
  alibi_win.left = 256, alibi_win.right = 16, alibi_win.alibi = 2, alibi_win.slope_mul = 0.25f;
  add(bf, 1, 4, 2, 1031, 1031, 128, Mask::CausalBottomRight, L::BSHD, 0, all);
  add(fp, 1, 2, 1, 1031, 1031, 64, Mask::None, L::BHSD, 0, alibi_win);
  add(bf, 2, 4, 2, 300, 100, 64, Mask::CausalBottomRight, L::BHSD, 0, win_rows);
  add(fp, 1, 4, 4, 300, 100, 128, Mask::None, L::BSHD, 0, win_rows);
  add(bf, 2, 2, 1, 17, 97, 64, Mask::CausalTopLeft, L::BSHD, 0, empty_band);
  add(fp, 1, 6, 2, 97, 300, 96, Mask::CausalTopLeft, L::BHSD, 0, cap_alibi);  // keys 97.. unseen
  add(bf, 1, 4, 2, 128, 97, 64, Mask::None, L::BHSD, 1.0f, cap_strong);       // scores ~ 8: tanh saturated
  add(fp, 3, 2, 1, 97, 97, 40, Mask::CausalBottomRight, L::BSHD, -0.25f, cap_alibi);
  add(bf, 2, 6, 1, 128, 128, 256, Mask::CausalBottomRight, L::BHSD, 0, all);
  add(fp, 1, 8, 2, 1, 1000, 128, Mask::None, L::BSHD, 0, cap_alibi);  // one query row over 1000 keys
  add(bf, 1, 2, 1, 1000, 1, 72, Mask::CausalBottomRight, L::BHSD, 0, alibi_win);  // 999 rows see nothing
  return out;
}

// ---- float32 ----------------------------------------------------------------------------------
class ScoreMods32 : public ::testing::TestWithParam<ModCase> {};
TEST_P(ScoreMods32, ForwardBackwardEveryRoute) {
  REQUIRE_GPU();
  check32(GetParam().cfg, GetParam().mods);
}
INSTANTIATE_TEST_SUITE_P(Grid, ScoreMods32, ::testing::ValuesIn(grid_cases(false)),
                         [](const ::testing::TestParamInfo<ModCase>& i) { return i.param.name; });

// ---- float16 / bfloat16 -----------------------------------------------------------------------
class ScoreMods16 : public ::testing::TestWithParam<ModCase> {};
TEST_P(ScoreMods16, ForwardBackwardEveryRoute) {
  REQUIRE_GPU();
  check16_problem(GetParam().cfg, GetParam().mods);
}
INSTANTIATE_TEST_SUITE_P(Grid, ScoreMods16, ::testing::ValuesIn(grid_cases(true)),
                         [](const ::testing::TestParamInfo<ModCase>& i) { return i.param.name; });

// ---- small problems for compute-sanitizer (memcheck, racecheck) ---------------------------------
// 'SmallMods/*' : every route on short problems with every modification at once, each dtype.
std::vector<ModCase> sanitize_cases() {
  Mods all;
  all.left = 30, all.right = 5, all.softcap = 5.0f, all.alibi = 2;
  Mods cap;
  cap.softcap = 8.0f, cap.alibi = 1;
  std::vector<ModCase> out;
  const ProblemConfig cs[] = {
      make_config(1, 2, 1, 150, 70, 64, Mask::CausalBottomRight, DType::BFloat16, testing::Layout::BHSD, 0, 91),
      make_config(1, 2, 1, 70, 150, 128, Mask::None, DType::Float16, testing::Layout::BSHD, 0, 92),
      make_config(1, 2, 1, 137, 137, 96, Mask::CausalTopLeft, DType::Float16, testing::Layout::BSHD, 0, 93),
      make_config(1, 2, 1, 33, 140, 256, Mask::None, DType::BFloat16, testing::Layout::BHSD, 0, 94),
      make_config(1, 2, 1, 70, 45, 40, Mask::CausalBottomRight, DType::Float32, testing::Layout::BHSD, 0, 95),
      make_config(1, 2, 1, 79, 65, 128, Mask::None, DType::Float32, testing::Layout::BSHD, 0, 96),
      make_config(1, 2, 1, 88, 85, 256, Mask::CausalTopLeft, DType::Float32, testing::Layout::BHSD, 0, 97),
  };
  int i = 0;
  for (const ProblemConfig& c : cs) {
    const Mods& m = i++ % 2 ? cap : all;
    out.push_back({c, m, case_name(c, m)});
  }
  return out;
}
class SmallMods : public ::testing::TestWithParam<ModCase> {};
TEST_P(SmallMods, EveryRoute) {
  REQUIRE_GPU();
  const ModCase& c = GetParam();
  if (c.cfg.dtype == DType::Float32) check32(c.cfg, c.mods);
  else check16_problem(c.cfg, c.mods);
}
INSTANTIATE_TEST_SUITE_P(Sanitize, SmallMods, ::testing::ValuesIn(sanitize_cases()),
                         [](const ::testing::TestParamInfo<ModCase>& i) { return i.param.name; });

// ---- the fp32-mode forward over key chunks ---------------------------------------------------------
// Long key sequences run the fp32 mode's forward one chunk of keys at a time, merged in float64
// (ForwardPlan::key_chunk; from 16384 keys). With chunks of 128 keys (FLASHATTN_CUDA_KEY_CHUNK)
// short problems take that path: every route against the float64 reference, windows, softcap and
// ALiBi across chunk edges, ragged last chunks, rows that see no key in some chunks or in all, GQA.
TEST(KeyChunks32, EveryModAcrossChunks) {
  REQUIRE_GPU();
  EnvScope chunks("FLASHATTN_CUDA_KEY_CHUNK", "128");
  Mods all;
  all.left = 150, all.right = 20, all.softcap = 5.0f, all.alibi = 2;
  Mods win;
  win.left = 40, win.right = 7;
  Mods alibi;
  alibi.alibi = 1, alibi.slope_mul = 0.05f;
  const Mods none;
  const std::pair<ProblemConfig, Mods> cases[] = {
      {make_config(1, 2, 1, 70, 450, 64, Mask::CausalBottomRight, DType::Float32, testing::Layout::BHSD, 0, 201), all},
      {make_config(1, 4, 2, 97, 1000, 40, Mask::None, DType::Float32, testing::Layout::BSHD, 0, 202), win},
      {make_config(2, 2, 2, 300, 290, 128, Mask::CausalTopLeft, DType::Float32, testing::Layout::BHSD, 0, 203), alibi},
      {make_config(1, 2, 1, 600, 333, 64, Mask::CausalBottomRight, DType::Float32, testing::Layout::BSHD, 0, 204), none},
      {make_config(1, 1, 1, 1, 700, 256, Mask::None, DType::Float32, testing::Layout::BHSD, 0, 205), none},
  };
  for (const auto& [cfg, m] : cases) {
    SCOPED_TRACE(cfg.describe() + m.name());
    check32(cfg, m);
  }
}
// The same path small enough for compute-sanitizer (scripts/gpu-check's mods set): three chunks,
// the last ragged, every modification.
TEST(SanitizeKeyChunks32, ThreeChunks) {
  REQUIRE_GPU();
  EnvScope chunks("FLASHATTN_CUDA_KEY_CHUNK", "128");
  Mods all;
  all.left = 100, all.right = 9, all.softcap = 5.0f, all.alibi = 1;
  check32(make_config(1, 2, 1, 40, 300, 64, Mask::CausalBottomRight, DType::Float32, testing::Layout::BSHD, 0, 206),
          all);
}

// ---- the modifications change the result -----------------------------------------------------
// A kernel that ignored a softcap or the slopes would still be close to the reference on problems
// where they hardly matter; here each one moves every output far beyond the tolerances above, and
// the call must follow the reference with it, not the unmodified attention. (The grid checks
// accuracy; this checks that the options reach the kernels at all, on each route.)
TEST(ScoreModsEffect, SoftcapAndAlibiReachEveryKernel) {
  REQUIRE_GPU();
  Mods cap;
  cap.softcap = 1.0f;
  Mods alibi;
  alibi.alibi = 2, alibi.slope_mul = 2.0f;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16})
    for (int64_t d : {64, 128})
      for (const Mods& m : {cap, alibi}) {
        const ProblemConfig c = make_config(2, 4, 2, 130, 97, d, Mask::None, dt, testing::Layout::BSHD, 1.0f,
                                            33 + static_cast<uint64_t>(d));
        Problem p(c);
        DeviceSlopes sl(c, m);
        ASSERT_TRUE(sl.ok());
        const Ref64 with = reference_mods(p, m, sl.per_head);
        const Ref64 without = reference_mods(p, Mods{}, {});
        const std::string info = c.describe() + m.name();
        const Env routes[] = {{}, {{"FLASHATTN_CUDA_ARCH", "sm80"}}, {{"FLASHATTN_CUDA_BWD", "atomic"}}};
        for (const Env& env : routes) {
          EnvSet scope(env);
          DeviceProblem dev(p);
          ASSERT_TRUE(dev.ok());
          const Options o = options_with(c, m, sl);
          if (!call("forward", info, [&] { dev.forward(o); }) || !call("backward", info, [&] { dev.backward(o); }))
            continue;
          p.poison_outputs();
          dev.download();
          const testing::HostTensor* got[5] = {&p.out, &p.lse, &p.dq, &p.dk, &p.dv};
          for (int i = 0; i < 5; ++i) {
            const std::vector<double> g = p.to_double(*got[i]);
            const testing::ErrorStats near = testing::compare(g, with.r[i]);
            const testing::ErrorStats far = testing::compare(g, without.r[i]);
            EXPECT_EQ(0, near.nan) << kNames[i] << env_str(env) << "\n" << info;
            // Closer to the modified reference than to the plain one by a wide margin.
            EXPECT_LT(near.max_abs * 8, far.max_abs) << kNames[i] << env_str(env) << ": " << near.str() << " vs plain "
                                                     << far.str() << "\n" << info;
          }
        }
      }
}

// ---- determinism ------------------------------------------------------------------------------
// deterministic = 1 with a softcap and ALiBi: forward and backward bitwise identical run to run
// (16-bit: the split XF backward, whatever FLASHATTN_CUDA_BWD says; float32: the mma.sync XF
// kernels), with finite outputs.
TEST(ScoreModsDeterminism, BitwiseAcrossRuns) {
  REQUIRE_GPU();
  Mods m;
  m.left = 200, m.right = 0, m.softcap = 5.0f, m.alibi = 2;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Float16}) {
    const ProblemConfig c =
        make_config(1, 4, 2, 1031, 777, 128, Mask::CausalBottomRight, dt, testing::Layout::BSHD, 0, 61);
    Problem p(c);
    DeviceSlopes sl(c, m);
    ASSERT_TRUE(sl.ok());
    DeviceProblem d(p);
    ASSERT_TRUE(d.ok());
    const Options o = options_with(c, m, sl, Precision::Fp32, /*deterministic=*/true);
    std::vector<Snapshot> runs;
    for (const char* env : {static_cast<const char*>(nullptr), "atomic", static_cast<const char*>(nullptr)}) {
      EnvScope scope("FLASHATTN_CUDA_BWD", env);
      d.poison();
      if (!call("forward", c.describe(), [&] { d.forward(o); })) return;
      if (!call("backward", c.describe(), [&] { d.backward(o); })) return;
      p.poison_outputs();
      d.download();
      runs.push_back(snapshot(p));
      if (runs.size() == 1)
        for (const testing::HostTensor* t : {&p.out, &p.dq, &p.dk, &p.dv}) {
          const std::vector<double> x = p.to_double(*t);
          EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](double y) { return std::isfinite(y); }))
              << short_dtype(dt) << ": non-finite output";
        }
    }
    for (size_t r = 1; r < runs.size(); ++r)
      for (int t = 4; t < 9; ++t)  // snapshot order: q k v dout out lse dq dk dv
        EXPECT_TRUE(runs[0].bytes[t] == runs[r].bytes[t])
            << short_dtype(dt) << " run " << r << ": " << kNames[t - 4] << " differs from run 0";
  }
}

}  // namespace
}  // namespace flashattn::test
