// Device building blocks shared by every CUDA kernel: asynchronous tile loads, the warp-level
// matrix products for each Math, and the masked softmax pieces. Kernels (kernels.cuh) are written
// in terms of these only.
//
// Register layout (shared by all three maths): a warp owns a 16-row slice of an M x N tile,
// stored as acc[N/8][4] with the m16n8 accumulator layout of mma.sync: for lane = 4*g + t,
//   acc[j][0] = C[g][8j+2t]   acc[j][1] = C[g][8j+2t+1]
//   acc[j][2] = C[g+8][8j+2t] acc[j][3] = C[g+8][8j+2t+1]
// Every index into these arrays is a compile-time constant (fully unrolled loops), so they stay
// in registers.
#pragma once

#include <cstdint>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "core/score.hpp"
#include "cuda/common/config.hpp"
#include "cuda/common/work.hpp"

namespace flashattn::cuda::dev {

constexpr float kLog2e = ScoreTransform::kLog2e;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
// The warpgroup index threadIdx.x / 128 as lane 0 has it: the same value, but one the compiler
// knows is uniform across the warp, so that the shared-memory addresses and wgmma descriptors
// computed from it live in uniform registers (with threadIdx.x / 128 every wgmma's descriptors
// were built in per-thread registers and moved over with R2UR: ~7 instructions per wgmma in the
// float32 kernels' tile loops). Call it where every lane of the warp is active.
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

// Programmatic dependent launch (host: launch_checked_pdl). pdl_wait: returns once the stream's
// previous kernel has completed and its writes are visible (at once when this kernel was not
// launched as a dependent one); pdl_trigger: the next kernel, if launched as a dependent one, may
// start once every CTA of this one has called it or exited. No-ops before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- cp.async --------------------------------------------------------------------------------
// src_bytes < size zero-fills the rest of the destination: padded head-dim columns and rows past
// the sequence end read as 0.0f, so they add nothing to any product.
__device__ __forceinline__ void cp_async16(float* dst, const float* src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(float* dst, const float* src, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Loads rows [0, ROWS) x columns [0, DP) of a row-major global tile (row stride `ld` elements,
// `rows` valid rows, `cols` valid columns) into shared memory with row stride DP + 4, spread over
// all THREADS threads so that consecutive threads read consecutive 16 bytes of a row (coalesced).
// vec16 requires a 16-byte aligned base and a row stride that is a multiple of 4; otherwise the
// same tile goes through 4-byte copies.
template <int ROWS, int DP, int THREADS>
__device__ __forceinline__ void load_tile(float* smem, const float* g, int64_t ld, int rows,
                                          int cols, bool vec16) {
  constexpr int LD = smem_row(DP);
  if (vec16) {
    constexpr int CPR = DP / 4, N = ROWS * CPR;
#pragma unroll
    for (int i = 0; i < (N + THREADS - 1) / THREADS; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * THREADS;
      if (N % THREADS == 0 || c < N) {
        const int r = c / CPR, col = (c % CPR) * 4;
        int bytes = r < rows ? (cols - col) * 4 : 0;
        bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
        cp_async16(smem + r * LD + col, bytes ? g + r * ld + col : g, bytes);
      }
    }
  } else {
    constexpr int N = ROWS * DP;
#pragma unroll 4
    for (int i = 0; i < (N + THREADS - 1) / THREADS; ++i) {
      const int c = static_cast<int>(threadIdx.x) + i * THREADS;
      if (N % THREADS == 0 || c < N) {
        const int r = c / DP, col = c % DP;
        const bool in = r < rows && col < cols;
        cp_async4(smem + r * LD + col, in ? g + r * ld + col : g, in ? 4 : 0);
      }
    }
  }
}

// The software pipeline every kernel runs over its streamed tiles (one cp.async group per tile),
// tiles numbered it < ntiles (an iteration count, or a tile index and the end of the range: any
// numbering whose consecutive tiles alternate the buffers).
// Top of iteration `it`: with two stages, start copying tile it + 1 into the other buffer (the
// barrier that ended it - 1 released it) and wait for tile it only; then a barrier so that every
// thread sees tile it.
template <int STAGES, class Load>
__device__ __forceinline__ void pipeline_acquire(int it, int ntiles, Load&& load) {
  if (STAGES == 2 && it + 1 < ntiles) {
    load(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}
// End of iteration `it`: a barrier (every read of its buffer is done); a single-stage pipeline
// refills its one buffer only now.
template <int STAGES, class Load>
__device__ __forceinline__ void pipeline_release(int it, int ntiles, Load&& load) {
  __syncthreads();
  if (STAGES == 1 && it + 1 < ntiles) {
    load(it + 1, 0);
    cp_async_commit();
  }
}
// After the loop: no copy may still be in flight into shared memory (with no tiles the
// stationary tile's may be) and every thread is done with the tiles the epilogue reuses.
__device__ __forceinline__ void pipeline_drain() {
  cp_async_wait<0>();
  __syncthreads();
}

// A float vector (LSE or D of a query tile): n valid entries with stride `ld`, zero past them.
template <int N, int THREADS>
__device__ __forceinline__ void load_vec(float* smem, const float* g, int64_t ld, int n) {
  for (int c = static_cast<int>(threadIdx.x); c < N; c += THREADS)
    cp_async4(smem + c, c < n ? g + c * ld : g, c < n ? 4 : 0);
}

// ---- TF32 splitting ----------------------------------------------------------------------------
// Round to the nearest TF32 (10 explicit mantissa bits; ties away from zero) with integer ops:
// full-rate ALU instead of the conversion unit. tf32_round_finite: finite x only.
__device__ __forceinline__ uint32_t tf32_round_finite(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
// Any x: a non-finite one skips the rounding add (as cvt.rna.tf32.f32 compiles), so that an
// infinity stays one and a NaN a NaN: the add carried a NaN's low significand bits into the sign
// (the GPU's canonical NaN 0x7fffffff, which every NaN the kernels compute is, became -0 and
// vanished from the products, where training must see it). (A NaN whose payload lies only in the
// 13 dropped bits, which no arithmetic makes, would read as an infinity.)
__device__ __forceinline__ uint32_t tf32_round(float x) {
  const uint32_t u = __float_as_uint(x);
  return (fabsf(x) < INFINITY ? u + 0x1000u : u) & 0xffffe000u;
}
// x = big + small with both TF32: big carries the top 11 significant bits, small the next 11
// (x - big is exact in fp32), so big*big + big*small + small*big misses only small*small,
// ~2^-22 relative: float32-class products from TF32 tensor cores. A NaN x keeps a NaN big
// (tf32_round). An infinite x has big = x and small = round(inf - inf): the GPU's NaN 0x7fffffff,
// which tf32_round_finite turns into -0, so its products stay infinite where the other operand's
// small part is not 0 (0 * inf is NaN: 3xTF32 cannot carry infinities, docs/ALGORITHM.md). (An
// explicit test for it cost the 3xTF32 dK/dV kernel at D = 256 some 300 more spill bytes.)
__device__ __forceinline__ void tf32_split(float x, uint32_t& big, uint32_t& small) {
  big = tf32_round(x);
  small = tf32_round_finite(x - __uint_as_float(big));
}

// float32 -> tf32 (round to nearest, ties away) on the conversion unit, as the bit pattern the
// tensor cores read; unlike tf32_round it keeps infinities and NaNs what they are.
__device__ __forceinline__ uint32_t to_tf32(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
#else
  return tf32_round(x);
#endif
}

// Key (query) slots of the Hopper tf32 kernels: a tf32 A fragment holds k = t and t + 4 of each
// k-step, an accumulator columns 2t and 2t + 1 of each 8-column block, so an accumulator serves as
// the A operand of the next product unshuffled when that product's B operand stores position n
// of each group of 8 in slot tf32_slot(n): k-slot t = position 2t, slot t + 4 = position 2t + 1.
__host__ __device__ constexpr int tf32_slot(int n) { return (n & ~7) | ((n & 7) >> 1) | ((n & 1) << 2); }

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A fragment (16x8, row-major) in the precision of M, converted once and reused for every
// n-tile of a k-step; B fragments are converted where they are loaded.
template <Math M>
struct AFrag {
  uint32_t big[4];
  uint32_t small[M == Math::Tf32x3 ? 4 : 1];
};
template <Math M>
__device__ __forceinline__ AFrag<M> make_afrag(const float (&a)[4]) {
  AFrag<M> f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (M == Math::Tf32x3) tf32_split(a[i], f.big[i], f.small[i]);
    else f.big[i] = tf32_round(a[i]);
  }
  return f;
}

// c += A*B for one 3xTF32 m16n8k8 step with B split already (by mma_step below, or once per CTA
// by split_tile_tf32). Small terms first: they are added while the accumulator is still small.
__device__ __forceinline__ void mma_step_split(float (&c)[4], const AFrag<Math::Tf32x3>& a, const uint32_t (&bb)[2],
                                               const uint32_t (&bs)[2]) {
  mma_tf32(c, a.small, bb);
  mma_tf32(c, a.big, bs);
  mma_tf32(c, a.big, bb);
}

// c += A*B for one m16n8k8 step, in the precision of M.
template <Math M>
__device__ __forceinline__ void mma_step(float (&c)[4], const AFrag<M>& a, const float (&b)[2]) {
  if constexpr (M == Math::Tf32) {
    const uint32_t bb[2] = {tf32_round(b[0]), tf32_round(b[1])};
    mma_tf32(c, a.big, bb);
  } else {
    uint32_t bb[2], bs[2];
    tf32_split(b[0], bb[0], bs[0]);
    tf32_split(b[1], bb[1], bs[1]);
    mma_step_split(c, a, bb, bs);
  }
}

// Splits a tile of shared memory (ROWS x DP floats, row stride LD) into tf32 big (in place) and
// small (at +SOFF floats) with tf32_split, all T threads of the CTA taking 16-byte words
// (callers synchronise before and after). The warp products then read both parts (gemm_nt /
// gemm_rn with SOFF): the same values, so bitwise the same results as splitting per fragment.
template <int ROWS, int DP, int LD, int T, int SOFF>
__device__ __forceinline__ void split_tile_tf32(float* tile) {
  static_assert(DP % 4 == 0 && LD % 4 == 0 && SOFF % 4 == 0, "16-byte words");
  for (int i = static_cast<int>(threadIdx.x); i < ROWS * DP / 4; i += T) {
    float* w = tile + (i / (DP / 4)) * LD + (i % (DP / 4)) * 4;
    const float4 v = *reinterpret_cast<const float4*>(w);
    uint32_t b[4], sm[4];
    tf32_split(v.x, b[0], sm[0]);
    tf32_split(v.y, b[1], sm[1]);
    tf32_split(v.z, b[2], sm[2]);
    tf32_split(v.w, b[3], sm[3]);
    *reinterpret_cast<float4*>(w) = make_float4(__uint_as_float(b[0]), __uint_as_float(b[1]), __uint_as_float(b[2]),
                                                __uint_as_float(b[3]));
    *reinterpret_cast<float4*>(w + SOFF) = make_float4(__uint_as_float(sm[0]), __uint_as_float(sm[1]),
                                                       __uint_as_float(sm[2]), __uint_as_float(sm[3]));
  }
}

// One tile step's operand conversion in the mma.sync kernels (then a barrier): in 3xTF32 mode
// with SOFF the stage's two streamed tiles are split. Nothing otherwise. (tf32 mode rounds per
// fragment: rounding its tiles once per CTA the same way measured 10-19% slower in the float32
// backward on an H200 - the extra barrier per tile costs more than the adds it saves.)
template <Math M, int SOFF, int RB, int DP, int LD, int T>
__device__ __forceinline__ void convert_step_tiles(float* b0, float* b1) {
  if constexpr (SOFF != 0) {
    split_tile_tf32<RB, DP, LD, T, SOFF>(b0);
    split_tile_tf32<RB, DP, LD, T, SOFF>(b1);
    __syncthreads();
  }
}

// ---- warp matrix products -------------------------------------------------------------------
// C[16 x 8*NT] += A[16 x K] * B[8*NT x K]^T, A and B row-major in shared memory (row stride LD),
// A = the warp's 16 rows, B = rows [0, 8*NT). K = KD (multiple of 8).
// SOFF (3xTF32 only, nonzero): B was split in shared memory, its small part SOFF floats further.
template <Math M, int NT, int KD, int LD, int SOFF = 0>
__device__ __forceinline__ void gemm_nt(float (&acc)[NT][4], const float* A, const float* B) {
  static_assert(SOFF == 0 || M == Math::Tf32x3, "only 3xtf32 operands are split in shared memory");
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
  if constexpr (M == Math::Fma) {
    // Each lane computes its 4 accumulator entries as full dot products, 4 k at a time (16-byte
    // loads; lanes of a quad share A rows, lanes with equal t share B rows: broadcasts).
    const float* a0p = A + g * LD;
    const float* a1p = A + (g + 8) * LD;
#pragma unroll 2
    for (int k = 0; k < KD; k += 4) {
      const float4 a0 = *reinterpret_cast<const float4*>(a0p + k);
      const float4 a1 = *reinterpret_cast<const float4*>(a1p + k);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float4 b0 = *reinterpret_cast<const float4*>(B + (8 * j + 2 * t) * LD + k);
        const float4 b1 = *reinterpret_cast<const float4*>(B + (8 * j + 2 * t + 1) * LD + k);
        acc[j][0] = fmaf(a0.x, b0.x, acc[j][0]); acc[j][0] = fmaf(a0.y, b0.y, acc[j][0]);
        acc[j][0] = fmaf(a0.z, b0.z, acc[j][0]); acc[j][0] = fmaf(a0.w, b0.w, acc[j][0]);
        acc[j][1] = fmaf(a0.x, b1.x, acc[j][1]); acc[j][1] = fmaf(a0.y, b1.y, acc[j][1]);
        acc[j][1] = fmaf(a0.z, b1.z, acc[j][1]); acc[j][1] = fmaf(a0.w, b1.w, acc[j][1]);
        acc[j][2] = fmaf(a1.x, b0.x, acc[j][2]); acc[j][2] = fmaf(a1.y, b0.y, acc[j][2]);
        acc[j][2] = fmaf(a1.z, b0.z, acc[j][2]); acc[j][2] = fmaf(a1.w, b0.w, acc[j][2]);
        acc[j][3] = fmaf(a1.x, b1.x, acc[j][3]); acc[j][3] = fmaf(a1.y, b1.y, acc[j][3]);
        acc[j][3] = fmaf(a1.z, b1.z, acc[j][3]); acc[j][3] = fmaf(a1.w, b1.w, acc[j][3]);
      }
    }
  } else {
    // Same grouping as gemm_rn (see there): in the fp32-accurate mode every two k-steps go into a
    // fresh accumulator that is added with an FADD, so a D = 256 dot product (96 mma) does not
    // drift with the tensor cores' truncating accumulation.
    constexpr int NKK = KD / 8;
    constexpr int KG = (M == Math::Tf32x3 && NKK % 2 == 0) ? 2 : 1;
#pragma unroll
    for (int k0 = 0; k0 < NKK; k0 += KG) {
      AFrag<M> a[KG];
#pragma unroll
      for (int u = 0; u < KG; ++u) {
        const int k = 8 * (k0 + u) + t;
        // Fragment loads: lane (g, t) reads row g at column t: banks 4g + t, conflict free.
        const float af[4] = {A[g * LD + k], A[(g + 8) * LD + k], A[g * LD + k + 4], A[(g + 8) * LD + k + 4]};
        a[u] = make_afrag<M>(af);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (M == Math::Tf32x3) {
          float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int u = 0; u < KG; ++u) {
            const float* bp = B + (8 * j + g) * LD + 8 * (k0 + u) + t;
            if constexpr (SOFF != 0) {
              const uint32_t bb[2] = {__float_as_uint(bp[0]), __float_as_uint(bp[4])};
              const uint32_t bs[2] = {__float_as_uint(bp[SOFF]), __float_as_uint(bp[SOFF + 4])};
              mma_step_split(part, a[u], bb, bs);
            } else {
              const float b[2] = {bp[0], bp[4]};
              mma_step<M>(part, a[u], b);
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] += part[e];
        } else {
          const float* bp = B + (8 * j + g) * LD + 8 * k0 + t;
          const float b[2] = {bp[0], bp[4]};
          mma_step<M>(acc[j], a[0], b);
        }
      }
    }
  }
}

// C[16 x 8*NT] += P[16 x 8*NK] * B[8*NK x 8*NT], P in registers in the accumulator layout
// (P[kk] holds columns 8kk..8kk+7), B row-major in shared memory (row stride LD).
template <Math M, int NT, int NK, int LD, int SOFF = 0>
__device__ __forceinline__ void gemm_rn(float (&acc)[NT][4], const float (&P)[NK][4], const float* B) {
  static_assert(SOFF == 0 || M == Math::Tf32x3, "only 3xtf32 operands are split in shared memory");
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
  if constexpr (M == Math::Fma) {
    // P[row][k] lives in lane 4*row' + k/2 of the quad: broadcast it with shuffles, then FMA
    // against row k of B, keys in natural order (the summation order of a plain loop).
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int src = (lane & ~3) | (c >> 1);
        const float p0 = __shfl_sync(0xffffffffu, P[kk][c & 1], src);
        const float p1 = __shfl_sync(0xffffffffu, P[kk][2 + (c & 1)], src);
        const float* row = B + (8 * kk + c) * LD + 2 * t;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const float2 b = *reinterpret_cast<const float2*>(row + 8 * j);
          acc[j][0] = fmaf(p0, b.x, acc[j][0]);
          acc[j][1] = fmaf(p0, b.y, acc[j][1]);
          acc[j][2] = fmaf(p1, b.x, acc[j][2]);
          acc[j][3] = fmaf(p1, b.y, acc[j][3]);
        }
      }
    }
  } else {
    // The accumulator holds columns 2t, 2t+1 where the A fragment wants t, t+4. Instead of
    // shuffling, relabel the k index: A column t <-> key 2t, column t+4 <-> key 2t+1, and read B
    // rows in the same order. Sums over k do not care about order. B loads: rows 2t (8 banks
    // apart with the +4 pad) and columns g: conflict free.
    //
    // These products accumulate over thousands of keys (a whole sequence, times the GQA group
    // for dK/dV). The tensor cores add into their fp32 accumulator with truncation, relative to
    // the accumulator's magnitude, so a long chain drifts by ~n * 2^-23 (measured: 10-20x the
    // error of an FMA loop at Skv = 1000). In the fp32-accurate mode each group of KG k-steps
    // therefore starts from a zero accumulator and is added to acc with a round-to-nearest FADD.
    // Two k-steps per group: half the FADDs of one, and (measured with ptxas) fewer registers
    // than one at D = 128, where the compiler interleaves more of the short chains.
    constexpr int KG = (M == Math::Tf32x3 && NK % 2 == 0) ? 2 : 1;
#pragma unroll
    for (int k0 = 0; k0 < NK; k0 += KG) {
      AFrag<M> a[KG];
#pragma unroll
      for (int u = 0; u < KG; ++u) {
        const float af[4] = {P[k0 + u][0], P[k0 + u][2], P[k0 + u][1], P[k0 + u][3]};
        a[u] = make_afrag<M>(af);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if constexpr (M == Math::Tf32x3) {
          float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int u = 0; u < KG; ++u) {
            const float* r0 = B + (8 * (k0 + u) + 2 * t) * LD + g + 8 * j;
            if constexpr (SOFF != 0) {
              const uint32_t bb[2] = {__float_as_uint(r0[0]), __float_as_uint(r0[LD])};
              const uint32_t bs[2] = {__float_as_uint(r0[SOFF]), __float_as_uint(r0[SOFF + LD])};
              mma_step_split(part, a[u], bb, bs);
            } else {
              const float b[2] = {r0[0], r0[LD]};
              mma_step<M>(part, a[u], b);
            }
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] += part[e];
        } else {
          const float* r0 = B + (8 * k0 + 2 * t) * LD + g + 8 * j;
          const float b[2] = {r0[0], r0[LD]};
          mma_step<M>(acc[j], a[0], b);
        }
      }
    }
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
}
// acc += x, entry by entry (the 3xTF32 wgmma kernels' short chains added in float32).
template <int NT>
__device__ __forceinline__ void add_into(float (&acc)[NT][4], const float (&x)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] += x[j][e];
}

// ---- masks ----------------------------------------------------------------------------------
// Calls f(j, e, row, col) for every accumulator entry, with its row/column offsets inside the
// warp's 16 x 8*NT slice.
template <int NT, class F>
__device__ __forceinline__ void for_each_entry(F&& f) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(j, e, g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1));
}

