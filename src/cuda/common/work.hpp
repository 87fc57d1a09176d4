// The CUDA kernels' work arithmetic, host and device: which tiles a CTA visits and which entries of
// a tile a lane keeps, all from the mask's band (core/mask.hpp). Every kernel iterates the tile
// range these functions give (tile of iteration it = t_begin + it) and masks with their per-row
// bounds, so the band (causal, a sliding window) is this file's concern, not the kernels'. (A
// packed batch's sequence is a dense call of its own to these: at_sequence, core/params.hpp.) (The score transform's per-entry step, softcap and ALiBi, changes
// values, never which entries are visible: it is no concern of this file.)
// Plain integer code (no device intrinsics): tests/cuda/test_work.cpp checks it on the host
// against a brute-force mask.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"
#include "core/mask.hpp"
#include "core/params.hpp"

// Fixed two-row loops fully unrolled on the device (their arrays stay in registers).
#if defined(__CUDA_ARCH__)
#define FLASHATTN_UNROLL _Pragma("unroll")
#else
#define FLASHATTN_UNROLL
#endif

namespace flashattn::cuda::dev {

// Division by a launch constant (a head count, a split count, a group size), made once on the
// host: n / d as a high multiply, an add and a shift (the round-up method: shift = ceil(log2 d),
// mul = floor(2^32 (2^shift - d) / d) + 1), exact for every n < 2^31 and 1 <= d < 2^31. A
// division by a runtime value is ~20 dependent instructions with a reciprocal on the device; the
// decoding kernel's prologue did eight before its first load (docs/perf-log/data/
// decode-b1-sass-h100-2026-12-06.md).
struct U32Div {
  uint32_t d = 1, mul = 0, shift = 0;
  static U32Div make(uint32_t d) {
    U32Div r;
    r.d = d < 1 ? 1 : d;
    while (r.shift < 31 && (uint32_t{1} << r.shift) < r.d) ++r.shift;
    r.mul = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << r.shift) - r.d)) / r.d + 1);
    return r;
  }
  FLASHATTN_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(n, mul);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(n) * mul) >> 32);
#endif
    return (hi + n) >> shift;
  }
  FLASHATTN_HD uint32_t mod(uint32_t n) const { return n - div(n) * d; }
};

// The band's lower edge (a window's left side) as the ranges below use it. Without a window the
// rule's lo is the constant -kUnbounded (make_mask_rule's default), so testing bounded_below()
// first lets the compiler drop that side's arithmetic altogether: the kernels of the masks without
// a window keep the code (and registers) they had before the band had a lower edge.
FLASHATTN_HD int64_t first_key(const MaskRule& rule, int64_t row) {  // key_begin(row)
  return rule.bounded_below() ? rule.key_begin(row) : 0;
}
FLASHATTN_HD int64_t end_row(const MaskRule& rule, int64_t key, int64_t seq_q) {  // row_end(key, seq_q)
  return rule.bounded_below() ? rule.row_end(key, seq_q) : seq_q;
}
// Whether the band holds a diagonal at all (lo > hi: a window left of a top-left causal diagonal).
FLASHATTN_HD bool band_empty(const MaskRule& rule) { return rule.bounded_below() && rule.lo > rule.hi; }

// Tiles [begin, begin + count) of bn entries each.
struct TileRange {
  int begin, count;
};
// The tiles of bn entries holding [first, end) (empty: count 0). (Written in the form of the
// range arithmetic before the band had a lower edge, a clamped start and a count, with one select
// for the empty case: the mma.sync kernels sit at ptxas' 255-register limit, where a branch here
// or an unclamped start measured up to 20 more spill bytes in the tile loops' kernels.)
FLASHATTN_HD TileRange tiles_of(int64_t first, int64_t end, int bn) {
  const int t0 = static_cast<int>((first < end ? first : end) / bn);
  const int n = static_cast<int>((end + bn - 1) / bn) - t0;
  return TileRange{t0, first < end ? n : 0};
}
// The key tiles holding every key that query rows [r0, r0 + rows) see: the band's edges are
// monotone in the row and consecutive rows' ranges overlap (a band at least one diagonal wide), so
// the union of the rows' ranges is [key_begin(r0), key_end(last row)). An empty band (lo > hi: a
// window left of a top-left causal diagonal) hides everything.
FLASHATTN_HD TileRange key_tiles(const MaskRule& rule, int64_t r0, int rows, int64_t seq_kv, int bn) {
  const int64_t end = rule.key_end(r0 + rows - 1, seq_kv);
  // No lower edge: from tile 0, the arithmetic of the kernels before windows (see tiles_of).
  if (!rule.bounded_below()) return TileRange{0, static_cast<int>((end + bn - 1) / bn)};
  if (band_empty(rule)) return TileRange{0, 0};
  return tiles_of(rule.key_begin(r0), end, bn);
}
// The query tiles holding every query that sees one of keys [k0, k0 + keys), likewise.
FLASHATTN_HD TileRange query_tiles(const MaskRule& rule, int64_t k0, int keys, int64_t seq_q, int bn) {
  if (band_empty(rule)) return TileRange{0, 0};
  return tiles_of(rule.row_begin(k0), end_row(rule, k0 + keys - 1, seq_q), bn);
}

