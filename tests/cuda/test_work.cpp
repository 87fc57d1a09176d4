// The CUDA kernels' work arithmetic (src/cuda/common/work.hpp) on the host, against a brute-force
// mask written out from its definition: the key tiles a query block visits and the query tiles a
// key block visits (exactly the tiles holding a visible entry, none for a block that sees nothing),
// which tiles skip per-entry masking (only those whose every entry is visible), the per-lane
// column bounds that mask the others (exactly the visible entries), and which rows and keys have no
// visible entry at all, and the ordered dQ reduction's turns (a model of the blocks taking them:
// arrival order, no deadlock). Masks none, causal top-left
// and bottom-right, sliding windows with and without causal, Sq != Skv, tiles of 16 to 128.
// Host code only: runs in CI.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "cuda/common/work.hpp"

namespace flashattn::cuda::dev {
namespace {

struct Band {
  int32_t mask;          // 0 none, 1 causal top-left, 2 causal bottom-right
  int64_t left, right;   // window sizes (FlashAttention's window_size), -1 = unbounded
};

// Key j visible to query i, from the definitions (not from MaskRule): causal top-left j <= i,
// bottom-right j <= i + Skv - Sq; a window keeps i + d - left <= j <= i + d + right around the
// bottom-right diagonal d = Skv - Sq.
bool ref_visible(const Band& m, int64_t sq, int64_t skv, int64_t i, int64_t j) {
  if (i < 0 || i >= sq || j < 0 || j >= skv) return false;
  const int64_t d = skv - sq;
  if (m.mask == 1 && j > i) return false;
  if (m.mask == 2 && j > i + d) return false;
  if (m.left >= 0 && j < i + d - m.left) return false;
  if (m.right >= 0 && j > i + d + m.right) return false;
  return true;
}

// The visibility of one problem with rectangle counts (2-d prefix sums; nothing outside
// [0, Sq) x [0, Skv) is visible).
class Grid {
 public:
  Grid(const Band& m, int64_t sq, int64_t skv) : sq_(sq), skv_(skv), r_(sq), c_(skv) {
    vis_.assign(r_ * c_, 0);
    sum_.assign((r_ + 1) * (c_ + 1), 0);
    for (int64_t i = 0; i < r_; ++i)
      for (int64_t j = 0; j < c_; ++j) vis_[i * c_ + j] = ref_visible(m, sq, skv, i, j);
    for (int64_t i = 0; i < r_; ++i)
      for (int64_t j = 0; j < c_; ++j)
        sum_[(i + 1) * (c_ + 1) + j + 1] =
            vis_[i * c_ + j] + sum_[i * (c_ + 1) + j + 1] + sum_[(i + 1) * (c_ + 1) + j] - sum_[i * (c_ + 1) + j];
  }
  bool at(int64_t i, int64_t j) const { return i >= 0 && i < r_ && j >= 0 && j < c_ && vis_[i * c_ + j] != 0; }
  // Visible entries of rows [i0, i1) x keys [j0, j1).
  int64_t count(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    auto cl = [](int64_t x, int64_t n) { return x < 0 ? 0 : (x > n ? n : x); };
    i0 = cl(i0, r_), i1 = cl(i1, r_), j0 = cl(j0, c_), j1 = cl(j1, c_);
    auto s = [&](int64_t i, int64_t j) { return sum_[i * (c_ + 1) + j]; };
    return s(i1, j1) - s(i0, j1) - s(i1, j0) + s(i0, j0);
  }
  // The first and last key seen by rows [i0, i1), or query seeing keys [j0, j1); {-1, -1} for none.
  std::pair<int64_t, int64_t> keys_of_rows(int64_t i0, int64_t i1) const {
    int64_t lo = -1, hi = -1;
    for (int64_t j = 0; j < skv_; ++j)
      if (count(i0, i1, j, j + 1) > 0) {
        if (lo < 0) lo = j;
        hi = j;
      }
    return {lo, hi};
  }
  std::pair<int64_t, int64_t> rows_of_keys(int64_t j0, int64_t j1) const {
    int64_t lo = -1, hi = -1;
    for (int64_t i = 0; i < sq_; ++i)
      if (count(i, i + 1, j0, j1) > 0) {
        if (lo < 0) lo = i;
        hi = i;
      }
    return {lo, hi};
  }