// The score transform's per-entry step (softcap, ALiBi: core/score.hpp) on the warp's 16 x 8*NS
// accumulator slice of raw products, in place: s becomes log2-unit logits (afterwards the code
// uses score.after_elementwise()). The slice's entry (g + 8r, 8j + 2t + c) is query row
// row0 + g + 8r and key col0 + 8j + 2t + c, or with TRANSPOSED (S^T = K Q^T: the dK/dV kernels)
// key row0 + ... and query col0 + .... It must run before masking: a masked -inf would become
// finite under the softcap's tanh. The layout is mma.sync's m16n8 accumulator, which is also each
// warp's 16-row part of a wgmma accumulator.
// FAST: the 16-bit kernels' tanh (softcap_tanh<true>).
template <bool TRANSPOSED = false, bool FAST = false, int NS>
__device__ __forceinline__ void transform_scores(float (&s)[NS][4], const ScoreTransform::Head& hd, int64_t row0,
                                                 int64_t col0) {
  for_each_entry<NS>([&](int j, int e, int r, int c) {
    const int64_t a = row0 + r, b = col0 + c;
    s[j][e] = TRANSPOSED ? hd.logit2_at<FAST>(s[j][e], b, a) : hd.logit2_at<FAST>(s[j][e], a, b);
  });
}
// One entry of it, also giving the backward's factor on dS (1 - tanh^2 under a softcap): raw product
// s at slice row `row`, column `col` (absolute indices, as above). For loops that use each entry's
// factor at once: no factor array stays live across the tile.
template <bool TRANSPOSED = false, bool FAST = false>
__device__ __forceinline__ float transform_score(float s, float& f, const ScoreTransform::Head& hd, int64_t row,
                                                 int64_t col) {
  return TRANSPOSED ? hd.logit2_at<FAST>(s, col, row, f) : hd.logit2_at<FAST>(s, row, col, f);
}
// The slice with the factors of every entry.
template <bool TRANSPOSED = false, int NS>
__device__ __forceinline__ void transform_scores(float (&s)[NS][4], float (&f)[NS][4], const ScoreTransform::Head& hd,
                                                 int64_t row0, int64_t col0) {
  for_each_entry<NS>([&](int j, int e, int r, int c) {
    s[j][e] = transform_score<TRANSPOSED>(s[j][e], f[j][e], hd, row0 + r, col0 + c);
  });
}

