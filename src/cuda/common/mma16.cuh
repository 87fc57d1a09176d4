// Device building blocks of the float16/bfloat16 kernels (kernels16.cuh): swizzled shared-memory
// tiles, cp.async tile loads, ldmatrix, mma.sync m16n8k16 with float32 accumulation, and the three
// warp-level products the attention passes are made of.
//
// Register layout: a warp owns MT m16 tiles (16*MT rows) of an M x N product, stored as
// acc[MT][N/8][4] in the m16n8 accumulator layout (device.cuh), so the float32 kernels' softmax,
// mask and reduction pieces apply per m16 tile unchanged.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/config.hpp"
#include "cuda/common/device.cuh"

namespace flashattn::cuda::dev {

// Two floats -> one register of two 16-bit values, `lo` in the low half (the lower column index,
// as every mma fragment wants it). Round to nearest even.
template <Half16 H>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (H == Half16::BF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// c += a * b, m16n8k16, 16-bit inputs, float32 accumulator.
template <Half16 H>
__device__ __forceinline__ void mma16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (H == Half16::BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- swizzled tiles -------------------------------------------------------------------------------
// A ROWS x COLS tile of 16-bit values, row-major, in 16-byte chunks of 8 columns. Every access
// of the kernels reads or writes 8 consecutive rows at one logical chunk (ldmatrix, cp.async of a
// column strip) or 8 rows x 4 words (fragment stores). Without swizzling, rows of 128, 256 or
// 512 bytes start in the same bank and those 8 accesses serialise 8-fold. XOR-ing the chunk index
// with the row (mod 8) spreads the 8 rows over all 8 16-byte bank groups. Rows of 12 chunks
// (COLS = 96, 192 bytes) already alternate between two bank halves, so the XOR uses row / 2
// over groups of 4 chunks. The permutation stays inside an aligned group of chunks of one row,
// so a row still occupies exactly its own COLS * 2 bytes: no padding.
template <int ROWS, int COLS>
struct Tile {
  static constexpr int kRows = ROWS;
  static constexpr int kChunks = COLS / 8;  // per row
  static_assert(COLS % 16 == 0 && (kChunks % 8 == 0 || kChunks % 8 == 4), "tile width");
  static constexpr int kBytes = ROWS * COLS * 2;
  // Byte offset of logical chunk c of row r.
  __device__ __forceinline__ static uint32_t offset(int r, int c) {
    const int p = kChunks % 8 == 0 ? (c ^ (r & 7)) : (c ^ ((r >> 1) & 3));
    return static_cast<uint32_t>((r * kChunks + p) * 16);
  }
};

// ---- global <-> shared ----------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// Loads rows [0, ROWS) x columns [0, COLS) of a row-major global tile (`rows` valid rows, `cols`
// valid columns, row stride `ld` elements) into a swizzled Tile, zero-filling everything outside
// (padded head-dim columns and rows past the sequence end then add nothing to any product).
// vec16: base 16-byte aligned and ld a multiple of 8: asynchronous 16-byte copies, consecutive
// threads on consecutive chunks of a row (coalesced). Otherwise plain 2-byte loads and shared
// stores: correct for any alignment, synchronous (the kernels' barriers order them like cp.async).
// L is the shared-memory layout (Tile here; the sm_90 kernels' TileSw128): any type with
// kRows, kChunks and offset(row, chunk).
template <class L, int THREADS>
__device__ __forceinline__ void load_tile16_as(unsigned char* smem, const uint16_t* g, int64_t ld,
                                               int rows, int cols, bool vec16) {
  constexpr int N = L::kRows * L::kChunks;
  const uint32_t base = smem_addr(smem);
  if (vec16) {
#pragma unroll
    for (int i = 0; i < (N + THREADS - 1) / THREADS; ++i) {
      const int idx = static_cast<int>(threadIdx.x) + i * THREADS;
      if (N % THREADS == 0 || idx < N) {
        const int r = idx / L::kChunks, c = idx % L::kChunks, col = c * 8;
        int bytes = r < rows ? (cols - col) * 2 : 0;
        bytes = bytes < 0 ? 0 : (bytes > 16 ? 16 : bytes);
        cp_async16_s(base + L::offset(r, c), bytes ? g + r * ld + col : g, bytes);
      }
    }
  } else {
    for (int idx = static_cast<int>(threadIdx.x); idx < N; idx += THREADS) {
      const int r = idx / L::kChunks, c = idx % L::kChunks;
      uint16_t v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int col = c * 8 + e;
        v[e] = (r < rows && col < cols) ? g[r * ld + col] : uint16_t(0);
      }
      uint4 w;
      w.x = v[0] | (uint32_t(v[1]) << 16);
      w.y = v[2] | (uint32_t(v[3]) << 16);
      w.z = v[4] | (uint32_t(v[5]) << 16);
      w.w = v[6] | (uint32_t(v[7]) << 16);
      *reinterpret_cast<uint4*>(smem + L::offset(r, c)) = w;
    }
  }
}
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile16(unsigned char* smem, const uint16_t* g, int64_t ld,
                                            int rows, int cols, bool vec16) {
  load_tile16_as<Tile<ROWS, COLS>, THREADS>(smem, g, ld, rows, cols, vec16);
}

// Stores rows [r0, r0 + NR) (those < rows) x columns [0, cols) of a tile in layout L to a row-major
// global tile (row r at g + r * ld), 16 bytes per thread where the chunk is whole and aligned
// (vec16), else element by element; `tid` in [0, THREADS) numbers the storing threads.
template <class L, int NR, int THREADS>
__device__ __forceinline__ void store_rows16_as(uint16_t* g, int64_t ld, const unsigned char* smem, int r0,
                                                int rows, int cols, bool vec16, int tid) {
  constexpr int N = NR * L::kChunks;
  for (int idx = tid; idx < N; idx += THREADS) {
    const int r = r0 + idx / L::kChunks, c = idx % L::kChunks, col = c * 8;
    if (r >= rows || col >= cols) continue;
    const uint4 w = *reinterpret_cast<const uint4*>(smem + L::offset(r, c));
    uint16_t* dst = g + r * ld + col;
    if (vec16 && col + 8 <= cols) {
      *reinterpret_cast<uint4*>(dst) = w;
    } else {
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (col + e < cols) dst[e] = static_cast<uint16_t>(u[e / 2] >> (16 * (e & 1)));
    }
  }
}
// The whole of a swizzled Tile, by all THREADS threads of the block.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void store_tile16(uint16_t* g, int64_t ld, const unsigned char* smem,
                                             int rows, int cols, bool vec16) {
  store_rows16_as<Tile<ROWS, COLS>, ROWS, THREADS>(g, ld, smem, 0, rows, cols, vec16, static_cast<int>(threadIdx.x));
}

// Writes a warp's accumulator slice acc[MT][NT][4] (rows row0 + [0, 16*MT), columns
// col0 + [0, 8*NT)) times `mul` into a swizzled tile (layout L) as 16-bit values. Lane (g, t) writes 4 bytes
// at rows g, g+8 of chunk col/8: the XOR puts the 8 rows in 8 different bank groups.
template <Half16 H, class L, int MT, int NT>
__device__ __forceinline__ void stage_acc_as(unsigned char* smem, const float (&acc)[MT][NT][4], int row0,
                                             int col0, float mul) {
  const int lane = lane_id(), g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 16 * m + g + 8 * r, col = col0 + 8 * j;
        *reinterpret_cast<uint32_t*>(smem + L::offset(row, col / 8) + 4 * t) =
            pack2<H>(acc[m][j][2 * r] * mul, acc[m][j][2 * r + 1] * mul);
      }
}
template <Half16 H, int ROWS, int COLS, int MT, int NT>
__device__ __forceinline__ void stage_acc(unsigned char* smem, const float (&acc)[MT][NT][4], int row0,
                                          int col0, float mul) {
  stage_acc_as<H, Tile<ROWS, COLS>, MT, NT>(smem, acc, row0, col0, mul);
}

