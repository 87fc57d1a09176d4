// Definitions of the sm_90a launchers declared in launch.hpp; included by the generated
// instantiation files inst/*_sm90_d*.cu only, which are compiled for sm_90a alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cuda/host/check.hpp"
#include "cuda/host/resources.hpp"
#include "cuda/sm90/dkv16.cuh"
#include "cuda/sm90/fwd16.cuh"
#include "cuda/sm90/x3_fwd.cuh"
#include "cuda/sm90/tf32_fwd.cuh"
#include "cuda/sm90/tf32_bwd.cuh"
#include "cuda/sm90/tf32_bwd_pair.cuh"
#include "cuda/host/launch.hpp"
#include "cuda/host/select.hpp"
#include "cuda/sm90/seq_maps.hpp"
#include "cuda/sm90/tma.hpp"

namespace flashattn::cuda {

// The operand pre-pass's copies (launch_tf32_operands) as tensor maps, the float32 sm_90a kernels'
// streamed operands: row copies [B, H, seq, DP] (boxes of box_rows rows: the pass's tile) and
// transposed copies [B, H, DP, seq8] (seq8 = round8(seq); boxes of all DP rows); their sizes are
// copy_sizes() (select.hpp), which also sized the plan's workspace.
template <int DP>
bool map_copy_rows(CUtensorMap* map, float* ptr, int64_t batch, int64_t heads, int64_t seq, int box_rows) {
  return make_tensor_map32(map, In4{ptr, heads * seq * DP, seq * DP, DP}, batch, heads, seq, DP, box_rows);
}
template <int DP>
bool map_copy_cols(CUtensorMap* map, float* ptr, int64_t batch, int64_t heads, int64_t seq8) {
  return make_tensor_map32(map, In4{ptr, heads * DP * seq8, DP * seq8, seq8}, batch, heads, DP, seq8, DP);
}

// A tensor map the selection promised (tma_ok) that does not encode: an internal error.
inline void require_maps(bool ok, const char* what) {
  if (!ok) throw Error(Status::Internal, std::string(what) + ": a tensor map failed to encode for operands selection accepted (" +
                         last_map_failure() + ")");
}

// The maps of a 16-bit sm_90a kernel's streamed operands: of the operands as stored (dense), or
// (a packed batch) one per sequence, written by the seq_maps pre-pass into a.seq_maps from the
// packed operands' maps (batch 1, all rows): ops[i] with its box rows and whether its rows are keys.
struct MapOperand {
  const In4* op;
  int64_t heads;
  bool keys;
  int box_rows;
  CUtensorMap* dense;  // the kernel argument's map (dense calls)
};
// With `blocks` (the forward's compact grid) the pre-pass also writes that table of nblocks entries.
template <int N>
const CUtensorMap* make_maps16(const MapOperand (&ops)[N], Half16 h, const Shape& s, const Packing& pk, void* seq_maps,
                               cudaStream_t stream, const char* what, int2* blocks = nullptr, int64_t nblocks = 0,
                               int bm = 0) {
  static_assert(N <= kMaxSeqMapOperands, "SeqMapsJob holds kMaxSeqMapOperands maps");
  bool ok = true;
  if (!pk.on()) {
    for (const MapOperand& o : ops)
      ok = ok && make_tensor_map16(o.dense, *o.op, h, s.batch, o.heads, o.keys ? s.seq_kv : s.seq_q, s.head_dim,
                                   o.box_rows);
    require_maps(ok, what);
    return nullptr;
  }
  SeqMapsJob j{};
  for (int i = 0; i < N; ++i) {
    const MapOperand& o = ops[i];
    const int64_t rows = std::max<int64_t>(1, o.keys ? pk.total_k : pk.total_q);
    ok = ok && make_tensor_map16(&j.tmpl[i], *o.op, h, 1, o.heads, rows, s.head_dim, o.box_rows);
    j.base[i] = static_cast<const char*>(o.op->ptr);
    j.row_bytes[i] = o.op->ss * 2;  // (16-bit elements)
    j.keys[i] = o.keys;
  }
  require_maps(ok, what);
  if (seq_maps == nullptr || reinterpret_cast<uintptr_t>(seq_maps) % kSeqMapBytes != 0)
    throw Error(Status::Internal, std::string(what) + ": the per-sequence maps' workspace is missing or not 128-byte aligned");
  j.n = N;
  j.shape = s;
  j.packing = pk;
  j.out = static_cast<CUtensorMap*>(seq_maps);
  j.blocks = blocks;
  j.nblocks = nblocks;
  j.bm = bm;
  launch_seq_maps(j, stream);
  return j.out;
}

// XF: the kernel with the per-entry score step (softcap, ALiBi); selection picks it when
// a.score.elementwise().
template <int DP, Half16 H, bool XF>
void launch_forward_sm90(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90(Pass::Forward, DP);
  dev::Sm90FwdArgs args{};  // (a packed call leaves the dense maps unused: zeros, not stack bytes)
  args.f = a;
  const MapOperand ops[3] = {{&a.p.q, s.heads_q, false, c.block_m, &args.tq},
                             {&a.p.k, s.heads_kv, true, c.block_n, &args.tk},
                             {&a.p.v, s.heads_kv, true, c.block_n, &args.tv}};
  args.seq_maps = make_maps16(ops, H, s, a.p.packing, a.seq_maps, stream, "cuda 16-bit sm_90a forward",
                              a.block_table, a.grid_blocks, c.block_m);
  args.blocks = a.block_table;
  // The dense grid (row blocks of max_seqlen_q x heads x sequences), or the compact one: one CTA
  // per entry of the block table x heads; or walk_ctas CTAs walking the row blocks of that grid.
  dim3 grid = a.block_table != nullptr
                  ? dim3(static_cast<unsigned>(a.grid_blocks), static_cast<unsigned>(s.heads_q), 1)
                  : dim3(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q),
                         static_cast<unsigned>(s.batch));
  const int64_t blocks = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  if (a.walk_ctas > 0 && blocks > a.walk_ctas) {
    const dev::FwdWalk w{grid.x, grid.y, grid.z};
    const int64_t ctas = std::min<int64_t>(a.walk_ctas, w.units());
    // (The kernel counts a CTA's tiles and blocks in int: at most two blocks of every key tile
    // per unit. Only a forced handful of CTAs on a huge call could pass 2^31; it keeps the grid.)
    const int64_t tiles = ((w.units() + ctas - 1) / ctas) * 2 * ((s.seq_kv + c.block_n - 1) / c.block_n);
    if (tiles < INT32_MAX) {
      args.walk = w;
      grid = dim3(static_cast<unsigned>(ctas), 1, 1);
    }
  }
  launch_checked(dev::forward_sm90_kernel<DP, H, XF>, grid, c.threads(), smem_bytes90(Pass::Forward, DP), stream, args,
                 "forward_sm90 kernel launch");
}

