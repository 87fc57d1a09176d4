// sm_90a building blocks of the Hopper kernels (sm90/*.cuh): 128-byte-swizzled shared-memory
// tiles in the layout the warpgroup tensor-core instructions (wgmma) read through descriptors,
// the descriptors themselves, the wgmma ordering primitives, and warpgroup products built on the
// generated wrappers of wgmma_ops.cuh. Only the sm_90a cubin executes these instructions; the
// kernels using them compile to empty bodies elsewhere (see fwd16.cuh, dkv16.cuh).
//
// Register layout: a warpgroup (4 consecutive warps, 128 threads) owns 64 rows of an M x N
// product; warp w of the group owns rows 16w..16w+15 in the m16n8 accumulator layout of
// device.cuh (acc[N/8][4]), so softmax, masks and epilogues are the mma.sync kernels' pieces.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/common/config.hpp"
#include "cuda/host/launch.hpp"
#include "cuda/sm90/mbarrier.cuh"
#include "cuda/common/mma16.cuh"
#include "cuda/sm90/smem_desc.hpp"
#include "cuda/sm90/wgmma_ops.cuh"

namespace flashattn::cuda::dev {

// A ROWS x COLS tile of 16-bit values in the 128-byte swizzle mode: COLS/64 column blocks stored
// one after the other, each ROWS rows of 128 bytes, in 8-row x 128-byte atoms whose 16-byte chunk
// c of row r sits at chunk position c ^ (r & 7). The hardware applies the same XOR to address bits
// [4,7) from bits [7,10), so a tile must start on a 1024-byte boundary. Both the row-major
// ("K-major") reading of Q and K and the transposed ("MN-major") reading of V use this one layout;
// only the descriptor strides differ. Every 8 consecutive rows at one chunk index land in 8
// distinct 16-byte bank groups, so cp.async fills and the epilogue's reads are conflict free.
template <int ROWS, int COLS>
struct TileSw128 {
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "TileSw128 shape");
  static constexpr int kRows = ROWS;
  static constexpr int kChunks = COLS / 8;
  static constexpr int kBytes = ROWS * COLS * 2;
  static constexpr int kBlockBytes = ROWS * 128;  // one 64-column block
  __device__ __forceinline__ static uint32_t offset(int r, int c) {
    return static_cast<uint32_t>((c >> 3) * kBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
  }
};

// Shared memory of a CTA aligned up to 1024 bytes (the swizzle atoms' alignment).
__device__ __forceinline__ unsigned char* smem_aligned1024(unsigned char* p) {
  const uint32_t a = smem_addr(p);
  return p + ((1024 - (a & 1023)) & 1023);
}

// desc_sw128 / desc_advance (the descriptors): cuda/sm90/smem_desc.hpp.

// Orders this thread's register writes (accumulators, A fragments) before the next wgmma reads.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of registers an in-flight wgmma writes across this
// point (used after every wait and before every issue): accumulators (float) and A fragments
// (uint32_t). The tf32 backward pins A fragments before the wgmma_fence() of the products that
// read them: PTX forbids writing a register that a wgmma reads between wgmma.fence and the wgmma,
// and to the compiler the fence is an opaque statement below which it could sink the instructions
// that build the fragments. (No fault was traced to this; keep_live_in_loop's was.)
template <class T, int NT>
__device__ __forceinline__ void fence_regs(T (&d)[NT][4]) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint32_t>, "accumulators or A fragments");
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same_v<T, float>) asm volatile("" : "+f"(d[j][e])::"memory");
      else asm volatile("" : "+r"(d[j][e])::"memory");
    }
}
// Re-defines A fragments that stay fixed across a loop of wgmma products (one XOR with a zero
// the compiler cannot see per register and iteration; call it once per iteration). Seen with
// ptxas of CUDA 13.0 (SASS of dkv_tf32_sm90_kernel): the registers of K and V fragments defined
// before the loop and read by the loop's wgmmas were handed to other values inside the loop (the
// softmax's LSE loads, P^T's fragments), so from the second iteration on S^T = K Q^T read P^T:
// dK and dV wrong whenever a key block saw two or more query tiles. A definition inside the
// loop makes them loop-carried values, which ptxas keeps; docs/ALGORITHM.md has the details.
template <int NT>
__device__ __forceinline__ void keep_live_in_loop(uint32_t (&a)[NT][4], uint32_t opaque_zero) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[j][e] ^= opaque_zero;
}

