// The attention mask as arithmetic, shared by every backend and the reference (host and device).
//
// A mask is a diagonal band: key j is visible to query i when
//     i + lo <= j <= i + hi        (and 0 <= j < Skv)
// where the band's sides are offsets from the main diagonal. Every mask the library knows is such
// a band, so one rule answers "which keys does this query block see" (a contiguous key range, start
// AND end) and "which queries see this key block" for every kernel:
//   - none:                 lo = -inf, hi = +inf
//   - causal top-left:      hi = 0 (the seed's rule: key j visible to query i iff j <= i)
//   - causal bottom-right:  hi = Skv - Sq (FlashAttention's and PyTorch's causal_lower_right)
//   - a sliding window (left, right) around the bottom-right diagonal d = Skv - Sq, as
//     FlashAttention defines it: lo = d - left, hi = d + right (either side unbounded when < 0),
//     combined with causal by taking hi = min(hi, d).
// Unbounded sides are kUnbounded, far beyond any index so that i + lo and j - hi never overflow.
// Rows whose band holds no key in [0, Skv) (e.g. bottom-right with Sq > Skv: the first Sq - Skv
// rows) produce O = 0, LSE = -inf and no gradient, whatever the inputs hold.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace flashattn {

struct MaskRule {
  static constexpr int64_t kUnbounded = int64_t{1} << 60;
  int64_t lo;  // key j visible to query i iff lo <= j - i <= hi
  int64_t hi;

  FLASHATTN_HD bool bounded_above() const { return hi < kUnbounded; }  // later keys hidden (causal)
  FLASHATTN_HD bool bounded_below() const { return lo > -kUnbounded; }  // earlier keys hidden (window)
  FLASHATTN_HD bool visible(int64_t i, int64_t j) const { return j - i >= lo && j - i <= hi; }

  // Keys visible to row i: [key_begin(i), key_end(i, seq_kv)), possibly empty (begin >= end).
  FLASHATTN_HD int64_t key_begin(int64_t i) const { return clamp(i + lo, 0, kUnbounded); }
  FLASHATTN_HD int64_t key_end(int64_t i, int64_t seq_kv) const { return clamp(i + hi + 1, 0, seq_kv); }
  // Rows that see key j: [row_begin(j), row_end(j, seq_q)), possibly empty.
  FLASHATTN_HD int64_t row_begin(int64_t j) const { return clamp(j - hi, 0, kUnbounded); }
  FLASHATTN_HD int64_t row_end(int64_t j, int64_t seq_q) const { return clamp(j - lo + 1, 0, seq_q); }
  // Whether row i sees some key, and key j some row. The others' outputs are exact zeros whatever
  // the inputs hold (O = 0, LSE = -inf, dQ = 0; dK = dV = 0): emptiness is the band's, never the
  // values' (docs/ALGORITHM.md, "Non-finite inputs and empty rows").
  FLASHATTN_HD bool row_sees_keys(int64_t i, int64_t seq_kv) const { return key_begin(i) < key_end(i, seq_kv); }
  FLASHATTN_HD bool key_seen(int64_t j, int64_t seq_q) const { return row_begin(j) < row_end(j, seq_q); }
  // The same as ranges (the band's edges are monotone): rows [i, i + 1) with lo <= hi,
  // i + hi >= 0 and i + lo < seq_kv see a key, i.e. rows [live_rows_begin, live_rows_end); keys
  // j >= lo with j - hi < seq_q are seen, i.e. keys [live_keys_begin, live_keys_end). Both empty
  // when lo > hi, and when the other side has no entries (a packed batch's sequence without keys:
  // lo is unbounded without a window, so seq_kv - lo alone would call every row live). One compare per row against values uniform over a kernel (the CUDA epilogues).
  FLASHATTN_HD int64_t live_rows_begin(int64_t seq_q) const { return clamp(-hi, 0, seq_q); }
  FLASHATTN_HD int64_t live_rows_end(int64_t seq_q, int64_t seq_kv) const {
    return lo > hi || seq_kv <= 0 ? 0 : clamp(seq_kv - lo, 0, seq_q);
  }
  FLASHATTN_HD int64_t live_keys_begin(int64_t seq_kv) const { return clamp(lo, 0, seq_kv); }
  FLASHATTN_HD int64_t live_keys_end(int64_t seq_q, int64_t seq_kv) const {
    return lo > hi || seq_q <= 0 ? 0 : clamp(seq_q + hi, 0, seq_kv);
  }

  // The union over a block of rows [r0, r1) is one range (the band's edges are monotone in i):
  // keys [key_begin(r0), key_end(r1 - 1)); likewise rows [row_begin(k0), row_end(k1 - 1)) for
  // keys [k0, k1).
  // Whether every entry of rows [r0, r1) x keys [c0, c1) is visible by the band (bounds of the
  // sequences are the caller's): the tile's far corners lie inside it.
  FLASHATTN_HD bool tile_inside(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    return (c1 - 1) - r0 <= hi && c0 - (r1 - 1) >= lo;
  }

  // row_begin(j) clamped to seq_q as well (the sm_90a dK/dV kernels' per-key bound: cheaper in
  // registers there than the unclamped form).
  FLASHATTN_HD int64_t first_row(int64_t j, int64_t seq_q) const {
    const int64_t r = row_begin(j);
    return r > seq_q ? seq_q : r;
  }

  FLASHATTN_HD static int64_t clamp(int64_t x, int64_t a, int64_t b) { return x < a ? a : (x > b ? b : x); }
};

// mask: 0 none, 1 causal top-left, 2 causal bottom-right (validated before this point).
// window_left / window_right: FlashAttention's window_size, -1 = unbounded on that side.
FLASHATTN_HD MaskRule make_mask_rule(int32_t mask, int64_t seq_q, int64_t seq_kv, int64_t window_left = -1,
                                     int64_t window_right = -1) {
  const int64_t U = MaskRule::kUnbounded, d = seq_kv - seq_q;
  MaskRule r{-U, U};
  // A side beyond any index is unbounded: capped at U, d - left and i + hi cannot overflow.
  if (window_left >= 0) r.lo = d - (window_left < U ? window_left : U);
  if (window_right >= 0) r.hi = d + (window_right < U ? window_right : U);
  if (mask != 0) {
    const int64_t diag = mask == 2 ? d : 0;
    if (diag < r.hi) r.hi = diag;
  }
  return r;
}

}  // namespace flashattn
