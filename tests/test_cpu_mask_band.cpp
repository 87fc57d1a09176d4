// The CPU kernels under mask bands: sliding windows (FlashAttention's window_size (left, right),
// core/mask.hpp), alone and combined with both causal masks. The kernels are called directly
// through the kernel-set seam (cpu/kernels.hpp: the driver builds a MaskRule from the options, the
// kernels take it as an argument), every instruction set this CPU runs, against a float64
// computation that applies the same band through MaskRule::visible: forward (out, lse) and
// backward (dq, dk, dv), in both of the backward's designs (fused and split, which must give the
// same bits). (Through the public API, windows are checked against the float64 reference by
// test_cpu_score_mods.cpp.)
//
// The grid: sequence lengths 1, 17, 97 and beyond one tile (300, 700: several query and key
// tiles), Sq != Skv both ways, GQA and MQA, windows narrower and wider than a tile, one-sided and
// two-sided, with no mask / causal top-left / causal bottom-right, float32 and float64. Rows that
// see no key and keys that no row sees arise throughout, and some problems have an empty band.
// Outputs are poisoned with NaN before each call (the kernels' scratch too) and every element is
// checked; NaN never passes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "cpu/kernels.hpp"

namespace flashattn::test {
namespace {

// Runs the tasks in order on the calling thread (results do not depend on the schedule; the
// determinism tests check that through the library). Scratch and allocations are handed out
// filled with NaN, so a kernel that reads scratch it did not write cannot pass.
class SerialParallel final : public cpu::Parallel {
 public:
  explicit SerialParallel(int design = kAuto) : Parallel(1, design) {}
  SerialParallel(const SerialParallel&) = delete;
  SerialParallel& operator=(const SerialParallel&) = delete;
  ~SerialParallel() {
    for (void* p : owned_) ::operator delete(p, std::align_val_t(64));
  }
  void run(int64_t num_tasks, size_t scratch_bytes, TaskFn fn, const void* ctx) override {
    void* scratch = alloc(scratch_bytes);
    for (int64_t t = 0; t < num_tasks; ++t) fn(ctx, t, scratch);
  }
  void* alloc(size_t bytes) override {
    const size_t n = bytes == 0 ? 64 : bytes;
    owned_.push_back(::operator new(n, std::align_val_t(64)));
    std::memset(owned_.back(), 0xff, n);  // all-ones bytes: NaN as float and as double
    return owned_.back();
  }

