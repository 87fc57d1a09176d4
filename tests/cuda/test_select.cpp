// The CUDA backend's kernel selection (src/cuda/host/select.cpp) without a GPU: which kernel each
// pass runs for each (dtype, head dim, mask, lengths, precision, determinism, compute capability,
// operand alignment, override), the plan's settings, and the reasons given for what is
// unsupported. The rules come from measurements (select.cpp states each one's reason; the runs
// are in docs/perf-log/); these tests pin them so that a change is deliberate. Runs everywhere
// the CUDA backend is built, CI included (no device needed).
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "cuda/host/select.hpp"

namespace flashattn::cuda {
namespace {

Shape shape(int64_t s, int64_t d, int64_t skv = -1) { return Shape{2, 8, 8, s, skv < 0 ? s : skv, d}; }
Numerics num(DType t, Mask m = Mask::None, Precision p = Precision::Fp32, bool det = false) {
  Numerics n{t, 0.125f, m, p, det};
  n.window_left = n.window_right = -1;  // no sliding window (0 would be a window of one diagonal)
  return n;
}
// The same numerics with a softcap, ALiBi slopes (never dereferenced here) and a sliding window.
const float kSlopes[1] = {0.5f};
Numerics with_softcap(Numerics n, float c = 30.0f) {
  n.softcap = c;
  return n;
}
Numerics with_alibi(Numerics n) {
  n.alibi = Alibi{kSlopes, 0, 1};
  return n;
}
Numerics with_window(Numerics n, int64_t left, int64_t right) {
  n.window_left = left;
  n.window_right = right;
  return n;
}

// Overrides as the environment would give them: {"FLASHATTN_CUDA_ARCH", "sm80"}, ...
Overrides ov(std::map<std::string, std::string> vars = {}) {
  return parse_overrides(
      [](const char* n, void* ctx) -> const char* {
        auto& m = *static_cast<std::map<std::string, std::string>*>(ctx);
        const auto it = m.find(n);
        return it == m.end() ? nullptr : it->second.c_str();
      },
      &vars);
}

// A device of compute capability major.minor (an H200's limits at 9.0, an A100's at 8.x; the
// older ones given room enough that only the arithmetic rules decide).
DeviceCaps dev(int major, int minor) {
  DeviceCaps d;
  d.cc_major = major;
  d.cc_minor = minor;
  d.smem_optin = major >= 9 ? 232448 : major == 8 ? 166912 : 232448;
  d.sms = major >= 9 ? 132 : 108;
  d.resident_sms = d.sms;
  d.tma = major >= 9;
  return d;
}

// [B, H, S, D] operands at aligned addresses with rows padded to 8 elements (16 bytes of a 16-bit
// type), so that the rules below see every kernel family; operands that do not allow 16-byte
// vectors or tensor maps are tested on their own. Never dereferenced.
template <class Op>
Op dense(uintptr_t at, const Shape& s, int64_t heads, int64_t seq) {
  const int64_t ld = (s.head_dim + 7) / 8 * 8;
  return Op{reinterpret_cast<decltype(Op{}.ptr)>(at), heads * seq * ld, seq * ld, ld};
}
ForwardParams fparams(const Shape& s, const Numerics& n) {
  ForwardParams p{};
  p.shape = s;
  p.num = n;
  p.q = dense<In4>(0x100000, s, s.heads_q, s.seq_q);
  p.k = dense<In4>(0x200000, s, s.heads_kv, s.seq_kv);
  p.v = dense<In4>(0x300000, s, s.heads_kv, s.seq_kv);
  p.out = dense<Out4>(0x400000, s, s.heads_q, s.seq_q);
  return p;
}
BackwardParams bparams(const Shape& s, const Numerics& n) {
  const ForwardParams f = fparams(s, n);
  BackwardParams p{};
  p.shape = s;
  p.num = n;
  p.q = f.q;
  p.k = f.k;
  p.v = f.v;
  p.out = In4{f.out.ptr, f.out.sb, f.out.sh, f.out.ss};
  p.dout = dense<In4>(0x500000, s, s.heads_q, s.seq_q);
  p.dq = dense<Out4>(0x600000, s, s.heads_q, s.seq_q);
  p.dk = dense<Out4>(0x700000, s, s.heads_kv, s.seq_kv);
  p.dv = dense<Out4>(0x800000, s, s.heads_kv, s.seq_kv);
  return p;
}

// The overrides in force for sel() below: set for a scope, as a developer would set the variables.
std::map<std::string, std::string>& scoped_vars() {
  static std::map<std::string, std::string> vars;
  return vars;
}
class OverrideScope {
 public:
  OverrideScope(const char* name, const char* value) : name_(name) { scoped_vars()[name] = value; }
  ~OverrideScope() { scoped_vars().erase(name_); }
  OverrideScope(const OverrideScope&) = delete;
  OverrideScope& operator=(const OverrideScope&) = delete;

 private:
  std::string name_;
};

// Both plans of a problem, as the backend would get them, and the facts the rules below pin.
struct Sel {
  Selected<ForwardPlan> f;
  Selected<BackwardPlan> b;
  const ForwardPlan& fwd() const { return f.plan; }
  const BackwardPlan& bwd() const { return b.plan; }
  bool ok = false;
  std::string why;
  int dp = 0;
  Math math = Math::Fma;
  bool half16 = false, sm90_fwd = false, sm90_bwd = false, atomic_bwd = false;
  bool tf32_dkv_wgmma = false, f32_pair = false;
  int sm90_variant = 0, tf32_fwd_copies = 0;
};
Sel sel(const Shape& s, const Numerics& n, int major, int minor) {
  const Overrides o = ov(scoped_vars());
  Sel r{select_forward(fparams(s, n), dev(major, minor), o), select_backward(bparams(s, n), dev(major, minor), o)};
  r.ok = r.f.ok && r.b.ok;
  r.why = !r.f.ok ? r.f.why : r.b.why;
  const ForwardPlan& f = r.f.plan;
  const BackwardPlan& b = r.b.plan;
  EXPECT_EQ(f.dp, b.dp);
  EXPECT_EQ(f.math, b.math);
  r.dp = f.dp;
  r.math = f.math;
  r.half16 = f.kernel == FwdKernel::Sm80Mma16 || f.kernel == FwdKernel::Sm90Wgmma16;
  r.sm90_fwd = f.kernel == FwdKernel::Sm90Wgmma16 || f.kernel == FwdKernel::Sm90Tf32 || f.kernel == FwdKernel::Sm90X3;
  r.sm90_bwd = b.kernel == BwdKernel::Sm90Wgmma16Atomic || b.kernel == BwdKernel::Sm90Wgmma32;
  r.atomic_bwd = b.atomic_dq();
  r.tf32_dkv_wgmma = b.kernel == BwdKernel::Sm90Wgmma32 && b.dkv_wgmma;
  r.f32_pair = b.kernel == BwdKernel::Sm90Wgmma32 && b.pair;
  r.sm90_variant = b.sm90_variant;
  r.tf32_fwd_copies = f.tf32_copies;
  return r;
}

// Packed batches run the mma.sync kernels on every device (the sm_90a kernels do not take them),
// with the backward design an sm_80 device would get, and workspaces sized by the packed rows
// (Hq * total_q), not by B * max_seqlen_q.
// Packed batches: 16-bit calls on a 9.0 device run the sm_90a kernels with per-sequence tensor
// maps in the workspace (after D and the dQ accumulator, 128-byte aligned: Q, K, V forward; Q, dO,
// K, V backward); float32 calls and every call before sm_90 the mma.sync kernels.
TEST(CudaSelect, PackedBatchesRunTheSm90KernelsWithSequenceMaps) {
  static const int32_t cu[3] = {0, 100, 300};  // never read by selection
  for (DType dt : {DType::BFloat16, DType::Float16, DType::Float32})
    for (int64_t d : {64, 128}) {
      Shape s{2, 8, 8, 4096, 4096, d};  // max_seqlen 4096, total 300 rows
      ForwardParams f = fparams(s, num(dt));
      BackwardParams b = bparams(s, num(dt));
      for (auto* x : {&f.q, &f.k, &f.v, &b.q, &b.k, &b.v, &b.out, &b.dout}) x->sb = 0;
      for (auto* x : {&f.out, &b.dq, &b.dk, &b.dv}) x->sb = 0;
      f.packing = b.packing = Packing{cu, cu, nullptr, 300, 300};
      for (int major : {8, 9}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " D" + std::to_string(d) + " sm" + std::to_string(major) + "0");
        const Selected<ForwardPlan> fp = select_forward(f, dev(major, 0), ov(scoped_vars()));
        const Selected<BackwardPlan> bp = select_backward(b, dev(major, 0), ov(scoped_vars()));
        ASSERT_TRUE(fp.ok && bp.ok) << fp.why << bp.why;
        const bool half = dt != DType::Float32, sm90 = half && major == 9;
        EXPECT_EQ(fp.plan.kernel, sm90 ? FwdKernel::Sm90Wgmma16 : half ? FwdKernel::Sm80Mma16 : FwdKernel::Sm80Mma32);
        EXPECT_EQ(fp.plan.seq_maps, sm90 ? 0 : -1);
        EXPECT_EQ(fp.plan.workspace, sm90 ? 2 * 3 * 128u : 0u);
        const BwdKernel want = !half ? BwdKernel::Sm80Mma32Split
                               : sm90 ? BwdKernel::Sm90Wgmma16Atomic
                               : d <= 64 ? BwdKernel::Sm80Mma16Atomic : BwdKernel::Sm80Mma16Split;
        EXPECT_EQ(bp.plan.kernel, want);
        const size_t rows = 8 * 300, delta = (rows + 3) / 4 * 4;
        const size_t before = (delta + (bp.plan.atomic_dq() ? rows * bp.plan.dp : 0)) * sizeof(float);
        const size_t maps_at = (before + 127) / 128 * 128;
        EXPECT_EQ(bp.plan.seq_maps, sm90 ? static_cast<int64_t>(maps_at) : -1);
        EXPECT_EQ(bp.plan.workspace, sm90 ? maps_at + 2 * 4 * 128 : before);
      }
    }
}

// Device-resident sequence arrays that validation did not read (Packing::unchecked): every plan,
// whatever its kernels, reserves the device check's copies and verdict (seq_check_bytes) at the
// 16-byte aligned end of its workspace; host-checked arrays reserve nothing.
TEST(CudaSelect, PackedUncheckedArraysReserveTheCheck) {
  static const int32_t cu[3] = {0, 100, 300};  // never read by selection
  EXPECT_EQ(seq_check_bytes(2), 48u);       // (3 + 3 + 2 entries and the verdict: 36 bytes, rounded)
  EXPECT_EQ(seq_check_bytes(1000), 12016u);
  for (DType dt : {DType::BFloat16, DType::Float32})
    for (int major : {8, 9}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " sm" + std::to_string(major) + "0");
      Shape s{2, 8, 8, 4096, 4096, 64};
      ForwardParams f = fparams(s, num(dt));
      BackwardParams b = bparams(s, num(dt));
      for (auto* x : {&f.q, &f.k, &f.v, &b.q, &b.k, &b.v, &b.out, &b.dout}) x->sb = 0;
      for (auto* x : {&f.out, &b.dq, &b.dk, &b.dv}) x->sb = 0;
      f.packing = b.packing = Packing{cu, cu, nullptr, 300, 300};
      const Selected<ForwardPlan> f0 = select_forward(f, dev(major, 0), ov(scoped_vars()));
      const Selected<BackwardPlan> b0 = select_backward(b, dev(major, 0), ov(scoped_vars()));
      ASSERT_TRUE(f0.ok && b0.ok) << f0.why << b0.why;
      EXPECT_EQ(f0.plan.seq_check, -1);
      EXPECT_EQ(b0.plan.seq_check, -1);
      f.packing.unchecked = b.packing.unchecked = true;
      const Selected<ForwardPlan> f1 = select_forward(f, dev(major, 0), ov(scoped_vars()));
      const Selected<BackwardPlan> b1 = select_backward(b, dev(major, 0), ov(scoped_vars()));
      ASSERT_TRUE(f1.ok && b1.ok) << f1.why << b1.why;
      EXPECT_EQ(f1.plan.kernel, f0.plan.kernel);
      EXPECT_EQ(f1.plan.seq_check, static_cast<int64_t>((f0.plan.workspace + 15) / 16 * 16));
      EXPECT_EQ(f1.plan.workspace, static_cast<size_t>(f1.plan.seq_check) + seq_check_bytes(2));
      EXPECT_EQ(b1.plan.seq_check, static_cast<int64_t>((b0.plan.workspace + 15) / 16 * 16));
      EXPECT_EQ(b1.plan.workspace, static_cast<size_t>(b1.plan.seq_check) + seq_check_bytes(2));
    }
}