// Mask test of one score: in range and inside the mask's band (both edges).
__device__ __forceinline__ bool keep(const MaskRule& rule, int64_t i, int64_t j, int64_t sq, int64_t skv) {
  return i < sq && j < skv && rule.visible(i, j);
}

// 2^x on the special-function unit, subnormal results flushed to zero: one MUFU.EX2, where
// exp2f() adds range scaling for subnormal results (three more instructions per element). Used
// by the 16-bit kernels, whose P is rounded to 16 bits anyway (a float32 subnormal is far below
// the smallest 16-bit subnormal of bfloat16's P and at the edge of float16's), and by the tf32
// wgmma kernels, whose P has 10 mantissa bits: a dropped 2^-126 is far below its rounding.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- CTA work ranges (work.hpp) -----------------------------------------------------------------
// The CTA's blocks (grid: row blocks x heads x batch).
template <int BM, int BN>
__device__ __forceinline__ QueryBlock query_block(const Shape& s, const Numerics& n) {
  return query_block<BM, BN>(s, n, blockIdx.z, blockIdx.y, blockIdx.x);
}
template <int BM, int BN>
__device__ __forceinline__ KeyBlock key_block(const Shape& s, const Numerics& n) {
  return key_block<BM, BN>(s, n, blockIdx.z, blockIdx.y, blockIdx.x);
}

