// Kernel selection of the CUDA backend: the single answer to "which kernel runs this problem on
// this device, and is it supported?". select_forward / select_backward return a typed plan per
// pass - the kernel, its head-dim instantiation, arithmetic, variant settings, shared memory and
// workspace - decided here once, from the problem, the operands' alignment (16-byte vectors, the
// copy engine's tensor maps), the device's capabilities and the developer overrides. backend.cu
// only switches on the plan and launches; a launcher never falls back to another kernel.
// Host code only, no CUDA runtime calls, so that every rule is unit-tested without a GPU
// (tests/cuda/test_select.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/params.hpp"
#include "cuda/common/config.hpp"
#include "cuda/host/overrides.hpp"

namespace flashattn::cuda {

// What selection needs to know of a device (backend.cu reads it once per device).
struct DeviceCaps {
  int cc_major = 0;
  int cc_minor = 0;
  int smem_optin = 0;  // bytes of shared memory one block may opt into
  int sms = 0;         // multiprocessors
  bool tma = false;    // the driver encodes tensor maps (cuTensorMapEncodeTiled found)
  double mem_gbps = 0; // peak memory bandwidth, GB/s (2 x memory clock x bus width; 0: unknown)
  // Multiprocessors this process's kernels can be sure to hold at once (the ordered backward's
  // dq_rotate needs all key blocks of a head resident): the device's, 0 under MPS (a client's share
  // of the device is not visible) or where unknown; the backward narrows it to the current
  // context's (a green context's share) when its plan depends on it (backend.cu backward_plan_for).
  int resident_sms = 0;
  bool sm90a() const { return cc_major == 9 && cc_minor == 0; }  // "a" features: exactly 9.0
  bool big() const { return cc_major >= 9; }  // runs the sm_90 cubin: tile_config(..., big = true)
};

// ---- the forward ---------------------------------------------------------------------------------
enum class FwdKernel : uint8_t {
  Sm80Mma32,   // float32 mma.sync (tf32 / 3xTF32) or CUDA-core FMA (sm80/kernels_fp32.cuh)
  Sm80Mma16,   // float16/bfloat16 mma.sync (sm80/kernels16.cuh)
  Sm90Wgmma16, // float16/bfloat16 wgmma + TMA, warp-specialized (sm90/fwd16.cuh, dkv16.cuh)
  Sm90Tf32,    // float32 in tf32 on wgmma (sm90/tf32_fwd.cuh)
  Sm90X3,      // float32 fp32-accurate (3xTF32) on wgmma, on the pre-pass's split copies (sm90/x3_fwd.cuh)
};
struct ForwardPlan {
  FwdKernel kernel = FwdKernel::Sm80Mma32;
  int dp = 0;                 // padded head dim: the instantiation
  Math math = Math::Tf32x3;   // float32 kernels
  Half16 h = Half16::BF16;    // 16-bit kernels
  bool vec16 = false;         // 16-byte vector loads and stores of every operand
  bool big = false;           // DeviceCaps::big
  bool pingpong = false;      // Sm90Wgmma16: the two consumer warpgroups take turns issuing products
  int tf32_copies = 0;        // Sm90Tf32: operands the pre-pass copies (0 none, 1 V transposed, 2 K and V)
  bool xf = false;            // the kernel with the per-entry score step (softcap, ALiBi; launchers' XF)
  int smem = 0;               // dynamic shared memory of the kernel, bytes
  size_t workspace = 0;       // device scratch, bytes (the pre-pass copies; packed: maps and block table)
  int64_t seq_maps = -1;      // a packed batch on Sm90Wgmma16: the per-sequence maps' offset in the workspace, bytes
  int64_t seq_check = -1;     // a packed batch with unchecked arrays: the check's offset (seq_check.hpp), bytes
  // A packed batch on Sm90Wgmma16 with a compact grid: one CTA per real row block (of at most
  // grid_blocks, seq_blocks_bound()), found in a table after the maps (-1: the dense grid over
  // max_seqlen_q, CTAs past a sequence's rows return).
  int64_t block_table = -1;
  int64_t grid_blocks = 0;
  // Sm90Wgmma16 on a dense call: at most this many CTAs, each walking row blocks in a static order
  // (FwdWalk, work.hpp: where the blocks cost about the same, one per multiprocessor); 0: one CTA
  // per row block in the hardware's order.
  int walk_ctas = 0;
  // > 0: the float32 forward in the fp32 mode over key chunks of this many keys, each chunk's
  // (O, LSE) folded into float64 row sums (backend.cu forward_chunked), so that no float32 sum
  // of a row runs over more than key_chunk / 64 tiles (docs/ALGORITHM.md, "Long key sequences").
  // The plan above is then the one of the whole call; each chunk selects its own.
  int64_t key_chunk = 0;
};
// Keys per chunk of the fp32-mode forward (ForwardPlan::key_chunk; FLASHATTN_CUDA_KEY_CHUNK): a
// one-level float32 sum over 256 tiles errs by at most ~256 * 2^-24 relative (7.4e-6 measured
// as 2.9e-8 per tile on an H100), under the 1e-5 the fp32 mode promises at any length.
constexpr int64_t kKeyChunk = 16384;
// Whether calls chunk by default (FLASHATTN_CUDA_KEY_CHUNK=0 turns it off): on since the chunked
// path's GPU tests (KeyChunks32, CudaLongSequences, CudaNonFinite's chunk routes) passed.
constexpr bool kKeyChunksByDefault = true;

// ---- the backward --------------------------------------------------------------------------------
enum class BwdKernel : uint8_t {
  Sm80Mma32Split,   // preprocess, dQ pass, dK/dV pass: float32 mma.sync / FMA (no atomics)
  Sm80Mma16Split,   // the same for float16/bfloat16 (deterministic)
  Sm80Mma16Atomic,  // preprocess, one dK/dV pass adding dQ into float32 by atomics, convert
  Sm90Wgmma16Atomic,// the same on the sm_90a wgmma dK/dV kernel
  Sm90Wgmma32,      // float32 tf32 or 3xTF32 on wgmma: operand copies, dQ pass, dK/dV pass
};
struct BackwardPlan {
  BwdKernel kernel = BwdKernel::Sm80Mma32Split;
  int dp = 0;
  Math math = Math::Tf32x3;
  Half16 h = Half16::BF16;
  bool vec16 = false;
  bool big = false;
  int sm90_variant = 0;     // Sm90Wgmma16Atomic: tile_config90 variant (1: one warpgroup, two CTAs per SM)
  bool pair = false;        // Sm90Wgmma32: the pair kernels (sm90/tf32_bwd_pair.cuh)
  bool dkv_wgmma = false;   // Sm90Wgmma32 split kernels: the dK/dV pass on wgmma (else mma.sync)
  long persistent_cap = 0;  // Sm90Wgmma32 pair kernels: at most this many CTAs walk the blocks (0: one per block)
  int convert_ctas = 0;     // Sm90Wgmma32: CTAs writing the Q/dO copies on a side stream (0: in order)
  bool xf = false;          // the kernels with the per-entry score step (softcap, ALiBi; launchers' XF)
  int smem_dq = 0;          // dynamic shared memory of the dQ pass (0: none)
  int smem_dkv = 0;         // of the dK/dV pass
  size_t workspace = 0;     // device scratch, bytes (D, the dQ accumulator; Sm90Wgmma32 adds its copies)
  int64_t seq_maps = -1;    // a packed batch on Sm90Wgmma16Atomic: the per-sequence maps' offset, bytes
  int64_t seq_check = -1;   // a packed batch with unchecked arrays: the check's offset (seq_check.hpp), bytes
  // Sm90Wgmma16Atomic with the dQ sums in a fixed key-block order (deterministic = 1, or
  // FLASHATTN_CUDA_BWD = ordered): the counters' offset in the workspace (bytes) and size (ints);
  // -1: none.
  int64_t dq_locks = -1;
  int64_t dq_lock_count = 0;
  // ... without a mask, with every key block of a head on the GPU at once: the blocks start at
  // query tiles spread over the row and take turns in the order they arrive (docs/ALGORITHM.md).
  bool dq_rotate = false;
  // ... under GQA (dense calls): one CTA per (key block, query head) instead of per kv head, the
  // group's dK/dV partials summed in query-head order in a float32 accumulator ([B, Hkv, nk
  // block_m rows, DP] for dK, then dV; offset in bytes, -1: none) with a counter per (batch, kv
  // head, key block) after dq_locks' (inside dq_lock_count, zeroed with them). The default design
  // too, with FLASHATTN_CUDA_ATOMIC_HEADS=1: then its counters alone (dq_locks = -1, dq_lock_count
  // counts them).
  int64_t dkv_acc = -1;
  int64_t dkv_acc_rows = 0;   // B Hkv nk block_m: dV's part starts this many rows after dK's
  int64_t dkv_locks = -1;     // bytes
  bool atomic_dq() const { return kernel == BwdKernel::Sm80Mma16Atomic || kernel == BwdKernel::Sm90Wgmma16Atomic; }
};

// ---- KV-cache calls ---------------------------------------------------------------------------------
// The decode kernel (sm80/decode16.cuh) for a flashattn_forward_kvcache call, and its workspace:
// the device copies of the call's index arrays (idx_ints int32: seqlen_k, first_new, pos0, then
// batch_row, start and the dense block table where the call has them), the rotated q, the
// split-KV partials.
struct KvcachePlan {
  int dp = 0;
  Half16 h = Half16::BF16;
  bool xf = false;
  int kw = 4;          // DecodeShape: 4 (16 rows per CTA, warps split the keys) or 1 (64 rows)
  int splits = 1;      // CTAs per row block along the keys (> 1: partials and a combine pass)
  bool vec16 = false;
  int loader = DecodeShape::kRows;  // DecodeShape::Loader (kBulk only on sm_90, D = DP, 16-byte rows)
  int stages = 2;      // K/V tiles in the pipeline (DecodeShape::kMinStages..kMaxStages)
  int smem = 0;
  size_t workspace = 0;
  size_t idx_ints = 0;        // the index arrays' entries: at offset 0 of the workspace, unless
  bool idx_inline = false;    // in the kernels' parameters (KvIndex: no block table, <= kKvIndexMax)
  int64_t q_rot = -1;         // byte offset of the rotated q ([B, Hq, Sq, q_rot_ld] 16-bit), -1: none
  int64_t q_rot_ld = 0;
  int64_t check = -1;         // KvCheck: the check's derived arrays and verdict ([3 B + 1] int32), bytes
  int64_t o_part = -1;        // byte offsets of the partials (splits > 1)
  int64_t lse_part = -1;
};
// Index entries a KV-cache call passes in its kernels' parameters (KvIndex, launch.hpp).
constexpr int kKvIndexMax = 384;
// At most this many splits (FlashAttention's bound too), and at least this many key tiles per
// split when the library chooses.
constexpr int kMaxKvSplits = 128;
constexpr int kMinKvTilesPerSplit = 2;
// What one CTA of the whole-tile KV loader streams at most, GB/s (H200: 128 such CTAs, one per
// multiprocessor, read 3675 GB/s, 28.7 each, against the copy's 4278; on the H100 one per
// multiprocessor reaches the copy's ~3000). A device whose bandwidth per multiprocessor is above
// it needs more CTAs than multiprocessors (kv_streams).
constexpr double kKvCtaGBps = 30.0;
// CTAs per multiprocessor that keep the device's memory busy with the whole-tile loader: 1 on an
// H100 (25 GB/s per SM), 2 on an H200 (37); 1 when the bandwidth is unknown.
int kv_streams(const DeviceCaps& dev);
// The split count: `requested` (the caller's num_splits) when > 0, bounded by the key tiles;
// otherwise one split from 4 waves of row blocks on the device's CTA slots, else the fewest splits
// (each of at least kMinKvTilesPerSplit tiles) whose waves are at least 90% full, or the fullest.
int kv_splits(int64_t blocks, int64_t tiles, int64_t slots, int requested);

template <class Plan>
struct Selected {
  bool ok = false;
  std::string why;  // when !ok: the reason, for an Unsupported error
  Plan plan;
};

// The plans for a problem on a device. Operands' pointers and strides decide vector and tensor-map
// eligibility only (no memory is touched).
Selected<ForwardPlan> select_forward(const ForwardParams& p, const DeviceCaps& dev, const Overrides& ov);
Selected<BackwardPlan> select_backward(const BackwardParams& p, const DeviceCaps& dev, const Overrides& ov);

Selected<KvcachePlan> select_kvcache(const KvcacheParams& p, const DeviceCaps& dev, const Overrides& ov = {});

// Short names for messages and tests ("sm90-tf32", ...).
const char* kernel_name(FwdKernel k);
const char* kernel_name(BwdKernel k);
// A plan's kernel, "+xf" when it runs the per-entry score step ("sm80-mma16+xf").
std::string kernel_name(const ForwardPlan& p);
std::string kernel_name(const BackwardPlan& p);

// 16-byte vector accesses of an operand: an aligned base and strides that are whole multiples of
// 16 bytes (`per16` elements), so that every row starts 16-byte aligned.
template <class Op>
bool vec_ok(const Op& o, int64_t per16) {
  return reinterpret_cast<uintptr_t>(o.ptr) % 16 == 0 && o.sb % per16 == 0 && o.sh % per16 == 0 && o.ss % per16 == 0;
}
// Whether the copy engine can address a [batch, heads, seq, head_dim] operand of `elem_bytes`
// elements as stored: a 16-byte aligned base, and every stride of a dim longer than 1 a nonzero
// multiple of 16 bytes below 2^40 (cuTensorMapEncodeTiled's rules; sm90/tma.cu encodes only
// what passes this test).
bool tma_ok(const In4& o, int elem_bytes, int64_t batch, int64_t heads, int64_t seq);

// The float32 sm_90a kernels' operand copies in the workspace, in floats (padded head dim dp):
// one definition for the plans' workspace sizes and the launchers' carving of it. Row copies
// [B, H, seq, dp]; transposed copies [B, H, dp, seq8] with seq8 = round8(seq).
inline int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }
struct CopySizes {
  size_t q, qt;  // Q (or dO) rows and transposed (the backward's wgmma dK/dV pass only, else 0)
  size_t k, kt;  // K (or V) rows and transposed
  // One part of the backward's copies: Q, dO, Q^T, dO^T, K, V, K^T (3xTF32 has a second part, the
  // small terms).
  size_t backward_part() const { return 2 * q + 2 * qt + 2 * k + kt; }
};
inline CopySizes copy_sizes(const Shape& s, int dp, bool with_q) {
  const size_t d = static_cast<size_t>(dp);
  CopySizes c;
  c.q = with_q ? static_cast<size_t>(s.batch * s.heads_q * s.seq_q) * d : 0;
  c.qt = with_q ? static_cast<size_t>(s.batch * s.heads_q * round8(s.seq_q)) * d : 0;
  c.k = static_cast<size_t>(s.batch * s.heads_kv * s.seq_kv) * d;
  c.kt = static_cast<size_t>(s.batch * s.heads_kv * round8(s.seq_kv)) * d;
  return c;
}
// Floats of the backward workspace before the accumulator or the copies: D [B*Hq*Sq], rounded up
// so that what follows starts 16-byte aligned (the sm_90 kernels' vector reductions need 8).
inline size_t query_rows(const Shape& s, const Packing& pk) {
  return static_cast<size_t>(s.heads_q * (pk.on() ? pk.total_q : s.batch * s.seq_q));
}
inline size_t delta_floats(const Shape& s, const Packing& pk) { return (query_rows(s, pk) + 3) / 4 * 4; }