 private:
  std::vector<void*> owned_;
};

std::vector<const cpu::KernelSet*> kernel_sets() {
  std::vector<const cpu::KernelSet*> all;
#if defined(FLASHATTN_CPU_X86)
  all.push_back(&cpu::avx512::kernels);
  all.push_back(&cpu::avx2::kernels);
#endif
  all.push_back(&cpu::generic::kernels);
  std::vector<const cpu::KernelSet*> runnable;
  for (const cpu::KernelSet* k : all)
    if (cpu::supported(*k)) runnable.push_back(k);
  return runnable;
}

struct BandCase {
  int64_t batch, heads_q, heads_kv, seq_q, seq_kv, head_dim;
  int32_t mask;                       // 0 none, 1 causal top-left, 2 causal bottom-right
  int64_t window_left, window_right;  // -1: unbounded on that side
  DType dtype;
  float scale;
  uint64_t seed;
  std::string name;
  MaskRule rule() const {
    return make_mask_rule(mask, seq_q, seq_kv, window_left, window_right);
  }
};

void PrintTo(const BandCase& c, std::ostream* os) { *os << c.name; }

std::vector<BandCase> make_cases() {
  struct Dims {
    int64_t b, hq, hkv, sq, skv, d;
  };
  // Query tiles are 64 rows and key tiles 128 keys (every instruction set): 300 and 700 span
  // several of each, with ragged last tiles.
  const Dims dims[] = {
      {1, 1, 1, 1, 1, 8},     {1, 2, 1, 1, 300, 32},  {1, 2, 2, 97, 1, 16},
      {2, 4, 2, 17, 17, 16},  {1, 3, 1, 17, 97, 40},  {2, 4, 2, 97, 17, 32},
      {1, 4, 2, 300, 300, 64}, {1, 2, 1, 300, 97, 128}, {1, 2, 1, 97, 300, 24},
      {1, 1, 1, 700, 260, 8},
  };
  // (left, right); (-1, -1) is the plain mask, the rest are windows narrower and wider than a
  // tile, one-sided and two-sided.
  const int64_t windows[][2] = {{-1, -1}, {0, 0},  {16, 0},   {3, 7},
                                {40, -1}, {-1, 20}, {130, 2}, {200, 150}};
  const char* mask_names[] = {"none", "tl", "br"};
  std::vector<BandCase> cases;
  int n = 0;
  for (const Dims& d : dims)
    for (int32_t mask = 0; mask < 3; ++mask)
      for (int t = 0; t < 2; ++t, ++n) {
        // n mod 24 picks the (mask, window) pair, so the 60 cases hold every pair.
        const int64_t* w = windows[n % 8];
        for (DType dt : {DType::Float32, DType::Float64}) {
          BandCase c{d.b, d.hq, d.hkv, d.sq, d.skv, d.d, mask, w[0], w[1], dt,
                     // every fifth case with scores twice as spread
                     static_cast<float>((n % 5 == 4 ? 2.0 : 1.0) / std::sqrt(double(d.d))),
                     static_cast<uint64_t>(7000 + n), ""};
          std::ostringstream os;
          os << n << "_" << (dt == DType::Float32 ? "f32" : "f64") << "_" << mask_names[mask]
             << "_w" << (w[0] < 0 ? std::string("inf") : std::to_string(w[0])) << "x"
             << (w[1] < 0 ? std::string("inf") : std::to_string(w[1])) << "_B" << d.b << "_H"
             << d.hq << "x" << d.hkv << "_S" << d.sq << "x" << d.skv << "_D" << d.d;
          c.name = os.str();
          cases.push_back(c);
        }
      }
  return cases;
}

// Inputs as doubles holding float32 values, so that both dtypes see exactly these numbers.
struct Inputs {
  std::vector<double> q, k, v, dout;  // [B,Hq,Sq,D], [B,Hkv,Skv,D] x2, [B,Hq,Sq,D]
};
Inputs make_inputs(const BandCase& c) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto fill = [&](int64_t n) {
    std::vector<double> x(static_cast<size_t>(n));
    for (double& e : x) e = nd(rng);
    return x;
  };
  const int64_t nq = c.batch * c.heads_q * c.seq_q * c.head_dim;
  const int64_t nk = c.batch * c.heads_kv * c.seq_kv * c.head_dim;
  Inputs in;
  in.q = fill(nq);
  in.k = fill(nk);
  in.v = fill(nk);
  in.dout = fill(nq);
  return in;
}

// The float64 result, and for each gradient the largest sum of |terms| of one element (rounding
// scales with it, not with the result, which cancels to 0 where a row sees a single key).
struct Expected {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<bool> row_sees_key, key_seen;  // [B,Hq,Sq], [B,Hkv,Skv]
  double mag_dq = 0, mag_dk = 0, mag_dv = 0;
};

Expected expected(const BandCase& c, const Inputs& in) {
  const MaskRule rule = c.rule();
  const int64_t D = c.head_dim, Sq = c.seq_q, Skv = c.seq_kv, group = c.heads_q / c.heads_kv;
  const double scale = c.scale, ninf = -std::numeric_limits<double>::infinity();
  Expected e;
  e.out.assign(in.q.size(), 0.0);
  e.dq.assign(in.q.size(), 0.0);
  e.dk.assign(in.k.size(), 0.0);
  e.dv.assign(in.k.size(), 0.0);
  e.lse.assign(static_cast<size_t>(c.batch * c.heads_q * Sq), ninf);
  e.row_sees_key.assign(e.lse.size(), false);
  e.key_seen.assign(static_cast<size_t>(c.batch * c.heads_kv * Skv), false);
  std::vector<double> mk(in.k.size(), 0.0), mv(in.k.size(), 0.0), s(Skv), p(Skv), dp(Skv);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < c.heads_q; ++h) {
      const int64_t qrow0 = (b * c.heads_q + h) * Sq, krow0 = (b * c.heads_kv + h / group) * Skv;
      const double* K = &in.k[krow0 * D];
      const double* V = &in.v[krow0 * D];
      for (int64_t i = 0; i < Sq; ++i) {
        const double* q = &in.q[(qrow0 + i) * D];
        const double* dO = &in.dout[(qrow0 + i) * D];
        double m = ninf;
        for (int64_t j = 0; j < Skv; ++j) {
          if (!rule.visible(i, j)) continue;
          double acc = 0;
          for (int64_t x = 0; x < D; ++x) acc += q[x] * K[j * D + x];
          s[j] = scale * acc;
          m = std::max(m, s[j]);
        }
        if (m == ninf) continue;  // no visible key: out 0, lse -inf, dq 0
        e.row_sees_key[qrow0 + i] = true;
        double z = 0;
        for (int64_t j = 0; j < Skv; ++j) z += rule.visible(i, j) ? std::exp(s[j] - m) : 0.0;
        const double lse = m + std::log(z);
        e.lse[qrow0 + i] = lse;
        double* o = &e.out[(qrow0 + i) * D];
        double delta = 0;
        for (int64_t j = 0; j < Skv; ++j) {
          p[j] = rule.visible(i, j) ? std::exp(s[j] - lse) : 0.0;
          double acc = 0;
          for (int64_t x = 0; x < D; ++x) acc += dO[x] * V[j * D + x];
          dp[j] = acc;
          delta += p[j] * dp[j];
          for (int64_t x = 0; x < D; ++x) o[x] += p[j] * V[j * D + x];
        }
        double dabs = 0;
        for (int64_t x = 0; x < D; ++x) dabs += std::fabs(dO[x] * o[x]);
        double* dq = &e.dq[(qrow0 + i) * D];
        for (int64_t j = 0; j < Skv; ++j) {
          if (!rule.visible(i, j)) continue;
          e.key_seen[krow0 + j] = true;
          const double ds = p[j] * (dp[j] - delta), dsabs = p[j] * (std::fabs(dp[j]) + dabs);
          for (int64_t x = 0; x < D; ++x) {
            dq[x] += scale * ds * K[j * D + x];
            e.dk[(krow0 + j) * D + x] += scale * ds * q[x];
            e.dv[(krow0 + j) * D + x] += p[j] * dO[x];
            mk[(krow0 + j) * D + x] += std::fabs(scale) * dsabs * std::fabs(q[x]);
            mv[(krow0 + j) * D + x] += p[j] * std::fabs(dO[x]);
          }
        }
        for (int64_t x = 0; x < D; ++x) {
          double mq = 0;
          for (int64_t j = 0; j < Skv; ++j)
            if (rule.visible(i, j))
              mq += std::fabs(scale) * p[j] * (std::fabs(dp[j]) + dabs) * std::fabs(K[j * D + x]);
          e.mag_dq = std::max(e.mag_dq, mq);
        }
      }
    }
  for (size_t r = 0; r < mk.size(); ++r) {
    e.mag_dk = std::max(e.mag_dk, mk[r]);
    e.mag_dv = std::max(e.mag_dv, mv[r]);
  }
  return e;
}

