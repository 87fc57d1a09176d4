// Kernel selection of the CUDA backend (select.hpp). Host code only.
//
// Every default below was measured on an H200 with the benchmarks in bench/ (current figures in
// docs/PERF.md, the runs behind each rule in docs/perf-log/); each rule says what it won and where.
#include "cuda/host/select.hpp"

#include <algorithm>
#include <cmath>
#include <string>

namespace flashattn::cuda {
namespace {

// 16-bit backward design when the caller did not ask for a deterministic one: the single pass with
// atomic dQ at D <= 64 (+2-6% over the split passes on an H200) and wherever the sm_90a dK/dV
// kernel exists; the split passes (dQ pass + dK/dV pass, every sum in a fixed order) from D = 96
// up before sm_90 (+3-7%).
bool atomic_default(int dp, bool sm90) { return dp <= 64 || (sm90 && has_sm90(Pass::Dkv, dp)); }

// The sm_90a dK/dV kernel's CTA shape: variant 1 (D = 64: one consumer warpgroup, 64 keys, two
// CTAs per SM, so one CTA's prologue and epilogue overlap the other's main loop): 3-10% faster with
// a causal mask at S <= 1024, where CTAs have few and unequal tiles; 2-12% slower elsewhere (dQ is
// added twice as often per key). Not with ordered dQ: twice the key blocks take turns at every
// query tile (H100, causal S 1k: ordered 135.7 TFLOP/s in variant 1, 167.3 in variant 0).
int sm90_bwd_variant(const Shape& s, Mask mask, int dp, bool ordered, const Overrides& ov) {
  if (!has_sm90_variant(Pass::Dkv, dp, 1)) return 0;
  if (ov.sm90_variant >= 0) return ov.sm90_variant;
  return !ordered && mask != Mask::None && s.seq_q <= 1024 && s.seq_kv <= 1024 ? 1 : 0;
}

// Keys a query row sees on average, roughly: the band's width where it has two edges, half the
// keys under one edge (causal; a window's one side), all with none. The forward's choices below
// follow it rather than Skv: they depend on how many key tiles a row block runs through.
int64_t keys_per_row(const Shape& s, const Numerics& n) {
  const MaskRule r = mask_rule(s, n);
  return r.bounded_above() && r.bounded_below() ? std::min<int64_t>(r.hi - r.lo + 1, s.seq_kv)
       : r.bounded_above() || r.bounded_below() ? s.seq_kv / 2
                                               : s.seq_kv;
}

// Ping-pong scheduling of the sm_90a forward's two consumer warpgroups: faster at D = 64 at every
// length and at Skv <= 4096 for D = 128 and 256 without a mask, slower beyond; by keys per row
// (H100, 2026-12-06: causal S 8k neutral, 0.995x; the S 16k window (1024, 0) forward 4% faster,
// its cost 1.56 -> 1.50: short rows start both warpgroups on the same tile, and the turns part them).
bool pingpong_default(const Shape& s, const Numerics& n, int dp) { return dp <= 64 || keys_per_row(s, n) <= 4096; }

// The 16-bit sm_90a forward's walk (FwdWalk): one CTA per multiprocessor doing the row blocks in
// units of two saves each block's pipeline fill and epilogue, worth up to 19% while the rows see few
// keys (H100, bf16, 16k tokens: causal S 512-8k +4-19%, no mask S 512-4k +0-15%, causal + window
// (1024, 0) at S 16k +5-10%); at 8k or more keys per row that saving is ~1%, below what the static
// order's tail costs (a CTA may do one unit more than another: causal S 16k 0.98-0.99x).
bool walk_default(const Shape& s, const Numerics& n) { return keys_per_row(s, n) < 8192; }

// A packed call whose arrays validation did not read (device memory): the check's copies and
// verdict at the end of the workspace (cuda/common/seq_check.hpp), whatever the kernel family.
template <class Plan>
void add_seq_check(Plan& plan, const Packing& pk, int64_t batch) {
  if (!pk.on() || !pk.unchecked) return;
  plan.seq_check = static_cast<int64_t>((plan.workspace + 15) / 16 * 16);
  plan.workspace = static_cast<size_t>(plan.seq_check) + seq_check_bytes(batch);
}

// The tf32 sm_90a forward's operand copies. The kernel's producer warps transposing V were its
// limit: with V transposed by the pre-pass it runs 1.3-1.8x faster at S = 1k-16k. Rounding K there
// too saves another pass over each K tile in shared memory but costs a read and a write of K: 8-17%
// faster at S >= 4k, 6% slower at S = 1k causal. Each copy costs per key what the kernel gains per
// key times the query rows that see it (Sq x the GQA group, halved under a causal mask): V's pays
// from 256 such rows (at 64-128 rows a call takes 10-22% longer with it, at 512 22% less), K's
// from 2048.
int tf32_fwd_copies_default(const Shape& s, Mask mask) {
  const int64_t rows = s.seq_q * (s.heads_q / s.heads_kv) / (mask == Mask::None ? 1 : 2);
  return rows >= 2048 ? 2 : rows >= 256 ? 1 : 0;
}

// The CTAs writing the Q / dO copies of the float32 sm_90a backward on a side stream while the dQ
// pass (which does not read them) runs on the other multiprocessors: a quarter of them. (The copies
// before the passes were 8-20% of a call at S = 1k; beside the dQ pass they are mostly hidden.)
int convert_ctas_default(int sms) { return std::max(0, sms / 4); }

// Problem limits every CUDA kernel shares; empty when supported.
std::string common_limits(const Shape& s, int dp) {
  if (dp == 0) return "head_dim = " + std::to_string(s.head_dim) + " is not supported on CUDA (1..256)";
  if (s.batch > 65535 || s.heads_q > 65535)
    return "batch = " + std::to_string(s.batch) + ", heads = " + std::to_string(s.heads_q) +
           ": the CUDA grid allows at most 65535 of each";
  if ((s.seq_q + 15) / 16 > 0x7fffffff || (s.seq_kv + 15) / 16 > 0x7fffffff) return "sequence too long for the CUDA grid";
  return {};
}

std::string dtype_limits(DType t, const DeviceCaps& dev) {
  if (t == DType::Float16 || t == DType::BFloat16) {
    if (dev.cc_major < 8)
      return std::string("q.dtype = ") + dtype_name(t) +
             ": the float16/bfloat16 kernels need sm_80 or newer (this device is sm_" + std::to_string(dev.cc_major) +
             "x)";
    return {};
  }
  if (t != DType::Float32) return std::string("q.dtype = ") + dtype_name(t) + " is not supported on CUDA";
  return {};
}

std::string smem_limit(const Shape& s, int need, const DeviceCaps& dev) {
  if (need <= dev.smem_optin) return {};
  return "head_dim = " + std::to_string(s.head_dim) + " needs " + std::to_string(need) +
         " bytes of shared memory per block; this device allows " + std::to_string(dev.smem_optin);
}

// The float32 arithmetic: the precision's (tf32 mma.sync needs sm_80: FMA before), or the override.
bool float32_math(const Numerics& n, const DeviceCaps& dev, const Overrides& ov, Math* m, std::string* why) {
  *m = dev.cc_major < 8 ? Math::Fma : n.precision == Precision::Tf32 ? Math::Tf32 : Math::Tf32x3;
  if (ov.math >= 0) {
    const Math forced = static_cast<Math>(ov.math);
    if (forced != Math::Fma && dev.cc_major < 8) {
      *why = std::string("FLASHATTN_CUDA_MATH = ") + math_name(forced) + " needs sm_80 or newer";
      return false;
    }
    *m = forced;
  }
  return true;
}

// The rows and batch the tensor maps see: a packed operand is one sequence of all its rows (each
// sequence's own map is derived from it on the device, sm90/seq_maps.hpp).
struct MapRows {
  int64_t batch, q, k;
  MapRows(const Shape& s, const Packing& pk)
      : batch(pk.on() ? 1 : s.batch), q(pk.on() ? std::max<int64_t>(1, pk.total_q) : s.seq_q),
        k(pk.on() ? std::max<int64_t>(1, pk.total_k) : s.seq_kv) {}
};

bool sm90_allowed(const DeviceCaps& dev, const Overrides& ov) { return dev.sm90a() && ov.arch != 0; }

// What both passes' plans start from: the dtype's and the grid's limits, the padded head dim, the
// device's tile class and the 16-bit type. False (r.why set) when unsupported.
// A softcap or ALiBi (Numerics::elementwise_scores) takes the XF kernels: the sm_80 mma.sync kernels
// of every dtype and the 16-bit sm_90a wgmma kernels have them; the float32 sm_90a kernels (tf32,
// 3xTF32) do not, so such a float32 call runs the mma.sync kernels in either precision. (A sliding
// window needs no kernel of its own: every kernel iterates mask_rule()'s band.)
template <class Plan>
bool start(const Shape& s, const Numerics& n, const DeviceCaps& dev, Selected<Plan>& r) {
  if (!(r.why = dtype_limits(n.dtype, dev)).empty()) return false;
  r.plan.xf = n.elementwise_scores();
  const bool half = n.dtype != DType::Float32;
  r.plan.dp = half ? padded_head_dim16(s.head_dim) : padded_head_dim(s.head_dim);
  if (!(r.why = common_limits(s, r.plan.dp)).empty()) return false;
  r.plan.big = dev.big();
  r.plan.h = n.dtype == DType::BFloat16 ? Half16::BF16 : Half16::F16;
  return true;
}

}  // namespace

bool tma_ok(const In4& o, int elem_bytes, int64_t batch, int64_t heads, int64_t seq) {
  if (reinterpret_cast<uintptr_t>(o.ptr) % 16 != 0) return false;
  // The sequence, head and batch strides in bytes; a dim of extent 1 is never stepped over and
  // gets a legal stride whatever the caller's is.
  const int64_t extent[3] = {seq, heads, batch}, stride[3] = {o.ss, o.sh, o.sb};
  for (int i = 0; i < 3; ++i) {
    if (extent[i] == 1) continue;
    const uint64_t bytes = static_cast<uint64_t>(stride[i]) * static_cast<uint64_t>(elem_bytes);
    if (bytes == 0 || bytes % 16 != 0 || bytes >= (uint64_t{1} << 40)) return false;
  }
  return true;
}

int persistent_ctas(int64_t items, long cap) {
  const int64_t n = cap > 0 ? std::min<int64_t>(items, cap) : items;
  // (A grid dimension holds 2^31 - 1 blocks; selection bounds the block counts far below.)
  return static_cast<int>(std::max<int64_t>(1, n));
}

const char* kernel_name(FwdKernel k) {
  switch (k) {
    case FwdKernel::Sm80Mma32: return "sm80-mma32";
    case FwdKernel::Sm80Mma16: return "sm80-mma16";
    case FwdKernel::Sm90Wgmma16: return "sm90-wgmma16";
    case FwdKernel::Sm90Tf32: return "sm90-tf32";
    case FwdKernel::Sm90X3: return "sm90-3xtf32";
  }
  return "?";
}
const char* kernel_name(BwdKernel k) {
  switch (k) {
    case BwdKernel::Sm80Mma32Split: return "sm80-mma32-split";
    case BwdKernel::Sm80Mma16Split: return "sm80-mma16-split";
    case BwdKernel::Sm80Mma16Atomic: return "sm80-mma16-atomic";
    case BwdKernel::Sm90Wgmma16Atomic: return "sm90-wgmma16-atomic";
    case BwdKernel::Sm90Wgmma32: return "sm90-wgmma32";
  }
  return "?";
}
std::string kernel_name(const ForwardPlan& p) { return std::string(kernel_name(p.kernel)) + (p.xf ? "+xf" : ""); }
std::string kernel_name(const BackwardPlan& p) { return std::string(kernel_name(p.kernel)) + (p.xf ? "+xf" : ""); }

Selected<ForwardPlan> select_forward(const ForwardParams& p, const DeviceCaps& dev, const Overrides& ov) {
  Selected<ForwardPlan> r;
  ForwardPlan& f = r.plan;
  const Shape& s = p.shape;
  const Numerics& n = p.num;
  if (!start(s, n, dev, r)) return r;
  const bool half = n.dtype != DType::Float32;
  const int64_t per16 = 16 / dtype_size(n.dtype);
  f.vec16 = vec_ok(p.q, per16) && vec_ok(p.k, per16) && vec_ok(p.v, per16) && vec_ok(p.out, per16);
  // A packed batch: every kernel takes each CTA's sequence through at_sequence; the 16-bit sm_90a
  // kernels also through per-sequence tensor maps (sm90/seq_maps.hpp). The float32 sm_90a kernels'
  // operand copies are laid out per dense batch: packed float32 calls run the mma.sync kernels.
  const bool packed = p.packing.on();
  const bool sm90 = sm90_allowed(dev, ov) && dev.tma && f.vec16;
  const int eb = dtype_size(n.dtype);
  const MapRows mr(s, p.packing);
  auto maps_q = [&] { return tma_ok(p.q, eb, mr.batch, s.heads_q, mr.q); };
  auto maps_k = [&] { return tma_ok(p.k, eb, mr.batch, s.heads_kv, mr.k); };
  auto maps_v = [&] { return tma_ok(p.v, eb, mr.batch, s.heads_kv, mr.k); };
  if (half) {
    if (sm90 && has_sm90(Pass::Forward, f.dp) && maps_q() && maps_k() && maps_v()) {
      f.kernel = FwdKernel::Sm90Wgmma16;
      f.pingpong = ov.pingpong >= 0 ? ov.pingpong == 1 : pingpong_default(s, n, f.dp);
      f.smem = smem_bytes90(Pass::Forward, f.dp);
      // Dense calls: one CTA per multiprocessor walking the row blocks in pairs of equal cost
      // (FwdWalk, work.hpp), the pipeline filled once per CTA instead of once per block.
      if (!packed)
        f.walk_ctas = ov.fwd_ctas == -2 ? std::max(1, dev.sms)
                    : ov.fwd_ctas >= 0  ? static_cast<int>(ov.fwd_ctas)
                    : walk_default(s, n) ? dev.sms : 0;
      if (packed) {
        f.seq_maps = 0;
        f.workspace = seq_maps_bytes(s.batch, 3);  // Q, K, V
        // The compact grid (a developer's choice until measured against the dense one): a table
        // of (sequence, row block) per CTA, 8 bytes each, after the maps.
        if (ov.packed_grid == 1) {
          f.grid_blocks = seq_blocks_bound(p.packing.total_q, s.batch, tile_config90(Pass::Forward, f.dp).block_m);
          f.block_table = static_cast<int64_t>(f.workspace);
          f.workspace += static_cast<size_t>(f.grid_blocks) * 8;
        }
      }
    } else {
      f.kernel = FwdKernel::Sm80Mma16;
      f.smem = smem_bytes16(Pass::Forward, f.dp, f.big);
    }
  } else {
    if (!float32_math(n, dev, ov, &f.math, &r.why)) return r;
    f.kernel = FwdKernel::Sm80Mma32;
    f.smem = smem_bytes(Pass::Forward, f.dp, f.big);
    const bool sm90_32 = sm90 && !f.xf && !packed;  // (no per-entry step in the sm_90a float32 forwards: start())
    if (sm90_32 && f.math == Math::Tf32 && has_sm90_tf32(f.dp) && maps_q()) {
      // tf32 on Hopper: the wgmma forward; the operands it streams as stored need maps.
      const int copies = ov.tf32_fwd_copies >= 0 ? ov.tf32_fwd_copies : tf32_fwd_copies_default(s, n.mask);
      if ((copies == 2 || maps_k()) && (copies >= 1 || maps_v())) {
        f.kernel = FwdKernel::Sm90Tf32;
        f.tf32_copies = copies;
        f.smem = smem_bytes90_tf32(f.dp);
        const CopySizes c = copy_sizes(s, f.dp, false);
        f.workspace = ((copies >= 1 ? c.kt : 0) + (copies == 2 ? c.k : 0)) * sizeof(float);
      }
    } else if (sm90_32 && f.math == Math::Tf32x3 && has_sm90_3xtf32(f.dp) && maps_q() &&
               (ov.fp32_fwd >= 0 ? ov.fp32_fwd == 1 : fp32_fwd_wgmma_default(f.dp))) {
      // The fp32-accurate forward on wgmma (the default at padded D = 64 and 128: 1.3-1.5x the
      // mma.sync 3xTF32 kernel at 128, 4-17% faster at 64), streaming the pre-pass's split copies
      // of K (rows) and V (transposed): 2 |K| + 2 |V| floats.
      f.kernel = FwdKernel::Sm90X3;
      f.smem = smem_bytes90_3xtf32(f.dp);
      const CopySizes c = copy_sizes(s, f.dp, false);
      f.workspace = (2 * c.k + 2 * c.kt) * sizeof(float);
    }
    // Longer key sequences in the fp32 mode (FMA or 3xTF32; tf32's error is its inputs' rounding
    // anyway): chunks of keys merged in float64, dense calls (packed calls: a sequence at a time,
    // not chunked yet).
    const int64_t chunk = ov.key_chunk >= 0 ? ov.key_chunk : (kKeyChunksByDefault ? kKeyChunk : 0);
    if (f.math != Math::Tf32 && !packed && !p.kv.on() && n.kv_total < 0 && chunk > 0 && s.seq_kv > chunk)
      f.key_chunk = chunk;
  }
  if (!(r.why = smem_limit(s, f.smem, dev)).empty()) return r;
  add_seq_check(f, p.packing, s.batch);
  r.ok = true;
  return r;
}

Selected<BackwardPlan> select_backward(const BackwardParams& p, const DeviceCaps& dev, const Overrides& ov) {
  Selected<BackwardPlan> r;
  BackwardPlan& b = r.plan;
  const Shape& s = p.shape;
  const Numerics& n = p.num;
  if (!start(s, n, dev, r)) return r;
  const bool half = n.dtype != DType::Float32;
  const int64_t per16 = 16 / dtype_size(n.dtype);
  b.vec16 = vec_ok(p.q, per16) && vec_ok(p.k, per16) && vec_ok(p.v, per16) && vec_ok(p.out, per16) &&
            vec_ok(p.dout, per16) && vec_ok(p.dq, per16) && vec_ok(p.dk, per16) && vec_ok(p.dv, per16);
  const bool packed = p.packing.on();  // (as the forward)
  const bool sm90 = sm90_allowed(dev, ov) && dev.tma && b.vec16;
  const int eb = dtype_size(n.dtype);
  // Every sm_90a backward maps Q and dO (streamed by the dK/dV pass, or the dQ pass's stationary
  // operands) and K and V as stored.
  const MapRows mr(s, p.packing);
  const bool maps = sm90 && tma_ok(p.q, eb, mr.batch, s.heads_q, mr.q) && tma_ok(p.dout, eb, mr.batch, s.heads_q, mr.q) &&
                    tma_ok(p.k, eb, mr.batch, s.heads_kv, mr.k) && tma_ok(p.v, eb, mr.batch, s.heads_kv, mr.k);
  const size_t rows = query_rows(s, p.packing);
  const size_t delta = delta_floats(s, p.packing);
  if (half) {
    bool atomic = atomic_default(b.dp, sm90_allowed(dev, ov));
    if (ov.bwd >= 0) atomic = ov.bwd >= 1;
    // deterministic = 1 (or FLASHATTN_CUDA_BWD = ordered): the sm_90a single pass with each query
    // tile's dQ added by its key blocks in a fixed order, where that kernel runs (no per-entry
    // score step); 0.85-0.99x the default backward on an H100 with MHA (GQA causal lower:
    // docs/PERF.md), 1.3-2x the split passes it replaced there. Elsewhere, or with
    // FLASHATTN_CUDA_BWD = split, the split passes.
    const bool ordered = (ov.bwd == 2 || (n.deterministic && ov.bwd != 0)) && maps && has_sm90(Pass::Dkv, b.dp) && !b.xf;
    if (n.deterministic && !ordered) atomic = false;  // the split passes: every sum in a fixed order
    if (ov.bwd == 2 && !ordered) atomic = false;
    if (!atomic) {
      b.kernel = BwdKernel::Sm80Mma16Split;
      b.smem_dq = smem_bytes16(Pass::Dq, b.dp, b.big);
      b.smem_dkv = smem_bytes16(Pass::Dkv, b.dp, b.big);
    } else if (maps && has_sm90(Pass::Dkv, b.dp)) {
      b.kernel = BwdKernel::Sm90Wgmma16Atomic;
      b.sm90_variant = sm90_bwd_variant(s, n.mask, b.dp, ordered, ov);
      b.smem_dkv = smem_bytes90(Pass::Dkv, b.dp, b.sm90_variant, ordered);
    } else {
      b.kernel = BwdKernel::Sm80Mma16Atomic;
      b.smem_dkv = smem_bytes16(Pass::Dkv, b.dp, b.big, true);
    }
    // The float32 dQ accumulator (DP floats per query row) of the atomic design, zeroed before the pass.
    b.workspace = (delta + (b.atomic_dq() ? rows * b.dp : 0)) * sizeof(float);
    // The ordered design's head split under GQA (below; also the default design's, by a knob): the
    // group's dK/dV sums in float32 ([B, Hkv, nk block_m, DP], dK's rows then dV's) after a
    // counter per (batch, kv head, key block), zeroed with the dQ counters (counted in
    // dq_lock_count) or, without those, alone.
    auto add_head_split = [](BackwardPlan& pl, const Shape& sh, const TileConfig90& tc) {
      const int64_t key_blocks = (sh.seq_kv + tc.block_m - 1) / tc.block_m;
      const int64_t acc_rows = sh.batch * sh.heads_kv * key_blocks * tc.block_m;
      pl.dkv_locks = static_cast<int64_t>(pl.workspace);
      pl.dq_lock_count += sh.batch * sh.heads_kv * key_blocks;
      pl.workspace += static_cast<size_t>(sh.batch * sh.heads_kv * key_blocks) * sizeof(int);
      pl.workspace = (pl.workspace + 15) / 16 * 16;
      pl.dkv_acc = static_cast<int64_t>(pl.workspace);
      pl.dkv_acc_rows = acc_rows;
      pl.workspace += static_cast<size_t>(2 * acc_rows * pl.dp) * sizeof(float);
    };
    // A band (a causal mask or a window): a head's key blocks see different numbers of query tiles.
    const bool banded = n.mask != Mask::None || n.has_window();
    if (ordered && b.kernel == BwdKernel::Sm90Wgmma16Atomic) {
      // One counter per (sequence, query head, query tile, warpgroup), after the accumulator.
      const TileConfig90 c = tile_config90(Pass::Dkv, b.dp, b.sm90_variant);
      b.dq_locks = static_cast<int64_t>(b.workspace);
      b.dq_lock_count = s.batch * s.heads_q * ((s.seq_q + c.block_n - 1) / c.block_n) * c.warpgroups;
      b.workspace += static_cast<size_t>(b.dq_lock_count) * sizeof(int);
      // Without a mask every key block sees every query tile and, all starting at tile 0, the
      // blocks of a head would hand each tile's turn down a chain once per wave of CTAs (0.75-0.82x
      // the default at S <= 4k, H100). Starting them at tiles spread over the row, with turns in
      // arrival order, no block waits - but a block may then wait for blocks launched after it,
      // which is safe only when all key blocks of a head fit on the GPU at once (one CTA per SM
      // of those the process can hold: none known under MPS).
      const int64_t key_blocks = (s.seq_kv + c.block_m - 1) / c.block_m;
      b.dq_rotate = !banded && key_blocks <= dev.resident_sms;
      // GQA under a band: a CTA per (key block, query head). With one per kv head walking every
      // head of the group, a banded group's key blocks differ in length G times more and,
      // launched shortest first (the order the turns need), the longest start last: causal GQA
      // ran at 0.31-0.98x the default backward, split 0.75-1.29x (H100, bf16, G 4/8, D 64-256,
      // S 1k-16k). Without a mask the blocks are equal and the split only adds the partials' sum
      // (a float32 read and write of the block's dK and dV per head: 0.67-1.07x against
      // 0.85-1.07x unsplit) - except at D 64 past 1024 keys, where the default design too splits
      // (1.14-1.20x the unsplit ordered kernel, H100, G 4/8, S 4k-16k); short causal rows at
      // D <= 128 likewise (S 1k: 0.75-0.89x against 0.89-0.98x). FLASHATTN_CUDA_ORD_HEADS=0/1
      // forces either.
      const bool split_heads = ov.ord_heads >= 0  ? ov.ord_heads == 1
                               : banded           ? s.seq_kv > 1024 || b.dp > 128
                                                  : s.seq_kv > 1024 && b.dp <= 64;
      if (s.group() > 1 && !packed && split_heads) add_head_split(b, s, c);
    } else if (b.kernel == BwdKernel::Sm90Wgmma16Atomic && s.group() > 1 && !packed && !b.xf) {
      // The same head split for the default design (reductions in any order): a CTA per (key
      // block, query head), so that a banded group's key blocks are MHA's lengths, not G times
      // MHA's. Against the unsplit kernel (H100, bf16, G 4/8, S 1k-16k): causal 1.00-1.40x at
      // D >= 128 and at D 64 from S 4k, 0.87-0.91x at D 64 S 1k (the partials' float32 sum then
      // outweighs the balance); without a mask 1.06-1.23x at D 64 from S 4k, 0.78-0.99x elsewhere
      // but D 128 S 16k (1.02-1.06x, kept unsplit). FLASHATTN_CUDA_ATOMIC_HEADS=0/1 forces either.
      const bool split_heads = ov.atomic_heads >= 0 ? ov.atomic_heads == 1
                                                    : s.seq_kv > 1024 ? banded || b.dp <= 64 : banded && b.dp > 64;
      if (split_heads) add_head_split(b, s, tile_config90(Pass::Dkv, b.dp, b.sm90_variant));
    }
    if (packed && b.kernel == BwdKernel::Sm90Wgmma16Atomic) {
      b.seq_maps = static_cast<int64_t>(seq_maps_at(b.workspace));
      b.workspace = b.seq_maps + seq_maps_bytes(s.batch, 4);  // Q, dO, K, V
    }
  } else {
    if (!float32_math(n, dev, ov, &b.math, &r.why)) return r;
    b.kernel = BwdKernel::Sm80Mma32Split;
    b.smem_dq = smem_bytes(Pass::Dq, b.dp, b.big);
    b.smem_dkv = smem_bytes(Pass::Dkv, b.dp, b.big);
    b.workspace = delta * sizeof(float);
    // tf32 on Hopper at padded D = 64 and 128: both passes on wgmma after the operand pre-pass
    // (at D = 64 1.4-2.3x the mma.sync kernels at every benchmark shape); the pair kernels at
    // D = 128 (a choice at 64). fp32 (3xTF32) at D = 64 and 128: the pair kernels with every
    // product in three terms (1.1-1.4x the mma.sync 3xTF32 kernels at D = 64).
    // FLASHATTN_CUDA_TF32_BWD: mma (the mma.sync kernels), wgmma-dq (D = 64: the dK/dV pass on
    // mma.sync), wgmma (default), pair (the pair kernels at D = 64 too).
    // (None of them has the per-entry step: a softcap or ALiBi keeps the mma.sync passes, start().)
    const bool maps32 = maps && !b.xf && !packed;  // (packed: as the forward)
    const int tf32_bwd = ov.tf32_bwd >= 0 ? ov.tf32_bwd : 2;
    bool wgmma = false;
    if (maps32 && b.math == Math::Tf32 && has_sm90_tf32_bwd(b.dp) && tf32_bwd >= 1) {
      wgmma = true;
      b.pair = tf32_bwd_pair(b.dp) || tf32_bwd == 3;
      b.dkv_wgmma = tf32_bwd >= 2 || b.pair;
    } else if (maps32 && b.math == Math::Tf32x3 && has_sm90_3xtf32_bwd(b.dp) && ov.fp32_bwd != 0) {
      wgmma = b.pair = b.dkv_wgmma = true;
    }
    if (wgmma) {
      const bool x3 = b.math == Math::Tf32x3;
      b.kernel = BwdKernel::Sm90Wgmma32;
      b.smem_dq = smem_bytes90_tf32_bwd(Pass::Dq, b.dp, b.pair, x3);
      b.smem_dkv = b.dkv_wgmma ? smem_bytes90_tf32_bwd(Pass::Dkv, b.dp, b.pair, x3) : smem_bytes(Pass::Dkv, b.dp, b.big);
      b.persistent_cap = !b.pair ? 0 : ov.persistent_ctas == -2 ? std::max(1, dev.sms) : std::max(0L, ov.persistent_ctas);
      b.convert_ctas = !b.dkv_wgmma ? 0 : ov.convert_ctas >= 0 ? static_cast<int>(ov.convert_ctas) : convert_ctas_default(dev.sms);
      // The copies: Q, dO [B, Hq, Sq, DP] and Q^T, dO^T [B, Hq, DP, Sq8] (only for the wgmma dK/dV
      // pass); K, V [B, Hkv, Skv, DP] and K^T [B, Hkv, DP, Skv8]; as much again for the small
      // parts (3xTF32); 4 more floats: the persistent pair kernels' two block counters.
      const size_t part = copy_sizes(s, b.dp, b.dkv_wgmma).backward_part();
      b.workspace = (delta + (x3 ? 2 : 1) * part + 4) * sizeof(float);
    }
  }
  for (int need : {b.smem_dq, b.smem_dkv})
    if (!(r.why = smem_limit(s, need, dev)).empty()) return r;
  add_seq_check(b, p.packing, s.batch);
  r.ok = true;
  return r;
}


int kv_streams(const DeviceCaps& dev) {
  if (dev.mem_gbps <= 0 || dev.sms <= 0) return 1;
  return static_cast<int>(std::max(1.0, std::min(4.0, std::ceil(dev.mem_gbps / dev.sms / kKvCtaGBps - 1e-9))));
}

int kv_splits(int64_t blocks, int64_t tiles, int64_t slots, int requested) {
  const int64_t cap = std::max<int64_t>(1, std::min<int64_t>(tiles, kMaxKvSplits));
  if (requested > 0) return static_cast<int>(std::min<int64_t>(requested, cap));
  // Memory-bound CTAs: a last partial wave leaves slots idle. From 4 waves on the tail costs at
  // most a fifth; below, the fewest splits whose slots do at least 90% useful work (the most
  // when none does), at least kMinKvTilesPerSplit tiles each. Useful work counts whole tiles: s
  // splits of `tiles` take ceil(tiles / s) tiles each (the last ones fewer or none), so the
  // waves' time is waves x ceil(tiles / s) tiles of which blocks x tiles are real.
  blocks = std::max<int64_t>(1, blocks);
  slots = std::max<int64_t>(1, slots);
  tiles = std::max<int64_t>(1, tiles);
  if (blocks >= 4 * slots) return 1;
  const int64_t most = std::min(cap, std::max<int64_t>(1, tiles / kMinKvTilesPerSplit));
  int64_t best = 1;
  double best_eff = 0;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t per = (tiles + s - 1) / s, used = (tiles + per - 1) / per;  // splits with tiles
    const int64_t ctas = blocks * used, waves = (ctas + slots - 1) / slots;
    const double eff = static_cast<double>(blocks * tiles) / static_cast<double>(waves * slots * per);
    if (eff >= 0.9) return static_cast<int>(used);
    if (eff > best_eff + 1e-9) best = used, best_eff = eff;
  }
  return static_cast<int>(best);
}

