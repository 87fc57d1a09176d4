// The float32 tanh of the CPU kernels' softcap (kernels_impl.hpp tanhv), every instruction set
// this CPU runs, against double tanh: a sweep over the float32 values of [0, 40] (every 257th bit
// pattern, both signs, plus every float around the switch between its two forms at 0.625), and
// the special values. Relative error bound 2.5e-7 (about 4 float32 ulps; observed 1.8e-7): the
// softcap's logit c * tanh(x / c) then carries no more relative error than the float32 product
// it comes from.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu/kernels.hpp"

namespace flashattn::test {
namespace {

std::vector<const cpu::KernelSet*> runnable_sets() {
  std::vector<const cpu::KernelSet*> all;
#if defined(FLASHATTN_CPU_X86)
  all.push_back(&cpu::avx512::kernels);
  all.push_back(&cpu::avx2::kernels);
#endif
  all.push_back(&cpu::generic::kernels);
  std::vector<const cpu::KernelSet*> r;
  for (const cpu::KernelSet* k : all)
    if (cpu::supported(*k)) r.push_back(k);
  return r;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(CpuSoftcapTanh, WithinFourUlpsEverywhere) {
  std::vector<float> x;
  const uint32_t top = to_bits(40.0f);
  for (uint32_t b = 0; b <= top; b += 257) x.push_back(from_bits(b));
  const uint32_t mid = to_bits(0.625f);
  for (uint32_t b = mid - 20000; b <= mid + 20000; ++b) x.push_back(from_bits(b));
  const size_t n = x.size();
  for (size_t i = 0; i < n; ++i) x.push_back(-x[i]);
  x.push_back(1e-45f);  // denormal: tanh(x) = x
  std::vector<float> y(x.size());
  for (const cpu::KernelSet* k : runnable_sets()) {
    SCOPED_TRACE(std::string("kernels ") + k->name);
    std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
    // An odd count: the tail that does not fill a vector is computed too.
    k->tanh(x.data(), y.data(), static_cast<int64_t>(x.size()));
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double want = std::tanh(static_cast<double>(x[i]));
      const double err = want == 0 ? std::fabs(y[i]) : std::fabs(y[i] - want) / std::fabs(want);
      if (!(err <= worst)) {
        worst = err;
        at = i;
      }
    }
    EXPECT_LE(worst, 2.5e-7) << "at x = " << x[at] << ": got " << y[at] << ", want "
                             << std::tanh(static_cast<double>(x[at]));
    char text[32];
    std::snprintf(text, sizeof text, "%.3e", worst);
    RecordProperty(std::string("max_rel_err_") + k->name, text);
  }
}

TEST(CpuSoftcapTanh, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> x = {0.0f, -0.0f, inf, -inf, 1e30f, -1e30f, 20.0f, -20.0f,
                                std::numeric_limits<float>::quiet_NaN()};
  const std::vector<float> want = {0.0f, -0.0f, 1.0f, -1.0f, 1.0f, -1.0f, 1.0f, -1.0f};
  for (const cpu::KernelSet* k : runnable_sets()) {
    SCOPED_TRACE(std::string("kernels ") + k->name);
    std::vector<float> y(x.size(), 0.5f);
    k->tanh(x.data(), y.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(y[i], want[i]) << "tanh(" << x[i] << ")";
      EXPECT_EQ(std::signbit(y[i]), std::signbit(want[i])) << "sign of tanh(" << x[i] << ")";
    }
    EXPECT_TRUE(std::isnan(y.back())) << "tanh(NaN) = " << y.back();
  }
}

}  // namespace
}  // namespace flashattn::test