// D[64 x N] (+)= A[64 x KD] B[N x KD]^T, both K-major TileSw128s: the warpgroup's A rows start at
// a_row0, B's N rows at b_row0 (multiples of 8). accumulate = false overwrites D.
template <Half16 H, int KD, class TA, class TB, int NT>
__device__ __forceinline__ void wg_gemm_nt(float (&d)[NT][4], uint32_t sA, int a_row0, uint32_t sB, int b_row0,
                                           bool accumulate) {
  // (One descriptor per operand, the k-steps by desc_advance: an add each, not a rebuild.)
  const uint64_t a0 = desc_sw128(sA + a_row0 * 128, 16, 1024), b0 = desc_sw128(sB + b_row0 * 128, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < KD / 16; ++kk) {
    const uint32_t off = (kk >> 2) * TA::kBlockBytes + (kk & 3) * 32, boff = (kk >> 2) * TB::kBlockBytes + (kk & 3) * 32;
    wgmma_ss<H, 0, 0>(d, desc_advance(a0, off), desc_advance(b0, boff), (accumulate || kk > 0) ? 1 : 0);
  }
}

// D[64 x N] += P[64 x 16*NK] B[16*NK x N]: P in registers as m16k16 A fragments, B an MN-major
// TileSw128 (tile rows = k, from b_row0; columns from col0, a multiple of 64).
template <Half16 H, int NK, class TB, int NT>
__device__ __forceinline__ void wg_gemm_rn(float (&d)[NT][4], const uint32_t (&pa)[NK][4], uint32_t sB, int b_row0,
                                           int col0) {
  const uint64_t b0 = desc_sw128(sB + (col0 >> 6) * TB::kBlockBytes + b_row0 * 128, TB::kBlockBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) wgmma_rs<H, 1>(d, pa[kk], desc_advance(b0, 16 * kk * 128), 1);
}

// D[64 x N] += A[64 x 16*NK] B[16*NK x N]: A a K-major TileSw128 (rows = m from a_row0, columns =
// k), B an MN-major TileSw128 (tile rows = k from b_row0; columns from col0, a multiple of 64).
template <Half16 H, int NK, class TA, class TB, int NT>
__device__ __forceinline__ void wg_gemm_sn(float (&d)[NT][4], uint32_t sA, int a_row0, uint32_t sB, int b_row0,
                                           int col0) {
  const uint64_t a0 = desc_sw128(sA + a_row0 * 128, 16, 1024);
  const uint64_t b0 = desc_sw128(sB + (col0 >> 6) * TB::kBlockBytes + b_row0 * 128, TB::kBlockBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < NK; ++kk)
    wgmma_ss<H, 0, 1>(d, desc_advance(a0, (kk >> 2) * TA::kBlockBytes + (kk & 3) * 32), desc_advance(b0, 16 * kk * 128), 1);
}

// D[64 x N] (+)= A[64 x 16*NK] B[16*NK x N] with both operands stored k-major by rows: A as an
// MN-major TileSw128 holding A^T (tile rows = k, columns = the 64 m, from a_col0), B as an
// MN-major TileSw128 (tile rows = k, columns = n from b_col0; b_col0 may sit inside a 64-column
// block: the swizzle is a function of the address, so a start 2*b_col0 % 128 bytes into the
// block's rows reads the right chunks).
template <Half16 H, int NK, class TA, class TB, int NT>
__device__ __forceinline__ void wg_gemm_tt(float (&d)[NT][4], uint32_t sA, int a_col0, uint32_t sB, int b_col0,
                                           bool accumulate) {
  const uint64_t a0 = desc_sw128(sA + (a_col0 >> 6) * TA::kBlockBytes + (a_col0 & 63) * 2, TA::kBlockBytes, 1024);
  const uint64_t b0 = desc_sw128(sB + (b_col0 >> 6) * TB::kBlockBytes + (b_col0 & 63) * 2, TB::kBlockBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < NK; ++kk)
    wgmma_ss<H, 1, 1>(d, desc_advance(a0, 16 * kk * 128), desc_advance(b0, 16 * kk * 128), (accumulate || kk > 0) ? 1 : 0);
}