// An absolute bound x (a key or query index) as a column of the tile of bn entries from n0,
// clamped to [0, bn].
FLASHATTN_HD int tile_col(int64_t x, int64_t n0, int bn) {
  const int64_t c = x - n0;
  return c < 0 ? 0 : (c > bn ? bn : static_cast<int>(c));
}

// ---- CTA work ranges ---------------------------------------------------------------------------
// A CTA of the forward or dQ pass: BM query rows of one (batch, head) and the BN-key tiles
// [t_begin, t_begin + ntiles) that hold every key the mask leaves visible to them (none: ntiles 0,
// the rows get O = 0, LSE = -inf, dQ = 0).
struct QueryBlock {
  int64_t b, h, hk;  // batch, query head, its kv head
  int64_t m0;        // first query row
  int rows;          // valid query rows (<= BM)
  int t_begin, ntiles;
  MaskRule rule;
  // The first key of iteration it (key tile t_begin + it).
  FLASHATTN_HD int64_t key0(int it, int bn) const { return static_cast<int64_t>(t_begin + it) * bn; }
  // Only key tiles that cross the sequence end or an edge of the mask's band need per-entry masking.
  FLASHATTN_HD bool tile_masked(int64_t n0, int bn, int64_t skv) const {
    return n0 + bn > skv || !rule.tile_inside(m0, m0 + rows, n0, n0 + bn);
  }
};
// Row block x of (b, h) in launch order (x = 0 starts first), bm rows, bn-key tiles.
FLASHATTN_HD QueryBlock query_block_at(const Shape& s, const MaskRule& rule, int64_t b, int64_t h, int64_t x, int bm,
                                       int bn) {
  QueryBlock q;
  q.b = b;
  q.h = h;
  q.hk = h / (s.heads_q / s.heads_kv);
  q.rule = rule;
  // Causal: the last query blocks see the most keys; start them first.
  const int64_t nx = (s.seq_q + bm - 1) / bm;
  if (x >= nx) {  // a packed batch's grid covers max_seqlen_q: past this sequence's rows, no work
    q.m0 = 0;
    q.rows = q.t_begin = q.ntiles = 0;
    return q;
  }
  const int64_t mb = rule.bounded_above() ? nx - 1 - x : x;
  q.m0 = mb * bm;
  q.rows = static_cast<int>(s.seq_q - q.m0 < bm ? s.seq_q - q.m0 : bm);
  const TileRange t = key_tiles(rule, q.m0, q.rows, s.seq_kv, bn);
  q.t_begin = t.begin;
  q.ntiles = t.count;
  return q;
}
template <int BM, int BN>
FLASHATTN_HD QueryBlock query_block(const Shape& s, const Numerics& n, int64_t b, int64_t h, int64_t x) {
  return query_block_at(s, mask_rule(s, n), b, h, x, BM, BN);
}