// A packed batch on the 16-bit sm_90a kernels: one tensor map (128 bytes) per sequence and
// streamed operand (sm90/seq_maps.hpp), in the workspace after D and the dQ accumulator (the
// forward: at its start, the compact grid's block table after them), 128-byte aligned.
constexpr size_t kSeqMapBytes = 128;
inline size_t seq_maps_at(size_t bytes_before) { return (bytes_before + kSeqMapBytes - 1) / kSeqMapBytes * kSeqMapBytes; }
inline size_t seq_maps_bytes(int64_t batch, int operands) { return static_cast<size_t>(batch) * operands * kSeqMapBytes; }
// Workspace bytes of a packed call's check of its sequence arrays (cuda/common/seq_check.hpp): the
// arrays' copies (B + 1, B + 1 and B entries) and the verdict.
inline size_t seq_check_bytes(int64_t batch) {
  return static_cast<size_t>((2 * (batch + 1) + batch + 1) * 4 + 15) / 16 * 16;
}

// The row blocks of bm rows a packed batch of `batch` sequences and total_q query rows has at most:
// sum_b ceil(len_b / bm) <= total_q / bm + batch (each sequence adds at most one partial block).
inline int64_t seq_blocks_bound(int64_t total_q, int64_t batch, int bm) { return total_q / bm + batch; }

// The pair kernels' CTAs for `items` blocks: one per block unless `cap` > 0 (at most cap CTAs,
// each taking its next block from a counter).
int persistent_ctas(int64_t items, long cap);

}  // namespace flashattn::cuda