// FLASHATTN_CUDA_PACKED_GRID=compact: the packed sm_90a forward's table of real row blocks (8
// bytes per CTA, at most total_q / 128 + batch of them) after the maps; the backward and dense
// calls keep their grids.
TEST(CudaSelect, PackedCompactGridTableFollowsTheMaps) {
  static const int32_t cu[4] = {0, 100, 300, 1001};  // never read by selection
  Shape s{3, 8, 8, 4096, 4096, 128};
  ForwardParams f = fparams(s, num(DType::BFloat16));
  for (auto* x : {&f.q, &f.k, &f.v}) x->sb = 0;
  f.out.sb = 0;
  f.packing = Packing{cu, cu, nullptr, 1001, 1001};
  {
    OverrideScope e("FLASHATTN_CUDA_PACKED_GRID", "compact");
    const Selected<ForwardPlan> fp = select_forward(f, dev(9, 0), ov(scoped_vars()));
    ASSERT_TRUE(fp.ok) << fp.why;
    EXPECT_EQ(fp.plan.kernel, FwdKernel::Sm90Wgmma16);
    EXPECT_EQ(fp.plan.grid_blocks, 1001 / 128 + 3);
    EXPECT_EQ(fp.plan.block_table, static_cast<int64_t>(3 * 3 * 128));
    EXPECT_EQ(fp.plan.workspace, 3 * 3 * 128u + (1001 / 128 + 3) * 8u);
    f.packing = Packing{};  // a dense call: no table
    for (auto* x : {&f.q, &f.k, &f.v}) x->sb = 8 * 4096 * 128;
    f.out.sb = 8 * 4096 * 128;
    const Selected<ForwardPlan> dp = select_forward(f, dev(9, 0), ov(scoped_vars()));
    ASSERT_TRUE(dp.ok) << dp.why;
    EXPECT_EQ(dp.plan.block_table, -1);
    EXPECT_EQ(dp.plan.workspace, 0u);
  }
  f.packing = Packing{cu, cu, nullptr, 1001, 1001};
  for (auto* x : {&f.q, &f.k, &f.v}) x->sb = 0;
  f.out.sb = 0;
  const Selected<ForwardPlan> def = select_forward(f, dev(9, 0), ov(scoped_vars()));
  ASSERT_TRUE(def.ok) << def.why;
  EXPECT_EQ(def.plan.block_table, -1) << "the dense grid stays the default until measured";
}

// Long key sequences in the fp32 mode (FMA or 3xTF32) run over chunks of kKeyChunk keys (merged in
// float64), on every device, when chunks are on (kKeyChunksByDefault, or FLASHATTN_CUDA_KEY_CHUNK);
// tf32, 16-bit, packed calls and a chunk itself never; the knob sets the size (0: never chunked).
TEST(CudaSelect, Fp32ForwardChunksLongKeySequences) {
  static const int32_t cu[2] = {0, 40000};  // never read by selection
  auto chunk_of = [](const ForwardParams& f, int major) {
    const Selected<ForwardPlan> r = select_forward(f, dev(major, 0), ov(scoped_vars()));
    EXPECT_TRUE(r.ok) << r.why;
    return r.plan.key_chunk;
  };
  const Shape longer{1, 4, 2, 64, kKeyChunk + 1, 64}, exact{1, 4, 2, 64, kKeyChunk, 64};
  EXPECT_EQ(chunk_of(fparams(longer, num(DType::Float32)), 9), kKeyChunksByDefault ? kKeyChunk : 0);
  {
    OverrideScope on("FLASHATTN_CUDA_KEY_CHUNK", std::to_string(kKeyChunk).c_str());
    for (int major : {8, 9}) {
      EXPECT_EQ(chunk_of(fparams(longer, num(DType::Float32)), major), kKeyChunk);
      EXPECT_EQ(chunk_of(fparams(exact, num(DType::Float32)), major), 0);
      EXPECT_EQ(chunk_of(fparams(longer, num(DType::Float32, Mask::None, Precision::Tf32)), major), 0);
      EXPECT_EQ(chunk_of(fparams(longer, num(DType::BFloat16)), major), 0);
      ForwardParams part = fparams(longer, num(DType::Float32));
      part.num.kv_total = 2 * longer.seq_kv;  // already a chunk of a longer call
      EXPECT_EQ(chunk_of(part, major), 0);
      ForwardParams packed = fparams(Shape{1, 4, 2, 40000, 40000, 64}, num(DType::Float32));
      for (auto* x : {&packed.q, &packed.k, &packed.v}) x->sb = 0;
      packed.out.sb = 0;
      packed.packing = Packing{cu, cu, nullptr, 40000, 40000};
      EXPECT_EQ(chunk_of(packed, major), 0);
    }
  }
  {
    OverrideScope e("FLASHATTN_CUDA_KEY_CHUNK", "256");
    EXPECT_EQ(chunk_of(fparams(Shape{1, 1, 1, 5, 257, 64}, num(DType::Float32)), 9), 256);
    EXPECT_EQ(chunk_of(fparams(Shape{1, 1, 1, 5, 256, 64}, num(DType::Float32)), 9), 0);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_KEY_CHUNK", "0");
    EXPECT_EQ(chunk_of(fparams(longer, num(DType::Float32)), 9), 0);
  }
  OverrideScope bad("FLASHATTN_CUDA_KEY_CHUNK", "100");
  EXPECT_THROW(ov(scoped_vars()), Error) << "a chunk that is not a multiple of 128";
}

// deterministic = 1 (and FLASHATTN_CUDA_BWD=ordered, and deterministic with =atomic: deterministic
// wins): the sm_90a single pass with its counters (one per sequence, query head, query tile,
// warpgroup) after the dQ accumulator; the split passes where that kernel does not run (sm_80,
// the per-entry step, D = 96) or with FLASHATTN_CUDA_BWD=split.
TEST(CudaSelect, OrderedBackwardIsTheDeterministicSm90SinglePass) {
  Numerics n = num(DType::BFloat16);
  n.deterministic = true;
  for (const char* knob : {static_cast<const char*>(nullptr), "ordered", "atomic", "split"}) {
    SCOPED_TRACE(knob ? knob : "no knob");
    std::optional<OverrideScope> e;
    if (knob != nullptr) e.emplace("FLASHATTN_CUDA_BWD", knob);
    const Selected<BackwardPlan> bp = select_backward(bparams(shape(1000, 128), n), dev(9, 0), ov(scoped_vars()));
    ASSERT_TRUE(bp.ok) << bp.why;
    const bool split = knob != nullptr && std::string(knob) == "split";
    EXPECT_EQ(bp.plan.kernel, split ? BwdKernel::Sm80Mma16Split : BwdKernel::Sm90Wgmma16Atomic);
    EXPECT_EQ(bp.plan.dq_locks >= 0, !split);
    Numerics nd = n;
    nd.deterministic = false;  // the knob alone: ordered asks for it, atomic and split are designs
    const Selected<BackwardPlan> bn = select_backward(bparams(shape(1000, 128), nd), dev(9, 0), ov(scoped_vars()));
    ASSERT_TRUE(bn.ok) << bn.why;
    EXPECT_EQ(bn.plan.dq_locks >= 0, knob != nullptr && std::string(knob) == "ordered");
  }
  OverrideScope e("FLASHATTN_CUDA_BWD", "ordered");
  for (int64_t d : {64, 128, 256}) {
    SCOPED_TRACE(d);
    const Shape s = shape(1000, d);
    const Selected<BackwardPlan> bp = select_backward(bparams(s, n), dev(9, 0), ov(scoped_vars()));
    ASSERT_TRUE(bp.ok) << bp.why;
    EXPECT_EQ(bp.plan.kernel, BwdKernel::Sm90Wgmma16Atomic);
    const TileConfig90 c = tile_config90(Pass::Dkv, bp.plan.dp, bp.plan.sm90_variant);
    const size_t rows = static_cast<size_t>(s.batch * s.heads_q * s.seq_q), delta = (rows + 3) / 4 * 4;
    EXPECT_EQ(bp.plan.dq_locks, static_cast<int64_t>((delta + rows * bp.plan.dp) * sizeof(float)));
    EXPECT_EQ(bp.plan.dq_lock_count, s.batch * s.heads_q * ((s.seq_q + c.block_n - 1) / c.block_n) * c.warpgroups);
    EXPECT_EQ(bp.plan.workspace, static_cast<size_t>(bp.plan.dq_locks) + bp.plan.dq_lock_count * sizeof(int));
    const Selected<BackwardPlan> b80 = select_backward(bparams(s, n), dev(8, 0), ov(scoped_vars()));
    ASSERT_TRUE(b80.ok);
    EXPECT_EQ(b80.plan.kernel, BwdKernel::Sm80Mma16Split);
    EXPECT_EQ(b80.plan.dq_locks, -1);
    // The kernel's dynamic shared memory: the default design's bulk dQ (D = 128) stages the
    // tile's float32 dQ (64 rows of DP + 8 floats); the ordered kernel reserves no such tile.
    Numerics nd = n;
    nd.deterministic = false;
    OverrideScope atomic("FLASHATTN_CUDA_BWD", "atomic");
    const Selected<BackwardPlan> bd = select_backward(bparams(s, nd), dev(9, 0), ov(scoped_vars()));
    ASSERT_TRUE(bd.ok) << bd.why;
    ASSERT_EQ(bd.plan.sm90_variant, bp.plan.sm90_variant);
    EXPECT_EQ(bd.plan.smem_dkv - bp.plan.smem_dkv, d == 128 ? c.block_n * (d + 8) * 4 : 0);
    EXPECT_LE(bd.plan.smem_dkv, 227 * 1024);
  }
  // Without a mask and with every key block of a head on the GPU at once (132 SMs here, 128 keys
  // a block at D = 128), the blocks start at spread tiles (dq_rotate); a mask, a window or more
  // key blocks than SMs keep the common start.
  auto rotates = [&](Mask m, int64_t sq, int64_t skv, int64_t wl) {
    Numerics nm = n;
    nm.mask = m;
    nm.window_left = wl;
    const Selected<BackwardPlan> r = select_backward(bparams(shape(sq, 128, skv), nm), dev(9, 0), ov(scoped_vars()));
    EXPECT_TRUE(r.ok && r.plan.dq_locks >= 0) << r.why;
    return r.plan.dq_rotate;
  };
  EXPECT_TRUE(rotates(Mask::None, 1000, 1000, -1));
  EXPECT_TRUE(rotates(Mask::None, 64, 132 * 128, -1));
  EXPECT_FALSE(rotates(Mask::None, 64, 132 * 128 + 1, -1)) << "133 key blocks on 132 SMs";
  EXPECT_FALSE(rotates(Mask::CausalBottomRight, 1000, 1000, -1));
  EXPECT_FALSE(rotates(Mask::None, 1000, 1000, 256));
  // The SMs the process can hold (a green context's share; none known under MPS), not the device's.
  for (int resident : {0, 7, 8}) {
    DeviceCaps d = dev(9, 0);
    d.resident_sms = resident;
    const Selected<BackwardPlan> r = select_backward(bparams(shape(1000, 128), n), d, ov(scoped_vars()));
    ASSERT_TRUE(r.ok) << r.why;
    EXPECT_EQ(r.plan.dq_rotate, resident >= 8) << resident << " resident SMs, 8 key blocks";
  }
  // The two-CTA shape at D = 64 (short causal rows) is the unordered pass's only
  // (TwoCtaBackwardOnlyForShortCausalAtD64).
  Numerics nc = n;
  nc.mask = Mask::CausalTopLeft;
  EXPECT_EQ(select_backward(bparams(shape(512, 64), nc), dev(9, 0), ov(scoped_vars())).plan.sm90_variant, 0);
  Numerics nx = n;
  nx.softcap = 30.0f;
  const Selected<BackwardPlan> bx = select_backward(bparams(shape(1000, 128), nx), dev(9, 0), ov(scoped_vars()));
  ASSERT_TRUE(bx.ok);
  EXPECT_EQ(bx.plan.kernel, BwdKernel::Sm80Mma16Split) << "the ordered kernel has no per-entry step";
}

