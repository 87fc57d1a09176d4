#include "testing/naive.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <thread>

#include "core/mask.hpp"
#include "testing/parallel.hpp"

namespace flashattn::testing {
namespace {

// Rows per task: enough work to amortise a task, small enough to balance 2..64 threads.
constexpr int64_t kRowsPerTask = 128;

// C[M,N] (+)= alpha * A[M,K] * B[K,N]; A is read as A[m*sam + k*sak], so A^T costs nothing.
// Written as row updates (axpy over N) so the inner loop is contiguous and vectorises without
// reordering a reduction; four rows of C share each row of B. On x86-64 GCC/Clang build an AVX2
// and an AVX-512 clone picked at load time, so the baseline is not handicapped by the SSE2 default
// against a library that dispatches at run time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#endif
void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t sam, int64_t sak,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    float* c0 = C + m * ldc;
    float* c1 = c0 + ldc;
    float* c2 = c1 + ldc;
    float* c3 = c2 + ldc;
    if (!accumulate)
      for (int64_t n = 0; n < N; ++n) c0[n] = c1[n] = c2[n] = c3[n] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float* a = A + m * sam + k * sak;
      const float a0 = alpha * a[0], a1 = alpha * a[sam], a2 = alpha * a[2 * sam],
                  a3 = alpha * a[3 * sam];
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) {
        const float bn = b[n];
        c0[n] += a0 * bn;
        c1[n] += a1 * bn;
        c2[n] += a2 * bn;
        c3[n] += a3 * bn;
      }
    }
  }
  for (; m < M; ++m) {
    float* c = C + m * ldc;
    if (!accumulate)
      for (int64_t n = 0; n < N; ++n) c[n] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float a = alpha * A[m * sam + k * sak];
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

// dst[c*rows + r] = src[r*cols + c]
void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// Transposed copies of one [S, D] matrix per (batch, kv head): [D, S].
std::vector<float> transpose_heads(const NaiveShape& s, const float* x, int threads) {
  const int64_t heads = s.batch * s.heads_kv, per = s.seq_kv * s.head_dim;
  std::vector<float> t(static_cast<size_t>(heads * per));
  parallel_for(heads, threads,
               [&](int64_t h) { transpose(x + h * per, s.seq_kv, s.head_dim, t.data() + h * per); });
  return t;
}

int64_t row_blocks(int64_t rows) { return (rows + kRowsPerTask - 1) / kRowsPerTask; }

}  // namespace

double naive_matrix_bytes(const NaiveShape& s) {
  return 2.0 * 4.0 * static_cast<double>(s.batch) * s.heads_q * s.seq_q * s.seq_kv;
}