// Whether the lane's rows row0 and row0 + 8 (r = 0, 1) lie in [begin, end): with
// MaskRule::live_rows_begin / _end, whether they see some key; with live_keys_begin / _end (rows
// are keys), whether some query row sees them. The bounds are uniform over the kernel (the call's
// band), so the epilogues pay two compares per row and no registers across their main loop (a
// per-row band test there, hoisted by ptxas above the loop, cost dq16 10 registers and spills).
__device__ __forceinline__ void rows_in(int64_t row0, int64_t begin, int64_t end, bool (&in)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) in[r] = row0 + 8 * r >= begin && row0 + 8 * r < end;
}

// Sets row r (0: the lane's row g, 1: row g + 8) of a 16 x 8NT accumulator slice to exactly 0 where
// keep[r] is false: the epilogues' outputs of rows that see no key (O, dQ) and of keys no row sees
// (dK, dV). Their weights P and dS are 0, but a tile product still multiplies them with the rows
// of the other operand that share the tile, and 0 * NaN (or 0 * inf) is NaN.
template <int NT>
__device__ __forceinline__ void zero_rows_unless(float (&acc)[NT][4], const bool (&keep)[2]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = keep[e >> 1] ? acc[j][e] : 0.0f;
}

// Reductions over the 4 lanes of a quad (they hold one row between them).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---- online softmax (forward) ---------------------------------------------------------------
// Row statistics for the lane's two rows (g and g+8) in the log2 domain: m = running max of
// s*scale*log2(e); l = this lane's partial sum of exp2(x - m) (the quad sums at the end).
struct SoftmaxState {
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
};