// A packed operand the copy engine cannot address (a row stride that is not a multiple of 16
// bytes) keeps a packed 16-bit call on the mma.sync kernels (16-byte vectors need the same).
TEST(CudaSelect, PackedBatchesNeedAddressableRowsForTheSm90Kernels) {
  static const int32_t cu[3] = {0, 100, 300};
  Shape s{2, 8, 8, 4096, 4096, 64};
  ForwardParams f = fparams(s, num(DType::BFloat16));
  for (auto* x : {&f.q, &f.k, &f.v}) x->sb = 0;
  f.out.sb = 0;
  f.packing = Packing{cu, cu, nullptr, 300, 300};
  f.k.sh = 8 * 64 + 4;  // 8-byte head stride
  const Selected<ForwardPlan> fp = select_forward(f, dev(9, 0), ov(scoped_vars()));
  ASSERT_TRUE(fp.ok) << fp.why;
  EXPECT_EQ(fp.plan.kernel, FwdKernel::Sm80Mma16);
  EXPECT_EQ(fp.plan.seq_maps, -1);
}

TEST(CudaSelect, Hopper16BitUsesTheSm90KernelsAndTheAtomicBackward) {
  for (int64_t d : {64, 128, 256}) {
    const Sel c = sel(shape(4096, d), num(DType::BFloat16), 9, 0);
    ASSERT_TRUE(c.ok) << c.why;
    EXPECT_TRUE(c.half16);
    EXPECT_EQ(c.dp, d);
    EXPECT_TRUE(c.sm90_fwd) << "D = " << d;
    EXPECT_TRUE(c.sm90_bwd) << "D = " << d;
    EXPECT_TRUE(c.atomic_bwd) << "D = " << d;
    EXPECT_EQ(c.sm90_variant, 0) << "D = " << d;
  }
  // Head dims padded to 96 have no sm_90a kernels: mma.sync forward, split backward.
  const Sel c96 = sel(shape(4096, 80), num(DType::Float16), 9, 0);
  ASSERT_TRUE(c96.ok);
  EXPECT_EQ(c96.dp, 96);
  EXPECT_FALSE(c96.sm90_fwd);
  EXPECT_FALSE(c96.sm90_bwd);
  EXPECT_FALSE(c96.atomic_bwd);
}