struct Got {
  std::vector<double> out, lse, dq, dk, dv;
};

template <class T>
std::vector<T> stored(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}
template <class T>
std::vector<double> widened(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

// One forward and one backward through kernel set k, with the band as the kernels' MaskRule.
// p.num.mask is deliberately None: the kernels must take the mask from the rule alone.
// design: the backward's (cpu::Parallel::kSplit or kFused).
template <class T>
Got run_kernels(const cpu::KernelSet& k, const BandCase& c, const Inputs& in, int design) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const std::vector<T> q = stored<T>(in.q), kk = stored<T>(in.k), v = stored<T>(in.v),
                       dout = stored<T>(in.dout);
  std::vector<T> out(q.size(), nan), dq(q.size(), nan), dk(kk.size(), nan), dv(kk.size(), nan);
  std::vector<float> lse(static_cast<size_t>(c.batch * c.heads_q * c.seq_q),
                         std::numeric_limits<float>::quiet_NaN());
  const int64_t D = c.head_dim;
  const Shape shape{c.batch, c.heads_q, c.heads_kv, c.seq_q, c.seq_kv, D};
  const Numerics num{c.dtype, c.scale, Mask::None, Precision::Fp32, false};
  const Exec exec{-1, nullptr, 1};
  auto in4 = [&](const std::vector<T>& x, int64_t heads, int64_t seq) {
    return In4{x.data(), heads * seq * D, seq * D, D};
  };
  auto out4 = [&](std::vector<T>& x, int64_t heads, int64_t seq) {
    return Out4{x.data(), heads * seq * D, seq * D, D};
  };
  const MaskRule rule = c.rule();
  const ForwardParams fp{shape,
                         num,
                         exec,
                         in4(q, c.heads_q, c.seq_q),
                         in4(kk, c.heads_kv, c.seq_kv),
                         in4(v, c.heads_kv, c.seq_kv),
                         out4(out, c.heads_q, c.seq_q),
                         OutLse{lse.data(), c.heads_q * c.seq_q, c.seq_q, 1}};
  {
    SerialParallel par;
    k.forward(fp, rule, par);
  }
  const BackwardParams bp{shape,
                          num,
                          exec,
                          in4(q, c.heads_q, c.seq_q),
                          in4(kk, c.heads_kv, c.seq_kv),
                          in4(v, c.heads_kv, c.seq_kv),
                          in4(out, c.heads_q, c.seq_q),
                          in4(dout, c.heads_q, c.seq_q),
                          InLse{lse.data(), c.heads_q * c.seq_q, c.seq_q, 1},
                          out4(dq, c.heads_q, c.seq_q),
                          out4(dk, c.heads_kv, c.seq_kv),
                          out4(dv, c.heads_kv, c.seq_kv)};
  {
    SerialParallel par(design);
    k.backward(bp, rule, par);
  }
  return Got{widened(out), widened(lse), widened(dq), widened(dk), widened(dv)};
}

