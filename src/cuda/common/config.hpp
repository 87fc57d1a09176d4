// Compile-time configuration of the CUDA backend, visible to host and device code: the kinds of
// arithmetic ("math"), the padded head dims that have kernels, and the one table of tile sizes.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "cuda/common/head_dims.hpp"

#if defined(__CUDACC__)
#define FLASHATTN_CUDA_HD __host__ __device__
#else
#define FLASHATTN_CUDA_HD
#endif

namespace flashattn::cuda {

// How a float32 product a*b is formed inside the matrix products.
enum class Math : int {
  Fma = 0,     // CUDA cores, one fp32 FMA per product: the plain float32 baseline and fallback
  Tf32 = 1,    // one TF32 mma.sync m16n8k8 per product: ~1e-3 relative error, fastest
  Tf32x3 = 2,  // split precision a = big + small (both TF32), big*big + big*small + small*big
};

constexpr const char* math_name(Math m) {
  return m == Math::Fma ? "fma" : m == Math::Tf32 ? "tf32" : "3xtf32";
}

// Whether `dp` is in a list of common/head_dims.hpp (the one head-dim table, generated).
template <int N>
FLASHATTN_CUDA_HD constexpr bool in_dims(const int (&dims)[N], int64_t dp) {
  for (int i = 0; i < N; ++i)
    if (dims[i] == dp) return true;
  return false;
}
// The smallest head dim of a list that holds d (lists ascend), 0 when none does.
template <int N>
FLASHATTN_CUDA_HD constexpr int pad_to(const int (&dims)[N], int64_t d) {
  for (int i = 0; i < N; ++i)
    if (d <= dims[i]) return d >= 1 ? dims[i] : 0;
  return 0;
}

// Head dims are padded up to one of kHeadDims (zero columns change no dot product).
constexpr int padded_head_dim(int64_t d) { return pad_to(kHeadDims, d); }

// Every warp owns 16 rows of its pass's stationary operand (query rows for the forward and dQ,
// key rows for dK/dV), the M of an m16n8k8 tile, so all three maths share one register layout.
struct TileConfig {
  int block_m;    // rows of the stationary operand per CTA (= 16 * warps / col_split)
  int block_n;    // rows of the streamed operand per pipeline stage
  int warps;
  int stages;     // 2: cp.async double buffer; 1 where shared memory does not allow two
  int col_split;  // dK/dV only: warps sharing 16 key rows, each accumulating D/col_split columns
  FLASHATTN_CUDA_HD constexpr int threads() const { return warps * 32; }
};

enum class Pass { Forward, Dq, Dkv };

// The one tile table, one row per (pass, padded head dim) and shared-memory class: `big` is
// sm_90 and newer (227 KiB of shared memory per block), otherwise the sm_80 limit (163 KiB).
// Device code picks its row from __CUDA_ARCH__ (kDeviceBig below), the host from the device's
// compute capability (cc >= 9), so both always agree for the cubins built (sm_80, sm_90).
// Row stride in shared memory is D + 4 floats: the 4-float pad makes every fragment load of the
// mma layouts bank-conflict free (rows land 4 banks apart) and keeps rows 16-byte aligned for
// cp.async.
FLASHATTN_CUDA_HD constexpr TileConfig tile_config(Pass pass, int dp, bool big) {
  switch (pass) {
    case Pass::Forward:  // stationary Q [block_m x D]; streamed K, V [block_n x D] per stage
      return dp <= 64 ? TileConfig{128, 64, 8, 2, 1}
           : dp <= 128 ? TileConfig{128, 32, 8, 2, 1}  // block_n 64 spills (3xtf32, 255 regs)
           : big       ? TileConfig{64, 32, 4, 2, 1}
                       : TileConfig{64, 32, 4, 1, 1};
    case Pass::Dq:  // stationary Q, dO; streamed K, V (block_n 32 keeps 3xtf32 out of spills)
      return dp <= 64 ? TileConfig{128, 32, 8, 2, 1}
           : dp <= 128 ? (big ? TileConfig{128, 32, 8, 2, 1} : TileConfig{64, 32, 4, 2, 1})
           : big       ? TileConfig{64, 32, 4, 1, 1}
                       : TileConfig{32, 32, 2, 1, 1};
    case Pass::Dkv:  // stationary K, V; streamed Q, dO (+ LSE and D vectors)
      return dp <= 64 ? TileConfig{128, 32, 8, 2, 1}
           : dp <= 128 ? (big ? TileConfig{128, 16, 8, 2, 1} : TileConfig{64, 32, 4, 2, 1})
           : big       ? TileConfig{32, 32, 4, 2, 2}
                       : TileConfig{32, 32, 4, 1, 2};
  }
  return TileConfig{0, 0, 0, 0, 0};
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kDeviceBig = true;
#else
constexpr bool kDeviceBig = false;
#endif

FLASHATTN_CUDA_HD constexpr int smem_row(int dp) { return dp + 4; }

// Dynamic shared memory of one CTA, in bytes.
FLASHATTN_CUDA_HD constexpr int smem_bytes(Pass pass, int dp, bool big) {
  const TileConfig c = tile_config(pass, dp, big);
  const int row = smem_row(dp) * 4;
  switch (pass) {
    case Pass::Forward: return (c.block_m + 2 * c.stages * c.block_n) * row;
    case Pass::Dq: return (2 * c.block_m + 2 * c.stages * c.block_n) * row;
    case Pass::Dkv: return (2 * c.block_m + 2 * c.stages * c.block_n) * row + 2 * c.stages * c.block_n * 4;
  }
  return 0;
}

// 3xTF32 (fp32 mode): the streamed tiles (K, V in the forward and dQ; Q, dO in dK/dV) are split
// into big + small once per CTA in shared memory - big in place, small in a buffer of the same
// shape - instead of every warp splitting every fragment it loads (eight warps share each tile;
// the splits were a third of the kernels' SASS instructions). The forward up to D = 128; the
// backward at D = 64 only for now: at D = 128 the dQ tile's small buffers do not fit and the dK/dV
// kernel spills 28 bytes more with them (to be measured first). Elsewhere the warps keep
// splitting (split_smem_bytes = 0).
FLASHATTN_CUDA_HD constexpr int split_smem_bytes(Pass pass, int dp, bool big, Math m) {
  if (m != Math::Tf32x3 || dp > (pass == Pass::Forward ? 128 : 64)) return 0;
  const TileConfig c = tile_config(pass, dp, big);
  const int extra = 2 * c.stages * c.block_n * smem_row(dp) * 4;
  return smem_bytes(pass, dp, big) + extra <= (big ? 227 : 163) * 1024 ? extra : 0;
}

constexpr bool tiles_fit() {
  for (Pass p : {Pass::Forward, Pass::Dq, Pass::Dkv})
    for (int d : kHeadDims) {
      if (smem_bytes(p, d, false) > 163 * 1024 || smem_bytes(p, d, true) > 227 * 1024) return false;
      const TileConfig c = tile_config(p, d, true), s = tile_config(p, d, false);
      if (c.block_m * c.col_split != 16 * c.warps || s.block_m * s.col_split != 16 * s.warps) return false;
    }
  return true;
}
static_assert(tiles_fit(), "a tile_config row exceeds shared memory or leaves warps without rows");

// ==== float16 / bfloat16 kernels (kernels16.cuh) =================================================

enum class Half16 : int { F16 = 0, BF16 = 1 };

// Head dims with 16-bit kernels (kHeadDims16); any other dim up to 256 is padded to the next one.
constexpr int padded_head_dim16(int64_t d) { return pad_to(kHeadDims16, d); }

// Tiles of the 16-bit passes. A warp owns mt m16 tiles (16*mt rows) of the stationary operand
// (query rows for the forward and dQ, key rows for dK/dV); col_split warps share them in dK/dV,
// each accumulating DP/col_split columns (D = 256 would not fit dK and dV in registers
// otherwise). The streamed operand comes in block_n rows per stage, two stages (cp.async double
// buffer). Reasons for the sizes:
//  - forward: 2 m16 tiles per warp halve the shared-memory traffic of the K and V fragments
//    (each ldmatrix of K or V feeds two mma), which bounds mma.sync on this path; 4 warps x
//    32 rows = 128 queries. D = 256 keeps O in registers only with one m16 tile per warp.
//  - dQ: Q and dO stationary (2 x block_m x DP x 2 bytes); one m16 tile per warp (dQ, S and dP
//    accumulators).
//  - dK/dV: K and V stationary (128 keys), streamed Q/dO tiles; D = 256 splits columns over 2
//    warps (dK and dV accumulators would not fit in registers otherwise).
struct TileConfig16 {
  int block_m;    // stationary rows per CTA (= 16 * mt * warps / col_split)
  int block_n;    // streamed rows per stage
  int warps;
  int mt;         // m16 tiles per warp
  int col_split;  // dK/dV only
  FLASHATTN_CUDA_HD constexpr int threads() const { return warps * 32; }
};

// Rows measured on the H200 against alternatives: 2 m16 tiles per
// warp win the forward at D <= 128 (8 warps x 1 tile lost 10-25%); block_n 32 removes the D = 128
// forward's spills (+4%); 128-key dK/dV blocks with 64-128 streamed queries beat 32 (+10-20%).
FLASHATTN_CUDA_HD constexpr TileConfig16 tile_config16(Pass pass, int dp, bool big) {
  switch (pass) {
    case Pass::Forward:
      return dp <= 64  ? TileConfig16{128, 64, 4, 2, 1}
           : dp <= 128 ? TileConfig16{128, 32, 4, 2, 1}
           : big       ? TileConfig16{128, 64, 8, 1, 1}
                       : TileConfig16{128, 32, 8, 1, 1};
    case Pass::Dq:
      return dp <= 64  ? TileConfig16{128, 128, 8, 1, 1}
           : dp <= 128 ? TileConfig16{128, 64, 8, 1, 1}
                       : TileConfig16{64, 32, 4, 1, 1};
    case Pass::Dkv:
      return dp <= 64  ? TileConfig16{128, 128, 8, 1, 1}
           : dp <= 128 ? TileConfig16{128, 64, 8, 1, 1}
                       : TileConfig16{64, 32, 8, 1, 2};
  }
  return TileConfig16{0, 0, 0, 0, 0};
}

// Dynamic shared memory of one 16-bit CTA, in bytes (`atomic`: the dK/dV pass also stages dS^T
// for the dQ product).
FLASHATTN_CUDA_HD constexpr int smem_bytes16(Pass pass, int dp, bool big, bool atomic = false) {
  const TileConfig16 c = tile_config16(pass, dp, big);
  const int row = dp * 2;
  switch (pass) {
    case Pass::Forward: return (c.block_m + 2 * 2 * c.block_n) * row;
    case Pass::Dq: return (2 * c.block_m + 2 * 2 * c.block_n) * row;
    case Pass::Dkv:
      return (2 * c.block_m + 2 * 2 * c.block_n) * row + 2 * 2 * c.block_n * 4 +
             (atomic ? c.block_m * c.block_n * 2 : 0);
  }
  return 0;
}

// The KV-cache attention kernel (sm80/decode16.cuh): 128 threads, 64-key tiles in two stages;
// KW warps share each key tile (KW = 4: 16 (row, head) pairs per CTA; KW = 1: 64).
// How it loads the K/V tiles (DecodeArgs::loader):
//   kBulk    (sm_90) one bulk copy per cache row on the copy engine, completing on an mbarrier,
//            into rows padded by 16 bytes (unswizzled, conflict-free for ldmatrix): the SM's
//            own load path keeps too few bytes in flight to stream at the memory's rate;
//   kRows    cp.async, whole tiles of a contiguous cache as straight-line 16-byte copies;
//   kGeneric cp.async through the row map for every tile (load_rows16).
struct DecodeShape {
  static constexpr int kThreads = 128, kWarps = 4, kBlockN = 64;
  // K/V tiles in flight: the pipeline's stage count is a kernel argument (2..kMaxStages).
  static constexpr int kMinStages = 2, kMaxStages = 4;
  enum Loader : int { kBulk = 0, kRows = 1, kGeneric = 2 };
  FLASHATTN_CUDA_HD static constexpr int block_m(int kw) { return 16 * (kWarps / kw); }
};
// Its dynamic shared memory: the Q tile, `stages` stages of K and V tiles (rows padded by 16
// bytes with kBulk), the warps' row statistics, and with kBulk an mbarrier per stage.
FLASHATTN_CUDA_HD constexpr int decode_smem_bytes(int dp, int kw, bool bulk = false, int stages = 2) {
  return DecodeShape::block_m(kw) * dp * 2 + 2 * stages * DecodeShape::kBlockN * (dp * 2 + (bulk ? 16 : 0)) +
         2 * DecodeShape::kWarps * 16 * 4 + (bulk ? 8 * stages : 0);
}

constexpr bool tiles16_fit() {
  for (Pass p : {Pass::Forward, Pass::Dq, Pass::Dkv})
    for (int d : kHeadDims16)
      for (bool big : {false, true}) {
        const TileConfig16 c = tile_config16(p, d, big);
        if (smem_bytes16(p, d, big, true) > (big ? 227 : 163) * 1024) return false;
        if (c.block_m * c.col_split != 16 * c.mt * c.warps) return false;
        if (c.block_n % 16 != 0 || (d / c.col_split) % 16 != 0) return false;
        // dK/dV atomic dQ: warps tile the block_n x DP dQ product in m16 x (multiple of 16)
        if (p == Pass::Dkv && (c.warps % (c.block_n / 16) != 0 ||
                               (d / (c.warps / (c.block_n / 16))) % 16 != 0))
          return false;
      }
  return true;
}
static_assert(tiles16_fit(), "a tile_config16 row exceeds shared memory or leaves warps without rows");

// ==== sm_90a (Hopper) float16 / bfloat16 kernels (sm90/fwd16.cuh, sm90/dkv16.cuh) ============================

// Warpgroup tiles: each warpgroup (4 warps) owns 64 rows of the stationary operand, the M of a
// wgmma. The streamed operand comes in block_n rows per stage, two stages per operand (K and V
// are separate buffers so that K of tile j+1 and V of tile j can be in use at once). Only the
// head dims whose rows are whole 128-byte swizzle blocks (64, 128, 256) have these kernels.
struct TileConfig90 {
  int block_m;
  int block_n;
  int warpgroups;          // consumer warpgroups; one producer warpgroup more
  int col_split = 1;       // dK/dV: warpgroups sharing 64 keys, each accumulating DP/col_split columns
  int min_ctas = 1;        // resident CTAs per SM the registers are budgeted for
  int producer_regs = 24;  // per producer thread after setmaxnreg
  FLASHATTN_CUDA_HD constexpr int threads() const { return (warpgroups + 1) * 128; }
  // Registers per thread at entry (__launch_bounds__(threads, min_ctas)) and, after setmaxnreg,
  // per consumer thread: the producer's share handed over, multiples of 8.
  FLASHATTN_CUDA_HD constexpr int entry_regs() const { return 65536 / (threads() * min_ctas) / 8 * 8; }
  FLASHATTN_CUDA_HD constexpr int consumer_regs() const {
    const int r = (entry_regs() * threads() - 128 * producer_regs) / (128 * warpgroups) / 8 * 8;
    return r > 240 ? 240 : r;
  }
};

FLASHATTN_CUDA_HD constexpr bool has_sm90(Pass pass, int dp) {
  return pass == Pass::Forward ? in_dims(kSm90Forward16, dp)
       : pass == Pass::Dkv     ? in_dims(kSm90Dkv16, dp)  // single pass (atomic dQ)
                               : false;
}

// Forward: O (DP/2 floats per thread), S of one key tile (block_n/2) and P's fragments
// (block_n/4 registers) must fit in 240 registers with two consumer warpgroups per CTA.
// dK/dV (with atomic dQ): 128 keys per CTA (64 per warpgroup, the M of S^T = K Q^T), 64 queries
// per streamed tile; dK and dV accumulators take DP/2 registers each, S^T, dP^T and dQ
// (DP/2 columns per warpgroup, in products of at most 64) the rest. D = 256 would need 256
// registers for dK and dV alone: 64 keys per CTA, both warpgroups computing S^T and dP^T for
// them (the 2 of 5 products done twice) and each keeping half of dK's and dV's columns.
// variant 1 (dK/dV at D = 64 only): one consumer warpgroup per CTA (64 keys) and two CTAs per SM,
// so one CTA's prologue, epilogue and softmax overlap the other's products; it streams Q and dO
// and adds dQ twice as often per key (selection: sm90_bwd_variant() in select.cpp).
FLASHATTN_CUDA_HD constexpr TileConfig90 tile_config90(Pass pass, int dp, int variant = 0) {
  return pass == Pass::Forward ? (dp <= 128 ? TileConfig90{128, 128, 2} : TileConfig90{128, 64, 2})
       : pass == Pass::Dkv
           ? (variant == 1 ? TileConfig90{64, 64, 1, 1, 2, 56}
                           : dp <= 128 ? TileConfig90{128, 64, 2} : TileConfig90{64, 64, 2, 2})
           : TileConfig90{0, 0, 0};
}
FLASHATTN_CUDA_HD constexpr bool has_sm90_variant(Pass pass, int dp, int variant) {
  return variant == 0 ? has_sm90(pass, dp) : pass == Pass::Dkv && dp == 64;
}

// The forward stages O for its 16-byte stores in a tile of its own where shared memory holds one
// (D <= 128), so that a CTA walking several row blocks (FwdWalk, work.hpp) can copy the next
// block's Q while this one's epilogue runs; at D = 256 (Q, two stages of K and V: 192 KiB) O goes
// through Q's tile, which is then released only after the epilogue read it.
FLASHATTN_CUDA_HD constexpr bool fwd90_own_o(int dp) { return dp <= 128; }
// The dK/dV kernel's dQ by the copy engine (dkv16.cuh, kBulkDq): the two warpgroups stage the
// tile's float32 dQ in shared memory (rows dkv90_dq_ld floats apart) and a producer warp adds it
// to the accumulator with bulk reductions. At D = 128 (two key groups, the column split), in the
// default design. Against the consumers' own reductions (H200, bf16, S 1k-16k, one process):
// D 128 1.10-1.19x MHA, 1.02-1.19x GQA; D 64 (the alternating owner staging its whole tile)
// 0.70-0.77x - a D 64 tile is too short for the producer warp's 64 row-by-row bulk adds, and the
// next owner waits for the staged tile to be read.
FLASHATTN_CUDA_HD constexpr bool dkv90_bulk_dq(int dp, int variant, bool ordered) {
  return !ordered && dp > 64 && dp <= 128 && variant == 0;
}
// 8 floats of padding: rows 32 bytes apart in the banks, so a half-warp's 8-byte stores of an
// accumulator fragment (4 rows x 4 lanes) fall on 16 different bank pairs.
FLASHATTN_CUDA_HD constexpr int dkv90_dq_ld(int dp) { return dp + 8; }
// Dynamic shared memory: the tiles, 1 KiB so that the kernel can align them to 1024 bytes, and
// the pipeline's mbarriers. Forward: Q, two stages of K and V, O's own tile (fwd90_own_o).
// dK/dV: K, V; two stages of Q, dO, LSE and D; two dS^T tiles; the staged dQ (dkv90_bulk_dq).
FLASHATTN_CUDA_HD constexpr int smem_bytes90(Pass pass, int dp, int variant = 0, bool ordered = false) {
  const TileConfig90 c = tile_config90(pass, dp, variant);
  return pass == Pass::Forward ? ((fwd90_own_o(dp) ? 2 : 1) * c.block_m + 4 * c.block_n) * dp * 2 + 1024 + 16 * 8
       : pass == Pass::Dkv
           ? (2 * c.block_m + 4 * c.block_n) * dp * 2 + (c.col_split > 1 ? 4 : 2) * c.block_m * c.block_n * 2 +
                 4 * c.block_n * 4 + 1024 + 16 * 8 + (dkv90_bulk_dq(dp, variant, ordered) ? c.block_n * dkv90_dq_ld(dp) * 4 : 0)
           : 0;
}
// tf32 forward (sm90/tf32_fwd.cuh), padded D = 64 and 128: 128 queries (two consumer
// warpgroups) x 64 keys per step; the producer warpgroup keeps 40 registers (three of its warps
// transpose V), which leaves 232 per consumer thread for Q's tf32 fragments (DP/2), O (DP/2),
// S and P (block_n/2 each).
FLASHATTN_CUDA_HD constexpr bool has_sm90_tf32(int dp) { return in_dims(kSm90Tf32Forward, dp); }
FLASHATTN_CUDA_HD constexpr TileConfig90 tile_config90_tf32(int /*dp*/) { return TileConfig90{128, 64, 2, 1, 1, 40}; }
// Q (whose space then holds the two transposed V stages), two stages of K and of V as stored,
// 1 KiB for alignment, 16 mbarriers.
FLASHATTN_CUDA_HD constexpr int smem_bytes90_tf32(int dp) {
  return (tile_config90_tf32(dp).block_m + 4 * tile_config90_tf32(dp).block_n) * dp * 4 + 1024 + 16 * 8;
}
static_assert(smem_bytes90_tf32(128) <= 227 * 1024, "tile_config90_tf32 exceeds shared memory");

// fp32-accurate (3xTF32) forward on wgmma (sm90/x3_fwd.cuh), padded D = 64 and 128 (the
// default at both on 9.0, fp32_fwd_wgmma_default: at 64 since its descriptors stay on the uniform
// datapath, 4-17% faster than mma.sync there): 64 queries (both
// consumer warpgroups, each half the head dim) x 32-key tiles; the producer (one copy thread)
// keeps 40 registers, 232 per consumer thread: at D = 128 Q's big and small fragments of a half
// (64), O and the tile's O (32 each), S, its second k-group and the partner's partial (16 each),
// P's big and small fragments (32); at D = 64 half of the Q and O parts.
FLASHATTN_CUDA_HD constexpr bool has_sm90_3xtf32(int dp) { return in_dims(kSm90X3Forward, dp); }
FLASHATTN_CUDA_HD constexpr bool fp32_fwd_wgmma_default(int dp) { return has_sm90_3xtf32(dp); }
FLASHATTN_CUDA_HD constexpr TileConfig90 tile_config90_3xtf32(int /*dp*/) { return TileConfig90{64, 32, 2, 1, 1, 40}; }
// Q; two stages of K big, K small, Vt big, Vt small; the two warpgroups' partial scores; 1 KiB
// for alignment, room for 24 mbarriers (13 used).
FLASHATTN_CUDA_HD constexpr int smem_bytes90_3xtf32(int dp) {
  const TileConfig90 c = tile_config90_3xtf32(dp);
  return (c.block_m + 2 * 4 * c.block_n) * dp * 4 + 2 * c.block_m * c.block_n * 4 + 1024 + 24 * 8;
}
static_assert(smem_bytes90_3xtf32(64) <= 227 * 1024 && smem_bytes90_3xtf32(128) <= 227 * 1024,
              "tile_config90_3xtf32 exceeds shared memory");

// tf32 backward (sm90/tf32_bwd.cuh), padded D = 64: the split design's two passes on
// wgmma, reading operands that a pre-pass rounded to tf32 and transposed (k contiguous for every
// B operand). dQ: 128 queries (two consumer warpgroups) x 64-key tiles; Q and dO as tf32
// fragments (DP/2 registers each), dQ, S, dP and dS's fragments DP/2 and block_n/2 each.
// dK/dV: 128 keys (64 per warpgroup) x 64-query tiles; K and V as fragments, dK, dV, S^T, dP^T.
// At D = 128 that does not fit: K and V (or Q and dO) alone would take 128 registers per thread,
// and their tiles with two stages of four streamed operands exceed shared memory. So D = 128 has
// the pair design (sm90/tf32_bwd_pair.cuh): 64 rows per CTA, both warpgroups on the same
// rows, one stationary operand and one accumulator each (~160 registers), 32-row streamed tiles.
FLASHATTN_CUDA_HD constexpr bool has_sm90_tf32_bwd(int dp) { return in_dims(kSm90Tf32Backward, dp); }
// The fp32-accurate (3xTF32) backward on wgmma: the pair kernels with every product in three
// terms (x3), padded D = 64 and 128. Its stationary operand's big and small fragments take DP
// registers per thread, its streamed tiles come in big and small copies (twice the shared memory),
// and each tile's product goes to a fresh accumulator added to the long-lived one in float32 (the
// tensor cores truncate as they accumulate). At D = 128 neither registers nor two stages fit, so
// there (pair_small_in_smem) the stationary operand's small part stays in shared memory (split in
// place, read by the tensor cores from there) and a tile's streamed copies come in two half stages
// (the scores' operands, then the gradient product's), each released when its readers are done.
FLASHATTN_CUDA_HD constexpr bool has_sm90_3xtf32_bwd(int dp) { return in_dims(kSm90X3Backward, dp); }
FLASHATTN_CUDA_HD constexpr bool pair_small_in_smem(int dp, bool x3) { return x3 && dp == 128; }
// The tf32 backward on the pair kernels: always at D = 128, a choice at D = 64 (select.cpp); the
// 3xTF32 backward is on them always.
FLASHATTN_CUDA_HD constexpr bool tf32_bwd_pair(int dp) { return dp == 128; }
// The producer keeps 48 registers (its 64-bit tile and pointer arithmetic spilled at 24 and 40;
// 64 in the persistent pair kernels, whose block loop spilled at 48 and 56), which leaves 224
// (pair: 216) per consumer thread.
FLASHATTN_CUDA_HD constexpr TileConfig90 tile_config90_tf32_bwd(Pass /*pass*/, bool pair) {
  return pair ? TileConfig90{64, 32, 2, 1, 1, 64} : TileConfig90{128, 64, 2, 1, 1, 48};
}
// dQ: Q and dO (block_m rows), two buffers of K, V (rows = keys) and K^T (rows = head dim); pair
// design: the P and dS exchange buffers (block_m x block_n floats each; x3: dS's big and small).
// dK/dV: K and V (block_m rows), two buffers of Q, dO, Q^T and dO^T plus LSE and D vectors; pair
// design: the P^T exchange buffer. x3: every streamed tile twice (big, small); pair_small_in_smem:
// one buffer of each half instead of two.
// The streamed tiles in a TileRing (sm90/tf32_bwd.cuh): two buffers of each tile's X half
// (the scores' operands) and G half (the gradient product's), one each with pair_small_in_smem.
// Each: 1 KiB for alignment, up to 16 mbarriers and the block queue's two slots (BlockQueue).
FLASHATTN_CUDA_HD constexpr int smem_bytes90_tf32_bwd(Pass pass, int dp, bool pair, bool x3 = false) {
  const TileConfig90 c = tile_config90_tf32_bwd(pass, pair);
  const int parts = x3 ? 2 : 1, stages = pair && pair_small_in_smem(dp, x3) ? 1 : 2;
  const int exchange = pair ? (pass == Pass::Dq ? 1 + parts : 1) * c.block_m * c.block_n * 4 : 0;
  return exchange + (pass == Pass::Dq ? (2 * c.block_m + stages * 3 * parts * c.block_n) * dp * 4 + 1024 + 16 * 8 + 16
                                      : (2 * c.block_m + stages * 4 * parts * c.block_n) * dp * 4 +
                                            2 * 2 * c.block_n * 4 + 1024 + 16 * 8 + 16);
}
constexpr bool tiles90_tf32_bwd_fit() {
  for (Pass p : {Pass::Dq, Pass::Dkv})
    for (bool pair : {false, true})
      for (bool x3 : {false, true})
        if ((pair || !x3) && smem_bytes90_tf32_bwd(p, 64, pair, x3) > 227 * 1024) return false;
  for (Pass p : {Pass::Dq, Pass::Dkv})
    for (bool x3 : {false, true})
      if (smem_bytes90_tf32_bwd(p, 128, true, x3) > 227 * 1024) return false;
  return true;
}
static_assert(tiles90_tf32_bwd_fit(), "tile_config90_tf32_bwd exceeds shared memory");

constexpr bool tiles90_fit() {
  for (Pass p : {Pass::Forward, Pass::Dkv})
    for (int d : {64, 128, 256})
      for (int v : {0, 1})
        if (has_sm90_variant(p, d, v) &&
            smem_bytes90(p, d, v) * tile_config90(p, d, v).min_ctas > 227 * 1024)
          return false;
  return true;
}
static_assert(tiles90_fit(), "a tile_config90 row exceeds shared memory");

}  // namespace flashattn::cuda
