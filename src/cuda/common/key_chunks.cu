// The merge of the float32 forward's key chunks (ForwardPlan::key_chunk): a long key sequence's
// forward runs one chunk of keys at a time, each chunk's (O, LSE) written into the call's out and
// lse, and this pass folds each chunk into float64 row sums. A float32 running sum over 2^20 keys
// drifts by up to tiles * 2^-24 (~1e-3 when every tile adds the same value); split into chunks of
// at most 256 tiles and summed across chunks in float64 it stays under 1e-5. One warp per row
// (head_dim <= 256 values); memory-bound and small beside a chunk's forward.
#include <cmath>

#include "core/params.hpp"
#include "cuda/host/check.hpp"
#include "cuda/host/launch.hpp"

namespace flashattn::cuda {
namespace dev {

__global__ void key_chunk_merge_kernel(const __grid_constant__ KeyChunkMerge m) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= m.rows) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t i = row % m.seq_q, h = row / m.seq_q % m.heads_q, b = row / (m.seq_q * m.heads_q);
  float* o = static_cast<float*>(m.out.ptr) + b * m.out.sb + h * m.out.sh + i * m.out.ss;
  float* lse = m.lse.ptr + b * m.lse.sb + h * m.lse.sh + i * m.lse.ss;
  double* acc = m.acc + row * m.head_dim;
  double* mp = m.acc + m.rows * m.head_dim + row;
  double* lp = mp + m.rows;
  const double lc = *lse;
  const double mx_old = m.first ? -INFINITY : *mp, l_old = m.first ? 0.0 : *lp;
  // No chunk before this one gave the row a finite LSE: the sums hold nothing yet (their values
  // are 0, or NaN where a chunk's visible scores were all -inf - see below).
  const bool none_yet = mx_old == -INFINITY;
  // This chunk's weight against the new maximum, and the old sums' scale. A NaN LSE fails every
  // comparison and its weight exp(NaN) makes the row NaN, as in one pass; an infinite LSE takes
  // the whole weight (exp(inf - inf) avoided).
  double mx = mx_old, keep = 1.0, w = 0.0;
  if (lc != -INFINITY) {
    if (none_yet || lc > mx_old) {
      keep = none_yet ? 0.0 : exp(mx_old - lc);
      w = 1.0;
      mx = lc;
    } else {
      w = lc == mx_old ? 1.0 : exp(lc - mx_old);
    }
  }
  const double l = lc == -INFINITY ? l_old : (none_yet ? w : l_old * keep + w);
  for (int64_t d = lane; d < m.head_dim; d += 32) {
    const double prev = m.first ? 0.0 : acc[d];
    double a;
    if (lc == -INFINITY) {
      // No finite score of the row in this chunk: O is 0 (no visible key) or NaN (visible keys
      // whose scores are all -inf). The NaN stands only while no chunk has a finite score, as a
      // single pass gives it only for rows whose every visible score is -inf.
      a = none_yet && isnan(o[d]) ? static_cast<double>(NAN) : prev;
    } else {
      a = (none_yet ? 0.0 : prev * keep) + w * static_cast<double>(o[d]);
    }
    // (l == 0: no chunk gave a finite LSE: O is the 0 or NaN kept above, LSE -inf.)
    if (m.last) o[d] = static_cast<float>(l == 0.0 ? a : a / l);
    else acc[d] = a;
  }
  __syncwarp();  // (every lane has read lse, M and L above before lane 0 writes them)
  if (lane == 0) {
    if (m.last) *lse = l == 0.0 ? -INFINITY : static_cast<float>(mx + log(l));
    else *mp = mx, *lp = l;
  }
}

}  // namespace dev

size_t key_chunk_acc_bytes(const Shape& s) {
  const size_t rows = static_cast<size_t>(s.batch * s.heads_q * s.seq_q);
  return rows * (static_cast<size_t>(s.head_dim) + 2) * sizeof(double);
}

void launch_key_chunk_merge(const KeyChunkMerge& m, cudaStream_t stream) {
  constexpr int kRowsPerBlock = 4;  // warps of 32 threads, a row each
  if (m.rows == 0) return;
  launch_checked(dev::key_chunk_merge_kernel, dim3(grid_blocks(m.rows, kRowsPerBlock)), 32 * kRowsPerBlock, 0,
                 stream, m, "float32 key-chunk merge kernel launch");
}

}  // namespace flashattn::cuda