// |got - ref| <= bound for every element; a -inf reference needs exactly -inf; NaN and any other
// non-finite value fail.
::testing::AssertionResult close(const char* what, const std::vector<double>& got,
                                 const std::vector<double>& ref, double bound) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, expected "
                                         << ref.size();
  int64_t bad = 0, worst = -1;
  double worst_err = -1;
  for (size_t e = 0; e < ref.size(); ++e) {
    double err;
    if (std::isinf(ref[e]))
      err = got[e] == ref[e] ? 0 : std::numeric_limits<double>::infinity();
    else
      err = std::isfinite(got[e]) ? std::fabs(got[e] - ref[e])
                                  : std::numeric_limits<double>::infinity();
    if (!(err <= bound)) ++bad;
    if (!(err <= worst_err)) {
      worst_err = err;
      worst = static_cast<int64_t>(e);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << ref.size() << " elements off by more than " << bound
         << "; worst at " << worst << ": got " << got[worst] << ", expected " << ref[worst];
}

double max_finite_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::fabs(v));
  return m;
}

class CpuMaskBand : public ::testing::TestWithParam<BandCase> {};

TEST_P(CpuMaskBand, ForwardBackwardEveryIsa) {
  const BandCase& c = GetParam();
  const Inputs in = make_inputs(c);
  const Expected e = expected(c, in);
  // float64: the kernels compute in double (out agrees to ~1e-15); lse is stored as float32.
  // float32: the CPU grid test's bounds (observed errors are 4-10x below them).
  const bool f64 = c.dtype == DType::Float64;
  const double rtol = f64 ? 1e-10 : 2e-5, lse_rtol = f64 ? 2e-7 : 2e-5;
  const auto sets = kernel_sets();
  ASSERT_FALSE(sets.empty());
  for (const cpu::KernelSet* k : sets) {
    SCOPED_TRACE(std::string("kernels ") + k->name);
    auto run = [&](int design) {
      return f64 ? run_kernels<double>(*k, c, in, design) : run_kernels<float>(*k, c, in, design);
    };
    const Got g = run(cpu::Parallel::kFused);
    // The split passes give the same bits (the fused backward's dQ sums the same dS K terms in
    // the same order).
    const Got split = run(cpu::Parallel::kSplit);
    auto same_bits = [](const std::vector<double>& a, const std::vector<double>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
    };
    EXPECT_TRUE(same_bits(g.dq, split.dq)) << "dq: the fused and split backward differ";
    EXPECT_TRUE(same_bits(g.dk, split.dk)) << "dk: the fused and split backward differ";
    EXPECT_TRUE(same_bits(g.dv, split.dv)) << "dv: the fused and split backward differ";
    EXPECT_TRUE(close("out", g.out, e.out, rtol * max_finite_abs(e.out)));
    EXPECT_TRUE(close("lse", g.lse, e.lse, lse_rtol * max_finite_abs(e.lse)));
    EXPECT_TRUE(close("dq", g.dq, e.dq, rtol * e.mag_dq));
    EXPECT_TRUE(close("dk", g.dk, e.dk, rtol * e.mag_dk));
    EXPECT_TRUE(close("dv", g.dv, e.dv, rtol * e.mag_dv));
    // Rows that see no key: out and dq exactly 0 (lse -inf is checked above). Keys that no row
    // sees: dk and dv exactly 0.
    const int64_t D = c.head_dim;
    int64_t bad = 0;
    for (size_t r = 0; r < e.row_sees_key.size(); ++r)
      if (!e.row_sees_key[r])
        for (int64_t x = 0; x < D; ++x)
          bad += !(g.out[r * D + x] == 0.0) + !(g.dq[r * D + x] == 0.0);
    for (size_t r = 0; r < e.key_seen.size(); ++r)
      if (!e.key_seen[r])
        for (int64_t x = 0; x < D; ++x)
          bad += !(g.dk[r * D + x] == 0.0) + !(g.dv[r * D + x] == 0.0);
    EXPECT_EQ(bad, 0) << "nonzero out/dq of rows without keys or dk/dv of unseen keys";
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, CpuMaskBand, ::testing::ValuesIn(make_cases()),
                         [](const ::testing::TestParamInfo<BandCase>& info) {
                           return info.param.name;
                         });

// The grid holds what it claims: windows with each mask, rows without keys next to rows with
// keys, unseen keys, problems whose band is empty, and more than one tile each way.
TEST(CpuMaskBandCoverage, GridHoldsTheEdges) {
  bool window_mask[3] = {false, false, false}, partial_rows = false, unseen_keys = false,
       empty_band = false, multi_tile = false, two_sided = false;
  for (const BandCase& c : make_cases()) {
    const MaskRule r = c.rule();
    if (c.window_left >= 0 || c.window_right >= 0) window_mask[c.mask] = true;
    two_sided |= c.window_left >= 0 && c.window_right >= 0 && c.mask == 0;
    int64_t rows = 0, keys = 0;
    for (int64_t i = 0; i < c.seq_q; ++i) rows += r.key_begin(i) < r.key_end(i, c.seq_kv);
    for (int64_t j = 0; j < c.seq_kv; ++j) keys += r.row_begin(j) < r.row_end(j, c.seq_q);
    partial_rows |= rows > 0 && rows < c.seq_q;
    unseen_keys |= keys > 0 && keys < c.seq_kv;
    empty_band |= rows == 0;
    multi_tile |= c.seq_q > 2 * 64 && c.seq_kv > 2 * 128 &&
                  (c.window_left >= 0 || c.window_right >= 0);
  }
  EXPECT_TRUE(window_mask[0] && window_mask[1] && window_mask[2]);
  EXPECT_TRUE(partial_rows);
  EXPECT_TRUE(unseen_keys);
  EXPECT_TRUE(empty_band);
  EXPECT_TRUE(multi_tile);
  EXPECT_TRUE(two_sided);
}

}  // namespace
}  // namespace flashattn::test