// ---- tf32 (float32 kernels) -------------------------------------------------------------------
// tf32 wgmma reads both shared-memory operands K-major only (no transposing descriptor as for
// 16 bits): every B operand is stored with k contiguous, A comes from registers.
// A float32 tile in the copy engine's 128-byte swizzle: [COLS / 32 column blocks][ROWS][128 B],
// 16-byte chunk c of row r at chunk c ^ (r & 7) (TileSw128 with 4-byte elements).
template <int ROWS, int COLS>
struct TileSw128F {
  static_assert(COLS % 32 == 0 && ROWS % 8 == 0, "TileSw128F shape");
  static constexpr int kBytes = ROWS * COLS * 4;
  static constexpr int kBlockBytes = ROWS * 128;
  __device__ __forceinline__ static uint32_t offset(int r, int c) {
    return static_cast<uint32_t>((c >> 5) * kBlockBytes + r * 128 + ((((c >> 2) & 7) ^ (r & 7)) << 4) + (c & 3) * 4);
  }
};

// D[64 x N] (+)= A[64 x 8 KS] B[N x 8 KS]^T: A as KS tf32 fragments in registers, B a K-major
// TileSw128F (rows = n from b_row0, columns = k). kWriteOnly (with accumulate = false): the first
// k-step's d operands are outputs only, so d's old contents are not live into the product (the
// dK/dV kernel needs that to fit its registers; the dQ kernel spills with it: its allocation is
// better with the old values tied).
template <int KS, class TB, bool kWriteOnly = false, int NT>
__device__ __forceinline__ void wg_gemm_rs_tf32(float (&d)[NT][4], const uint32_t (&a)[KS][4], uint32_t sB,
                                                int b_row0, bool accumulate) {
  static_assert(((KS - 1) >> 2) * TB::kBlockBytes + ((KS - 1) & 3) * 32 < TB::kBytes, "k-steps beyond the tile");
  const uint64_t b0 = desc_sw128(sB + b_row0 * 128, 16, 1024);  // k-steps: desc_advance (smem_desc.hpp)
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const uint64_t b = desc_advance(b0, (kk >> 2) * TB::kBlockBytes + (kk & 3) * 32);
    if (kWriteOnly && kk == 0 && !accumulate) wgmma_rs_tf32_init(d, a[kk], b);
    else wgmma_rs_tf32(d, a[kk], b, (accumulate || kk > 0) ? 1 : 0);
  }
}

// The warp's tf32 A fragments of rows row0 + [0, 16) of a float32 TileSw128F (columns = k),
// rounded: k-step kk holds columns 8kk + t and 8kk + t + 4 of rows g and g + 8.
template <class T, int KS>
__device__ __forceinline__ void load_afrag_tf32(uint32_t (&a)[KS][4], const unsigned char* tile, int row0) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[kk][i] = to_tf32(*reinterpret_cast<const float*>(tile + T::offset(row0 + g + 8 * (i & 1), 8 * kk + t + 4 * (i >> 1))));
}

// An accumulator (P, dS, ...) as the tf32 A fragments of the next product, whose B operand stores
// its k positions in tf32_slot order (device.cuh): no shuffles, one conversion per element.
template <int NS>
__device__ __forceinline__ void acc_to_afrag_tf32(uint32_t (&a)[NS][4], const float (&s)[NS][4]) {
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    a[j][0] = to_tf32(s[j][0]);
    a[j][1] = to_tf32(s[j][2]);
    a[j][2] = to_tf32(s[j][1]);
    a[j][3] = to_tf32(s[j][3]);
  }
}