// A forward CTA walking several row blocks (the sm_90a 16-bit forward, ForwardPlan::walk_ctas):
// the blocks of the grid it replaces, (x, head, batch), in units of two: row blocks x = p and
// nx - 1 - p of one (head, batch), whose key tiles add up to the same count for every p under
// any band whose edges move with the row (none, causal, windows: the count is linear in x up to
// the clamps), so units cost alike and a static order balances: CTA c does units c, c + G,
// c + 2G, ... (G = gridDim.x), no counter to zero per call. Units go p fastest, then head, then
// batch - the order the hardware would launch the blocks in, so the CTAs running at once share a
// head's K and V in L2. The CTA's next block's Q and first K/V tiles are copied while this
// block's last products and epilogue run (D <= 128; at D = 256 K_0 only): the pipeline is filled
// once per CTA, not per block.
struct FwdWalk {
  int64_t nx = 0, ny = 0, nz = 0;  // the grid walked; nx = 0: none (CTA = blockIdx)
  FLASHATTN_HD int64_t units() const { return (nx + 1) / 2 * ny * nz; }
  // Block `half` (0, 1) of unit u as the grid's (x, y, z); false: the unit has one block (the
  // middle one of an odd nx).
  FLASHATTN_HD bool at(int64_t u, int half, int64_t* x, int64_t* y, int64_t* z) const {
    const int64_t nu = (nx + 1) / 2, p = u % nu, col = u / nu;
    *y = col % ny;
    *z = col / ny;
    *x = half == 0 ? p : nx - 1 - p;
    return half == 0 || nx - 1 - p != p;
  }
};

// A CTA of the dK/dV pass: BM key rows of one (batch, kv head) and, for each query head of its
// group, the BN-query tiles [t_begin, t_end) that hold every query seeing those keys. Iteration x
// (in [0, ntiles)) is query tile t_begin + x % per_head of query head hk * G + x / per_head.
struct KeyBlock {
  int64_t b, hk;  // batch, kv head
  int64_t m0;     // first key row
  int rows;       // valid key rows (<= BM)
  int t_begin, t_end, per_head, ntiles;
  int64_t group;  // query heads per kv head
  int64_t head0;  // the first query head walked (hk * group; one_head() narrows the walk)
  MaskRule rule;
  FLASHATTN_HD int64_t head(int x) const { return head0 + x / per_head; }
  // The walk over query head h of the group only (the ordered backward's head split).
  FLASHATTN_HD void one_head(int64_t h) {
    head0 = h;
    ntiles = per_head;
  }
  FLASHATTN_HD int64_t q0(int x, int bn) const { return static_cast<int64_t>(t_begin + x % per_head) * bn; }
  // Fully visible when in range and inside the mask's band.
  FLASHATTN_HD bool tile_masked(int64_t n0, int bn, int bm, int64_t sq, int64_t skv) const {
    return n0 + bn > sq || m0 + bm > skv || !rule.tile_inside(n0, n0 + bn, m0, m0 + bm);
  }
};
FLASHATTN_HD KeyBlock key_block_at(const Shape& s, const MaskRule& rule, int64_t b, int64_t hk, int64_t x, int bm,
                                   int bn) {
  KeyBlock k;
  k.b = b;
  k.hk = hk;
  k.group = s.heads_q / s.heads_kv;
  k.rule = rule;
  k.m0 = x * bm;
  k.rows = static_cast<int>(s.seq_kv - k.m0 < bm ? s.seq_kv - k.m0 : bm);  // <= 0: past a packed sequence
  const TileRange t = query_tiles(rule, k.m0, k.rows, s.seq_q, bn);
  k.t_begin = t.begin;
  k.t_end = t.begin + t.count;
  k.per_head = t.count;
  k.ntiles = static_cast<int>(k.group) * k.per_head;
  k.head0 = hk * k.group;
  return k;
}
template <int BM, int BN>
FLASHATTN_HD KeyBlock key_block(const Shape& s, const Numerics& n, int64_t b, int64_t hk, int64_t x) {
  return key_block_at(s, mask_rule(s, n), b, hk, x, BM, BN);
}

