// The attention mask as arithmetic, shared by every backend and the reference (host and device).
//
// Key j is visible to query i when j <= i + offset, with offset 0 for causal top-left (the seed's
// rule) and Skv - Sq for causal bottom-right (FlashAttention's and PyTorch's causal_lower_right).
// With no mask every key is visible. Bottom-right with Sq > Skv leaves the first Sq - Skv rows with
// no visible key: they produce O = 0, LSE = -inf and no gradient.
#pragma once

#include <cstdint>

#include "core/host_device.hpp"

namespace flashattn {

struct MaskRule {
  bool causal;
  int64_t offset;  // key j visible to query i iff !causal || j <= i + offset

  FLASHATTN_HD bool visible(int64_t i, int64_t j) const { return !causal || j <= i + offset; }
  // Number of visible keys of row i among [0, seq_kv): keys [0, visible_end(i)).
  FLASHATTN_HD int64_t visible_end(int64_t i, int64_t seq_kv) const {
    if (!causal) return seq_kv;
    int64_t e = i + offset + 1;
    return e < 0 ? 0 : (e > seq_kv ? seq_kv : e);
  }
  // First query row that sees key j (rows before it do not): rows [first_row(j), seq_q).
  FLASHATTN_HD int64_t first_row(int64_t j, int64_t seq_q) const {
    if (!causal) return 0;
    int64_t r = j - offset;
    return r < 0 ? 0 : (r > seq_q ? seq_q : r);
  }
};

FLASHATTN_HD MaskRule make_mask_rule(int32_t mask, int64_t seq_q, int64_t seq_kv) {
  // 0 none, 1 causal top-left, 2 causal bottom-right (validated before this point)
  return MaskRule{mask != 0, mask == 2 ? seq_kv - seq_q : 0};
}

}  // namespace flashattn