void naive_forward(const NaiveShape& s, const float* q, const float* k, const float* v, float scale,
                   Mask mask, float* out, float* lse, NaiveSaved& saved, int num_threads) {
  const int threads = resolve_threads(num_threads);
  const int64_t Sq = s.seq_q, Skv = s.seq_kv, D = s.head_dim, group = s.heads_q / s.heads_kv;
  const MaskRule rule = make_mask_rule(static_cast<int32_t>(mask), Sq, Skv);
  saved.p.assign(static_cast<size_t>(s.batch * s.heads_q * Sq * Skv), 0.0f);
  const std::vector<float> kt = transpose_heads(s, k, threads);
  const int64_t blocks = row_blocks(Sq);

  parallel_for(s.batch * s.heads_q * blocks, threads, [&](int64_t task) {
    const int64_t bh = task / blocks, i0 = (task % blocks) * kRowsPerTask;
    const int64_t i1 = std::min(Sq, i0 + kRowsPerTask);
    const int64_t kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / group;
    float* P = saved.p.data() + bh * Sq * Skv;
    // S = scale * Q K^T for rows [i0, i1), written where P will live.
    gemm(i1 - i0, Skv, D, scale, q + (bh * Sq + i0) * D, D, 1, kt.data() + kvh * Skv * D, Skv,
         P + i0 * Skv, Skv, false);
    for (int64_t i = i0; i < i1; ++i) {
      float* row = P + i * Skv;
      // The keys row i sees: [begin, end) (core/mask.hpp), possibly empty.
      const int64_t begin = rule.key_begin(i), end = rule.key_end(i, Skv);
      float* l = lse + bh * Sq + i;
      if (begin >= end) {  // no visible key: P = 0, lse = -inf, O = 0 below
        std::fill(row, row + Skv, 0.0f);
        *l = -std::numeric_limits<float>::infinity();
        continue;
      }
      float m = row[begin];
      for (int64_t j = begin + 1; j < end; ++j) m = std::max(m, row[j]);
      float sum = 0.0f;
      for (int64_t j = begin; j < end; ++j) {
        row[j] = std::exp(row[j] - m);
        sum += row[j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = begin; j < end; ++j) row[j] *= inv;
      std::fill(row, row + begin, 0.0f);
      std::fill(row + end, row + Skv, 0.0f);
      *l = m + std::log(sum);
    }
    // O = P V
    gemm(i1 - i0, D, Skv, 1.0f, P + i0 * Skv, Skv, 1, v + kvh * Skv * D, D,
         out + (bh * Sq + i0) * D, D, false);
  });
}

void naive_backward(const NaiveShape& s, const float* q, const float* k, const float* v,
                    const float* dout, const NaiveSaved& saved, float scale, float* dq, float* dk,
                    float* dv, int num_threads) {
  const int threads = resolve_threads(num_threads);
  const int64_t Sq = s.seq_q, Skv = s.seq_kv, D = s.head_dim, group = s.heads_q / s.heads_kv;
  const std::vector<float> vt = transpose_heads(s, v, threads);
  std::vector<float> ds(static_cast<size_t>(s.batch * s.heads_q * Sq * Skv));

  // Pass 1, per query head and row block: dP = dO V^T; dS = P * (dP - rowsum(P * dP));
  // dQ = scale * dS K. Masked entries have P = 0, hence dS = 0: the mask needs no second look.
  const int64_t qblocks = row_blocks(Sq);
  parallel_for(s.batch * s.heads_q * qblocks, threads, [&](int64_t task) {
    const int64_t bh = task / qblocks, i0 = (task % qblocks) * kRowsPerTask;
    const int64_t i1 = std::min(Sq, i0 + kRowsPerTask);
    const int64_t kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / group;
    const float* P = saved.p.data() + bh * Sq * Skv;
    float* dS = ds.data() + bh * Sq * Skv;
    gemm(i1 - i0, Skv, D, 1.0f, dout + (bh * Sq + i0) * D, D, 1, vt.data() + kvh * Skv * D, Skv,
         dS + i0 * Skv, Skv, false);
    for (int64_t i = i0; i < i1; ++i) {
      const float* p = P + i * Skv;
      float* d = dS + i * Skv;
      float rs = 0.0f;
      for (int64_t j = 0; j < Skv; ++j) rs += p[j] * d[j];
      for (int64_t j = 0; j < Skv; ++j) d[j] = p[j] * (d[j] - rs);
    }
    gemm(i1 - i0, D, Skv, scale, dS + i0 * Skv, Skv, 1, k + kvh * Skv * D, D,
         dq + (bh * Sq + i0) * D, D, false);
  });

  // Pass 2, per kv head and key block, summing over the group's query heads in a fixed order:
  // dV = sum_h P_h^T dO_h; dK = scale * sum_h dS_h^T Q_h.
  const int64_t kblocks = row_blocks(Skv);
  parallel_for(s.batch * s.heads_kv * kblocks, threads, [&](int64_t task) {
    const int64_t kvh = task / kblocks, j0 = (task % kblocks) * kRowsPerTask;
    const int64_t j1 = std::min(Skv, j0 + kRowsPerTask);
    const int64_t b = kvh / s.heads_kv, hk = kvh % s.heads_kv;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t bh = b * s.heads_q + hk * group + g;
      const float* P = saved.p.data() + bh * Sq * Skv;
      const float* dS = ds.data() + bh * Sq * Skv;
      gemm(j1 - j0, D, Sq, 1.0f, P + j0, 1, Skv, dout + bh * Sq * D, D, dv + (kvh * Skv + j0) * D,
           D, g > 0);
      gemm(j1 - j0, D, Sq, scale, dS + j0, 1, Skv, q + bh * Sq * D, D, dk + (kvh * Skv + j0) * D,
           D, g > 0);
    }
  });
}

}  // namespace flashattn::testing
