// Shared helpers of the C++ test suite: run a testing::Problem through the library and through the
// float64 reference, and compare.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"
#include "testing/reference.hpp"

namespace flashattn::test {

using testing::Problem;
using testing::ProblemConfig;

using testing::make_config;

inline testing::RefShape ref_shape(const ProblemConfig& c) {
  return testing::RefShape{c.batch, c.heads_q, c.heads_kv, c.seq_q, c.seq_kv, c.head_dim};
}

inline Options options_for(const ProblemConfig& c, int32_t num_threads = 0) {
  Options o;
  o.mask = c.mask;
  o.softmax_scale = c.softmax_scale;
  o.num_threads = num_threads;
  return o;
}

inline void run_forward(Problem& p, const Options& o) {
  forward(p.q.view, p.k.view, p.v.view, p.out.view, p.lse.view, o);
}

inline void run_backward(Problem& p, const Options& o) {
  backward(p.q.view, p.k.view, p.v.view, p.out.view, p.dout.view, p.lse.view, p.dq.view,
           p.dk.view, p.dv.view, o);
}

// The float64 reference on exactly the values stored in the problem's inputs (so for
// float16/bfloat16 it sees the rounded inputs the kernel sees), with the same float32 scale.
struct Reference {
  testing::RefForward fwd;
  testing::RefBackward bwd;
};
inline Reference reference_for(const Problem& p) {
  const auto q = p.to_double(p.q), k = p.to_double(p.k), v = p.to_double(p.v),
             dout = p.to_double(p.dout);
  const double scale = static_cast<double>(p.cfg.scale());
  Reference r;
  r.fwd = testing::reference_forward(ref_shape(p.cfg), q, k, v, scale, p.cfg.mask);
  r.bwd = testing::reference_backward(ref_shape(p.cfg), q, k, v, dout, scale, p.cfg.mask);
  return r;
}

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

}  // namespace flashattn::test
