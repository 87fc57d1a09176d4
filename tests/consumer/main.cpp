// Calls flashattn::forward on a tiny problem and checks it against a direct computation.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <flashattn/flashattn.hpp>

int main() {
  const int64_t S = 3, D = 4;  // B = H = 1
  std::vector<float> q(S * D), k(S * D), v(S * D), out(S * D, NAN), lse(S, NAN);
  for (int i = 0; i < S * D; ++i) {
    q[i] = 0.1f * static_cast<float>(i % 5) - 0.2f;
    k[i] = 0.05f * static_cast<float>(i % 7) - 0.1f;
    v[i] = static_cast<float>(i) * 0.25f;
  }
  using flashattn::DType;
  using flashattn::Tensor;
  flashattn::Options opts;
  opts.mask = flashattn::Mask::CausalTopLeft;
  try {
    flashattn::forward(Tensor::contiguous(q.data(), DType::Float32, 1, 1, S, D),
                       Tensor::contiguous(k.data(), DType::Float32, 1, 1, S, D),
                       Tensor::contiguous(v.data(), DType::Float32, 1, 1, S, D),
                       Tensor::contiguous(out.data(), DType::Float32, 1, 1, S, D),
                       Tensor::lse(lse.data(), 1, 1, S), opts);
  } catch (const flashattn::Error& e) {
    std::fprintf(stderr, "flashattn::forward failed: %s\n", e.what());
    return 1;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  double worst = 0;
  for (int i = 0; i < S; ++i) {
    std::vector<double> p(i + 1);
    double m = -INFINITY, z = 0;
    for (int j = 0; j <= i; ++j) {
      double s = 0;
      for (int x = 0; x < D; ++x) s += double(q[i * D + x]) * k[j * D + x];
      p[j] = s * scale;
      m = std::fmax(m, p[j]);
    }
    for (int j = 0; j <= i; ++j) z += std::exp(p[j] - m);
    worst = std::fmax(worst, std::fabs(lse[i] - (m + std::log(z))));
    for (int x = 0; x < D; ++x) {
      double o = 0;
      for (int j = 0; j <= i; ++j) o += std::exp(p[j] - m) / z * v[j * D + x];
      worst = std::fmax(worst, std::fabs(out[i * D + x] - o));
    }
  }
  if (!(worst < 1e-4)) {
    std::fprintf(stderr, "flashattn::forward disagrees with the direct computation: %g\n", worst);
    return 1;
  }
  std::printf("consumer: flashattn::forward ok (max error %g)\n", worst);
  return 0;
}