// S (scaled scores, masked entries -inf) becomes P = exp2(S - m_new); O is rescaled.
// s holds the scores' log2-unit logits (scale_scores) with masked entries at -inf: the transform
// before masking and before the max keeps a negative softmax scale exact (the max of the logits
// is then the max of the scaled values, and a masked -inf stays -inf).
template <int NS>
__device__ __forceinline__ void scale_scores(float (&s)[NS][4], const ScoreTransform& score) {
#pragma unroll
  for (int j = 0; j < NS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = score.logit2(s[j][e]);
}

// The statistics half of online softmax: s becomes P = exp2(s - m_new) and alpha[r] the factor
// that rescales everything accumulated before (the sm_90 forward applies it later, once the
// asynchronous product that still writes O has finished). s holds scores already in the log2
// domain (scale_scores ran), or with SCALED raw scores and an increasing transform `score`
// (positive scale): the row max is then taken on the raw scores and the transform folds into the
// exponent's FFMA, exp2(score.exp2_arg(s, m_new)), one instruction per score fewer (the sm_90
// forward, whose softmax is issue-bound). A negative scale turns the max into a min, so it must
// go through scale_scores. Masked entries are -inf either way.
template <int NS, bool FAST = false, bool SCALED = false>  // SCALED implies FAST
__device__ __forceinline__ void softmax_rows(SoftmaxState& st, float (&s)[NS][4], float (&alpha)[2],
                                             const ScoreTransform& score = ScoreTransform{}) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    mx = quad_max(mx);
    const float m_new = fmaxf(st.m[r], SCALED ? score.logit2(mx) : mx);
    // A row that has seen no visible key keeps m = -inf; subtracting 0 keeps its P at 0
    // instead of exp2(-inf + inf) = NaN. (fmaxf drops a NaN score from the max; its exp2 is NaN
    // all the same, so the row's sum l, and its O and LSE, are NaN: nothing here needs to see it.)
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    alpha[r] = FAST ? exp2_ftz(st.m[r] - m_use) : exp2f(st.m[r] - m_use);
    st.m[r] = m_new;
    float sum = 0.0f;
    // SCALED: the fused exponent fma(s, sl2, -m) is exact before its one rounding while m is the
    // rounded logit of the raw max, so at the max it is m's rounding error err (|err| <= 2^-24
    // |m|): a common factor 2^err of the row's P, which cancels in O = P V / l and in
    // LSE = m + log2 l while it is near 1 (|m| < 2^24: |err| <= 1/2). Beyond, P overflows or
    // vanishes (at scores of 2e19, 2^(+-2^40): O was 0, or NaN). A warp with such a row takes the
    // unfused form for the tile, whose exponent at the max is exactly 0 (one vote per row and tile).
    if (SCALED && __all_sync(0xffffffffu, fabsf(m_use) < 0x1p24f)) {
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        s[j][2 * r] = exp2_ftz(score.exp2_arg(s[j][2 * r], m_use));
        s[j][2 * r + 1] = exp2_ftz(score.exp2_arg(s[j][2 * r + 1], m_use));
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
    } else {
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        const float x0 = (SCALED ? score.logit2(s[j][2 * r]) : s[j][2 * r]) - m_use;
        const float x1 = (SCALED ? score.logit2(s[j][2 * r + 1]) : s[j][2 * r + 1]) - m_use;
        s[j][2 * r] = FAST ? exp2_ftz(x0) : exp2f(x0);
        s[j][2 * r + 1] = FAST ? exp2_ftz(x1) : exp2f(x1);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
    }
    st.l[r] = st.l[r] * alpha[r] + sum;
  }
}