// ---- warp products --------------------------------------------------------------------------------
// C[16*MT x 8*NT] += A[16*MT x KD] * B[8*NT x KD]^T: A rows a_row0.. and B rows b_row0.. of two
// swizzled tiles (both row-major with the KD dimension contiguous: Q, K, V, dO as stored).
// ldmatrix.x4 gives a whole m16k16 A fragment, and the k16 B fragments of two n8 tiles.
template <Half16 H, int MT, int NT, int KD, class TA, class TB>
__device__ __forceinline__ void gemm_ss(float (&acc)[MT][NT][4], uint32_t sA, int a_row0, uint32_t sB,
                                        int b_row0) {
  static_assert(NT % 2 == 0 && KD % 16 == 0, "gemm_ss shape");
  const int lane = lane_id();
#pragma unroll
  for (int kk = 0; kk < KD / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
      ldsm_x4(a[m], sA + TA::offset(a_row0 + 16 * m + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      ldsm_x4(b, sB + TB::offset(b_row0 + 16 * np + (lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma16<H>(acc[m][2 * np], a[m], b[0], b[1]);
        mma16<H>(acc[m][2 * np + 1], a[m], b[2], b[3]);
      }
    }
  }
}

// The k16 B fragments of n8 tiles 2*np and 2*np+1 of B[k][n] stored row-major with n contiguous
// (V, dO, Q, K as the right operand of P V, dS K, ...): ldmatrix.trans turns 8 k-rows x 8 n-columns
// into the column-major fragment.
template <class TB>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], uint32_t sB, int k_row0, int chunk0, int np) {
  const int lane = lane_id();
  ldsm_x4_t(b, sB + TB::offset(k_row0 + (lane & 7) + (((lane >> 3) & 1) << 3), chunk0 + 2 * np + (lane >> 4)));
}

// C[16*MT x 8*NT] += P[16*MT x 16*NK] * B[16*NK x 8*NT]: P in registers as A fragments (pa),
// B rows b_row0.. and columns from chunk b_chunk0 of a swizzled tile stored [k][n].
template <Half16 H, int MT, int NT, int NK, class TB>
__device__ __forceinline__ void gemm_rs(float (&acc)[MT][NT][4], const uint32_t (&pa)[MT][NK][4], uint32_t sB,
                                        int b_row0, int b_chunk0) {
  static_assert(NT % 2 == 0, "gemm_rs shape");
#pragma unroll
  for (int kk = 0; kk < NK; ++kk)
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      load_b_trans<TB>(b, sB, b_row0 + 16 * kk, b_chunk0, np);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        mma16<H>(acc[m][2 * np], pa[m][kk], b[0], b[1]);
        mma16<H>(acc[m][2 * np + 1], pa[m][kk], b[2], b[3]);
      }
    }
}