// The ordered (deterministic) dQ reduction's turns (sm90/dkv16.cuh, ORD; docs/ALGORITHM.md):
// key block kx's place among the key blocks that add into one entry of its walk list (a query
// head's query tile), 0 first. Highest first (any band): the blocks that see the tile are the
// range kt of key_tiles() and go from its last down, each a step after the one above it reached
// the tile. Rotated (no mask: all nk blocks see every one of the list's entries, and block y
// starts its walk at entry y * step, so it reaches entry x at step (x - y step) mod entries):
// arrival order, y0 = min(x / step, nk - 1) down to 0, then nk - 1 down to y0 + 1.
FLASHATTN_HD int turn_highest_first(const TileRange& kt, int64_t kx) {
  return static_cast<int>(kt.begin + kt.count - 1 - kx);
}
FLASHATTN_HD int turn_rotated(int x, int64_t kx, int nk, int step) {
  const int y0 = x / step < nk - 1 ? x / step : nk - 1;
  const int d = y0 - static_cast<int>(kx);
  return d < 0 ? d + nk : d;
}
// The rotation's step (entries between consecutive blocks' starts; any step with
// step * nk <= entries gives the arrival order above). Two, not entries / nk: an entry's nk adds
// then come within 2 * nk steps of each other, so a group of key blocks keeps about 2 * nk dQ
// tiles live in L2 instead of its whole walk list - under GQA that list is every query head of
// the group (G x the tiles): spread over it, the float32 accumulator left L2 (H100: 0.53-0.72x
// the default backward at D = 128, GQA 4 and 8). Two tiles apart are still distinct addresses,
// and give each handoff (fence, count, poll) two tiles' time.
FLASHATTN_HD int rotation_step(int entries, int nk) {
  const int spread = entries / nk;
  return spread < 2 ? spread : 2;
}

// The persistent kernels' work list (the pair kernels): item i of nx row blocks x heads x batch
// is row block i % nx of head i / nx % heads, batch i / (nx heads) - the order of the
// non-persistent grid (row blocks fastest), so that the CTAs running at one time work on the
// blocks of one or two heads and share their streamed tiles in L2. (Row blocks slowest, all
// heads at once, measured 10-30% slower at D = 128: every CTA streamed other K and V tiles.)
struct WorkItem {
  int64_t b, h, x;
};
FLASHATTN_HD WorkItem work_item(int64_t i, int64_t nx, int64_t heads) {
  const int64_t hb = i / nx;
  return WorkItem{hb / heads, hb % heads, i % nx};
}

// ---- per-lane bounds ---------------------------------------------------------------------------
// The keys visible to a lane's two query rows (row0 and row0 + 8, the m16 accumulator layout):
// [lo[r], hi[r]), none for a row at or past Sq. The kernels that mask by bounds instead of keep()
// (the sm_90a forwards and the float32 sm_90a dQ passes) take the tile-relative form.
struct RowKeys {
  int64_t lo[2], hi[2];
  bool lower;  // the band has a lower edge (a constant without a window: see first_key)
  FLASHATTN_HD RowKeys(const MaskRule& rule, int64_t row0, int64_t sq, int64_t skv) : lower(rule.bounded_below()) {
FLASHATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + 8 * r;
      lo[r] = first_key(rule, row);
      hi[r] = row < sq ? rule.key_end(row, skv) : 0;
    }
  }
  // The visible columns [c0[r], c1[r]) of the tile of bn keys from n0 (c0 = 0 without a lower
  // edge: the compiler then drops the test c < c0).
  FLASHATTN_HD void tile_cols(int64_t n0, int bn, int (&c0)[2], int (&c1)[2]) const {
FLASHATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
      c0[r] = lower ? tile_col(lo[r], n0, bn) : 0;
      c1[r] = tile_col(hi[r], n0, bn);
    }
  }
};

// The queries that see a lane's two key rows (key0 and key0 + 8) in the sm_90a dK/dV kernels:
// [q_lo[r], q_hi[r]), none for a key at or past Skv; per query tile they become tile-relative
// bounds [lo, hi) of the S^T columns kept.
struct KeyRowQueries {
  int64_t q_lo[2], q_hi[2];
  FLASHATTN_HD KeyRowQueries(const MaskRule& rule, int64_t key0, int64_t sq, int64_t skv) {
FLASHATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int64_t key = key0 + 8 * r;
      q_lo[r] = rule.first_row(key, sq);
      q_hi[r] = key < skv ? end_row(rule, key, sq) : 0;
    }
  }
  // The bounds in the tile of bn queries from n0 (all columns when the tile is not masked).
  FLASHATTN_HD void tile_bounds(int64_t n0, int bn, bool masked, int (&lo)[2], int (&hi)[2]) const {
FLASHATTN_UNROLL
    for (int r = 0; r < 2; ++r) {
      lo[r] = 0;
      hi[r] = bn;
      if (masked) {
        lo[r] = tile_col(q_lo[r], n0, bn);
        hi[r] = tile_col(q_hi[r], n0, bn);
      }
    }
  }
};

}  // namespace flashattn::cuda::dev