// Masks the keys outside [lo[r], hi[r]) (tile-relative) in the lane's rows g (r = 0) and g + 8
// (r = 1).
template <int NS>
__device__ __forceinline__ void mask_cols(float (&s)[NS][4], const int (&lo)[2], const int (&hi)[2]) {
  const int t = lane_id() & 3;
#pragma unroll
  for (int j = 0; j < NS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * j + 2 * t + (e & 1);
      if (c < lo[e >> 1] || c >= hi[e >> 1]) s[j][e] = -INFINITY;
    }
}

// One key tile of the sm_90a forwards' online softmax: the scores of keys [n0, n0 + BN) in s
// become P, the statistics are updated and alpha (for O) is returned. Keys outside the lane's
// rows' ranges (keys: sequence end and both band edges) are hidden from them; only tiles that
// cross such a bound (`masked`) pay for the test. fused (positive scale): the transform folds
// into the exponent's FFMA; a negative scale turns the max into a min, so it scales first.
template <int BN, int NS>
__device__ __forceinline__ void softmax_tile_sm90(float (&s)[NS][4], SoftmaxState& st, float (&alpha)[2],
                                                  const RowKeys& keys, int64_t n0, bool masked, bool fused,
                                                  const ScoreTransform& score) {
  if (masked) {
    int lo[2], hi[2];
    keys.tile_cols(n0, BN, lo, hi);
    mask_cols(s, lo, hi);
  }
  if (fused) {
    softmax_rows<NS, true, true>(st, s, alpha, score);
  } else {
    scale_scores(s, score);
    softmax_rows<NS, true>(st, s, alpha);
  }
}