// C[16 x 8*NT] += A[16 x 16*NK] * B[16*NK x 8*NT] with A stored transposed ([k][m], m contiguous:
// the dS^T tile of the dK/dV pass, read as dS for dQ) and B stored [k][n]: both through
// ldmatrix.trans.
template <Half16 H, int NT, int NK, class TA, class TB>
__device__ __forceinline__ void gemm_ts(float (&acc)[1][NT][4], uint32_t sA, int a_chunk0, uint32_t sB,
                                        int b_chunk0) {
  const int lane = lane_id();
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    // a0: m 0-7 x k 0-7, a1: m 8-15 x k 0-7, a2: m 0-7 x k 8-15, a3: m 8-15 x k 8-15.
    uint32_t a[4];
    ldsm_x4_t(a, sA + TA::offset(16 * kk + (lane & 7) + ((lane >> 4) << 3), a_chunk0 + ((lane >> 3) & 1)));
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      load_b_trans<TB>(b, sB, 16 * kk, b_chunk0, np);
      mma16<H>(acc[0][2 * np], a, b[0], b[1]);
      mma16<H>(acc[0][2 * np + 1], a, b[2], b[3]);
    }
  }
}

// A float accumulator slice [MT][2*NK][4] (e.g. P or dS, columns = the next product's k) as
// 16-bit A fragments: the m16n8 layout of two adjacent n8 tiles is exactly the m16k16 A layout.
template <Half16 H, int MT, int NK>
__device__ __forceinline__ void to_afrag(uint32_t (&pa)[MT][NK][4], const float (&s)[MT][2 * NK][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      pa[m][kk][0] = pack2<H>(s[m][2 * kk][0], s[m][2 * kk][1]);
      pa[m][kk][1] = pack2<H>(s[m][2 * kk][2], s[m][2 * kk][3]);
      pa[m][kk][2] = pack2<H>(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
      pa[m][kk][3] = pack2<H>(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
    }
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m) zero(acc[m]);
}

}  // namespace flashattn::cuda::dev