// The big and small tf32 A fragments of rows row0 + [0, 16) and columns col0 + [0, 8 KS) of a
// float32 TileSw128F (columns = k).
template <class T, int KS>
__device__ __forceinline__ void load_afrag_split_tf32(uint32_t (&big)[KS][4], uint32_t (&small)[KS][4],
                                                      const unsigned char* tile, int row0, int col0) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x = *reinterpret_cast<const float*>(
          tile + T::offset(row0 + g + 8 * (i & 1), col0 + 8 * kk + t + 4 * (i >> 1)));
      tf32_split(x, big[kk][i], small[kk][i]);
    }
}

// An accumulator (P) as the big and small tf32 A fragments of the next product (the order of
// acc_to_afrag_tf32: B stores its k positions in tf32_slot order). The small part is computed from
// a second rounding of x by other instructions (tf32_round_finite: the same value as tf32_round
// for a finite P) rather than from big's register: otherwise ptxas reads big's register again
// after writing it in the loop, the pattern scripts/check-sass-wgmma.py flags (it cannot tell
// that use from the register reuse it exists to catch). (tf32_round now compiles as cvt.rna does,
// so the two may not share a form.) A NaN P keeps big NaN (tf32_round); small is then 0 or NaN.
__device__ __forceinline__ void split_p_tf32(float x, uint32_t& big, uint32_t& small) {
  big = tf32_round(x);
  small = tf32_round_finite(x - __uint_as_float(tf32_round_finite(x)));
}
template <int NS>
__device__ __forceinline__ void acc_to_afrag_split_tf32(uint32_t (&big)[NS][4], uint32_t (&small)[NS][4],
                                                        const float (&s)[NS][4]) {
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    split_p_tf32(s[j][0], big[j][0], small[j][0]);
    split_p_tf32(s[j][2], big[j][1], small[j][1]);
    split_p_tf32(s[j][1], big[j][2], small[j][2]);
    split_p_tf32(s[j][3], big[j][3], small[j][3]);
  }
}

// The KS k-steps of fragments a starting at k-step k0, as an array reference of their own (the
// products below take a group of k-steps at a time).
template <int KS, int N>
__device__ __forceinline__ const uint32_t (&ksteps(const uint32_t (&a)[N][4], int k0))[KS][4] {
  return *reinterpret_cast<const uint32_t(*)[KS][4]>(&a[k0]);
}

// D (+)= A B^T in 3xTF32 (the fp32-accurate kernels): A as big and small fragments, B's big and
// small tiles at b_big and b_small (the same layout): small terms first, while D is small, then
// big * big; one accumulation chain of 3 KS wgmmas (keep KS at 4: see x3_fwd.cuh on
// why chains stay short).
template <int KS, class TB, bool kWriteOnly = false, int NT>
__device__ __forceinline__ void wg_gemm3_rs_tf32(float (&d)[NT][4], const uint32_t (&ab)[KS][4],
                                                 const uint32_t (&as)[KS][4], uint32_t b_big, uint32_t b_small,
                                                 int b_row0, bool accumulate) {
  wg_gemm_rs_tf32<KS, TB, kWriteOnly>(d, as, b_big, b_row0, accumulate);
  wg_gemm_rs_tf32<KS, TB>(d, ab, b_small, b_row0, true);
  wg_gemm_rs_tf32<KS, TB>(d, ab, b_big, b_row0, true);
}

// D (+)= A B^T with A a K-major TileSw128F in shared memory too (rows = m: the warpgroup's 64
// rows from a_row0, columns = k), B as in wg_gemm_rs_tf32.
template <int KS, class TA, class TB, bool kWriteOnly = false, int NT>
__device__ __forceinline__ void wg_gemm_ss_tf32(float (&d)[NT][4], uint32_t sA, int a_row0, uint32_t sB, int b_row0,
                                                bool accumulate) {
  static_assert(((KS - 1) >> 2) * TA::kBlockBytes + ((KS - 1) & 3) * 32 < TA::kBytes &&
                    ((KS - 1) >> 2) * TB::kBlockBytes + ((KS - 1) & 3) * 32 < TB::kBytes,
                "k-steps beyond the tile");
  const uint64_t a0 = desc_sw128(sA + a_row0 * 128, 16, 1024), b0 = desc_sw128(sB + b_row0 * 128, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const uint64_t a = desc_advance(a0, (kk >> 2) * TA::kBlockBytes + (kk & 3) * 32);
    const uint64_t b = desc_advance(b0, (kk >> 2) * TB::kBlockBytes + (kk & 3) * 32);
    if (kWriteOnly && kk == 0 && !accumulate) wgmma_ss_tf32_init(d, a, b);
    else wgmma_ss_tf32(d, a, b, (accumulate || kk > 0) ? 1 : 0);
  }
}