// KV-cache calls: float16/bfloat16 only (a float32 cache runs on the CPU backend), every head dim
// the 16-bit kernels pad to. Decoding (at most 16 (query row, head) pairs per kv head) takes the
// CTA shape whose warps split each key tile; more rows take 64 per CTA.
Selected<KvcachePlan> select_kvcache(const KvcacheParams& kp, const DeviceCaps& dev, const Overrides& ov) {
  Selected<KvcachePlan> r;
  KvcachePlan& k = r.plan;
  const ForwardParams& p = kp.fwd;
  const Shape& s = p.shape;
  if (p.num.dtype != DType::Float16 && p.num.dtype != DType::BFloat16) {
    r.why = std::string("q.dtype = ") + dtype_name(p.num.dtype) +
            ": KV-cache attention on CUDA takes float16 or bfloat16 (a float32 cache runs on the CPU)";
    return r;
  }
  if (!(r.why = dtype_limits(p.num.dtype, dev)).empty()) return r;
  k.dp = padded_head_dim16(s.head_dim);
  if (!(r.why = common_limits(s, k.dp)).empty()) return r;
  if (s.heads_kv > 65535) {
    r.why = "heads_kv = " + std::to_string(s.heads_kv) + ": the CUDA grid allows at most 65535";
    return r;
  }
  k.h = p.num.dtype == DType::BFloat16 ? Half16::BF16 : Half16::F16;
  k.xf = p.num.elementwise_scores();
  const int64_t rows = s.seq_q * s.group();
  k.kw = rows <= DecodeShape::block_m(4) ? 4 : 1;
  const bool rotary = kp.rotary.cos != nullptr;
  k.q_rot_ld = round8(s.head_dim);
  // 16-byte rows: the rotated q's ld is a multiple of 8 elements; a paged cache's page stride is
  // its sb.
  k.vec16 = (rotary || vec_ok(p.q, 8)) && vec_ok(p.out, 8) && vec_ok(p.k, 8) && vec_ok(p.v, 8);
  // The bulk copies move whole 16-byte-aligned rows of D = DP elements (no padded columns to zero).
  const bool bulk_ok = dev.cc_major >= 9 && k.vec16 && s.head_dim == k.dp;
  // The whole-tile loader streams every full tile (contiguous rows, or pages of whole tiles: a
  // page size that is a multiple of the tile's 64 rows, as FlashAttention's 256 is); otherwise
  // its tiles go the general way, row by row.
  const KvMap& m = p.kv;
  const bool tiles_whole =
      k.vec16 && s.head_dim == k.dp && (m.block_table == nullptr || m.block_size % DecodeShape::kBlockN == 0);
  k.loader = ov.decode_loader >= 0 ? ov.decode_loader : DecodeShape::kRows;
  if (k.loader == DecodeShape::kBulk && !bulk_ok) k.loader = DecodeShape::kRows;
  const bool bulk = k.loader == DecodeShape::kBulk;
  const int64_t sms = std::max(1, dev.sms);
  const int64_t blocks = s.batch * s.heads_kv * ((rows + DecodeShape::block_m(k.kw) - 1) / DecodeShape::block_m(k.kw));
  const int64_t tiles = (s.seq_kv + DecodeShape::kBlockN - 1) / DecodeShape::kBlockN;
  // CTA slots per multiprocessor at `stages`: by shared memory (the per-SM pool is 1 KB larger
  // than a block's opt-in limit and each block reserves 1 KB), at most 16 CTAs of 128 threads.
  auto fits = [&](int st) { return decode_smem_bytes(k.dp, k.kw, bulk, st) <= dev.smem_optin; };
  auto per_sm = [&](int st) {
    return static_cast<int64_t>(std::max(1, std::min(16, (dev.smem_optin + 1024) / (decode_smem_bytes(k.dp, k.kw, bulk, st) + 1024))));
  };
  if (k.loader == DecodeShape::kRows && tiles_whole) {
    // Streaming whole tiles, kv_streams CTAs per multiprocessor read at the copy's rate (one on an
    // H100, two on an H200: bench/decode.py, docs/PERF.md): the keys are split only until the CTAs
    // cover those slots evenly (a split costs its partials and the combine), and the stages chosen
    // so that the CTAs fill whole waves of the CTA slots they allow (fewest stages on a tie: more
    // CTAs resident).
    const int streams = ov.decode_streams >= 1 ? ov.decode_streams : kv_streams(dev);
    k.splits = kv_splits(blocks, tiles, sms * streams, kp.num_splits);
    const int64_t ctas = blocks * k.splits;
    k.stages = DecodeShape::kMinStages;
    if (ctas > sms) {
      double best = 0;
      for (int st = DecodeShape::kMinStages; st <= DecodeShape::kMaxStages && fits(st); ++st) {
        const int64_t slots = per_sm(st) * sms, waves = (ctas + slots - 1) / slots;
        const double eff = static_cast<double>(ctas) / static_cast<double>(waves * slots);
        if (eff > best + 1e-9) best = eff, k.stages = st;
      }
    }
  } else {
    // The general loader (one row lookup per 16-byte chunk) keeps fewer bytes in flight per CTA:
    // two stages, as many CTAs as the slots hold.
    k.stages = DecodeShape::kMinStages;
    k.splits = kv_splits(blocks, tiles, per_sm(k.stages) * sms, kp.num_splits);
  }
  if (ov.decode_stages >= 0) {  // (a knob's count, as many of them as fit: four do not at D = 256)
    k.stages = DecodeShape::kMinStages + ov.decode_stages;
    while (k.stages > DecodeShape::kMinStages && !fits(k.stages)) --k.stages;
  }
  k.smem = decode_smem_bytes(k.dp, k.kw, bulk, k.stages);
  if (!(r.why = smem_limit(s, k.smem, dev)).empty()) return r;
  if (s.batch * s.heads_q * s.seq_q > 0x7fffffff) k.splits = 1;  // (the combine's grid: a CTA per row)
  if ((blocks * k.splits + s.batch - 1) / s.batch > 0x7fffffff) {  // (grid x: row blocks x splits x Hkv)
    r.why = "too many query rows for the CUDA grid";
    return r;
  }
  // Workspace: the index arrays, then (16-byte aligned) the rotated q, then the partials.
  // (KvCheck: the arrays stay where the caller has them, device memory; the check's derived arrays
  // and verdict take the workspace's start instead.)
  const bool check = kp.check.on;
  k.idx_ints = check ? 0
                     : static_cast<size_t>(s.batch) * (3 + (m.batch_row ? 1 : 0) + (m.start ? 1 : 0)) +
                           (m.block_table ? static_cast<size_t>(s.batch * m.bt_stride) : 0);
  k.idx_inline = !check && m.block_table == nullptr && k.idx_ints <= static_cast<size_t>(kKvIndexMax);
  auto align16 = [](size_t n) { return (n + 15) / 16 * 16; };
  size_t at = k.idx_inline ? 0 : align16(k.idx_ints * 4);
  if (check) {
    k.check = static_cast<int64_t>(at);
    at = align16(at + static_cast<size_t>(3 * s.batch + 1) * 4);
  }
  if (rotary) {
    k.q_rot = static_cast<int64_t>(at);
    at = align16(at + static_cast<size_t>(s.batch * s.heads_q * s.seq_q * k.q_rot_ld) * 2);
  }
  if (k.splits > 1) {
    const size_t prow = static_cast<size_t>(s.batch * s.heads_q * s.seq_q) * k.splits;
    k.o_part = static_cast<int64_t>(at);
    at = align16(at + prow * k.dp * 4);
    k.lse_part = static_cast<int64_t>(at);
    at = align16(at + prow * 4);
  }
  k.workspace = at;
  r.ok = true;
  return r;
}

}  // namespace flashattn::cuda