// The tf32 forward on wgmma: Q, K, V tensor maps (boxes of block_m / block_n rows), one CTA per
// block_m queries. a.tf32_copies (forward_tf32_sm90_kernel's kCopies): 1, V transposed and rounded
// by the operand pre-pass first; 2, K rounded too (|V| and |K| floats, padded, in a.workspace);
// streamed as they are. 0: the kernel's producer warps transpose V as stored.
template <int DP>
void launch_forward_tf32_sm90(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90_tf32(DP);
  dev::Sm90Tf32FwdArgs args;
  args.f = a;
  require_maps(make_tensor_map32(&args.tq, a.p.q, s.batch, s.heads_q, s.seq_q, s.head_dim, c.block_m) &&
                   (a.tf32_copies == 2 ||
                    make_tensor_map32(&args.tk, a.p.k, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_n)),
               "cuda tf32 forward");
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  if (a.tf32_copies == 0) {
    require_maps(make_tensor_map32(&args.tv, a.p.v, s.batch, s.heads_kv, s.seq_kv, s.head_dim, c.block_n),
                 "cuda tf32 forward");
    launch_checked(dev::forward_tf32_sm90_kernel<DP, 0>, grid, c.threads(), smem_bytes90_tf32(DP), stream, args,
                   "forward_tf32_sm90 kernel launch");
    return;
  }
  const int64_t skv8 = round8(s.seq_kv);
  const CopySizes cs = copy_sizes(s, DP, false);
  const size_t nvt = cs.kt;
  const size_t nk = a.tf32_copies == 2 ? cs.k : 0;
  float* vt = a.workspace;
  float* kr = nk > 0 ? vt + nvt : nullptr;
  launch_tf32_operands(OperandJob{a.p.v, s.batch, s.heads_kv, s.seq_kv, nullptr, vt, nullptr, nullptr}, s.head_dim,
                       DP, stream);
  if (kr != nullptr)
    launch_tf32_operands(OperandJob{a.p.k, s.batch, s.heads_kv, s.seq_kv, kr, nullptr, nullptr, nullptr}, s.head_dim,
                         DP, stream);
  // (The copies' maps encoded while the GPU runs the copies.)
  if (!map_copy_cols<DP>(&args.tv, vt, s.batch, s.heads_kv, skv8) ||
      (kr != nullptr && !map_copy_rows<DP>(&args.tk, kr, s.batch, s.heads_kv, s.seq_kv, c.block_n)))
    throw Error(Status::Internal, "cuda tf32 forward: tensor maps of the operand copies failed");
  launch_checked(kr != nullptr ? dev::forward_tf32_sm90_kernel<DP, 2> : dev::forward_tf32_sm90_kernel<DP, 1>, grid,
                 c.threads(), smem_bytes90_tf32(DP), stream, args, "forward_tf32_sm90 kernel launch");
}

