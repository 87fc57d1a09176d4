#include "testing/naive_lowp.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>

#include "core/half.hpp"
#include "core/mask.hpp"
#include "testing/parallel.hpp"

namespace flashattn::testing {
namespace {

// C[M,N] = sum_k A[m*sam + k*sak] * B[k*ldb + n], accumulated in float32 (A^T costs nothing).
// Row updates (axpy over n) keep the inner loop contiguous so it vectorises without reordering
// any one element's sum.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
          const float* B, int64_t ldb, float* C) {
  for (int64_t m = 0; m < M; ++m) {
    float* c = C + m * N;
    std::fill(c, c + N, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[m * sam + k * sak];
      if (a == 0.0f) continue;  // masked P / dS entries: adding 0 * finite changes nothing
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

// dst[c*rows + r] = src[r*cols + c] for each of `count` [rows, cols] matrices.
std::vector<float> transpose_each(const std::vector<float>& src, int64_t count, int64_t rows,
                                  int64_t cols) {
  std::vector<float> t(src.size());
  for (int64_t h = 0; h < count; ++h)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        t[(h * cols + c) * rows + r] = src[(h * rows + r) * cols + c];
  return t;
}

}  // namespace

float round_to(DType dtype, float x) {
  return dtype == DType::BFloat16 ? bf16_to_float(float_to_bf16(x))
                                  : fp16_to_float(float_to_fp16(x));
}

LowpResult naive_lowp(const LowpShape& s, DType dtype, const float* q, const float* k,
                      const float* v, const float* dout, float scale, Mask mask, int num_threads) {
  const int threads = resolve_threads(num_threads);
  const int64_t B = s.batch, Hq = s.heads_q, Hkv = s.heads_kv, Sq = s.seq_q, Skv = s.seq_kv,
                D = s.head_dim, group = Hq / Hkv;
  auto r = [dtype](float x) { return round_to(dtype, x); };
  auto rounded = [&](const float* x, int64_t n) {
    std::vector<float> y(x, x + n);
    for (float& e : y) e = r(e);
    return y;
  };
  const int64_t nq = B * Hq * Sq * D, nk = B * Hkv * Skv * D;
  const std::vector<float> Q = rounded(q, nq), K = rounded(k, nk), V = rounded(v, nk),
                           dO = rounded(dout, nq);
  const std::vector<float> Kt = transpose_each(K, B * Hkv, Skv, D),
                           Vt = transpose_each(V, B * Hkv, Skv, D);
  const MaskRule rule = make_mask_rule(static_cast<int32_t>(mask), Sq, Skv);

  LowpResult res;
  res.out.assign(nq, 0.0f);
  res.lse.assign(B * Hq * Sq, 0.0f);
  res.dq.assign(nq, 0.0f);
  res.dk.assign(nk, 0.0f);
  res.dv.assign(nk, 0.0f);
  // Per query head dK_h, dV_h (each already rounded, as autograd stores them), summed per group
  // below.
  std::vector<float> dk_h(B * Hq * Skv * D), dv_h(B * Hq * Skv * D);

  parallel_for(B * Hq, threads, [&](int64_t bh) {
    const int64_t kvh = (bh / Hq) * Hkv + (bh % Hq) / group;
    const float* Qh = Q.data() + bh * Sq * D;
    const float* dOh = dO.data() + bh * Sq * D;
    const float* Kh = K.data() + kvh * Skv * D;
    const float* Vh = V.data() + kvh * Skv * D;
    std::vector<float> P(Sq * Skv), T(Sq * Skv), acc(std::max(Sq, Skv) * D);

    // ---- forward
    gemm(Sq, Skv, D, Qh, D, 1, Kt.data() + kvh * D * Skv, Skv, P.data());  // S0 (unrounded)
    for (int64_t i = 0; i < Sq; ++i) {
      float* row = P.data() + i * Skv;
      // The keys row i sees: [begin, end) (core/mask.hpp), possibly empty.
      const int64_t begin = rule.key_begin(i), end = rule.key_end(i, Skv);
      float* lse = &res.lse[bh * Sq + i];
      if (begin >= end) {
        std::fill(row, row + Skv, 0.0f);
        *lse = -std::numeric_limits<float>::infinity();
        continue;
      }
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = begin; j < end; ++j) {
        row[j] = r(scale * r(row[j]));  // S = r(scale * r(S0))
        m = std::max(m, row[j]);
      }
      float sum = 0.0f;
      for (int64_t j = begin; j < end; ++j) sum += std::exp(row[j] - m);
      *lse = r(m + std::log(sum));
      for (int64_t j = begin; j < end; ++j) row[j] = r(std::exp(row[j] - m) / sum);
      std::fill(row, row + begin, 0.0f);
      std::fill(row + end, row + Skv, 0.0f);
    }
    gemm(Sq, D, Skv, P.data(), Skv, 1, Vh, D, acc.data());
    for (int64_t e = 0; e < Sq * D; ++e) res.out[bh * Sq * D + e] = r(acc[e]);

    // ---- backward
    gemm(Sq, Skv, D, dOh, D, 1, Vt.data() + kvh * D * Skv, Skv, T.data());  // dP (unrounded)
    for (int64_t i = 0; i < Sq; ++i) {
      const float* p = P.data() + i * Skv;
      float* t = T.data() + i * Skv;
      float rs = 0.0f;
      for (int64_t j = 0; j < Skv; ++j) {
        t[j] = r(t[j]);  // dP
        rs += p[j] * t[j];
      }
      for (int64_t j = 0; j < Skv; ++j) t[j] = r(scale * r(p[j] * (t[j] - rs)));  // dS0
    }
    gemm(Sq, D, Skv, T.data(), Skv, 1, Kh, D, acc.data());
    for (int64_t e = 0; e < Sq * D; ++e) res.dq[bh * Sq * D + e] = r(acc[e]);
    gemm(Skv, D, Sq, T.data(), 1, Skv, Qh, D, acc.data());
    for (int64_t e = 0; e < Skv * D; ++e) dk_h[bh * Skv * D + e] = r(acc[e]);
    gemm(Skv, D, Sq, P.data(), 1, Skv, dOh, D, acc.data());
    for (int64_t e = 0; e < Skv * D; ++e) dv_h[bh * Skv * D + e] = r(acc[e]);
  });

  // Group sums in float32, one rounding (repeat_interleave's backward).
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t e = 0; e < Skv * D; ++e) {
        float sk = 0.0f, sv = 0.0f;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t bh = b * Hq + hk * group + g;
          sk += dk_h[bh * Skv * D + e];
          sv += dv_h[bh * Skv * D + e];
        }
        res.dk[(b * Hkv + hk) * Skv * D + e] = r(sk);
        res.dv[(b * Hkv + hk) * Skv * D + e] = r(sv);
      }
  return res;
}

}  // namespace flashattn::testing