// 3xTF32 with A's big part in registers and its small part in shared memory (sA_small, a tile of
// A's shape whose elements are tf32 values): small terms first, A_s B_b + A_b B_s, then A_b B_b.
template <int KS, class TA, class TB, bool kWriteOnly = false, int NT>
__device__ __forceinline__ void wg_gemm3_rss_tf32(float (&d)[NT][4], const uint32_t (&ab)[KS][4], uint32_t sA_small,
                                                  uint32_t b_big, uint32_t b_small, int b_row0, bool accumulate) {
  wg_gemm_ss_tf32<KS, TA, TB, kWriteOnly>(d, sA_small, 0, b_big, b_row0, accumulate);
  wg_gemm_rs_tf32<KS, TB>(d, ab, b_small, b_row0, true);
  wg_gemm_rs_tf32<KS, TB>(d, ab, b_big, b_row0, true);
}

// A stationary float32 TileSw128F operand split where it lies: the warp's big tf32 A fragments
// of rows row0 + [0, 16) (all KS k-steps) into registers, the small part tf32(x - big) written
// over x (as a float), so that the tile then serves wg_gemm3_rss_tf32 as A_small. Each element
// belongs to exactly one thread's fragments; the caller orders the writes before the tensor
// cores' reads (fence_proxy_async and a barrier over the warpgroup).
template <class T, int KS>
__device__ __forceinline__ void split_afrag_in_place(uint32_t (&big)[KS][4], unsigned char* tile, int row0) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float* e = reinterpret_cast<float*>(tile + T::offset(row0 + g + 8 * (i & 1), 8 * kk + t + 4 * (i >> 1)));
      uint32_t sm;
      tf32_split(*e, big[kk][i], sm);
      *e = __uint_as_float(sm);
    }
}

// N-columns [8 j0, 8 (j0 + N)) of an accumulator, as an array reference of their own.
template <int N, int M>
__device__ __forceinline__ float (&acc_cols(float (&a)[M][4], int j0))[N][4] {
  return *reinterpret_cast<float(*)[N][4]>(&a[j0]);
}

// The pair kernels' exchange between two warpgroups that own the same rows (tf32_bwd_pair.cuh,
// x3_fwd.cuh): a warpgroup's accumulator entries of one tile in a shared-memory buffer,
// thread i's NS float4 at [j][i] (consecutive threads, consecutive 16 bytes: conflict free), read
// back by thread i of the other warpgroup, which owns the same entries.
template <int NS>
__device__ __forceinline__ void exchange_store(float* buf, const float (&v)[NS][4]) {
  const int i = threadIdx.x & 127;
#pragma unroll
  for (int j = 0; j < NS; ++j) reinterpret_cast<float4*>(buf)[j * 128 + i] = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
}
template <int NS>
__device__ __forceinline__ void exchange_load(float (&v)[NS][4], const float* buf) {
  const int i = threadIdx.x & 127;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const float4 x = reinterpret_cast<const float4*>(buf)[j * 128 + i];
    v[j][0] = x.x;
    v[j][1] = x.y;
    v[j][2] = x.z;
    v[j][3] = x.w;
  }
}