// The 3xTF32 forward: a pre-pass writes K's big and small parts (rows) and V's transposed big and
// small parts (2 |K| + 2 |V| floats, padded, in a.workspace), which the kernel streams; Q is read
// as stored.
template <int DP>
void launch_forward_3xtf32_sm90(const FwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90_3xtf32(DP);
  dev::Sm90Tf32FwdArgs args;
  args.f = a;
  require_maps(make_tensor_map32(&args.tq, a.p.q, s.batch, s.heads_q, s.seq_q, s.head_dim, c.block_m),
               "cuda 3xtf32 forward");
  const int64_t skv8 = round8(s.seq_kv);
  const CopySizes cs = copy_sizes(s, DP, false);
  const size_t nk = cs.k, nvt = cs.kt;
  float* kb = a.workspace;
  float* ks = kb + nk;
  float* vtb = ks + nk;
  float* vts = vtb + nvt;
  launch_tf32_operands(OperandJob{a.p.k, s.batch, s.heads_kv, s.seq_kv, kb, nullptr, ks, nullptr}, s.head_dim, DP, stream);
  launch_tf32_operands(OperandJob{a.p.v, s.batch, s.heads_kv, s.seq_kv, nullptr, vtb, nullptr, vts}, s.head_dim, DP, stream);
  // (The copies' maps encoded while the GPU runs the copies, not before the first launch.)
  if (!map_copy_rows<DP>(&args.tk, kb, s.batch, s.heads_kv, s.seq_kv, c.block_n) ||
      !map_copy_rows<DP>(&args.tks, ks, s.batch, s.heads_kv, s.seq_kv, c.block_n) ||
      !map_copy_cols<DP>(&args.tv, vtb, s.batch, s.heads_kv, skv8) ||
      !map_copy_cols<DP>(&args.tvs, vts, s.batch, s.heads_kv, skv8))
    throw Error(Status::Internal, "cuda 3xtf32 forward: tensor maps of the operand copies failed");
  const dim3 grid(grid_blocks(s.seq_q, c.block_m), static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  launch_checked(dev::forward_3xtf32_sm90_kernel<DP>, grid, c.threads(), smem_bytes90_3xtf32(DP), stream, args,
                 "forward_3xtf32_sm90 kernel launch");
}

// Both float32 backwards on wgmma: tf32 (X3 = false; the split kernels at D = 64 unless
// a.f32_pair, the pair kernels at D = 128) and fp32-accurate 3xTF32 (X3; the pair kernels at
// D = 64 and 128).
template <int DP, bool X3, bool kPair>
void launch_bwd_f32_sm90(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 cq = tile_config90_tf32_bwd(Pass::Dq, kPair), ck = tile_config90_tf32_bwd(Pass::Dkv, kPair);
  // The pair kernels (both warpgroups on one tile's rows, split by product) have their dK/dV pass
  // always on wgmma (selection sets tf32_dkv_wgmma there too).
  const bool dkv_wgmma = kPair || a.tf32_dkv_wgmma;
  dev::Sm90Tf32BwdArgs dq, dkv;
  dq.f = dkv.f = a;
  dq.opaque_zero = dkv.opaque_zero = 0;
  dq.queue = dkv.queue = nullptr;
  const dim3 grid_q(grid_blocks(s.seq_q, cq.block_m), static_cast<unsigned>(s.heads_q), static_cast<unsigned>(s.batch));
  const dim3 grid_k(grid_blocks(s.seq_kv, ck.block_m), static_cast<unsigned>(s.heads_kv),
                    static_cast<unsigned>(s.batch));
  const int64_t nq_blocks = static_cast<int64_t>(grid_q.x) * grid_q.y * grid_q.z;
  const int64_t nk_blocks = static_cast<int64_t>(grid_k.x) * grid_k.y * grid_k.z;
  // The pair kernels number blocks in 32 bits (BlockQueue's counter runs up to blocks + CTAs).
  if (kPair && std::max(nq_blocks, nk_blocks) >= (int64_t{1} << 30))
    throw Error(Status::Unsupported, "float32 backward: " + std::to_string(std::max(nq_blocks, nk_blocks)) +
                                         " row blocks exceed the sm_90a kernels' limit of 2^30");
  // Pair kernels: one CTA per block, or (FLASHATTN_CUDA_PERSISTENT_CTAS) fewer walking the blocks
  // in work_item order, each next block from a counter (persistent_ctas, BlockQueue).
  const dim3 pq(kPair ? persistent_ctas(nq_blocks, a.persistent_cap) : 0),
      pk(kPair ? persistent_ctas(nk_blocks, a.persistent_cap) : 0);
  const bool walk = kPair && (pq.x < nq_blocks || pk.x < nk_blocks);
  // Each pass reads its stationary operands as the caller stores them (rounded, or split, when
  // loaded into registers): K and V in the dK/dV pass, Q and dO in the dQ pass - so the dQ pass
  // needs none of the Q / dO copies, which can be written beside it (below).
  require_maps(make_tensor_map32(&dkv.tk, a.p.k, s.batch, s.heads_kv, s.seq_kv, s.head_dim, ck.block_m) &&
                   make_tensor_map32(&dkv.tv, a.p.v, s.batch, s.heads_kv, s.seq_kv, s.head_dim, ck.block_m) &&
                   make_tensor_map32(&dq.tq, a.p.q, s.batch, s.heads_q, s.seq_q, s.head_dim, 64) &&
                   make_tensor_map32(&dq.tdo, a.p.dout, s.batch, s.heads_q, s.seq_q, s.head_dim, 64),
               "cuda float32 sm_90a backward");
  // The copies: Q, dO [B, Hq, Sq, DP] and Q^T, dO^T [B, Hq, DP, Sq8] (only for the wgmma dK/dV
  // pass); K, V [B, Hkv, Skv, DP] and K^T [B, Hkv, DP, Skv8]: 4 |Q| (or none) + 3 |K| floats
  // (padded), and as much again for the small parts (X3); freed on the stream after the passes.
  const int64_t sq8 = round8(s.seq_q), skv8 = round8(s.seq_kv);
  const CopySizes cs = copy_sizes(s, DP, dkv_wgmma);
  const size_t nq = cs.q, nqt = cs.qt, nk = cs.k;
  const size_t part = cs.backward_part();
  // (+ 4: the persistent pair kernels' two block counters, BlockQueue; BackwardPlan::workspace
  // sized a.copies for all of it)
  // The counters (walking only) zeroed before the side stream forks (below): its dK/dV pass may
  // use one.
  int* counters = reinterpret_cast<int*>(a.copies + (X3 ? 2 : 1) * part);
  if (walk) FLASHATTN_CUDA_CHECK(cudaMemsetAsync(counters, 0, 2 * sizeof(int), stream));
  struct Copies {
    float *q, *dout, *qt, *dot, *k, *v, *kt;
  };
  auto carve = [&](float* base) {
    Copies c;
    c.q = base;
    c.dout = c.q + nq;
    c.qt = c.dout + nq;
    c.dot = c.qt + nqt;
    c.k = c.dot + nqt;
    c.v = c.k + nk;
    c.kt = c.v + nk;
    return c;
  };
  const Copies big = carve(a.copies);
  const Copies small = X3 ? carve(a.copies + part) : Copies{};
  // One part's maps (row copies: boxes of the streaming pass's block_n rows): the dQ pass's streamed K, V, K^T; the dK/dV pass's streamed Q, dO, Q^T, dO^T
  // (none with the mma.sync dK/dV pass, which reads the caller's tensors).
  auto maps = [&](const Copies& c, CUtensorMap* dk, CUtensorMap* dv, CUtensorMap* dkt, CUtensorMap* kq,
                  CUtensorMap* kdo, CUtensorMap* kqt, CUtensorMap* kdot) {
    return (!dkv_wgmma || map_copy_rows<DP>(kq, c.q, s.batch, s.heads_q, s.seq_q, ck.block_n)) &&
           (!dkv_wgmma || map_copy_rows<DP>(kdo, c.dout, s.batch, s.heads_q, s.seq_q, ck.block_n)) &&
           (!dkv_wgmma || map_copy_cols<DP>(kqt, c.qt, s.batch, s.heads_q, sq8)) &&
           (!dkv_wgmma || map_copy_cols<DP>(kdot, c.dot, s.batch, s.heads_q, sq8)) &&
           map_copy_rows<DP>(dk, c.k, s.batch, s.heads_kv, s.seq_kv, cq.block_n) &&
           map_copy_rows<DP>(dv, c.v, s.batch, s.heads_kv, s.seq_kv, cq.block_n) &&
           map_copy_cols<DP>(dkt, c.kt, s.batch, s.heads_kv, skv8);
  };
  // Q, dO copies: only the wgmma dK/dV pass reads them. With convert_ctas > 0 they are written on
  // a side stream by that many CTAs (one per multiprocessor) while the dQ pass runs on the other
  // multiprocessors - the copies are memory-bound, the pass compute-bound, and the copies before
  // the passes were 8-20% of a call at S = 1k). `side` is destroyed (joined) on every path out of
  // this function, before the caller frees the workspace.
  std::optional<SideStream> side;
  if (dkv_wgmma) {
    const OperandJob oq{a.p.q, s.batch, s.heads_q, s.seq_q, big.q, big.qt, small.q, small.qt};
    const OperandJob odo{a.p.dout, s.batch, s.heads_q, s.seq_q, big.dout, big.dot, small.dout, small.dot};
    const int64_t units = oq.units() + odo.units();
    // (Not while a graph is being captured on either stream: a side stream still inside another
    // capture cannot join this one; side_stream_free.)
    const int convert = a.convert_ctas;
    if (convert > 0 && side_stream_free(stream)) {
      side.emplace(stream);
      // D = rowsum(dO O) first there, beside the K/V copies (both memory-bound; the copies alone
      // do not fill the memory system); the dQ pass waits for it at the mark.
      launch_preprocess(a, side->get());
      side->mark();
      const int ctas = static_cast<int>(std::min<int64_t>(convert, units));
      launch_tf32_operands_narrow(OperandJobs{{oq, odo}, 2, static_cast<int>(s.head_dim)}, DP, ctas, side->get());
    } else {
      for (const OperandJob& o : {oq, odo}) launch_tf32_operands(o, s.head_dim, DP, stream);
    }
  }
  if (!side) launch_preprocess(a, stream);
  launch_tf32_operands(OperandJob{a.p.k, s.batch, s.heads_kv, s.seq_kv, big.k, big.kt, small.k, small.kt}, s.head_dim,
                       DP, stream);
  launch_tf32_operands(OperandJob{a.p.v, s.batch, s.heads_kv, s.seq_kv, big.v, nullptr, small.v, nullptr}, s.head_dim,
                       DP, stream);
  // The copies' tensor maps (11 in tf32, 18 in 3xTF32) are encoded now, on the host while the GPU
  // runs the copies queued above, not before the first launch (the benchmark times a call from an
  // idle GPU: host work before the first launch is the call's time).
  bool ok = maps(big, &dq.tk, &dq.tv, &dq.tkt, &dkv.tq, &dkv.tdo, &dkv.tqt, &dkv.tdot);
  if constexpr (X3) ok = ok && maps(small, &dq.tks, &dq.tvs, &dq.tkts, &dkv.tqs, &dkv.tdos, &dkv.tqts, &dkv.tdots);
  if (!ok) throw Error(Status::Internal, "cuda float32 backward: tensor maps of the operand copies failed");
  if (side) side->wait_mark();  // D, before the dQ pass
  // The dK/dV pass reads none of the dQ pass's results: with the side stream it runs there after
  // the Q/dO copies, beside the dQ pass - its CTAs take the multiprocessors the copies and the dQ
  // pass's last blocks leave free, instead of waiting for the whole dQ pass. Without it, after the dQ
  // pass on `stream`.
  const cudaStream_t dkv_stream = side ? side->get() : stream;
  if constexpr (kPair) {
    // Fewer CTAs than blocks: each takes its next block from a counter (BlockQueue; zeroed above).
    dq.queue = pq.x < nq_blocks ? counters : nullptr;
    dkv.queue = pk.x < nk_blocks ? counters + 1 : nullptr;
    // (A kernel of its own per mode: one block per CTA with the block index known at compile time.)
    launch_checked(dq.queue ? dev::dq_tf32_sm90_pair_kernel<DP, X3, true> : dev::dq_tf32_sm90_pair_kernel<DP, X3, false>,
                   pq, cq.threads(), smem_bytes90_tf32_bwd(Pass::Dq, DP, true, X3), stream, dq,
                   "dq_tf32_sm90_pair kernel launch");
    launch_checked(dkv.queue ? dev::dkv_tf32_sm90_pair_kernel<DP, X3, true> : dev::dkv_tf32_sm90_pair_kernel<DP, X3, false>,
                   pk, ck.threads(), smem_bytes90_tf32_bwd(Pass::Dkv, DP, true, X3), dkv_stream, dkv,
                   "dkv_tf32_sm90_pair kernel launch");
  } else {
    launch_checked(dev::dq_tf32_sm90_kernel<DP>, grid_q, cq.threads(), smem_bytes90_tf32_bwd(Pass::Dq, DP, false),
                   stream, dq, "dq_tf32_sm90 kernel launch");
    if (!dkv_wgmma) {
      launch_dkv<DP, Math::Tf32>(a, stream);
      return;
    }
    launch_checked(dev::dkv_tf32_sm90_kernel<DP>, grid_k, ck.threads(), smem_bytes90_tf32_bwd(Pass::Dkv, DP, false),
                   dkv_stream, dkv, "dkv_tf32_sm90 kernel launch");
  }
  if (side) side->join();  // (the workspace is freed on `stream` after this)
}

template <int DP>
void launch_bwd_tf32_sm90(const BwdArgs& a, cudaStream_t stream) {
  if constexpr (tf32_bwd_pair(DP)) launch_bwd_f32_sm90<DP, false, true>(a, stream);
  else if (a.f32_pair) launch_bwd_f32_sm90<DP, false, true>(a, stream);
  else launch_bwd_f32_sm90<DP, false, false>(a, stream);
}

template <int DP>
void launch_bwd_3xtf32_sm90(const BwdArgs& a, cudaStream_t stream) {
  launch_bwd_f32_sm90<DP, true, true>(a, stream);
}

template <int DP, Half16 H, int V, bool XF>
void launch_dkv_sm90_variant(const BwdArgs& a, cudaStream_t stream) {
  const Shape& s = a.p.shape;
  constexpr TileConfig90 c = tile_config90(Pass::Dkv, DP, V);
  dev::Sm90BwdArgs args{};
  args.f = a;
  // (The order of dev::Sm90BwdArgs::seq_maps: Q, dO, K, V.)
  const MapOperand ops[4] = {{&a.p.q, s.heads_q, false, c.block_n, &args.tq},
                             {&a.p.dout, s.heads_q, false, c.block_n, &args.tdo},
                             {&a.p.k, s.heads_kv, true, c.block_m, &args.tk},
                             {&a.p.v, s.heads_kv, true, c.block_m, &args.tv}};
  args.seq_maps = make_maps16(ops, H, s, a.p.packing, a.seq_maps, stream, "cuda 16-bit sm_90a backward");
  // The head split (BackwardPlan::dkv_acc, either design): a CTA per query head, grid.y = Hq, and
  // the group's sums and counters.
  const dim3 grid(grid_blocks(s.seq_kv, c.block_m), static_cast<unsigned>(a.dkv_acc != nullptr ? s.heads_q : s.heads_kv),
                  static_cast<unsigned>(s.batch));
  args.dkv_acc = a.dkv_acc;
  args.dkv_acc_rows = a.dkv_acc_rows;
  args.dkv_locks = a.dkv_locks;
  if (a.dq_locks != nullptr) {
    // The ordered (deterministic) reduction: kernels without the per-entry step only (selection).
    if constexpr (!XF) {
      args.locks = a.dq_locks;
      args.lock_tiles = grid_blocks(s.seq_q, c.block_n);
      launch_checked(dev::dkv_sm90_kernel<DP, H, V, false, true>, grid, c.threads(), smem_bytes90(Pass::Dkv, DP, V, true),
                     stream, args, "dkv_sm90 (ordered dQ) kernel launch");
      return;
    }
    throw Error(Status::Internal, "dkv_sm90: the ordered dQ reduction has no kernel with the per-entry score step");
  }
  launch_checked(dev::dkv_sm90_kernel<DP, H, V, XF>, grid, c.threads(), smem_bytes90(Pass::Dkv, DP, V), stream, args,
                 "dkv_sm90 kernel launch");
}

// XF as launch_forward_sm90's.
template <int DP, Half16 H, bool XF>
void launch_dkv_sm90(const BwdArgs& a, cudaStream_t stream) {
  if constexpr (has_sm90_variant(Pass::Dkv, DP, 1)) {
    if (a.sm90_variant == 1) return launch_dkv_sm90_variant<DP, H, 1, XF>(a, stream);
  }
  launch_dkv_sm90_variant<DP, H, 0, XF>(a, stream);
}

#define FLASHATTN_INSTANTIATE_SM90_dkv(DP)                                                   \
  template void launch_dkv_sm90<DP, Half16::F16, false>(const BwdArgs&, cudaStream_t);      \
  template void launch_dkv_sm90<DP, Half16::BF16, false>(const BwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_dkv_xf(DP)                                                \
  template void launch_dkv_sm90<DP, Half16::F16, true>(const BwdArgs&, cudaStream_t);       \
  template void launch_dkv_sm90<DP, Half16::BF16, true>(const BwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_bwd_tf32(DP) template void launch_bwd_tf32_sm90<DP>(const BwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_bwd_3xtf32(DP) \
  template void launch_bwd_3xtf32_sm90<DP>(const BwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_forward_3xtf32(DP) \
  template void launch_forward_3xtf32_sm90<DP>(const FwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_forward_tf32(DP) template void launch_forward_tf32_sm90<DP>(const FwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_forward(DP)                                               \
  template void launch_forward_sm90<DP, Half16::F16, false>(const FwdArgs&, cudaStream_t);  \
  template void launch_forward_sm90<DP, Half16::BF16, false>(const FwdArgs&, cudaStream_t);

#define FLASHATTN_INSTANTIATE_SM90_forward_xf(DP)                                            \
  template void launch_forward_sm90<DP, Half16::F16, true>(const FwdArgs&, cudaStream_t);   \
  template void launch_forward_sm90<DP, Half16::BF16, true>(const FwdArgs&, cudaStream_t);

}  // namespace flashattn::cuda
