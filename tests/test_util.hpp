// Shared helpers of the C++ test suite: run a testing::Problem through the library and through the
// float64 reference, and compare.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"
#include "testing/reference.hpp"

namespace flashattn::test {

using testing::Problem;
using testing::ProblemConfig;

using testing::make_config;

// An int32 [n] tensor over x (varlen cu_seqlens / seqused_k, kvcache index tensors) on the CPU.
inline Tensor index_tensor(std::vector<int32_t>& x) {
  Tensor t;
  t.data = x.data();
  t.dtype = DType::Int32;
  t.ndim = 1;
  t.shape[0] = static_cast<int64_t>(x.size());
  t.stride[0] = 1;
  return t;
}

inline testing::RefShape ref_shape(const ProblemConfig& c) {
  return testing::RefShape{c.batch, c.heads_q, c.heads_kv, c.seq_q, c.seq_kv, c.head_dim};
}

// The options of a configuration without its ALiBi slopes (which live in a Problem: use the
// overload below).
inline Options options_for(const ProblemConfig& c, int32_t num_threads = 0) {
  Options o;
  o.mask = c.mask;
  o.softmax_scale = c.softmax_scale;
  o.num_threads = num_threads;
  o.window_left = c.window_left;
  o.window_right = c.window_right;
  o.softcap = c.softcap;
  return o;
}

// The options of a problem including its score modifications (window, softcap, ALiBi slopes).
inline Options options_for(const Problem& p, int32_t num_threads = 0) { return p.options(num_threads); }

inline void run_forward(Problem& p, const Options& o) {
  forward(p.q.view, p.k.view, p.v.view, p.out.view, p.lse.view, o);
}

inline void run_backward(Problem& p, const Options& o) {
  backward(p.q.view, p.k.view, p.v.view, p.out.view, p.dout.view, p.lse.view, p.dq.view,
           p.dk.view, p.dv.view, o);
}

// The float64 reference on exactly the values stored in the problem's inputs (so for
// float16/bfloat16 it sees the rounded inputs the kernel sees), with the same float32 scale and
// the problem's window, softcap and (float32) ALiBi slopes.
struct Reference {
  testing::RefForward fwd;
  testing::RefBackward bwd;
};
inline Reference reference_for(const Problem& p) {
  const auto q = p.to_double(p.q), k = p.to_double(p.k), v = p.to_double(p.v),
             dout = p.to_double(p.dout);
  const double scale = static_cast<double>(p.cfg.scale());
  Reference r;
  const testing::RefMods mods = p.ref_mods();
  r.fwd = testing::reference_forward(ref_shape(p.cfg), q, k, v, scale, p.cfg.mask, mods);
  r.bwd = testing::reference_backward(ref_shape(p.cfg), q, k, v, dout, scale, p.cfg.mask, mods);
  return r;
}

// FLASHATTN_CPU_BWD (the CPU backward's design: split / fused) set for the guard's lifetime; the
// driver reads it per call.
class DesignEnv {
 public:
  explicit DesignEnv(const char* design) {
    const char* old = std::getenv("FLASHATTN_CPU_BWD");
    had_ = old != nullptr;
    if (had_) old_ = old;
    setenv("FLASHATTN_CPU_BWD", design, 1);
  }
  ~DesignEnv() {
    if (had_)
      setenv("FLASHATTN_CPU_BWD", old_.c_str(), 1);
    else
      unsetenv("FLASHATTN_CPU_BWD");
  }
  DesignEnv(const DesignEnv&) = delete;
  DesignEnv& operator=(const DesignEnv&) = delete;

 private:
  bool had_ = false;
  std::string old_;
};

// Raw bytes of every buffer of a problem (inputs and outputs), for "nothing was written" and
// bitwise-determinism checks.
struct Snapshot {
  std::vector<std::vector<unsigned char>> bytes;
  bool operator==(const Snapshot& o) const { return bytes == o.bytes; }
};
inline Snapshot snapshot(const Problem& p) {
  Snapshot s;
  for (const testing::HostTensor* t : {&p.q, &p.k, &p.v, &p.dout, &p.out, &p.lse, &p.dq, &p.dk, &p.dv})
    s.bytes.push_back(t->bytes);
  return s;
}

inline std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "\"" : ", \"") + x + "\"";
  return s;
}

// Runs f, which must throw flashattn::Error with `status` and a message containing every needle.
template <class F>
::testing::AssertionResult throws_error(F&& f, Status status,
                                        const std::vector<std::string>& needles) {
  try {
    f();
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (e.status() != status)
      return ::testing::AssertionFailure()
             << "status " << static_cast<int>(e.status()) << ", expected "
             << static_cast<int>(status) << "; message: " << msg;
    for (const auto& n : needles)
      if (msg.find(n) == std::string::npos)
        return ::testing::AssertionFailure()
               << "message \"" << msg << "\" does not contain \"" << n << "\" (expected all of "
               << join(needles) << ")";
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-flashattn exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw (expected status "
                                       << static_cast<int>(status) << " and " << join(needles)
                                       << ")";
}

// ---- strided views (packed and fused layouts) -------------------------------------------------
// Logical [B,H,S,D] (or [B,H,S]) contents of any strided view, in double.
inline std::vector<double> gather(const Tensor& t) {
  std::vector<double> r;
  const int64_t n3 = t.ndim == 4 ? t.shape[3] : 1;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c)
        for (int64_t d = 0; d < n3; ++d)
          r.push_back(testing::load_element(
              t.data, t.dtype,
              a * t.stride[0] + b * t.stride[1] + c * t.stride[2] + (t.ndim == 4 ? d * t.stride[3] : 0)));
  return r;
}

// Fills a [B,H,S,D] view with U(-2, 2) values from a linear congruential generator started at
// `state`.
inline void fill_uniform(const Tensor& t, uint64_t state) {
  uint64_t s = state;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c)
        for (int64_t d = 0; d < t.shape[3]; ++d) {
          s = s * 6364136223846793005ull + 1442695040888963407ull;
          const double x = static_cast<double>(s >> 11) * 0x1.0p-53 * 4 - 2;  // U(-2, 2)
          testing::store_element(t.data, t.dtype,
                                 a * t.stride[0] + b * t.stride[1] + c * t.stride[2] + d, x);
        }
}

// Forward + backward on the views (default scale), every output against the float64 reference
// computed on their logical contents: relative error <= `tol` (LSE <= 2e-5), no NaN.
inline void check_views_against_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                          const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                          const Tensor& dk, const Tensor& dv, Mask mask, double tol) {
  Options o;
  o.mask = mask;
  ASSERT_NO_THROW(forward(q, k, v, out, lse, o));
  ASSERT_NO_THROW(backward(q, k, v, out, dout, lse, dq, dk, dv, o));
  const testing::RefShape s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]};
  const double scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.shape[3])));
  const auto f = testing::reference_forward(s, gather(q), gather(k), gather(v), scale, mask);
  const auto g =
      testing::reference_backward(s, gather(q), gather(k), gather(v), gather(dout), scale, mask);
  const std::pair<const Tensor*, const std::vector<double>*> checks[] = {
      {&out, &f.out}, {&lse, &f.lse}, {&dq, &g.dq}, {&dk, &g.dk}, {&dv, &g.dv}};
  const char* names[] = {"out", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 5; ++i) {
    const auto e = testing::compare(gather(*checks[i].first), *checks[i].second);
    EXPECT_EQ(e.nan, 0) << names[i] << ": " << e.str();
    EXPECT_LE(e.rel, i == 1 ? 2e-5 : tol) << names[i] << ": " << e.str();
  }
}

}  // namespace flashattn::test