// The same exchange for tf32 A fragments (the dQ pair kernel's dS): 16-byte words, conflict free.
template <int NS>
__device__ __forceinline__ void exchange_store_frags(uint32_t* buf, const uint32_t (&a)[NS][4]) {
  const int i = threadIdx.x & 127;
#pragma unroll
  for (int j = 0; j < NS; ++j) reinterpret_cast<uint4*>(buf)[j * 128 + i] = make_uint4(a[j][0], a[j][1], a[j][2], a[j][3]);
}
template <int NS>
__device__ __forceinline__ void exchange_load_frags(uint32_t (&a)[NS][4], const uint32_t* buf) {
  const int i = threadIdx.x & 127;
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const uint4 v = reinterpret_cast<const uint4*>(buf)[j * 128 + i];
    a[j][0] = v.x;
    a[j][1] = v.y;
    a[j][2] = v.z;
    a[j][3] = v.w;
  }
}

// The dK/dV kernels' per-query vectors of one streamed tile (query head h, queries n0 + [0, BQ)),
// written by the 32 lanes of one producer warp: LSE in the log2 domain and D = rowsum(dO * O).
// Past the last query LSE = +inf, so P = exp2(score.exp2_arg(s, inf)) = 0 there (those entries
// are masked too).
template <int BQ>
__device__ __forceinline__ void fill_lse_delta(float* sL, float* sD, const BwdArgs& a, int64_t b, int64_t h,
                                               int64_t n0) {
  const BackwardParams& p = a.p;
  const int64_t Sq = p.shape.seq_q;
  const float* lse = p.lse.ptr + b * p.lse.sb + h * p.lse.sh;
  const float* delta = a.delta + a.ws_row(b, h);
  for (int c = lane_id(); c < BQ; c += 32) {
    const int64_t q = n0 + c;
    sL[c] = q < Sq ? lse_to_log2(lse[q * p.lse.ss]) : INFINITY;
    sD[c] = q < Sq ? delta[q] : 0.0f;
  }
}

// Adds two floats to consecutive addresses (8-byte aligned) with one vector reduction.
__device__ __forceinline__ void red_add2(float* p, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(x), "f"(y) : "memory");
}
// (16-byte aligned p)
__device__ __forceinline__ void red_add4(float* p, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
}