template <int NO>
__device__ __forceinline__ void rescale_rows(float (&o)[NO][4], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    o[j][0] *= alpha[0];
    o[j][1] *= alpha[0];
    o[j][2] *= alpha[1];
    o[j][3] *= alpha[1];
  }
}

template <int NS, int NO, bool FAST = false>
__device__ __forceinline__ void online_softmax(SoftmaxState& st, float (&s)[NS][4], float (&o)[NO][4]) {
  float alpha[2];
  softmax_rows<NS, FAST>(st, s, alpha);
  rescale_rows(o, alpha);
}

// End of the forward for the lane's two rows: 1/l and LSE = ln(sum exp(S)) = (m + log2 l) * ln 2
// in IEEE arithmetic - l is NaN after a NaN or +inf score (O and LSE NaN), 0 when the visible
// scores were all -inf (O = 0/0 = NaN, LSE = -inf). A row that sees no key by the band (sees[r]
// false: rows_in with MaskRule::live_rows_*, never decided from l) gets inv = 0 and LSE = -inf,
// and normalize_rows makes its O exactly 0.
__device__ __forceinline__ void finish_rows(const SoftmaxState& st, const bool (&sees)[2], float (&inv)[2],
                                            float (&lse)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(st.l[r]);
    inv[r] = sees[r] ? 1.0f / l : 0.0f;
    lse[r] = sees[r] ? (st.m[r] + log2f(l)) * kLn2 : -INFINITY;
  }
}
// O /= l with finish_rows' inv; rows that see no key exactly 0 (zero_rows_unless).
template <int NO>
__device__ __forceinline__ void normalize_rows(float (&o)[NO][4], const float (&inv)[2], const bool (&sees)[2]) {
  rescale_rows(o, inv);
  zero_rows_unless(o, sees);
}