 private:
  int64_t sq_, skv_, r_, c_;
  std::vector<char> vis_;
  std::vector<int64_t> sum_;
};

constexpr int64_t kSizes[] = {1, 7, 16, 17, 64, 65, 100, 129, 200, 300};
constexpr Band kBands[] = {
    {0, -1, -1}, {1, -1, -1}, {2, -1, -1},  // none, causal top-left, causal bottom-right
    {0, 0, 0},   {0, 5, 3},   {0, 16, 0},   {0, 70, -1}, {0, -1, 40}, {0, 130, 2},  // windows
    {1, 5, 3},   {1, 70, -1}, {2, 0, 0},    {2, 16, -1}, {2, 1, 1},   {2, 130, 2},  // windows and causal
};
// (block rows, streamed tile) pairs: the kernels' and some odd ones.
constexpr int kTiles[][2] = {{16, 16}, {64, 32}, {128, 64}, {64, 128}, {128, 128}, {48, 80}, {192, 16}};

std::string what(const Band& m, int64_t sq, int64_t skv, int bm, int bn) {
  return "mask " + std::to_string(m.mask) + " window (" + std::to_string(m.left) + ", " + std::to_string(m.right) +
         ") Sq " + std::to_string(sq) + " Skv " + std::to_string(skv) + " tiles " + std::to_string(bm) + "/" +
         std::to_string(bn);
}

// Runs f(band, rule, sq, skv, grid) over every problem of the grid above.
template <class F>
void for_each_problem(F&& f) {
  for (const Band& m : kBands)
    for (int64_t sq : kSizes)
      for (int64_t skv : kSizes) {
        const MaskRule rule = make_mask_rule(m.mask, sq, skv, m.left, m.right);
        const Grid grid(m, sq, skv);
        f(m, rule, sq, skv, grid);
      }
}

TEST(CudaWork, QueryBlocksVisitExactlyTheKeyTilesTheirRowsSee) {
  for_each_problem([](const Band& m, const MaskRule& rule, int64_t sq, int64_t skv, const Grid& grid) {
    const Shape s{1, 4, 2, sq, skv, 64};
    for (const auto& tile : kTiles) {
      const int bm = tile[0], bn = tile[1];
      const std::string w = what(m, sq, skv, bm, bn);
      const int64_t nx = (sq + bm - 1) / bm;
      std::set<int64_t> starts;
      for (int64_t x = 0; x < nx; ++x) {
        const QueryBlock qb = query_block_at(s, rule, 0, 3, x, bm, bn);
        ASSERT_EQ(qb.hk, 1) << w;
        ASSERT_EQ(qb.m0 % bm, 0) << w;
        ASSERT_EQ(qb.rows, std::min<int64_t>(bm, sq - qb.m0)) << w;
        starts.insert(qb.m0);
        // The tile range: exactly from the first to the last tile holding a visible key.
        const auto [k_lo, k_hi] = grid.keys_of_rows(qb.m0, qb.m0 + qb.rows);
        if (k_lo < 0) {
          ASSERT_EQ(qb.ntiles, 0) << w << " block " << qb.m0;
        } else {
          ASSERT_EQ(qb.t_begin, k_lo / bn) << w << " block " << qb.m0;
          ASSERT_EQ(qb.t_begin + qb.ntiles - 1, k_hi / bn) << w << " block " << qb.m0;
        }
        for (int it = 0; it < qb.ntiles; ++it) {
          const int64_t n0 = qb.key0(it, bn);
          ASSERT_EQ(n0, static_cast<int64_t>(qb.t_begin + it) * bn) << w;
          // Unmasked exactly when every entry of the tile (the block's valid rows) is visible.
          const bool full = grid.count(qb.m0, qb.m0 + qb.rows, n0, n0 + bn) == static_cast<int64_t>(qb.rows) * bn;
          ASSERT_EQ(qb.tile_masked(n0, bn, skv), !full) << w << " block " << qb.m0 << " tile " << n0;
          // The per-lane bounds of every row of the block (r = 0 and r = 1 of RowKeys; rows past
          // Sq see nothing): exactly the visible keys.
          for (int64_t i = qb.m0; i < qb.m0 + bm; ++i)
            for (int r = 0; r < 2; ++r) {
              const RowKeys keys(rule, i - 8 * r, sq, skv);
              int lo[2], hi[2];
              keys.tile_cols(n0, bn, lo, hi);
              for (int c = 0; c < bn; ++c)
                ASSERT_EQ(c >= lo[r] && c < hi[r], grid.at(i, n0 + c)) << w << " row " << i << " key " << n0 + c;
            }
        }
      }
      ASSERT_EQ(static_cast<int64_t>(starts.size()), nx) << w << ": every row block once";
    }
  });
}

TEST(CudaWork, KeyBlocksVisitExactlyTheQueryTilesThatSeeTheirKeys) {
  for_each_problem([](const Band& m, const MaskRule& rule, int64_t sq, int64_t skv, const Grid& grid) {
    const int64_t group = 3;
    const Shape s{1, 2 * group, 2, sq, skv, 64};
    for (const auto& tile : kTiles) {
      const int bm = tile[0], bn = tile[1];
      const std::string w = what(m, sq, skv, bm, bn);
      const int64_t nx = (skv + bm - 1) / bm;
      for (int64_t x = 0; x < nx; ++x) {
        const KeyBlock kb = key_block_at(s, rule, 0, 1, x, bm, bn);
        ASSERT_EQ(kb.m0, x * bm) << w;
        ASSERT_EQ(kb.rows, std::min<int64_t>(bm, skv - kb.m0)) << w;
        ASSERT_EQ(kb.per_head, kb.t_end - kb.t_begin) << w;
        ASSERT_EQ(kb.ntiles, group * kb.per_head) << w;
        const auto [q_lo, q_hi] = grid.rows_of_keys(kb.m0, kb.m0 + kb.rows);
        if (q_lo < 0) {
          ASSERT_EQ(kb.ntiles, 0) << w << " block " << kb.m0;
        } else {
          ASSERT_EQ(kb.t_begin, q_lo / bn) << w << " block " << kb.m0;
          ASSERT_EQ(kb.t_end - 1, q_hi / bn) << w << " block " << kb.m0;
        }
        // The iterations enumerate (query head of the group, query tile) once each.
        std::set<std::pair<int64_t, int64_t>> seen;
        for (int it = 0; it < kb.ntiles; ++it) {
          const int64_t h = kb.head(it), n0 = kb.q0(it, bn);
          ASSERT_TRUE(h >= group && h < 2 * group) << w;
          ASSERT_TRUE(n0 % bn == 0 && n0 / bn >= kb.t_begin && n0 / bn < kb.t_end) << w;
          seen.insert({h, n0});
          const bool full = grid.count(n0, n0 + bn, kb.m0, kb.m0 + bm) == static_cast<int64_t>(bn) * bm;
          ASSERT_EQ(kb.tile_masked(n0, bn, bm, sq, skv), !full) << w << " block " << kb.m0 << " tile " << n0;
          if (it >= kb.per_head) continue;  // the other heads' tiles: the same bounds
          for (int64_t j = kb.m0; j < kb.m0 + bm; ++j)
            for (int r = 0; r < 2; ++r) {
              const KeyRowQueries kq(rule, j - 8 * r, sq, skv);
              int lo[2], hi[2];
              kq.tile_bounds(n0, bn, true, lo, hi);
              for (int c = 0; c < bn; ++c)
                ASSERT_EQ(c >= lo[r] && c < hi[r], grid.at(n0 + c, j)) << w << " key " << j << " query " << n0 + c;
              kq.tile_bounds(n0, bn, false, lo, hi);
              ASSERT_TRUE(lo[r] == 0 && hi[r] == bn) << w;
            }
        }
        ASSERT_EQ(static_cast<int64_t>(seen.size()), kb.ntiles) << w;
      }
    }
  });
}

// The ranges of rows that see nothing: bottom-right with Sq > Skv (the first Sq - Skv rows), and
// keys nobody sees (top-left with Skv > Sq): no tiles, so the kernels write O = 0, LSE = -inf and
// zero dK, dV there.
TEST(CudaWork, BlocksThatSeeNothingVisitNoTiles) {
  const Shape s{1, 1, 1, 300, 100, 64};
  const MaskRule br = make_mask_rule(2, 300, 100);
  // 64-row blocks in launch order 4, 3, 2, 1, 0: rows from 200 on see keys.
  for (int64_t x = 0; x < 5; ++x) {
    const QueryBlock qb = query_block_at(s, br, 0, 0, x, 64, 64);
    EXPECT_EQ(qb.m0, (4 - x) * 64);
    EXPECT_EQ(qb.ntiles, x == 0 ? 2 : x == 1 ? 1 : 0) << x;  // rows 256-299: keys [0, 100); 192-255: [0, 56)
  }
  const Shape t{1, 1, 1, 100, 300, 64};
  const MaskRule tl = make_mask_rule(1, 100, 300);
  EXPECT_EQ(key_block_at(t, tl, 0, 0, 1, 64, 64).ntiles, 1);  // keys [64, 128): queries [64, 100)
  for (int64_t x = 2; x < 5; ++x) EXPECT_EQ(key_block_at(t, tl, 0, 0, x, 64, 64).ntiles, 0);
  // The template forms (the kernels', from the call's numerics) agree with the run-time ones.
  auto numerics = [](Mask m) {
    Numerics n{};
    n.mask = m;
    n.window_left = n.window_right = -1;
    return n;
  };
  const QueryBlock a = query_block<64, 32>(s, numerics(Mask::CausalBottomRight), 0, 0, 1);
  const QueryBlock b = query_block_at(s, br, 0, 0, 1, 64, 32);
  EXPECT_TRUE(a.m0 == b.m0 && a.t_begin == b.t_begin && a.ntiles == b.ntiles);
  const KeyBlock c = key_block<64, 32>(t, numerics(Mask::CausalTopLeft), 0, 0, 1);
  const KeyBlock d = key_block_at(t, tl, 0, 0, 1, 64, 32);
  EXPECT_TRUE(c.m0 == d.m0 && c.t_begin == d.t_begin && c.ntiles == d.ntiles);
}

// The rows that see some key and the keys some row sees, as the epilogues take them
// (MaskRule::live_rows_begin / _end, live_keys_begin / _end: one range each, uniform over a
// kernel) and as the CPU kernels and the reference do (row_sees_keys, key_seen): exactly those of
// the brute-force mask. They decide which outputs are written as exact zeros, whatever the inputs.
TEST(CudaWork, RowsWithoutKeysAndKeysWithoutRows) {
  for_each_problem([](const Band& m, const MaskRule& rule, int64_t sq, int64_t skv, const Grid& grid) {
    const std::string w = what(m, sq, skv, 0, 0);
    for (int64_t i = 0; i < sq; ++i) {
      const bool sees = grid.count(i, i + 1, 0, skv) > 0;
      ASSERT_EQ(rule.row_sees_keys(i, skv), sees) << w << " row " << i;
      ASSERT_EQ(i >= rule.live_rows_begin(sq) && i < rule.live_rows_end(sq, skv), sees) << w << " row " << i;
    }
    for (int64_t j = 0; j < skv; ++j) {
      const bool seen = grid.count(0, sq, j, j + 1) > 0;
      ASSERT_EQ(rule.key_seen(j, sq), seen) << w << " key " << j;
      ASSERT_EQ(j >= rule.live_keys_begin(skv) && j < rule.live_keys_end(sq, skv), seen) << w << " key " << j;
    }
  });
}

// A packed batch's sequence may have queries and no keys (or keys and no queries): then no row is
// live (O = 0, LSE = -inf) and no key is seen, under every mask and window.
TEST(CudaWork, NoLiveRowsWithoutKeys) {
  for (int mask : {0, 1, 2})
    for (int64_t wl : {-1, 0, 5})
      for (int64_t wr : {-1, 0, 5}) {
        const MaskRule none_k = make_mask_rule(mask, 17, 0, wl, wr), none_q = make_mask_rule(mask, 0, 17, wl, wr);
        const std::string w = "mask " + std::to_string(mask) + " window (" + std::to_string(wl) + ", " + std::to_string(wr) + ")";
        EXPECT_LE(none_k.live_rows_end(17, 0), none_k.live_rows_begin(17)) << w;
        for (int64_t i = 0; i < 17; ++i) EXPECT_FALSE(none_k.row_sees_keys(i, 0)) << w;
        EXPECT_LE(none_q.live_keys_end(0, 17), none_q.live_keys_begin(17)) << w;
        for (int64_t j = 0; j < 17; ++j) EXPECT_FALSE(none_q.key_seen(j, 0)) << w;
      }
}

// A window narrows both ends of the range: the tiles before the band's lower edge are skipped
// (the forward and dQ start at t_begin > 0; dK/dV stop before the end of Sq).
TEST(CudaWork, WindowsSkipTilesOnBothSides) {
  const Shape s{1, 1, 1, 1024, 1024, 64};
  const MaskRule w = make_mask_rule(2, 1024, 1024, 100, 0);  // causal, 100 keys to the left
  const QueryBlock qb = query_block_at(s, w, 0, 0, 0, 128, 64);  // the last row block first
  EXPECT_EQ(qb.m0, 896);
  EXPECT_EQ(qb.t_begin, (896 - 100) / 64);
  EXPECT_EQ(qb.t_begin + qb.ntiles, 1024 / 64);
  const KeyBlock kb = key_block_at(s, w, 0, 0, 2, 128, 64);  // keys [256, 384): queries [256, 484)
  EXPECT_EQ(kb.t_begin, 256 / 64);
  EXPECT_EQ(kb.t_end, (383 + 100) / 64 + 1);
  // The kernels' template forms take the window from the call's numerics (mask_rule).
  Numerics n{};
  n.mask = Mask::CausalBottomRight;
  n.window_left = 100;
  n.window_right = 0;
  const QueryBlock qt = query_block<128, 64>(s, n, 0, 0, 0);
  EXPECT_TRUE(qt.t_begin == qb.t_begin && qt.ntiles == qb.ntiles);
  const KeyBlock kt = key_block<128, 64>(s, n, 0, 0, 2);
  EXPECT_TRUE(kt.t_begin == kb.t_begin && kt.t_end == kb.t_end && kt.ntiles == kb.ntiles);
}

// ---- the forward's walk (FwdWalk) ------------------------------------------------------------------
// G CTAs walking a grid (CTA c: both blocks of units c, c + G, ...) do every block exactly once, for
// any G, with the units in launch order (p fastest, then y, then z).
TEST(CudaWork, ForwardWalkDoesEveryBlockOnce) {
  const int64_t grids[][3] = {{1, 1, 1}, {8, 16, 2}, {17, 3, 5}, {1, 40, 1}, {129, 1, 1}, {2, 3, 1}};
  for (const auto& gd : grids) {
    const FwdWalk w{gd[0], gd[1], gd[2]};
    ASSERT_EQ(w.units(), (gd[0] + 1) / 2 * gd[1] * gd[2]);
    for (int64_t ctas : {int64_t{1}, int64_t{3}, int64_t{7}, w.units() - 1, w.units(), int64_t{132}}) {
      if (ctas < 1) continue;
      std::vector<int> seen(static_cast<size_t>(gd[0] * gd[1] * gd[2]), 0);
      for (int64_t c = 0; c < ctas; ++c)
        for (int64_t u = c; u < w.units(); u += ctas)
          for (int half = 0; half < 2; ++half) {
            int64_t x, y, z;
            if (!w.at(u, half, &x, &y, &z)) {
              EXPECT_EQ(half, 1);
              EXPECT_EQ(gd[0] % 2, 1) << "only an odd row of blocks has a unit of one";
              continue;
            }
            ASSERT_TRUE(x >= 0 && x < gd[0] && y >= 0 && y < gd[1] && z >= 0 && z < gd[2]);
            EXPECT_EQ(u, (half == 0 ? x : gd[0] - 1 - x) + (gd[0] + 1) / 2 * (y + gd[1] * z)) << "not the launch order";
            ++seen[static_cast<size_t>(x + gd[0] * (y + gd[1] * z))];
          }
      for (int n : seen) ASSERT_EQ(n, 1) << "grid " << gd[0] << "x" << gd[1] << "x" << gd[2] << ", " << ctas << " CTAs";
    }
  }
}

// Why a static order balances: the two blocks of a unit see key tiles adding up to the same count
// for every unit under each band of the forward (aside: units holding a block whose window is
// still filling at the first rows, and an odd row's middle block, a unit of its own), within one
// tile per block of rounding.
TEST(CudaWork, ForwardWalkUnitsCostAlike) {
  struct C {
    Band m;
    int64_t sq, skv;
  };
  const C cases[] = {{{0, -1, -1}, 4096, 4096}, {{1, -1, -1}, 4096, 4096}, {{2, -1, -1}, 4096, 4096},
                     {{2, -1, -1}, 2048, 4096}, {{2, 1024, -1}, 4096, 4096}, {{0, 1024, -1}, 4096, 4096},
                     {{0, 256, 256}, 4096, 4096}, {{1, -1, -1}, 1920, 1920}};
  for (const C& c : cases) {
    const Shape s{1, 1, 1, c.sq, c.skv, 128};
    const MaskRule rule = make_mask_rule(c.m.mask, s.seq_q, s.seq_kv, c.m.left, c.m.right);
    const FwdWalk w{(c.sq + 127) / 128, 1, 1};
    int lo = 1 << 30, hi = 0;
    for (int64_t u = 0; u < w.units(); ++u) {
      int tiles = 0;
      bool edge = false;
      for (int half = 0; half < 2; ++half) {
        int64_t x, y, z;
        if (!w.at(u, half, &x, &y, &z)) {
          edge = true;  // the middle block of an odd row alone: half a unit
          continue;
        }
        const QueryBlock qb = query_block_at(s, rule, 0, 0, x, 128, 128);
        tiles += qb.ntiles;
        // A window's left side is clamped at key 0 for the first rows: those units are cheaper.
        edge = edge || (rule.bounded_below() && rule.key_begin(qb.m0) <= 0);
      }
      if (edge) continue;
      lo = tiles < lo ? tiles : lo;
      hi = tiles > hi ? tiles : hi;
    }
    EXPECT_LE(hi - lo, 2) << "mask " << c.m.mask << " window (" << c.m.left << ", " << c.m.right << ") Sq "
                          << c.sq << " Skv " << c.skv << ": units of " << lo << ".." << hi << " tiles";
  }
}

// ---- the ordered dQ reduction's turns (turn_highest_first, turn_rotated) -------------------------
// A model of the sm_90a ordered pass: key blocks, launched in the given order into at most `slots`
// resident places (a finished block's place goes to the next one), walk their lists of entries;
// an entry takes `cost` ticks of work, the last of them adding into it when the entry's counter
// equals the block's turn (else the block waits there, tick by tick), which counts it. Returns the ticks until every block finished, or -1 when a tick
// passes in which no block could do anything (they all wait: a deadlock). `counters` ends with
// how many blocks added into each entry.
struct TurnBlock {
  std::vector<int> entry, turn;  // per step of the walk: the entry's counter and this block's place
  int cost = 1;
};
int64_t simulate_turns(const std::vector<TurnBlock>& launch, int n_entries, size_t slots, std::vector<int>& counters) {
  counters.assign(static_cast<size_t>(n_entries), 0);
  struct Live {
    size_t b, pos;
    int timer;
  };
  std::vector<Live> live;
  size_t next = 0, done = 0;
  for (int64_t tick = 0;; ++tick) {
    while (live.size() < slots && next < launch.size()) live.push_back({next, 0, launch[next].cost - 1}), ++next;
    if (done == launch.size()) return tick;
    bool moved = false;
    for (Live& l : live) {
      const TurnBlock& tb = launch[l.b];
      if (l.pos == tb.entry.size()) continue;  // (finished: leaves below)
      if (l.timer > 0) {
        --l.timer, moved = true;
        continue;
      }
      if (counters[tb.entry[l.pos]] != tb.turn[l.pos]) continue;  // waiting for its turn
      ++counters[tb.entry[l.pos]], ++l.pos, l.timer = tb.cost - 1, moved = true;
    }
    for (size_t i = 0; i < live.size();)
      if (live[i].pos == launch[live[i].b].entry.size()) live.erase(live.begin() + i), ++done, moved = true;
      else ++i;
    if (!moved && done < launch.size()) return -1;
  }
}

// Rotated turns: at every entry of the list a permutation of the blocks, in the order of the step
// at which each reaches it (block y starts at entry y * step).
TEST(CudaWork, RotatedTurnsAreTheArrivalOrder) {
  for (int nk = 1; nk <= 24; ++nk)
    for (int n = nk; n <= 3 * nk + 3; ++n)
      for (int step = 1; step <= n / nk; ++step)  // (any step with step * nk <= n; the kernel's: rotation_step)
      for (int x = 0; x < n; ++x) {
        std::vector<int> at(static_cast<size_t>(nk), -1);
        for (int k = 0; k < nk; ++k) {
          const int t = turn_rotated(x, k, nk, step);
          ASSERT_TRUE(t >= 0 && t < nk) << nk << " blocks, " << n << " entries";
          ASSERT_EQ(at[t], -1) << "two blocks at place " << t;
          at[t] = k;
        }
        auto arrival = [&](int k) { return ((x - k * step) % n + n) % n; };
        for (int t = 1; t < nk; ++t)
          ASSERT_LT(arrival(at[t - 1]), arrival(at[t])) << nk << " blocks, step " << step << ", entry " << x;
      }
}

// The rotated walk (no mask): with every block resident nobody ever waits (n ticks for n entries
// at one tick each); with uneven speeds it still finishes; with one place fewer than blocks it
// deadlocks - why the plan asks for all key blocks of a head to fit on the GPU at once.
TEST(CudaWork, RotatedWalkNeedsEveryBlockResident) {
  for (int nk : {1, 2, 3, 8, 13}) {
    for (int n : {nk, nk + 1, 2 * nk + 1, 4 * nk, 16 * nk + 5})
    for (int step : {1, rotation_step(n, nk), n / nk}) {
      std::vector<TurnBlock> launch;
      for (int k = nk - 1; k >= 0; --k) {  // (the kernel's launch order: highest key block first)
        TurnBlock tb;
        for (int it = 0; it < n; ++it) {
          const int x = (it + k * step) % n;
          tb.entry.push_back(x);
          tb.turn.push_back(turn_rotated(x, k, nk, step));
        }
        launch.push_back(tb);
      }
      std::vector<int> counters;
      EXPECT_EQ(simulate_turns(launch, n, static_cast<size_t>(nk), counters), n) << nk << " blocks, " << n << " entries";
      for (int c : counters) EXPECT_EQ(c, nk);
      for (size_t i = 0; i < launch.size(); ++i) launch[i].cost = 1 + static_cast<int>((i * 7 + 3) % 4);
      EXPECT_GT(simulate_turns(launch, n, static_cast<size_t>(nk), counters), 0) << nk << " blocks, uneven";
      if (nk > 1) EXPECT_EQ(simulate_turns(launch, n, static_cast<size_t>(nk - 1), counters), -1) << nk << " blocks";
    }
  }
}

// Highest first under every band of the grid: every block finishes whatever the number of
// resident places (one included) and speeds, and each (query head, query tile) counter ends at the
// number of key blocks that see it - a block only ever waits for blocks launched before it.
TEST(CudaWork, HighestFirstTurnsNeverDeadlock) {
  for_each_problem([](const Band& m, const MaskRule& rule, int64_t sq, int64_t skv, const Grid&) {
    const int64_t group = 2;
    const Shape s{1, 2 * group, 2, sq, skv, 64};
    for (const auto& tile : kTiles) {
      const int bm = tile[0], bn = tile[1];
      const int64_t nx = (skv + bm - 1) / bm, nq = (sq + bn - 1) / bn;
      std::vector<TurnBlock> launch;
      std::vector<int> expect(static_cast<size_t>(2 * group * nq), 0);
      for (int64_t x = nx - 1; x >= 0; --x) {
        const KeyBlock kb = key_block_at(s, rule, 0, 1, x, bm, bn);
        TurnBlock tb;
        tb.cost = 1 + static_cast<int>(x % 3);
        for (int it = 0; it < kb.ntiles; ++it) {
          const int64_t h = kb.head(it), n0 = kb.q0(it, bn);
          const int qrows = static_cast<int>(sq - n0 < bn ? sq - n0 : bn);
          const int e = static_cast<int>(h * nq + n0 / bn);
          tb.entry.push_back(e);
          tb.turn.push_back(turn_highest_first(key_tiles(rule, n0, qrows, skv, bm), x));
          ++expect[static_cast<size_t>(e)];
        }
        launch.push_back(tb);
      }
      for (size_t slots : {size_t{1}, size_t{2}, static_cast<size_t>(nx)}) {
        std::vector<int> counters;
        ASSERT_GE(simulate_turns(launch, static_cast<int>(expect.size()), slots, counters), 0)
            << what(m, sq, skv, bm, bn) << ", " << slots << " resident";
        ASSERT_EQ(counters, expect) << what(m, sq, skv, bm, bn);
      }
    }
  });
}

// The kernel's step: at most 2, at least 1, step * nk within the list (the arrival order above);
// and what it is for: at any step of the walk the entries some but not all blocks have added
// into (dQ tiles live in L2) number at most 2 * step * nk, however long the list - under GQA the
// list is G x longer, and with the step entries / nk they were most of it.
TEST(CudaWork, RotationStepKeepsFewEntriesLive) {
  for (int nk = 1; nk <= 40; ++nk)
    for (int n = nk; n <= 64 * nk; n += 1 + n / 8) {
      const int step = rotation_step(n, nk);
      EXPECT_GE(step, 1) << nk << " blocks, " << n << " entries";
      EXPECT_LE(step, 2) << nk << " blocks, " << n << " entries";
      EXPECT_LE(step * nk, n) << nk << " blocks, " << n << " entries";
      std::vector<int> first(static_cast<size_t>(n), n), last(static_cast<size_t>(n), -1);
      for (int x = 0; x < n; ++x)
        for (int k = 0; k < nk; ++k) {
          const int a = ((x - k * step) % n + n) % n;  // the step at which block k adds into x
          first[static_cast<size_t>(x)] = a < first[static_cast<size_t>(x)] ? a : first[static_cast<size_t>(x)];
          last[static_cast<size_t>(x)] = a > last[static_cast<size_t>(x)] ? a : last[static_cast<size_t>(x)];
        }
      int most = 0;
      for (int t = 0; t < n; ++t) {
        int live = 0;
        for (int x = 0; x < n; ++x) live += first[static_cast<size_t>(x)] <= t && t < last[static_cast<size_t>(x)];
        most = live > most ? live : most;
      }
      EXPECT_LE(most, 2 * step * nk) << nk << " blocks, " << n << " entries";
    }
}

// The launch-constant divisor (U32Div): n / d and n % d exactly as integer division, for every
// divisor up to 4096 against numerators at the edges (0, multiples of d and their neighbours, up
// to 2^31 - 1) and random ones, and for large divisors (powers of two and their neighbours).
TEST(CudaWork, LaunchConstantDivisionIsExact) {
  std::vector<uint32_t> divisors;
  for (uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int s = 12; s <= 30; ++s)
    for (int64_t e = -3; e <= 3; ++e) divisors.push_back(static_cast<uint32_t>((int64_t{1} << s) + e));
  divisors.push_back(0x7fffffffu);
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  auto next = [&] {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return static_cast<uint32_t>(rng & 0x7fffffffu);
  };
  int64_t checked = 0;
  for (uint32_t d : divisors) {
    const U32Div f = U32Div::make(d);
    std::vector<uint32_t> ns = {0, 1, d - 1, d, d + 1, 2 * d - 1, 0x7fffffffu, 0x7ffffffeu, 0x40000000u};
    for (uint32_t k : {3u, 7u, 1000u, 65535u}) {
      const uint64_t m = uint64_t{k} * d;
      if (m < 0x80000000ull) ns.push_back(static_cast<uint32_t>(m)), ns.push_back(static_cast<uint32_t>(m - 1));
    }
    for (int i = 0; i < 64; ++i) ns.push_back(next());
    for (uint32_t n : ns) {
      if (n > 0x7fffffffu) continue;
      ASSERT_EQ(f.div(n), n / d) << "n = " << n << ", d = " << d;
      ASSERT_EQ(f.mod(n), n % d) << "n = " << n << ", d = " << d;
      ++checked;
    }
  }
  EXPECT_GT(checked, 300000);
}

}  // namespace
}  // namespace flashattn::cuda::dev