// ---- mbarriers, the tensor copy engine (TMA), warpgroup registers ---------------------------------
// The 16-bit split backward kernels' barriers: `once` for the block's stationary tiles (one
// copy-engine arrival) and two stages of full / empty barriers; initialised by thread 0 and
// published to the whole CTA (and the copy engine) before return. (The float32 kernels stream
// through a TileRing, tf32_bwd.cuh.)
__device__ __forceinline__ void init_stage_barriers(uint64_t* once, uint64_t* full, int full_count, uint64_t* empty,
                                                    int empty_count) {
  if (threadIdx.x == 0) {
    mbar_init(once, 1);
    for (int i = 0; i < 2; ++i) {
      mbar_init(full + i, full_count);
      mbar_init(empty + i, empty_count);
    }
    mbar_init_fence();
  }
  __syncthreads();
}
// Copies the box at coordinates (c0 = column, c1 = row, c2 = head, c3 = batch) of a 4-d tensor map
// into shared memory (swizzled as the map says; out-of-range elements read as zero) and
// completes its bytes on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* tmap, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}
// Tile t of a two-stage ring of shared-memory tiles T (its column blocks of 128 bytes, kCols
// elements wide, one box each) from a 4-d tensor map: stage t & 1, once the consumers released
// tile t - 2 from it (empty), completing on full; box coordinates (column c0 + kCols * block, row,
// head, batch).
template <class T, int kCols>
__device__ __forceinline__ void tma_load_stage(const void* map, unsigned char* base, uint64_t* full, uint64_t* empty,
                                               int t, int c0, int row, int head, int batch) {
  const int st = t & 1;
  mbar_wait(empty + st, ((t >> 1) & 1) ^ 1);
  mbar_expect_tx(full + st, T::kBytes);
#pragma unroll
  for (int blk = 0; blk < T::kBytes / T::kBlockBytes; ++blk)
    tma_load_4d(base + st * T::kBytes + blk * T::kBlockBytes, map, full + st, c0 + kCols * blk, row, head, batch);
}
// The forward kernels' copy schedule, run by one producer thread: Q once (full_q), then K_0, and
// K_{t+1} before V_t (the order the consumers need them), each tile into stage t & 1 of its ring.
// t counts the block's iterations; iteration t copies key tile t_begin + t (QueryBlock), keys from
// n0 = (t_begin + t) BN, into stage g0 + t (stages and barrier phases follow g0 + t: a CTA walking
// several blocks keeps one count of its tiles, g0 = the tiles of its blocks before this one). Q
// waits for empty_q (nullptr: no wait), released by the consumers of the CTA's previous block;
// kq counts the CTA's blocks (Q's barrier phases).
// TQ/TK: the shared-memory tile types (one box of 128 bytes' columns per column block); BN keys per
// tile; coordinates (column, row, head, batch). load_v(t, n0) copies V's tile of iteration t (as
// stored: copy_forward_tiles below; the tf32 forward's transposed copy: tf32_fwd.cuh).
template <class TQ, class TK, int DP, int BN, class LoadV>
__device__ __forceinline__ void copy_forward_tiles_with(const void* tq, const void* tk, unsigned char* sQ,
                                                        unsigned char* sK, uint64_t* full_q, uint64_t* full_k,
                                                        uint64_t* empty_k, int m0, int h, int hk, int b, int t_begin,
                                                        int ntiles, LoadV load_v, int g0 = 0,
                                                        uint64_t* empty_q = nullptr, int kq = 0) {
  constexpr int kBlocks = TQ::kBytes / TQ::kBlockBytes, kCols = DP / kBlocks;  // boxes per row, their width
  const int n_first = t_begin * BN;
  // K's first tile before Q when Q's tile is still in use: the copy engine fetches it meanwhile.
  if (ntiles > 0) tma_load_stage<TK, kCols>(tk, sK, full_k, empty_k, g0, 0, n_first, hk, b);
  if (empty_q != nullptr) mbar_wait(empty_q, (kq & 1) ^ 1);
  mbar_expect_tx(full_q, TQ::kBytes);
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk) tma_load_4d(sQ + blk * TQ::kBlockBytes, tq, full_q, kCols * blk, m0, h, b);
  for (int t = 0; t < ntiles; ++t) {
    if (t + 1 < ntiles) tma_load_stage<TK, kCols>(tk, sK, full_k, empty_k, g0 + t + 1, 0, n_first + (t + 1) * BN, hk, b);
    load_v(g0 + t, n_first + t * BN);
  }
}
// The same with V's tiles as stored (rows = keys), into their own ring.
template <class TQ, class TK, int DP, int BN>
__device__ __forceinline__ void copy_forward_tiles(const void* tq, const void* tk, const void* tv, unsigned char* sQ,
                                                   unsigned char* sK, unsigned char* sV, uint64_t* full_q,
                                                   uint64_t* full_k, uint64_t* empty_k, uint64_t* full_v,
                                                   uint64_t* empty_v, int m0, int h, int hk, int b, int t_begin,
                                                   int ntiles, int g0 = 0, uint64_t* empty_q = nullptr, int kq = 0) {
  constexpr int kCols = DP / (TQ::kBytes / TQ::kBlockBytes);
  copy_forward_tiles_with<TQ, TK, DP, BN>(
      tq, tk, sQ, sK, full_q, full_k, empty_k, m0, h, hk, b, t_begin, ntiles,
      [&](int g, int n0) { tma_load_stage<TK, kCols>(tv, sV, full_v, empty_v, g, 0, n0, hk, b); }, g0, empty_q, kq);
}

// Registers per thread of this warpgroup from here on (the kernel starts with an even split).
template <int N>
__device__ __forceinline__ void regs_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void regs_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// A barrier among `threads` threads only (id 0 is __syncthreads').
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same for a barrier whose waiting threads reach it from different places in the code (a
// consumer warpgroup and a producer warp in their own branches): bar.sync is the aligned form,
// which promises that all waiters of one generation execute the same barrier instruction
// (compute-sanitizer's synccheck reports "divergent threads" otherwise); barrier.sync is not.
__device__ __forceinline__ void named_barrier_unaligned(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp's arrival at named barrier `id` without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace flashattn::cuda::dev
