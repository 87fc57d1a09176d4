// A forward over one chunk of the keys (Numerics::kv_offset / kv_total: the CUDA fp32-mode forward
// at long key sequences) sees the whole sequence's band and ALiBi distances in its own key
// numbering: for every mask, window and chunk, key j' of the chunk is visible to row i exactly
// when key j' + offset is in the whole call, the row/key ranges the kernels iterate agree, and
// the ALiBi diagonal moves with the offset. (The kernels take the band only through mask_rule and
// ScoreTransform::make, core/params.hpp and core/score.hpp; their GPU results under chunks are
// checked in tests/cuda.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/mask.hpp"
#include "core/params.hpp"
#include "core/score.hpp"

namespace flashattn::test {
namespace {

TEST(KeyChunkBand, ChunksSeeTheWholeCallsBand) {
  struct W {
    int64_t left, right;
  };
  int64_t checked = 0;
  for (Mask mask : {Mask::None, Mask::CausalTopLeft, Mask::CausalBottomRight}) {
    for (const W w : {W{-1, -1}, W{5, 3}, W{0, 0}, W{40, -1}, W{-1, 7}, W{200, 0}}) {
      for (int64_t sq : {1, 17, 97, 300}) {
        for (int64_t skv : {1, 130, 300, 1000}) {
          for (int64_t chunk : {128, 256}) {
            Numerics n{};
            n.dtype = DType::Float32;
            n.scale = 0.125f;
            n.mask = mask;
            n.window_left = w.left;
            n.window_right = w.right;
            const Shape whole{1, 1, 1, sq, skv, 64};
            const MaskRule full = mask_rule(whole, n);
            const ScoreTransform full_st = ScoreTransform::make(whole, n);
            for (int64_t k0 = 0; k0 < skv; k0 += chunk) {
              Shape s = whole;
              s.seq_kv = std::min(chunk, skv - k0);
              Numerics c = n;
              c.kv_offset = k0;
              c.kv_total = skv;
              const MaskRule r = mask_rule(s, c);
              const std::string at = "mask " + std::to_string(static_cast<int>(mask)) + " window (" +
                                     std::to_string(w.left) + ", " + std::to_string(w.right) + ") Sq " +
                                     std::to_string(sq) + " Skv " + std::to_string(skv) + " chunk at " +
                                     std::to_string(k0);
              for (int64_t i = 0; i < sq; ++i) {
                bool any = false;
                for (int64_t j = 0; j < s.seq_kv; ++j) {
                  ASSERT_EQ(r.visible(i, j), full.visible(i, j + k0)) << at << " row " << i << " key " << j;
                  any |= r.visible(i, j);
                }
                // The ranges the kernels iterate: the row's keys in the chunk, and whether it has any.
                ASSERT_EQ(r.row_sees_keys(i, s.seq_kv), any) << at << " row " << i;
                const bool live = i >= r.live_rows_begin(sq) && i < r.live_rows_end(sq, s.seq_kv);
                ASSERT_EQ(live, any) << at << " row " << i;
                ++checked;
              }
              // ALiBi: -slope |j - i - diag| over the whole sequence's keys.
              const ScoreTransform st = ScoreTransform::make(s, c);
              ASSERT_EQ(st.diag + k0, full_st.diag) << at;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100000);
}

// Without an offset, nothing changes: the whole call's band and diagonal.
TEST(KeyChunkBand, DefaultsAreTheWholeCall) {
  Numerics n{};
  n.mask = Mask::CausalBottomRight;
  n.window_left = 10;
  n.window_right = -1;
  EXPECT_EQ(n.kv_offset, 0);
  EXPECT_EQ(n.kv_total, -1);
  const Shape s{1, 1, 1, 50, 80, 64};
  const MaskRule r = mask_rule(s, n), m = make_mask_rule(2, 50, 80, 10, -1);
  EXPECT_EQ(r.lo, m.lo);
  EXPECT_EQ(r.hi, m.hi);
  EXPECT_EQ(ScoreTransform::make(s, n).diag, 30);
}

}  // namespace
}  // namespace flashattn::test