// Writes the lane's two rows' LSE (rows row0 + g and row0 + g + 8 of one (b, h), those < sq), once
// per quad.
__device__ __forceinline__ void store_lse(const OutLse& out, int64_t b, int64_t h, int64_t row0, int64_t sq,
                                          const float (&lse)[2]) {
  const int lane = lane_id();
  if ((lane & 3) != 0) return;
  float* l = out.ptr + b * out.sb + h * out.sh;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t row = row0 + (lane >> 2) + 8 * r;
    if (row < sq) l[row * out.ss] = lse[r];
  }
}

// LSE in the backward's log2 domain: P = exp2(score.exp2_arg(s, l2)). NaN and -inf stay what they
// are, so that P of a visible entry is what IEEE arithmetic makes of them (NaN for a NaN row; NaN
// for a row whose visible scores were all -inf: -inf + inf). Rows with no visible key have every
// entry masked, and every kernel sets a masked entry's P to 0 after the exponential.
__device__ __forceinline__ float lse_to_log2(float lse) { return lse * kLog2e; }

// ---- epilogue ---------------------------------------------------------------------------------
// Stores the warp's 16 x 8*NT slice (times `mul`) to global rows [row0, row0+16) of a row-major
// tensor with row stride ld, columns col0 + [0, 8*NT), keeping rows < rows and columns < cols.
// pair_ok: 8-byte aligned float2 stores are allowed (aligned base and even row stride).
template <int NT>
__device__ __forceinline__ void store_rows(float* base, int64_t ld, int row0, int rows, int col0,
                                           int cols, const float (&acc)[NT][4], float mul,
                                           bool pair_ok) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row >= rows) continue;
    float* p = base + static_cast<int64_t>(row) * ld;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = col0 + 8 * j + 2 * t;
      const float x = acc[j][2 * r] * mul, y = acc[j][2 * r + 1] * mul;
      if (pair_ok && col + 1 < cols) {
        *reinterpret_cast<float2*>(p + col) = make_float2(x, y);
      } else {
        if (col < cols) p[col] = x;
        if (col + 1 < cols) p[col + 1] = y;
      }
    }
  }
}

// Overwrites with exactly 0 what store_rows wrote of the lane's rows g and g + 8 (r = 0, 1) where
// keep[r] is false. For the float32 dK/dV epilogue at 255 registers: zeroing the accumulators
// before the store, beside both live accumulators, cost the 3xTF32 kernel at D = 256 300 more
// spill bytes; after the store they are dead. (Rows that see nothing are rare: most lanes store
// nothing here. The same thread's later stores land last.)
template <int NT>
__device__ __forceinline__ void zero_stored_rows(float* base, int64_t ld, int row0, int rows, int col0, int cols,
                                                 const bool (&keep)[2]) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (keep[r] || row >= rows) continue;
    float* p = base + static_cast<int64_t>(row) * ld;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int col = col0 + 8 * j + 2 * t;
      if (col < cols) p[col] = 0.0f;
      if (col + 1 < cols) p[col + 1] = 0.0f;
    }
  }
}

}  // namespace flashattn::cuda::dev