TEST(CudaSelect, TwoCtaBackwardOnlyForShortCausalAtD64) {
  EXPECT_EQ(sel(shape(512, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 1);
  EXPECT_EQ(sel(shape(1024, 64), num(DType::BFloat16, Mask::CausalBottomRight), 9, 0).sm90_variant, 1);
  EXPECT_EQ(sel(shape(2048, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  EXPECT_EQ(sel(shape(512, 64, 2048), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  EXPECT_EQ(sel(shape(2048, 64, 512), num(DType::BFloat16, Mask::CausalBottomRight), 9, 0).sm90_variant, 0);
  EXPECT_EQ(sel(shape(512, 64), num(DType::BFloat16), 9, 0).sm90_variant, 0);
  EXPECT_EQ(sel(shape(512, 128), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  {
    OverrideScope e("FLASHATTN_CUDA_SM90_VARIANT", "1");
    EXPECT_EQ(sel(shape(8192, 64), num(DType::BFloat16), 9, 0).sm90_variant, 1);
    EXPECT_EQ(sel(shape(8192, 128), num(DType::BFloat16), 9, 0).sm90_variant, 0);  // none at D = 128
  }
  {
    OverrideScope e("FLASHATTN_CUDA_SM90_VARIANT", "0");
    EXPECT_EQ(sel(shape(512, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0).sm90_variant, 0);
  }
}

// deterministic = 1: before sm_90 (and at D = 96) the split passes; on sm_90a the single pass with
// ordered dQ counters (OrderedBackwardIsTheDeterministicSm90SinglePass) - never unordered atomics.
TEST(CudaSelect, DeterministicMeansNoUnorderedAtomics) {
  const Numerics det = num(DType::BFloat16, Mask::None, Precision::Fp32, true);
  const Sel c80 = sel(shape(4096, 64), det, 8, 0);
  ASSERT_TRUE(c80.ok);
  EXPECT_FALSE(c80.atomic_bwd);
  EXPECT_FALSE(c80.sm90_bwd);
  const Sel c90 = sel(shape(4096, 64), det, 9, 0);
  ASSERT_TRUE(c90.ok);
  EXPECT_TRUE(c90.sm90_bwd);
  EXPECT_GE(c90.bwd().dq_locks, 0) << "the ordered counters";
  const Sel d96 = sel(shape(4096, 96), det, 9, 0);
  ASSERT_TRUE(d96.ok);
  EXPECT_FALSE(d96.atomic_bwd) << "no sm_90a pass at D = 96: split";
  // ... whatever FLASHATTN_CUDA_BWD says.
  OverrideScope e("FLASHATTN_CUDA_BWD", "atomic");
  EXPECT_GE(sel(shape(4096, 128), det, 9, 0).bwd().dq_locks, 0);
  EXPECT_FALSE(sel(shape(4096, 128), det, 8, 0).atomic_bwd);
  EXPECT_TRUE(sel(shape(4096, 128), num(DType::BFloat16), 8, 0).atomic_bwd);
}

TEST(CudaSelect, OnlyComputeCapability90GetsTheSm90aKernels) {
  for (auto [major, minor] : {std::pair{8, 0}, std::pair{8, 9}, std::pair{9, 1}, std::pair{10, 0}, std::pair{12, 0}}) {
    const Sel c = sel(shape(4096, 128), num(DType::BFloat16), major, minor);
    ASSERT_TRUE(c.ok);
    EXPECT_FALSE(c.sm90_fwd) << major << "." << minor;
    EXPECT_FALSE(c.sm90_bwd) << major << "." << minor;
    EXPECT_FALSE(c.atomic_bwd) << major << "." << minor << ": D = 128 defaults to split off sm_90";
  }
  OverrideScope e("FLASHATTN_CUDA_ARCH", "sm80");
  const Sel c = sel(shape(4096, 128), num(DType::BFloat16), 9, 0);
  EXPECT_FALSE(c.sm90_fwd);
  EXPECT_FALSE(c.sm90_bwd);
}

TEST(CudaSelect, Float32ArithmeticAndTheTf32HopperKernels) {
  // precision fp32 -> 3xTF32 everywhere from sm_80; tf32 -> the wgmma forward at D <= 128 on 9.0
  // and the wgmma backward (both passes) at padded D = 64 and 128; fp32 at padded D = 128: the
  // 3xTF32 wgmma forward and backward.
  EXPECT_EQ(sel(shape(4096, 128), num(DType::Float32), 9, 0).math, Math::Tf32x3);
  EXPECT_TRUE(sel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_fwd);
  EXPECT_TRUE(sel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_bwd);
  for (int64_t d : {1, 64, 100, 128}) {
    const Sel c = sel(shape(4096, d), num(DType::Float32, Mask::None, Precision::Tf32), 9, 0);
    ASSERT_TRUE(c.ok);
    EXPECT_EQ(c.math, Math::Tf32);
    EXPECT_TRUE(c.sm90_fwd) << "D = " << d;
    EXPECT_TRUE(c.sm90_bwd) << "D = " << d;
    EXPECT_TRUE(c.tf32_dkv_wgmma) << "D = " << d;
  }
  for (Mask m : {Mask::None, Mask::CausalTopLeft})
    for (int64_t s : {1, 1024, 16384})
      EXPECT_TRUE(sel(shape(s, 64), num(DType::Float32, m, Precision::Tf32), 9, 0).tf32_dkv_wgmma)
          << "S = " << s;
  const Numerics tf32 = num(DType::Float32, Mask::None, Precision::Tf32);
  EXPECT_FALSE(sel(shape(4096, 256), tf32, 9, 0).sm90_fwd);
  EXPECT_FALSE(sel(shape(4096, 64), tf32, 8, 0).sm90_fwd);
  EXPECT_FALSE(sel(shape(4096, 64), tf32, 8, 0).sm90_bwd);
  {
    OverrideScope e("FLASHATTN_CUDA_ARCH", "sm80");
    EXPECT_FALSE(sel(shape(4096, 64), tf32, 9, 0).sm90_fwd);
    EXPECT_FALSE(sel(shape(4096, 64), tf32, 9, 0).sm90_bwd);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_MATH", "3xtf32");  // the override wins over the precision option
    const Sel c = sel(shape(4096, 128), tf32, 9, 0);
    EXPECT_EQ(c.math, Math::Tf32x3);
    EXPECT_TRUE(c.sm90_fwd);  // the 3xTF32 wgmma forward
    EXPECT_TRUE(c.sm90_bwd && c.f32_pair);  // and backward
    EXPECT_TRUE(sel(shape(4096, 64), tf32, 9, 0).sm90_fwd);  // (at padded D = 64 as well)
    EXPECT_TRUE(sel(shape(4096, 64), tf32, 9, 0).f32_pair);  // the 3xTF32 wgmma backward
  }
  {
    OverrideScope e("FLASHATTN_CUDA_MATH", "tf32");  // and the other way round: tf32's kernels
    const Sel c = sel(shape(4096, 64), num(DType::Float32), 9, 0);
    EXPECT_TRUE(c.sm90_fwd);
    EXPECT_TRUE(c.sm90_bwd);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_TF32_BWD", "wgmma-dq");
    EXPECT_TRUE(sel(shape(4096, 64), tf32, 9, 0).sm90_bwd);
    EXPECT_FALSE(sel(shape(4096, 64), tf32, 9, 0).tf32_dkv_wgmma);
    EXPECT_TRUE(sel(shape(4096, 128), tf32, 9, 0).sm90_bwd);
    EXPECT_TRUE(sel(shape(4096, 128), tf32, 9, 0).tf32_dkv_wgmma);  // (no mma.sync dK/dV variant there)
    EXPECT_FALSE(sel(shape(4096, 256), tf32, 9, 0).sm90_bwd);
    EXPECT_TRUE(sel(shape(4096, 128), num(DType::Float32), 9, 0).f32_pair);  // 3xTF32: unaffected
  }
  {
    // The fp32-accurate wgmma forward: the default at padded D = 64 and 128 on 9.0 only;
    // FLASHATTN_CUDA_FP32_FWD=mma keeps the mma.sync kernel.
    const Sel c = sel(shape(4096, 128), num(DType::Float32), 9, 0);
    EXPECT_EQ(c.math, Math::Tf32x3);
    EXPECT_TRUE(c.sm90_fwd);
    EXPECT_TRUE(sel(shape(4096, 97), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_TRUE(sel(shape(4096, 64), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_TRUE(sel(shape(1024, 40), num(DType::Float32), 9, 0).sm90_fwd);  // padded to 64
    EXPECT_FALSE(sel(shape(4096, 256), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_FALSE(sel(shape(4096, 128), num(DType::Float32), 8, 0).sm90_fwd);
    {
      OverrideScope e("FLASHATTN_CUDA_FP32_FWD", "mma");
      EXPECT_FALSE(sel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_fwd);
      EXPECT_FALSE(sel(shape(4096, 64), num(DType::Float32), 9, 0).sm90_fwd);
    }
    OverrideScope e("FLASHATTN_CUDA_FP32_FWD", "wgmma");
    for (int64_t d : {1, 40, 64, 128}) EXPECT_TRUE(sel(shape(4096, d), num(DType::Float32), 9, 0).sm90_fwd) << d;
    EXPECT_FALSE(sel(shape(4096, 256), num(DType::Float32), 9, 0).sm90_fwd);
    EXPECT_FALSE(sel(shape(4096, 64), num(DType::Float32), 8, 0).sm90_fwd);
  }
  {
    // The pair kernels: the default at padded D = 128, a choice at 64.
    EXPECT_TRUE(sel(shape(4096, 128), tf32, 9, 0).f32_pair);
    EXPECT_FALSE(sel(shape(4096, 64), tf32, 9, 0).f32_pair);
    OverrideScope e("FLASHATTN_CUDA_TF32_BWD", "pair");
    const Sel c = sel(shape(4096, 64), tf32, 9, 0);
    EXPECT_TRUE(c.sm90_bwd && c.tf32_dkv_wgmma && c.f32_pair);
    EXPECT_FALSE(sel(shape(4096, 256), tf32, 9, 0).f32_pair);
  }
  {
    // The fp32-accurate wgmma backward: the default at padded D = 64 and 128 on 9.0 only (the
    // pair kernels).
    const Sel c = sel(shape(4096, 64), num(DType::Float32), 9, 0);
    EXPECT_EQ(c.math, Math::Tf32x3);
    EXPECT_TRUE(c.sm90_bwd && c.tf32_dkv_wgmma && c.f32_pair);
    EXPECT_TRUE(c.sm90_fwd);  // the 3xTF32 wgmma forward (the default there too)
    for (int64_t d : {65, 100, 128}) {
      const Sel c128 = sel(shape(4096, d), num(DType::Float32), 9, 0);
      EXPECT_TRUE(c128.sm90_bwd && c128.tf32_dkv_wgmma && c128.f32_pair) << "D = " << d;
    }
    EXPECT_FALSE(sel(shape(4096, 256), num(DType::Float32), 9, 0).sm90_bwd);
    EXPECT_FALSE(sel(shape(4096, 64), num(DType::Float32), 8, 0).sm90_bwd);
    OverrideScope e("FLASHATTN_CUDA_FP32_BWD", "mma");
    EXPECT_FALSE(sel(shape(4096, 64), num(DType::Float32), 9, 0).sm90_bwd);
    EXPECT_FALSE(sel(shape(4096, 128), num(DType::Float32), 9, 0).sm90_bwd);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_TF32_BWD", "mma");
    EXPECT_FALSE(sel(shape(4096, 64), tf32, 9, 0).sm90_bwd);
    EXPECT_FALSE(sel(shape(4096, 128), tf32, 9, 0).sm90_bwd);
    EXPECT_FALSE(sel(shape(4096, 64), tf32, 9, 0).tf32_dkv_wgmma);
  }
  // Before sm_80 there is no TF32: the FMA kernels in both precisions; asking for TF32 is an error.
  EXPECT_EQ(sel(shape(4096, 64), num(DType::Float32, Mask::None, Precision::Tf32), 7, 5).math, Math::Fma);
  OverrideScope e("FLASHATTN_CUDA_MATH", "tf32");
  const Sel old = sel(shape(4096, 64), num(DType::Float32), 7, 5);
  EXPECT_FALSE(old.ok);
  EXPECT_NE(old.why.find("sm_80"), std::string::npos) << old.why;
}

// The tf32 sm_90a forward's operand copies: V transposed by the pre-pass once 256 query rows see
// each key (Sq x the GQA group, halved under a causal mask), K rounded there too from 2048.
TEST(CudaSelect, Tf32ForwardCopies) {
  const Numerics tf32 = num(DType::Float32, Mask::None, Precision::Tf32);
  const Numerics tf32c = num(DType::Float32, Mask::CausalTopLeft, Precision::Tf32);
  EXPECT_EQ(sel(shape(1024, 128), tf32, 9, 0).tf32_fwd_copies, 1);
  EXPECT_EQ(sel(shape(2048, 128), tf32, 9, 0).tf32_fwd_copies, 2);
  EXPECT_EQ(sel(shape(2048, 64), tf32c, 9, 0).tf32_fwd_copies, 1);
  EXPECT_EQ(sel(shape(4096, 64), tf32c, 9, 0).tf32_fwd_copies, 2);
  EXPECT_EQ(sel(shape(16384, 128), tf32, 9, 0).tf32_fwd_copies, 2);
  EXPECT_EQ(sel(shape(256, 64), tf32, 9, 0).tf32_fwd_copies, 1);
  EXPECT_EQ(sel(shape(255, 64), tf32, 9, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(sel(shape(256, 64), tf32c, 9, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(sel(shape(512, 64), tf32c, 9, 0).tf32_fwd_copies, 1);
  Shape gqa = shape(1024, 128);
  gqa.heads_kv = gqa.heads_q / 2;
  EXPECT_EQ(sel(gqa, tf32, 9, 0).tf32_fwd_copies, 2);  // each key seen by 2 x 1024 rows
  // Only the tf32 sm_90a forward has them.
  EXPECT_EQ(sel(shape(16384, 128), num(DType::Float32), 9, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(sel(shape(16384, 128), tf32, 8, 0).tf32_fwd_copies, 0);
  EXPECT_EQ(sel(shape(16384, 256), tf32, 9, 0).tf32_fwd_copies, 0);
  {
    OverrideScope e("FLASHATTN_CUDA_TF32_FWD_COPIES", "none");
    EXPECT_EQ(sel(shape(16384, 128), tf32, 9, 0).tf32_fwd_copies, 0);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_TF32_FWD_COPIES", "kv");
    EXPECT_EQ(sel(shape(128, 64), tf32c, 9, 0).tf32_fwd_copies, 2);
  }
  OverrideScope e("FLASHATTN_CUDA_TF32_FWD_COPIES", "bogus");
  try {
    (void)sel(shape(1024, 64), tf32, 9, 0);
    ADD_FAILURE() << "FLASHATTN_CUDA_TF32_FWD_COPIES=bogus was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::InvalidArgument);
    EXPECT_NE(std::string(err.what()).find("FLASHATTN_CUDA_TF32_FWD_COPIES"), std::string::npos) << err.what();
  }
}

TEST(CudaSelect, UnsupportedProblemsSayWhy) {
  const Sel old16 = sel(shape(128, 64), num(DType::Float16), 7, 5);
  EXPECT_FALSE(old16.ok);
  EXPECT_NE(old16.why.find("sm_80"), std::string::npos) << old16.why;
  EXPECT_NE(old16.why.find("float16"), std::string::npos) << old16.why;
  const Sel wide = sel(shape(128, 300), num(DType::BFloat16), 9, 0);
  EXPECT_FALSE(wide.ok);
  EXPECT_NE(wide.why.find("300"), std::string::npos) << wide.why;
  const Sel f64 = sel(shape(128, 64), num(DType::Float64), 9, 0);
  EXPECT_FALSE(f64.ok);
  EXPECT_NE(f64.why.find("float64"), std::string::npos) << f64.why;
}

TEST(CudaSelect, UnknownOverrideValuesAreErrorsNamingTheVariable) {
  for (const char* var : {"FLASHATTN_CUDA_MATH", "FLASHATTN_CUDA_BWD", "FLASHATTN_CUDA_ARCH", "FLASHATTN_CUDA_SM90_VARIANT"}) {
    OverrideScope e(var, "bogus");
    try {
      (void)sel(shape(512, 64), num(DType::BFloat16, Mask::CausalTopLeft), 9, 0);
      (void)sel(shape(512, 64), num(DType::Float32), 9, 0);
      ADD_FAILURE() << var << "=bogus was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.status(), Status::InvalidArgument) << var;
      EXPECT_NE(std::string(err.what()).find(var), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find("bogus"), std::string::npos) << err.what();
    }
  }
}

TEST(CudaSelect, PingPongRule) {
  auto pp = [](const Shape& sh) { return sel(sh, num(DType::BFloat16), 9, 0).fwd().pingpong; };
  EXPECT_TRUE(pp(shape(16384, 64)));
  EXPECT_TRUE(pp(shape(4096, 128)));
  EXPECT_FALSE(pp(shape(8192, 128)));
  EXPECT_FALSE(pp(shape(512, 256, 8192)));
  // By keys per row: causal at 8k sees 4k on average, a window its width.
  auto ppn = [](const Shape& sh, Numerics n) { return sel(sh, n, 9, 0).fwd().pingpong; };
  Numerics causal = num(DType::BFloat16, Mask::CausalBottomRight);
  EXPECT_TRUE(ppn(shape(8192, 128), causal));
  EXPECT_FALSE(ppn(shape(16384, 128), causal));
  causal.window_left = 1024;
  EXPECT_TRUE(ppn(shape(16384, 128), causal));
  EXPECT_TRUE(ppn(shape(65536, 256), causal));
  OverrideScope e("FLASHATTN_CUDA_PINGPONG", "1");
  EXPECT_TRUE(pp(shape(8192, 128)));
}

TEST(CudaSelect, ForwardWalkWhileRowsSeeFewKeys) {
  // The 16-bit sm_90a forward walks the row blocks with one CTA per multiprocessor on dense calls
  // whose rows see fewer than 8192 keys on average (the band's width; half the keys under one
  // edge); the other forwards (and packed calls) keep one CTA per block.
  auto walk = [](int64_t s, Numerics n) { return sel(shape(s, 128), n, 9, 0).fwd().walk_ctas; };
  const Numerics none = num(DType::BFloat16), causal = num(DType::Float16, Mask::CausalBottomRight);
  EXPECT_EQ(walk(4096, none), 132);
  EXPECT_EQ(walk(8191, none), 132);
  EXPECT_EQ(walk(8192, none), 0);
  EXPECT_EQ(walk(8192, causal), 132);
  EXPECT_EQ(walk(16384, causal), 0);
  Numerics window = causal;
  window.window_left = 1024;
  EXPECT_EQ(walk(16384, window), 132);
  EXPECT_EQ(walk(65536, window), 132);
  Numerics wide = none;
  wide.window_left = wide.window_right = 8192;
  EXPECT_EQ(walk(65536, wide), 0);
  Numerics left_only = none;
  left_only.window_left = 100;  // one edge: half the keys, roughly
  EXPECT_EQ(walk(16383, left_only), 132);
  EXPECT_EQ(walk(16384, left_only), 0);
  EXPECT_EQ(walk(4096, num(DType::Float32)), 0);  // the float32 kernels: one CTA per block
  EXPECT_EQ(sel(shape(4096, 128), none, 8, 0).fwd().walk_ctas, 0);  // the mma.sync forward
  {
    OverrideScope e("FLASHATTN_CUDA_FWD_CTAS", "3");
    EXPECT_EQ(walk(16384, causal), 3);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_FWD_CTAS", "0");
    EXPECT_EQ(walk(4096, none), 0);
  }
  OverrideScope e("FLASHATTN_CUDA_FWD_CTAS", "sms");
  EXPECT_EQ(walk(16384, none), 132);
}

// The ordered backward under GQA on dense banded calls (causal, windows) past 1024 keys, or at
// D = 256: a CTA per (key block, query head), the group's dK/dV sums in a float32 accumulator
// (two blocks of B Hkv nk block_m rows of DP floats, 16-byte aligned) after the counters, whose
// count includes one per (batch, kv head, key block) - zeroed with the dQ ones. Not for MHA,
// packed calls, without a mask, short rows at D <= 128, or with FLASHATTN_CUDA_ORD_HEADS=0;
// =1 splits every dense GQA call.
TEST(CudaSelect, OrderedBackwardSplitsTheGroupsQueryHeads) {
  Numerics n = num(DType::BFloat16, Mask::CausalBottomRight);
  n.deterministic = true;
  auto plan = [&](const Shape& s) {
    const Selected<BackwardPlan> r = select_backward(bparams(s, n), dev(9, 0), ov(scoped_vars()));
    EXPECT_TRUE(r.ok) << r.why;
    return r.plan;
  };
  for (int64_t d : {64, 128, 256}) {
    SCOPED_TRACE(d);
    const Shape gqa{2, 8, 2, 2000, 2000, d};
    const BackwardPlan p = plan(gqa);
    const TileConfig90 c = tile_config90(Pass::Dkv, p.dp, p.sm90_variant);
    const int64_t nk = (2000 + c.block_m - 1) / c.block_m, dq_count = 2 * 8 * ((2000 + c.block_n - 1) / c.block_n) * c.warpgroups;
    ASSERT_GE(p.dq_locks, 0);
    EXPECT_EQ(p.dkv_locks, p.dq_locks + dq_count * static_cast<int64_t>(sizeof(int)));
    EXPECT_EQ(p.dq_lock_count, dq_count + 2 * 2 * nk);
    EXPECT_EQ(p.dkv_acc % 16, 0);
    EXPECT_GE(p.dkv_acc, p.dkv_locks + 2 * 2 * nk * static_cast<int64_t>(sizeof(int)));
    EXPECT_EQ(p.dkv_acc_rows, 2 * 2 * nk * c.block_m);
    EXPECT_EQ(p.workspace, static_cast<size_t>(p.dkv_acc) + 2 * p.dkv_acc_rows * p.dp * sizeof(float));
    EXPECT_EQ(plan(Shape{2, 8, 8, 2000, 2000, d}).dkv_acc, -1) << "MHA";
    EXPECT_EQ(plan(Shape{2, 8, 2, 1024, 1024, d}).dkv_acc >= 0, d == 256) << "short rows";
  }
  Numerics none = n;
  none.mask = Mask::None;
  const Shape gqa{2, 8, 2, 4096, 4096, 128};
  EXPECT_EQ(select_backward(bparams(gqa, none), dev(9, 0), ov(scoped_vars())).plan.dkv_acc, -1) << "no mask";
  auto none_split = [&](int64_t seq, int64_t d) {
    return select_backward(bparams(Shape{2, 8, 2, seq, seq, d}, none), dev(9, 0), ov(scoped_vars())).plan.dkv_acc >= 0;
  };
  EXPECT_TRUE(none_split(2000, 64)) << "no mask, D 64, past 1024 keys";
  EXPECT_FALSE(none_split(1024, 64)) << "no mask, D 64, short rows";
  EXPECT_FALSE(none_split(20000, 256)) << "no mask, D 256";
  Numerics window = none;
  window.window_left = 512;
  EXPECT_GE(select_backward(bparams(gqa, window), dev(9, 0), ov(scoped_vars())).plan.dkv_acc, 0) << "a window";
  {
    OverrideScope e("FLASHATTN_CUDA_ORD_HEADS", "0");
    const BackwardPlan p = plan(gqa);
    EXPECT_GE(p.dq_locks, 0);
    EXPECT_EQ(p.dkv_acc, -1);
    EXPECT_EQ(p.dkv_locks, -1);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_ORD_HEADS", "1");
    EXPECT_GE(select_backward(bparams(gqa, none), dev(9, 0), ov(scoped_vars())).plan.dkv_acc, 0);
  }
  static const int32_t cu[3] = {0, 100, 300};  // never read by selection
  BackwardParams b = bparams(Shape{2, 8, 2, 4096, 4096, 128}, n);
  for (auto* x : {&b.q, &b.k, &b.v, &b.out, &b.dout}) x->sb = 0;
  for (auto* x : {&b.dq, &b.dk, &b.dv}) x->sb = 0;
  b.packing = Packing{cu, cu, nullptr, 300, 300};
  const Selected<BackwardPlan> packed = select_backward(b, dev(9, 0), ov(scoped_vars()));
  ASSERT_TRUE(packed.ok) << packed.why;
  EXPECT_GE(packed.plan.dq_locks, 0);
  EXPECT_EQ(packed.plan.dkv_acc, -1) << "packed calls keep a CTA per kv head";
}

TEST(CudaSelect, PersistentCtas) {
  // By default one CTA per block; the override runs a count, one per multiprocessor, or one per
  // block (0).
  EXPECT_EQ(persistent_ctas(1000, 0), 1000);
  EXPECT_EQ(persistent_ctas(17, 0), 17);
  EXPECT_EQ(persistent_ctas(0, 0), 1);
  EXPECT_EQ(persistent_ctas(1000, 3), 3);
  EXPECT_EQ(persistent_ctas(2, 3), 2);
  const Numerics tf32 = num(DType::Float32, Mask::None, Precision::Tf32);
  EXPECT_EQ(sel(shape(4096, 128), tf32, 9, 0).bwd().persistent_cap, 0);
  {
    OverrideScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "sms");
    EXPECT_EQ(sel(shape(4096, 128), tf32, 9, 0).bwd().persistent_cap, 132);
  }
  {
    OverrideScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "3");
    EXPECT_EQ(sel(shape(4096, 128), tf32, 9, 0).bwd().persistent_cap, 3);
    EXPECT_EQ(sel(shape(4096, 64), tf32, 9, 0).bwd().persistent_cap, 0);  // the split kernels do not walk
  }
  OverrideScope e("FLASHATTN_CUDA_PERSISTENT_CTAS", "many");
  try {
    (void)sel(shape(4096, 128), tf32, 9, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& x) {
    EXPECT_NE(std::string(x.what()).find("FLASHATTN_CUDA_PERSISTENT_CTAS"), std::string::npos) << x.what();
  }
}

TEST(CudaSelect, ConvertCtasAQuarterOfTheMultiprocessors) {
  const Numerics tf32 = num(DType::Float32, Mask::None, Precision::Tf32);
  EXPECT_EQ(sel(shape(4096, 128), tf32, 9, 0).bwd().convert_ctas, 33);
  OverrideScope e("FLASHATTN_CUDA_CONVERT_CTAS", "0");
  EXPECT_EQ(sel(shape(4096, 128), tf32, 9, 0).bwd().convert_ctas, 0);
}

// Alignment and the copy engine are decided by selection, once: operands the sm_90a kernels cannot
// map or read in 16-byte vectors get the mma.sync kernels (no launcher falls back later).
TEST(CudaSelect, OperandsTheCopyEngineCannotAddressGetTheSm80Kernels) {
  const Shape s = shape(1024, 128);
  for (const Numerics& n : {num(DType::BFloat16), num(DType::Float32, Mask::None, Precision::Tf32), num(DType::Float32)}) {
    const bool half = n.dtype != DType::Float32;
    {
      ForwardParams p = fparams(s, n);
      EXPECT_NE(select_forward(p, dev(9, 0), Overrides{}).plan.kernel, half ? FwdKernel::Sm80Mma16 : FwdKernel::Sm80Mma32);
      p.q.ptr = static_cast<const char*>(p.q.ptr) + 8;  // 8-byte aligned only
      const ForwardPlan f = select_forward(p, dev(9, 0), Overrides{}).plan;
      EXPECT_EQ(f.kernel, half ? FwdKernel::Sm80Mma16 : FwdKernel::Sm80Mma32);
      EXPECT_FALSE(f.vec16);
      EXPECT_EQ(f.workspace, 0u);
    }
    {
      // K broadcast over the batch (stride 0): vectors fine, no tensor map.
      ForwardParams p = fparams(s, n);
      p.k.sb = 0;
      const ForwardPlan f = select_forward(p, dev(9, 0), Overrides{}).plan;
      EXPECT_TRUE(f.vec16);
      if (half) EXPECT_EQ(f.kernel, FwdKernel::Sm80Mma16);
      BackwardParams b = bparams(s, n);
      b.v.sh = 0;
      const BackwardPlan bp = select_backward(b, dev(9, 0), Overrides{}).plan;
      EXPECT_TRUE(bp.kernel == BwdKernel::Sm80Mma32Split || bp.kernel == BwdKernel::Sm80Mma16Atomic)
          << kernel_name(bp.kernel);
    }
    {
      // A dim of extent 1 is never stepped over: any stride will do.
      Shape one = s;
      one.batch = 1;
      ForwardParams p = fparams(one, n);
      p.q.sb = p.k.sb = p.v.sb = 0;  // a zero stride the copy engine would refuse
      EXPECT_NE(select_forward(p, dev(9, 0), Overrides{}).plan.kernel, half ? FwdKernel::Sm80Mma16 : FwdKernel::Sm80Mma32);
    }
    // A driver without the tensor-map encoder: no sm_90a kernels.
    DeviceCaps no_tma = dev(9, 0);
    no_tma.tma = false;
    EXPECT_EQ(select_forward(fparams(s, n), no_tma, Overrides{}).plan.kernel, half ? FwdKernel::Sm80Mma16 : FwdKernel::Sm80Mma32);
  }
  // Contiguous float32 rows of 97 elements (388 bytes): not 16-byte aligned, so the mma.sync kernels
  // with 4-byte copies, whatever the head dim's padding would allow.
  {
    const Shape s97 = shape(4096, 97);
    ForwardParams p97 = fparams(s97, num(DType::Float32, Mask::None, Precision::Tf32));
    for (In4* o : {&p97.q, &p97.k, &p97.v}) *o = In4{o->ptr, 8 * 4096 * 97, 4096 * 97, 97};
    const ForwardPlan f97 = select_forward(p97, dev(9, 0), Overrides{}).plan;
    EXPECT_EQ(f97.kernel, FwdKernel::Sm80Mma32);
    EXPECT_FALSE(f97.vec16);
    EXPECT_EQ(f97.dp, 128);
  }
  // A row stride that is not a multiple of 16 bytes: neither vectors nor maps.
  ForwardParams p = fparams(shape(100, 60), num(DType::BFloat16));
  p.q.ss = 60;
  p.q.sh = 60 * 100;
  p.q.sb = 60 * 100 * 8;
  const ForwardPlan f = select_forward(p, dev(9, 0), Overrides{}).plan;
  EXPECT_FALSE(f.vec16);
  EXPECT_EQ(f.kernel, FwdKernel::Sm80Mma16);
}

// A softcap or ALiBi takes the XF kernels (the per-entry score step) on the route the plain call
// would take, except the float32 sm_90a kernels, which have no such step: float32 then runs the
// mma.sync kernels in either precision. Nothing else of the plan changes.
TEST(CudaSelect, SoftcapAndAlibiTakeTheXfKernels) {
  // Without them: no XF anywhere, also with a sliding window (windows need no kernel of their own).
  for (DType t : {DType::Float32, DType::BFloat16, DType::Float16})
    for (int cc : {8, 9}) {
      const Sel plain = sel(shape(1024, 128), num(t), cc, 0);
      const Sel win = sel(shape(1024, 128), with_window(num(t, Mask::CausalBottomRight), 64, 0), cc, 0);
      ASSERT_TRUE(plain.ok && win.ok) << plain.why << win.why;
      EXPECT_FALSE(plain.fwd().xf || plain.bwd().xf || win.fwd().xf || win.bwd().xf);
      EXPECT_EQ(plain.fwd().kernel, win.fwd().kernel) << dtype_name(t) << " sm_" << cc << "0";
      EXPECT_EQ(plain.bwd().kernel, win.bwd().kernel) << dtype_name(t) << " sm_" << cc << "0";
      EXPECT_EQ(kernel_name(plain.fwd()), kernel_name(plain.fwd().kernel));
    }
  const auto mods = {+[](Numerics n) { return with_softcap(n); }, +[](Numerics n) { return with_alibi(n); },
                     +[](Numerics n) { return with_window(with_alibi(with_softcap(n, 5.0f)), 100, -1); }};
  for (auto mod : mods) {
    // float32, both precisions, at the head dims where the plain call takes the sm_90a kernels
    // (64, 128) and where it does not (256), on 9.0 and 8.0: the mma.sync kernels with XF, the
    // precision's arithmetic, the plain mma.sync plan's shared memory and workspace.
    for (Precision prec : {Precision::Fp32, Precision::Tf32})
      for (int64_t d : {40, 64, 128, 256})
        for (int cc : {8, 9}) {
          const Numerics n = mod(num(DType::Float32, Mask::CausalTopLeft, prec));
          const Sel c = sel(shape(2048, d), n, cc, 0);
          ASSERT_TRUE(c.ok) << c.why;
          const std::string at = "D = " + std::to_string(d) + " sm_" + std::to_string(cc) + "0" +
                                 (prec == Precision::Tf32 ? " tf32" : " fp32");
          EXPECT_EQ(c.fwd().kernel, FwdKernel::Sm80Mma32) << at;
          EXPECT_EQ(c.bwd().kernel, BwdKernel::Sm80Mma32Split) << at;
          EXPECT_TRUE(c.fwd().xf && c.bwd().xf) << at;
          EXPECT_EQ(c.math, prec == Precision::Tf32 ? Math::Tf32 : Math::Tf32x3) << at;
          EXPECT_EQ(kernel_name(c.fwd()), "sm80-mma32+xf") << at;
          EXPECT_EQ(kernel_name(c.bwd()), "sm80-mma32-split+xf") << at;
          OverrideScope arch("FLASHATTN_CUDA_ARCH", "sm80");
          const Sel p80 = sel(shape(2048, d), num(DType::Float32, Mask::CausalTopLeft, prec), cc, 0);
          EXPECT_EQ(c.fwd().smem, p80.fwd().smem) << at;
          EXPECT_EQ(c.fwd().workspace, p80.fwd().workspace) << at;
          EXPECT_EQ(c.bwd().smem_dq, p80.bwd().smem_dq) << at;
          EXPECT_EQ(c.bwd().smem_dkv, p80.bwd().smem_dkv) << at;
          EXPECT_EQ(c.bwd().workspace, p80.bwd().workspace) << at;
        }
    {
      // ... whatever the float32 sm_90a overrides ask for; and FMA before sm_80.
      OverrideScope f("FLASHATTN_CUDA_FP32_FWD", "wgmma");
      OverrideScope b("FLASHATTN_CUDA_FP32_BWD", "wgmma");
      OverrideScope t("FLASHATTN_CUDA_TF32_BWD", "pair");
      for (Precision prec : {Precision::Fp32, Precision::Tf32}) {
        const Sel c = sel(shape(2048, 64), mod(num(DType::Float32, Mask::None, prec)), 9, 0);
        EXPECT_EQ(c.fwd().kernel, FwdKernel::Sm80Mma32);
        EXPECT_EQ(c.bwd().kernel, BwdKernel::Sm80Mma32Split);
        EXPECT_EQ(c.bwd().workspace, delta_floats(shape(2048, 64), Packing{}) * sizeof(float));
      }
      const Sel old = sel(shape(2048, 64), mod(num(DType::Float32)), 7, 5);
      EXPECT_EQ(old.math, Math::Fma);
      EXPECT_TRUE(old.fwd().xf && old.bwd().xf);
    }
    // 16-bit: the plain route, with XF: on 9.0 the wgmma forward and the atomic wgmma backward at
    // D = 64, 128, 256; the split backward when deterministic; at D = 96 (no sm_90a kernels) and
    // before 9.0 the mma.sync kernels in the plain call's design.
    for (DType t : {DType::BFloat16, DType::Float16}) {
      for (int64_t d : {64, 128, 256}) {
        const std::string at = std::string(dtype_name(t)) + " D = " + std::to_string(d);
        const Sel plain = sel(shape(2048, d), num(t, Mask::CausalTopLeft), 9, 0);
        const Sel c = sel(shape(2048, d), mod(num(t, Mask::CausalTopLeft)), 9, 0);
        ASSERT_TRUE(c.ok) << c.why;
        EXPECT_EQ(c.fwd().kernel, FwdKernel::Sm90Wgmma16) << at;
        EXPECT_EQ(c.bwd().kernel, BwdKernel::Sm90Wgmma16Atomic) << at;
        EXPECT_TRUE(c.fwd().xf && c.bwd().xf) << at;
        EXPECT_EQ(kernel_name(c.fwd()), "sm90-wgmma16+xf") << at;
        EXPECT_EQ(kernel_name(c.bwd()), "sm90-wgmma16-atomic+xf") << at;
        EXPECT_EQ(c.fwd().pingpong, plain.fwd().pingpong) << at;
        EXPECT_EQ(c.fwd().smem, plain.fwd().smem) << at;
        EXPECT_EQ(c.bwd().sm90_variant, plain.bwd().sm90_variant) << at;
        EXPECT_EQ(c.bwd().smem_dkv, plain.bwd().smem_dkv) << at;
        EXPECT_EQ(c.bwd().workspace, plain.bwd().workspace) << at;
        const Sel det = sel(shape(2048, d), mod(num(t, Mask::None, Precision::Fp32, true)), 9, 0);
        EXPECT_EQ(det.fwd().kernel, FwdKernel::Sm90Wgmma16) << at;
        EXPECT_EQ(det.bwd().kernel, BwdKernel::Sm80Mma16Split) << at;
        EXPECT_TRUE(det.fwd().xf && det.bwd().xf) << at;
        EXPECT_EQ(kernel_name(det.bwd()), "sm80-mma16-split+xf") << at;
        {
          OverrideScope arch("FLASHATTN_CUDA_ARCH", "sm80");
          const Sel c80 = sel(shape(2048, d), mod(num(t)), 9, 0);
          EXPECT_EQ(c80.fwd().kernel, FwdKernel::Sm80Mma16) << at;
          EXPECT_TRUE(c80.bwd().kernel == BwdKernel::Sm80Mma16Split || c80.bwd().kernel == BwdKernel::Sm80Mma16Atomic)
              << at << ": " << kernel_name(c80.bwd());
          EXPECT_TRUE(c80.fwd().xf && c80.bwd().xf) << at;
        }
        // Before 9.0: the atomic mma.sync backward at D = 64, split from 96 up (the plain rule).
        const Sel a100 = sel(shape(2048, d), mod(num(t)), 8, 0);
        EXPECT_EQ(a100.fwd().kernel, FwdKernel::Sm80Mma16) << at;
        EXPECT_EQ(a100.bwd().kernel, d == 64 ? BwdKernel::Sm80Mma16Atomic : BwdKernel::Sm80Mma16Split) << at;
        EXPECT_TRUE(a100.fwd().xf && a100.bwd().xf) << at;
        EXPECT_EQ(kernel_name(a100.fwd()), "sm80-mma16+xf") << at;
        {
          OverrideScope bwd("FLASHATTN_CUDA_BWD", "atomic");
          const Sel at100 = sel(shape(2048, d), mod(num(t)), 8, 0);
          EXPECT_EQ(at100.bwd().kernel, BwdKernel::Sm80Mma16Atomic) << at;
          EXPECT_TRUE(at100.bwd().xf) << at;
        }
      }
      const Sel c96 = sel(shape(2048, 80), mod(num(t)), 9, 0);
      ASSERT_TRUE(c96.ok) << c96.why;
      EXPECT_EQ(c96.dp, 96);
      EXPECT_EQ(c96.fwd().kernel, FwdKernel::Sm80Mma16);
      EXPECT_EQ(c96.bwd().kernel, BwdKernel::Sm80Mma16Split);
      EXPECT_TRUE(c96.fwd().xf && c96.bwd().xf);
      // Operands the copy engine cannot address: the mma.sync kernels, with XF.
      ForwardParams fp = fparams(shape(2048, 128), mod(num(t)));
      fp.q.ptr = static_cast<const char*>(fp.q.ptr) + 8;
      const ForwardPlan f = select_forward(fp, dev(9, 0), Overrides{}).plan;
      EXPECT_EQ(f.kernel, FwdKernel::Sm80Mma16);
      EXPECT_TRUE(f.xf);
    }
  }
  // Unsupported problems still say why, with or without the per-entry step.
  const Sel wide = sel(shape(128, 300), with_softcap(num(DType::BFloat16)), 9, 0);
  EXPECT_FALSE(wide.ok);
  EXPECT_NE(wide.why.find("300"), std::string::npos) << wide.why;
  const Sel old16 = sel(shape(128, 64), with_alibi(num(DType::Float16)), 7, 5);
  EXPECT_FALSE(old16.ok);
  EXPECT_NE(old16.why.find("sm_80"), std::string::npos) << old16.why;
}

TEST(CudaSelect, TmaRules) {
  const Shape s = shape(64, 64);
  In4 x{reinterpret_cast<const void*>(0x1000), 8 * 64 * 64, 64 * 64, 64};
  EXPECT_TRUE(tma_ok(x, 2, 2, 8, 64));
  In4 odd = x;
  odd.ptr = reinterpret_cast<const void*>(0x1008);
  EXPECT_FALSE(tma_ok(odd, 2, 2, 8, 64));
  In4 zero = x;
  zero.sh = 0;
  EXPECT_FALSE(tma_ok(zero, 2, 2, 8, 64));
  EXPECT_TRUE(tma_ok(zero, 2, 2, 1, 64));  // one head: its stride is never used
  In4 huge = x;
  huge.sb = int64_t{1} << 40;
  EXPECT_FALSE(tma_ok(huge, 4, 2, 8, 64));
  (void)s;
}

// The plan carries the call's scratch: D, plus the dQ accumulator of the atomic design or the
// float32 sm_90a kernels' operand copies.
TEST(CudaSelect, WorkspaceOfEachPlan) {
  const Shape s = shape(1000, 64);
  const size_t rows = 2 * 8 * 1000, delta = (rows + 3) / 4 * 4;
  const Sel atomic = sel(s, num(DType::BFloat16), 9, 0);
  ASSERT_TRUE(atomic.atomic_bwd);
  EXPECT_EQ(atomic.bwd().workspace, (delta + rows * 64) * sizeof(float));
  EXPECT_EQ(atomic.fwd().workspace, 0u);
  const Sel split = sel(s, num(DType::BFloat16, Mask::None, Precision::Fp32, true), 8, 0);
  EXPECT_EQ(split.bwd().workspace, delta * sizeof(float));
  const Sel x3 = sel(s, num(DType::Float32), 9, 0);
  ASSERT_EQ(x3.fwd().kernel, FwdKernel::Sm90X3);
  const size_t nk = 2 * 8 * 1000 * 64, nkt = 2 * 8 * 1000 * 64;  // (1000 is a multiple of 8)
  EXPECT_EQ(x3.fwd().workspace, (2 * nk + 2 * nkt) * sizeof(float));
  ASSERT_EQ(x3.bwd().kernel, BwdKernel::Sm90Wgmma32);
  EXPECT_EQ(x3.bwd().workspace, (delta + 2 * (2 * nk + 2 * nkt + 2 * nk + nkt) + 4) * sizeof(float));
  EXPECT_EQ(sel(s, num(DType::Float32), 8, 0).fwd().workspace, 0u);
}

TEST(CudaSelect, SharedMemoryLimitsSayWhy) {
  DeviceCaps small = dev(8, 0);
  small.smem_optin = 48 * 1024;
  const Selected<ForwardPlan> f = select_forward(fparams(shape(128, 256), num(DType::Float32)), small, Overrides{});
  EXPECT_FALSE(f.ok);
  EXPECT_NE(f.why.find("shared memory"), std::string::npos) << f.why;
  EXPECT_NE(f.why.find("49152"), std::string::npos) << f.why;
}

TEST(CudaSelect, OverridesParseEveryKnobAndRejectUnknownValues) {
  const Overrides o = ov({{"FLASHATTN_CUDA_ARCH", "sm80"},
                          {"FLASHATTN_CUDA_MATH", "fma"},
                          {"FLASHATTN_CUDA_BWD", "atomic"},
                          {"FLASHATTN_CUDA_SM90_VARIANT", "1"},
                          {"FLASHATTN_CUDA_PINGPONG", "0"},
                          {"FLASHATTN_CUDA_TF32_FWD_COPIES", "kv"},
                          {"FLASHATTN_CUDA_FP32_FWD", "mma"},
                          {"FLASHATTN_CUDA_TF32_BWD", "pair"},
                          {"FLASHATTN_CUDA_FP32_BWD", "wgmma"},
                          {"FLASHATTN_CUDA_PERSISTENT_CTAS", "sms"},
                          {"FLASHATTN_CUDA_CONVERT_CTAS", "7"},
                          {"FLASHATTN_CUDA_FWD_CTAS", "sms"},
                          {"FLASHATTN_CUDA_DECODE_LOADER", "rows"},
                          {"FLASHATTN_CUDA_ORD_HEADS", "0"}});
  EXPECT_EQ(o.arch, 0);
  EXPECT_EQ(o.math, static_cast<int>(Math::Fma));
  EXPECT_EQ(o.bwd, 1);
  EXPECT_EQ(o.sm90_variant, 1);
  EXPECT_EQ(o.pingpong, 0);
  EXPECT_EQ(o.tf32_fwd_copies, 2);
  EXPECT_EQ(o.fp32_fwd, 0);
  EXPECT_EQ(o.tf32_bwd, 3);
  EXPECT_EQ(o.fp32_bwd, 1);
  EXPECT_EQ(o.persistent_ctas, -2);
  EXPECT_EQ(o.convert_ctas, 7);
  EXPECT_EQ(o.fwd_ctas, -2);
  EXPECT_EQ(ov({{"FLASHATTN_CUDA_FWD_CTAS", "5"}}).fwd_ctas, 5);
  EXPECT_EQ(o.decode_loader, DecodeShape::kRows);
  EXPECT_EQ(o.ord_heads, 0);
  EXPECT_EQ(ov({{"FLASHATTN_CUDA_DECODE_LOADER", "bulk"}}).decode_loader, DecodeShape::kBulk);
  const Overrides none = ov();
  EXPECT_EQ(none.arch, -1);
  EXPECT_EQ(none.persistent_ctas, -1);
  EXPECT_EQ(ov({{"FLASHATTN_CUDA_MATH", ""}}).math, -1);  // empty: unset
  for (const char* var : {"FLASHATTN_CUDA_PINGPONG", "FLASHATTN_CUDA_FP32_FWD", "FLASHATTN_CUDA_CONVERT_CTAS"}) {
    try {
      (void)ov({{var, "-3x"}});
      ADD_FAILURE() << var << " = -3x was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.status(), Status::InvalidArgument);
      EXPECT_NE(std::string(err.what()).find(var), std::string::npos) << err.what();
    }
  }
}


// ---- KV-cache calls ----------------------------------------------------------------------------
// A decode-like call: B sequences of at most skv keys, Sq query rows, Hq/Hkv heads, head dim d.
KvcacheParams kv_call(DType t, int64_t B, int64_t sq, int64_t hq, int64_t hkv, int64_t skv, int64_t d) {
  static char dummy[64] alignas(16);
  KvcacheParams k{};
  k.fwd.shape = Shape{B, hq, hkv, sq, skv, d};
  k.fwd.num = num(t);
  const In4 in{dummy, hkv * skv * d, d, hkv * d};
  k.fwd.q = In4{dummy, sq * hq * d, d, hq * d};
  k.fwd.k = k.fwd.v = in;
  k.fwd.out = Out4{dummy, sq * hq * d, d, hq * d};
  static const int32_t lens[1] = {1};
  k.fwd.kv.seqlen_k = lens;
  return k;
}

TEST(KvcacheSelect, SplitCount) {
  // Requested counts are honoured up to the key tiles and the bound.
  EXPECT_EQ(kv_splits(8, 64, 396, 1), 1);
  EXPECT_EQ(kv_splits(8, 64, 396, 5), 5);
  EXPECT_EQ(kv_splits(8, 3, 396, 5), 3);
  EXPECT_EQ(kv_splits(8, 1000, 396, 500), kMaxKvSplits);
  // Automatic: none from 4 waves; else the fewest splits whose waves do >= 90% useful work, whole
  // tiles counted, each split at least kMinKvTilesPerSplit tiles (or the most useful such count).
  EXPECT_EQ(kv_splits(1600, 2048, 396, 0), 1);
  EXPECT_EQ(kv_splits(8, 2048, 396, 0), 46);   // 368 CTAs of 45 tiles (45 splits: 46 tiles, 89.9%)
  EXPECT_EQ(kv_splits(8, 64, 132, 0), 16);     // 128 CTAs of 4 tiles on 132 slots
  EXPECT_EQ(kv_splits(8, 64, 120, 0), 13);     // (15 splits of 5 tiles: only 13 have any)
  EXPECT_EQ(kv_splits(128, 64, 132, 0), 1);
  EXPECT_EQ(kv_splits(512, 64, 396, 0), 3);    // B 64, Hkv 8: 1536 CTAs, 3.9 waves
  EXPECT_EQ(kv_splits(8, 64, 396, 0), 32);     // at most 64 / 2 splits: 256 CTAs
  EXPECT_EQ(kv_splits(8, 1, 396, 0), 1);
  EXPECT_EQ(kv_splits(1, 100000, 396, 0), kMaxKvSplits);
}

TEST(KvcacheSelect, PlanShapesAndWorkspace) {
  const DeviceCaps h200 = dev(9, 0);
  // Decoding, GQA 32/8: 4 (row, head) pairs per kv head: the 16-row CTA; B = 1 at 8k keys: split.
  auto r = select_kvcache(kv_call(DType::BFloat16, 1, 1, 32, 8, 8192, 128), h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.kw, 4);
  EXPECT_EQ(r.plan.dp, 128);
  EXPECT_EQ(r.plan.h, Half16::BF16);
  EXPECT_GT(r.plan.splits, 8);
  EXPECT_GE(r.plan.o_part, 0);
  EXPECT_GT(r.plan.lse_part, r.plan.o_part);
  EXPECT_EQ(r.plan.q_rot, -1);
  EXPECT_GE(r.plan.workspace, static_cast<size_t>(r.plan.splits) * 32 * (128 * 4 + 4));
  // Batch 64: 512 blocks fill 3.9 waves of the 132 multiprocessors: no split; three stages hold
  // two CTAs per multiprocessor, whose 264 slots take them in 1.9 waves (two stages: 1.3 of 396).
  r = select_kvcache(kv_call(DType::Float16, 64, 1, 32, 8, 8192, 128), h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.splits, 1);
  EXPECT_EQ(r.plan.stages, 3);
  // Batch 16: 128 blocks, one per multiprocessor: no split, two stages.
  r = select_kvcache(kv_call(DType::Float16, 16, 1, 32, 8, 4096, 128), h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.splits, 1);
  EXPECT_EQ(r.plan.stages, 2);
  // Batch 256: 2048 blocks, over 4 waves: no split, no partials.
  r = select_kvcache(kv_call(DType::Float16, 256, 1, 32, 8, 8192, 128), h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.splits, 1);
  EXPECT_EQ(r.plan.o_part, -1);
  // 17 or more (row, head) pairs per kv head: 64-row CTAs.
  r = select_kvcache(kv_call(DType::BFloat16, 2, 5, 8, 2, 500, 64), h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.kw, 1);
  // The caller's num_splits.
  KvcacheParams k = kv_call(DType::BFloat16, 1, 1, 32, 8, 8192, 128);
  k.num_splits = 1;
  EXPECT_EQ(select_kvcache(k, h200).plan.splits, 1);
  k.num_splits = 7;
  EXPECT_EQ(select_kvcache(k, h200).plan.splits, 7);
  // A rotary embedding: the rotated q in the workspace, 16-byte rows.
  k.rotary.cos = k.rotary.sin = k.fwd.q.ptr;
  k.rotary.rotary_dim = 64;
  r = select_kvcache(k, h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_GE(r.plan.q_rot, 0);
  EXPECT_EQ(r.plan.q_rot % 16, 0);
  EXPECT_EQ(r.plan.q_rot_ld, 128);
  // Head dim 40 pads to 64; a misaligned row stride loses the vectors.
  k = kv_call(DType::BFloat16, 2, 1, 4, 4, 300, 40);
  r = select_kvcache(k, h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.dp, 64);
  EXPECT_TRUE(r.plan.vec16);
  k.fwd.k.ss = 4 * 40 + 2;
  EXPECT_FALSE(select_kvcache(k, h200).plan.vec16);
}

// The K/V loader (DecodeShape::Loader): the whole-tile cp.async one unless a knob asks; bulk
// copies only on sm_90 with 16-byte rows and D = DP (else the whole-tile loader), with the padded
// rows' larger shared memory in the plan.
TEST(KvcacheSelect, Loader) {
  const DeviceCaps h200 = dev(9, 0), a100 = dev(8, 0);
  const KvcacheParams k = kv_call(DType::BFloat16, 4, 1, 32, 8, 4096, 128);
  auto r = select_kvcache(k, h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.loader, DecodeShape::kRows);
  EXPECT_EQ(r.plan.smem, decode_smem_bytes(128, 4, false, r.plan.stages));
  Overrides ov;
  ov.decode_loader = DecodeShape::kBulk;
  r = select_kvcache(k, h200, ov);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.loader, DecodeShape::kBulk);
  EXPECT_EQ(r.plan.smem, decode_smem_bytes(128, 4, true));
  EXPECT_EQ(decode_smem_bytes(128, 4, true) - decode_smem_bytes(128, 4), 4 * 64 * 16 + 16);
  EXPECT_EQ(select_kvcache(k, a100, ov).plan.loader, DecodeShape::kRows);  // (no copy engine path)
  KvcacheParams pad = kv_call(DType::BFloat16, 4, 1, 32, 8, 4096, 40);  // D 40 < DP 64
  EXPECT_EQ(select_kvcache(pad, h200, ov).plan.loader, DecodeShape::kRows);
  KvcacheParams odd = k;
  odd.fwd.v.ss = 8 * 128 + 2;  // rows not 16-byte aligned
  r = select_kvcache(odd, h200, ov);
  EXPECT_FALSE(r.plan.vec16);
  EXPECT_EQ(r.plan.loader, DecodeShape::kRows);
  for (int l : {DecodeShape::kRows, DecodeShape::kGeneric}) {
    ov.decode_loader = l;
    EXPECT_EQ(select_kvcache(k, h200, ov).plan.loader, l);
  }
}

// Pipeline stages: the knob's count where the shared memory holds it, fewer where not (D = 256:
// four stages of 64 K and V rows are 256 KB), with the plan's shared memory and the CTA slots
// (and so the split count) following it.
TEST(KvcacheSelect, Stages) {
  const DeviceCaps h200 = dev(9, 0);
  const KvcacheParams k = kv_call(DType::BFloat16, 16, 1, 32, 8, 4096, 128);
  auto r = select_kvcache(k, h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_GE(r.plan.stages, DecodeShape::kMinStages);
  EXPECT_LE(r.plan.stages, DecodeShape::kMaxStages);
  Overrides ov;
  for (int st = 2; st <= 4; ++st) {
    SCOPED_TRACE("stages " + std::to_string(st));
    ov.decode_loader = DecodeShape::kRows;
    ov.decode_stages = st - 2;
    r = select_kvcache(k, h200, ov);
    ASSERT_TRUE(r.ok) << r.why;
    EXPECT_EQ(r.plan.stages, st);
    EXPECT_EQ(r.plan.smem, decode_smem_bytes(128, 4, false, st));
    EXPECT_EQ(decode_smem_bytes(128, 4, false, st) - decode_smem_bytes(128, 4, false, 2), (st - 2) * 2 * 64 * 256);
    ov.decode_loader = DecodeShape::kBulk;
    r = select_kvcache(k, h200, ov);
    EXPECT_EQ(r.plan.smem, decode_smem_bytes(128, 4, true, st));
  }
  // The split count of the whole-tile loader spreads CTAs over the multiprocessors (128 row
  // blocks on 132: none); the general loader's (a knob, or rows that are not whole tiles) over its
  // CTA slots, three per multiprocessor at two stages: three splits.
  ov.decode_loader = -1;
  ov.decode_stages = -1;
  EXPECT_EQ(select_kvcache(k, h200, ov).plan.splits, 1);
  ov.decode_loader = DecodeShape::kGeneric;
  r = select_kvcache(k, h200, ov);
  EXPECT_EQ(r.plan.splits, 3);
  EXPECT_EQ(r.plan.stages, 2);
  ov.decode_loader = -1;
  KvcacheParams paged = k;
  static const int32_t table[64] = {};
  paged.fwd.kv.block_table = table;
  paged.fwd.kv.bt_stride = 4;
  paged.fwd.kv.block_size = 1024;  // whole tiles: as contiguous
  EXPECT_EQ(select_kvcache(paged, h200, ov).plan.splits, 1);
  paged.fwd.kv.block_size = 16;  // tiles over 4 pages: row by row
  EXPECT_EQ(select_kvcache(paged, h200, ov).plan.splits, 3);
  const KvcacheParams d256 = kv_call(DType::BFloat16, 16, 1, 32, 8, 4096, 256);
  ov.decode_stages = 2;
  r = select_kvcache(d256, h200, ov);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.stages, 3);
  EXPECT_LE(r.plan.smem, h200.smem_optin);
  EXPECT_GT(decode_smem_bytes(256, 4, false, 4), h200.smem_optin);
}

// CTAs per multiprocessor that keep the memory busy with the whole-tile loader (kv_streams): one
// on an H100 (2619 MHz x 5120 bits: 25 GB/s per SM), two on an H200 (3201 MHz x 6144 bits: 37),
// one when the bandwidth is unknown. B16 4k (128 row blocks): one split on the H100, two (256
// CTAs, two per SM, at a stage count that leaves two slots) on the H200; B64 4k: one on both.
TEST(KvcacheSelect, StreamsPerMultiprocessor) {
  DeviceCaps h100 = dev(9, 0), h200 = dev(9, 0);
  h100.mem_gbps = 2.0 * 2619e6 * 640 / 1e9;
  h200.mem_gbps = 2.0 * 3201e6 * 768 / 1e9;
  EXPECT_EQ(kv_streams(h100), 1);
  EXPECT_EQ(kv_streams(h200), 2);
  EXPECT_EQ(kv_streams(dev(9, 0)), 1);
  const KvcacheParams b16 = kv_call(DType::BFloat16, 16, 1, 32, 8, 4096, 128);
  EXPECT_EQ(select_kvcache(b16, h100).plan.splits, 1);
  const auto r = select_kvcache(b16, h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_EQ(r.plan.splits, 2);
  EXPECT_GE((h200.smem_optin + 1024) / (r.plan.smem + 1024), 2);
  const KvcacheParams b64 = kv_call(DType::BFloat16, 64, 1, 32, 8, 4096, 128);
  EXPECT_EQ(select_kvcache(b64, h100).plan.splits, 1);
  EXPECT_EQ(select_kvcache(b64, h200).plan.splits, 1);
  // The caller's num_splits is kept either way; the knob sets the CTAs per SM.
  KvcacheParams asked = b16;
  asked.num_splits = 5;
  EXPECT_EQ(select_kvcache(asked, h200).plan.splits, 5);
  Overrides ov;
  ov.decode_streams = 1;
  EXPECT_EQ(select_kvcache(b16, h200, ov).plan.splits, 1);
  ov.decode_streams = 2;
  EXPECT_EQ(select_kvcache(b16, h100, ov).plan.splits, 2);
}

// Index arrays checked on the stream (KvCheck): nothing of them in the parameters or copied; the
// check's derived arrays and verdict ([3 B + 1] int32) at the workspace's start, the partials after.
TEST(KvcacheSelect, DeviceCheckLayout) {
  const DeviceCaps h200 = dev(9, 0);
  KvcacheParams k = kv_call(DType::BFloat16, 4, 1, 32, 8, 8192, 128);
  k.check.on = true;
  k.check.batch = 4;
  const auto r = select_kvcache(k, h200);
  ASSERT_TRUE(r.ok) << r.why;
  EXPECT_FALSE(r.plan.idx_inline);
  EXPECT_EQ(r.plan.idx_ints, 0u);
  EXPECT_EQ(r.plan.check, 0);
  const size_t after = (13 * 4 + 15) / 16 * 16;
  if (r.plan.splits > 1) {
    EXPECT_EQ(r.plan.o_part, static_cast<int64_t>(after));
  } else {
    EXPECT_EQ(r.plan.workspace, after);
  }
  k.check.on = false;
  EXPECT_EQ(select_kvcache(k, h200).plan.check, -1);
}

TEST(KvcacheSelect, Refusals) {
  auto r = select_kvcache(kv_call(DType::Float32, 1, 1, 8, 8, 100, 64), dev(9, 0));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.why.find("float32"), std::string::npos) << r.why;
  r = select_kvcache(kv_call(DType::BFloat16, 1, 1, 8, 8, 100, 64), dev(7, 5));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.why.find("sm_80"), std::string::npos) << r.why;
  r = select_kvcache(kv_call(DType::BFloat16, 1, 1, 8, 8, 100, 300), dev(9, 0));
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.why.find("head_dim"), std::string::npos) << r.why;
}

// The default design under GQA with the head split - its sums and counters alone in the workspace
// (no dQ turns), after the dQ accumulator. By rule (measured, select.cpp): banded from S 1k + 1 at
// every D and at D > 64 below; unbanded from S 1k + 1 at D 64 only. Never for MHA, packed calls or
// the per-entry step; FLASHATTN_CUDA_ATOMIC_HEADS=0/1 forces either.
TEST(CudaSelect, DefaultBackwardHeadSplit) {
  const Numerics causal = num(DType::BFloat16, Mask::CausalBottomRight);
  const Numerics none = num(DType::BFloat16, Mask::None);
  auto plan = [&](const Shape& s, const Numerics& nn) {
    const Selected<BackwardPlan> r = select_backward(bparams(s, nn), dev(9, 0), ov(scoped_vars()));
    EXPECT_TRUE(r.ok) << r.why;
    return r.plan;
  };
  auto split = [&](int64_t seq, int64_t d, const Numerics& nn) {
    return plan(Shape{2, 8, 2, seq, seq, d}, nn).dkv_acc >= 0;
  };
  EXPECT_TRUE(split(2000, 128, causal));
  EXPECT_TRUE(split(2000, 64, causal));
  EXPECT_TRUE(split(1000, 128, causal));
  EXPECT_TRUE(split(1000, 256, causal));
  EXPECT_FALSE(split(1000, 64, causal)) << "short causal rows at D 64";
  EXPECT_TRUE(split(2000, 64, none));
  EXPECT_FALSE(split(1000, 64, none));
  EXPECT_FALSE(split(2000, 128, none));
  EXPECT_FALSE(split(20000, 256, none));
  Numerics window = none;
  window.window_left = 256;
  EXPECT_TRUE(split(2000, 128, window)) << "a window is a band";
  const Shape gqa{2, 8, 2, 2000, 2000, 128};
  BackwardPlan p0;
  {
    OverrideScope off("FLASHATTN_CUDA_ATOMIC_HEADS", "0");
    p0 = plan(gqa, causal);
    EXPECT_EQ(p0.dkv_acc, -1) << "forced off";
    OverrideScope on("FLASHATTN_CUDA_ATOMIC_HEADS", "1");
    EXPECT_GE(plan(gqa, none).dkv_acc, 0) << "forced on";
  }
  const BackwardPlan p = plan(gqa, causal);
  ASSERT_EQ(p.kernel, BwdKernel::Sm90Wgmma16Atomic);
  const TileConfig90 c = tile_config90(Pass::Dkv, p.dp, p.sm90_variant);
  const int64_t nk = (2000 + c.block_m - 1) / c.block_m;
  EXPECT_EQ(p.dq_locks, -1);
  EXPECT_EQ(p.dkv_locks, static_cast<int64_t>(p0.workspace)) << "after D and the dQ accumulator";
  EXPECT_EQ(p.dq_lock_count, 2 * 2 * nk);
  EXPECT_EQ(p.dkv_acc % 16, 0);
  EXPECT_EQ(p.dkv_acc_rows, 2 * 2 * nk * c.block_m);
  EXPECT_EQ(p.workspace, static_cast<size_t>(p.dkv_acc) + 2 * p.dkv_acc_rows * p.dp * sizeof(float));
  EXPECT_EQ(plan(Shape{2, 8, 8, 2000, 2000, 128}, causal).dkv_acc, -1) << "MHA";
  Numerics cap = causal;
  cap.softcap = 30.0f;
  EXPECT_EQ(plan(gqa, cap).dkv_acc, -1) << "per-entry step";
}

}  // namespace
}  // namespace flashattn::cuda
