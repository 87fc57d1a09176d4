// KV-cache attention (flashattn_forward_kvcache / forward_kvcache) on the CPU: results against the
// float64 reference per sequence (testing::reference_kvcache, which appends and rotates from the
// definitions), the append itself (new rows written exactly, every other cache byte untouched),
// paged caches bitwise equal to contiguous ones, and refused inputs that write nothing, the
// caches included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"
#include "testing/reference.hpp"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

// One call: sizes, cache layout and options. Contents are a function of (seed, tensor, logical
// index), so two cases that differ only in the cache layout hold the same logical values.
struct KvCase {
  DType dtype = DType::Float32;
  int64_t B = 2, Sq = 1, Hq = 8, Hkv = 2, D = 64;
  int64_t s_new = 1;                // 0: no append
  std::vector<int32_t> seqlens;     // cache_seqlens before the append; empty: none (whole cache)
  int64_t S_cache = 64;             // contiguous cache length
  int64_t block_size = 0;           // > 0: paged, max_blocks pages per sequence
  int64_t max_blocks = 0;
  bool unused_pages_invalid = false;  // block_table entries past the used ones are -1
  bool batch_idx = false;           // sequence b in cache row B - b (B_cache = B + 1)
  std::vector<int32_t> leftpad;     // empty: none
  int64_t rotary_dim = 0;           // 0: no rotary
  bool interleaved = true;
  Mask mask = Mask::None;
  int64_t window_left = -1, window_right = -1;
  float softcap = 0.0f;
  bool alibi = false;
  int64_t q_pad = 0;                // extra elements per q / out sequence row (strided views)
  uint64_t seed = 1;
};

double value(uint64_t seed, uint64_t tensor, uint64_t index) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + tensor * 0xbf58476d1ce4e5b9ull + index * 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53 * 4 - 2;  // U(-2, 2)
}

Tensor view4(void* data, DType t, int64_t a, int64_t b, int64_t c, int64_t d, int64_t row_pad = 0) {
  Tensor r;
  r.data = data;
  r.dtype = t;
  r.ndim = 4;
  const int64_t sh[4] = {a, b, c, d};
  const int64_t st[4] = {b * (c * d + row_pad), c * d + row_pad, d, 1};
  for (int i = 0; i < 4; ++i) r.shape[i] = sh[i], r.stride[i] = st[i];
  return r;
}

// The buffers of a case (outputs NaN-poisoned), the views and the KvCache description.
struct Harness {
  KvCase c;
  int64_t Bc = 0, rows = 0, capacity = 0, num_blocks = 0;  // rows: dim 1 of the cache tensors
  std::vector<unsigned char> q, kc, vc, kn, vn, out, cos, sin;
  std::vector<float> lse, slopes;
  std::vector<int32_t> seqlens, bidx, leftpad, table;
  Tensor tq, tkc, tvc, tkn, tvn, tout, tlse, tcos, tsin, tsl, tbi, tlp, tbt, talibi;
  KvCache kv;
  Options opts;

  int64_t es() const { return dtype_size(c.dtype); }
  static void fill(std::vector<unsigned char>& buf, DType t, int64_t n, uint64_t seed, uint64_t tensor) {
    buf.assign(static_cast<size_t>(n * dtype_size(t)), 0);
    for (int64_t i = 0; i < n; ++i) testing::store_element(buf.data(), t, i, value(seed, tensor, i));
  }
  // Element offset of (sequence b, absolute cache row r, kv head h, d) in the cache tensors.
  int64_t cache_offset(int64_t b, int64_t r, int64_t h, int64_t d) const {
    if (c.block_size > 0) {
      const int64_t page = table[b * c.max_blocks + r / c.block_size];
      return ((page * c.block_size + r % c.block_size) * c.Hkv + h) * c.D + d;
    }
    const int64_t row = c.batch_idx ? bidx[b] : b;
    return ((row * c.S_cache + r) * c.Hkv + h) * c.D + d;
  }

  explicit Harness(const KvCase& kc_) : c(kc_) {
    const DType t = c.dtype;
    const int64_t qrow = c.Hq * c.D + c.q_pad;
    fill(q, t, c.B * c.Sq * qrow, c.seed, 1);
    out.assign(q.size(), 0);
    for (int64_t i = 0; i < c.B * c.Sq * qrow; ++i)
      testing::store_element(out.data(), t, i, std::numeric_limits<double>::quiet_NaN());
    tq = view4(q.data(), t, c.B, c.Sq, c.Hq, c.D, c.q_pad);
    tout = view4(out.data(), t, c.B, c.Sq, c.Hq, c.D, c.q_pad);
    lse.assign(static_cast<size_t>(c.B * c.Hq * c.Sq), std::numeric_limits<float>::quiet_NaN());
    tlse = Tensor::lse(lse.data(), c.B, c.Hq, c.Sq);

    // The cache: logical row r of sequence b holds value(seed, 2/3, ((b * cap + r) * Hkv + h) * D + d)
    // wherever the layout puts it; rows no sequence owns hold other values.
    if (c.block_size > 0) {
      capacity = c.block_size * c.max_blocks;
      num_blocks = c.B * c.max_blocks + 3;
      rows = c.block_size;
      Bc = num_blocks;
      // Pages handed out in a scrambled order: sequence b's block i is page (7 * (b * max_blocks + i) + 2) % num_blocks.
      std::vector<int32_t> perm(static_cast<size_t>(num_blocks));
      for (int64_t i = 0; i < num_blocks; ++i) perm[i] = static_cast<int32_t>(i);
      for (int64_t i = num_blocks - 1; i > 0; --i)
        std::swap(perm[i], perm[static_cast<int64_t>((value(c.seed, 9, i) + 2) / 4 * (i + 1)) % (i + 1)]);
      table.assign(static_cast<size_t>(c.B * c.max_blocks), 0);
      for (int64_t i = 0; i < c.B * c.max_blocks; ++i) table[i] = perm[i];
    } else {
      capacity = c.S_cache;
      Bc = c.batch_idx ? c.B + 1 : c.B;
      rows = c.S_cache;
      if (c.batch_idx)
        for (int64_t b = 0; b < c.B; ++b) bidx.push_back(static_cast<int32_t>(c.B - b));
    }
    const int64_t cache_n = Bc * rows * c.Hkv * c.D;
    fill(kc, t, cache_n, c.seed, 20);  // background: rows that no sequence owns
    fill(vc, t, cache_n, c.seed, 30);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t r = 0; r < capacity; ++r)
        for (int64_t h = 0; h < c.Hkv; ++h)
          for (int64_t d = 0; d < c.D; ++d) {
            const uint64_t li = static_cast<uint64_t>(((b * capacity + r) * c.Hkv + h) * c.D + d);
            testing::store_element(kc.data(), t, cache_offset(b, r, h, d), value(c.seed, 2, li));
            testing::store_element(vc.data(), t, cache_offset(b, r, h, d), value(c.seed, 3, li));
          }
    tkc = view4(kc.data(), t, Bc, rows, c.Hkv, c.D);
    tvc = view4(vc.data(), t, Bc, rows, c.Hkv, c.D);

    if (c.s_new > 0) {
      fill(kn, t, c.B * c.s_new * c.Hkv * c.D, c.seed, 4);
      fill(vn, t, c.B * c.s_new * c.Hkv * c.D, c.seed, 5);
      tkn = view4(kn.data(), t, c.B, c.s_new, c.Hkv, c.D);
      tvn = view4(vn.data(), t, c.B, c.s_new, c.Hkv, c.D);
      kv.k_new = &tkn;
      kv.v_new = &tvn;
    }
    if (!c.seqlens.empty()) {
      seqlens = c.seqlens;
      tsl = index_tensor(seqlens);
      kv.cache_seqlens = &tsl;
    }
    if (c.batch_idx) tbi = index_tensor(bidx), kv.cache_batch_idx = &tbi;
    if (!c.leftpad.empty()) leftpad = c.leftpad, tlp = index_tensor(leftpad), kv.cache_leftpad = &tlp;
    if (c.block_size > 0) {
      if (c.unused_pages_invalid)
        for (int64_t b = 0; b < c.B; ++b) {
          const int64_t used = (seqlens[b] + c.s_new + c.block_size - 1) / c.block_size;
          for (int64_t i = used; i < c.max_blocks; ++i) table[b * c.max_blocks + i] = -1;
        }
      tbt.data = table.data();
      tbt.dtype = DType::Int32;
      tbt.ndim = 2;
      tbt.shape[0] = c.B, tbt.shape[1] = c.max_blocks;
      tbt.stride[0] = c.max_blocks, tbt.stride[1] = 1;
      kv.block_table = &tbt;
    }
    if (c.rotary_dim > 0) {
      // Standard RoPE tables: angle pos * 10000^(-2i / rotary_dim), stored in the call's dtype.
      const int64_t half = c.rotary_dim / 2, S_ro = capacity + c.Sq;
      cos.assign(static_cast<size_t>(S_ro * half * es()), 0);
      sin.assign(cos.size(), 0);
      for (int64_t p = 0; p < S_ro; ++p)
        for (int64_t i = 0; i < half; ++i) {
          const double a = static_cast<double>(p) * std::pow(10000.0, -2.0 * static_cast<double>(i) / c.rotary_dim);
          testing::store_element(cos.data(), t, p * half + i, std::cos(a));
          testing::store_element(sin.data(), t, p * half + i, std::sin(a));
        }
      for (auto* x : {&tcos, &tsin}) {
        x->data = x == &tcos ? static_cast<void*>(cos.data()) : static_cast<void*>(sin.data());
        x->dtype = t;
        x->ndim = 2;
        x->shape[0] = S_ro, x->shape[1] = half;
        x->stride[0] = half, x->stride[1] = 1;
      }
      kv.rotary_cos = &tcos;
      kv.rotary_sin = &tsin;
      kv.rotary_interleaved = c.interleaved;
    }
    opts.mask = c.mask;
    opts.window_left = c.window_left;
    opts.window_right = c.window_right;
    opts.softcap = c.softcap;
    if (c.alibi) {
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.Hq; ++h)
          slopes.push_back(static_cast<float>(std::pow(2.0, -8.0 * (h + 1) / c.Hq) * (1 + 0.5 * b)));
      talibi.data = slopes.data();
      talibi.dtype = DType::Float32;
      talibi.ndim = 2;
      talibi.shape[0] = c.B, talibi.shape[1] = c.Hq;
      talibi.stride[0] = c.Hq, talibi.stride[1] = 1;
      opts.alibi_slopes = &talibi;
    }
  }

  void run() { forward_kvcache(tq, tkc, tvc, tout, tlse, kv, opts); }

  int32_t seqlen(int64_t b) const { return seqlens.empty() ? static_cast<int32_t>(capacity) : seqlens[b]; }
  int32_t start(int64_t b) const { return leftpad.empty() ? 0 : leftpad[b]; }

  // Every buffer, for "nothing was written" checks.
  std::vector<std::vector<unsigned char>> snapshot() const {
    std::vector<std::vector<unsigned char>> s = {q, kc, vc, kn, vn, out, cos, sin};
    s.emplace_back(reinterpret_cast<const unsigned char*>(lse.data()),
                   reinterpret_cast<const unsigned char*>(lse.data() + lse.size()));
    for (const auto* x : {&seqlens, &bidx, &leftpad, &table})
      s.emplace_back(reinterpret_cast<const unsigned char*>(x->data()),
                     reinterpret_cast<const unsigned char*>(x->data() + x->size()));
    return s;
  }
};

double tol_of(DType t) {
  switch (t) {
    case DType::Float64: return 1e-11;
    case DType::Float32: return 2e-5;
    case DType::Float16: return 4e-3;
    default: return 3e-2;
  }
}

// Runs the case and checks it against the reference: out and lse per sequence, the appended
// rows, and every other cache element bit for bit.
void check_case(const KvCase& kc) {
  Harness h(kc);
  const KvCase& c = h.c;
  const std::vector<unsigned char> kc0 = h.kc, vc0 = h.vc;
  ASSERT_NO_THROW(h.run());
  const DType t = c.dtype;
  const double scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.D)));
  std::vector<char> written(kc0.size() / h.es(), 0);
  testing::RefRotary rot;
  if (c.rotary_dim > 0) {
    const int64_t n = h.tcos.shape[0] * h.tcos.shape[1];
    for (int64_t i = 0; i < n; ++i) {
      rot.cos.push_back(testing::load_element(h.cos.data(), t, i));
      rot.sin.push_back(testing::load_element(h.sin.data(), t, i));
    }
    rot.rotary_dim = c.rotary_dim;
    rot.interleaved = c.interleaved;
    rot.round_to = t;
  }
  const int64_t qrow = c.Hq * c.D + c.q_pad;
  for (int64_t b = 0; b < c.B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    testing::RefKvcacheSeq s;
    s.heads_q = c.Hq, s.heads_kv = c.Hkv, s.seq_q = c.Sq, s.head_dim = c.D;
    for (int64_t hh = 0; hh < c.Hq; ++hh)
      for (int64_t i = 0; i < c.Sq; ++i)
        for (int64_t d = 0; d < c.D; ++d)
          s.q.push_back(testing::load_element(h.q.data(), t, (b * c.Sq + i) * qrow + hh * c.D + d));
    const int64_t p0 = h.seqlen(b), st = h.start(b);
    s.len_old = p0 - st;
    s.seq_new = c.s_new;
    s.pos0 = p0;
    s.q_advances = c.mask != Mask::None || c.window_left >= 0 || c.window_right >= 0;
    for (int64_t hh = 0; hh < c.Hkv; ++hh) {
      for (int64_t r = st; r < p0; ++r)
        for (int64_t d = 0; d < c.D; ++d) {
          s.k_old.push_back(testing::load_element(kc0.data(), t, h.cache_offset(b, r, hh, d)));
          s.v_old.push_back(testing::load_element(vc0.data(), t, h.cache_offset(b, r, hh, d)));
        }
      for (int64_t j = 0; j < c.s_new; ++j)
        for (int64_t d = 0; d < c.D; ++d) {
          s.k_new.push_back(testing::load_element(h.kn.data(), t, ((b * c.s_new + j) * c.Hkv + hh) * c.D + d));
          s.v_new.push_back(testing::load_element(h.vn.data(), t, ((b * c.s_new + j) * c.Hkv + hh) * c.D + d));
        }
    }
    testing::RefMods mods;
    mods.window_left = c.window_left, mods.window_right = c.window_right, mods.softcap = c.softcap;
    if (c.alibi)
      for (int64_t hh = 0; hh < c.Hq; ++hh) mods.alibi.push_back(h.slopes[b * c.Hq + hh]);
    const testing::RefKvcache ref = testing::reference_kvcache(s, rot, scale, c.mask, mods);

    std::vector<double> got_o, got_l;
    for (int64_t hh = 0; hh < c.Hq; ++hh)
      for (int64_t i = 0; i < c.Sq; ++i) {
        for (int64_t d = 0; d < c.D; ++d)
          got_o.push_back(testing::load_element(h.out.data(), t, (b * c.Sq + i) * qrow + hh * c.D + d));
        got_l.push_back(h.lse[(b * c.Hq + hh) * c.Sq + i]);
      }
    const auto eo = testing::compare(got_o, ref.fwd.out), el = testing::compare(got_l, ref.fwd.lse);
    EXPECT_EQ(eo.nan, 0) << "out: " << eo.str();
    EXPECT_LE(eo.rel, tol_of(t)) << "out: " << eo.str();
    EXPECT_EQ(el.nan, 0) << "lse: " << el.str();
    EXPECT_LE(el.rel, t == DType::Float64 ? 2e-7 : 1e-4) << "lse: " << el.str();  // float32 lse

    // The appended rows: values exactly k_new / v_new (without rotary), or the rotated keys.
    std::vector<double> got_k, want_k;
    for (int64_t hh = 0; hh < c.Hkv; ++hh)
      for (int64_t j = 0; j < c.s_new; ++j)
        for (int64_t d = 0; d < c.D; ++d) {
          const int64_t off = h.cache_offset(b, p0 + j, hh, d), src = ((b * c.s_new + j) * c.Hkv + hh) * c.D + d;
          written[off] = 1;
          EXPECT_EQ(std::memcmp(&h.vc[off * h.es()], &h.vn[src * h.es()], h.es()), 0) << "v_cache row " << p0 + j;
          if (c.rotary_dim == 0 || d >= c.rotary_dim)
            EXPECT_EQ(std::memcmp(&h.kc[off * h.es()], &h.kn[src * h.es()], h.es()), 0) << "k_cache row " << p0 + j;
          got_k.push_back(testing::load_element(h.kc.data(), t, off));
          want_k.push_back(ref.k_appended[(hh * c.s_new + j) * c.D + d]);
        }
    const auto ek = testing::compare(got_k, want_k);
    EXPECT_EQ(ek.nan, 0);
    // One rounding step of the dtype at most (float rotation vs the exact one, both rounded).
    EXPECT_LE(ek.rel, t == DType::Float64 ? 1e-15 : t == DType::Float32 ? 1e-6 : 1e-2) << "appended k: " << ek.str();
  }
  // Every other cache element untouched.
  int64_t changed = 0;
  for (size_t e = 0; e < written.size(); ++e)
    if (!written[e] && (std::memcmp(&h.kc[e * h.es()], &kc0[e * h.es()], h.es()) != 0 ||
                        std::memcmp(&h.vc[e * h.es()], &vc0[e * h.es()], h.es()) != 0))
      ++changed;
  EXPECT_EQ(changed, 0) << "cache elements outside the appended rows changed";
}

// ---- results against the reference -------------------------------------------------------------

TEST(KvCache, DecodeContiguous) {
  KvCase c;
  c.seqlens = {17, 40};
  check_case(c);
}

TEST(KvCache, DecodeNoAppend) {
  KvCase c;
  c.s_new = 0;
  c.seqlens = {1, 64};
  check_case(c);
}

TEST(KvCache, WholeCacheWithoutSeqlens) {
  KvCase c;
  c.s_new = 0;
  c.S_cache = 33;
  c.Sq = 3;
  c.mask = Mask::CausalBottomRight;
  check_case(c);
}

TEST(KvCache, PrefillChunkCausal) {
  for (Mask m : {Mask::None, Mask::CausalBottomRight, Mask::CausalTopLeft}) {
    SCOPED_TRACE(mask_name(m));
    KvCase c;
    c.Sq = 5, c.s_new = 5, c.seqlens = {0, 23}, c.S_cache = 40, c.mask = m;
    check_case(c);
  }
}

TEST(KvCache, SqLargerThanNew) {
  // Sq > S_new: queries see keys the append did not add (and, causal, some see none).
  KvCase c;
  c.Sq = 7, c.s_new = 2, c.seqlens = {3, 1}, c.S_cache = 16, c.mask = Mask::CausalBottomRight;
  check_case(c);
}

TEST(KvCache, LongCaches) {
  KvCase c;
  c.seqlens = {1, 1000, 1234};
  c.B = 3, c.S_cache = 1300, c.Hq = 4, c.Hkv = 4, c.D = 40, c.s_new = 3, c.Sq = 3, c.mask = Mask::CausalBottomRight;
  check_case(c);
}

TEST(KvCache, GqaAndMqa) {
  for (int64_t hkv : {int64_t{2}, int64_t{1}}) {
    KvCase c;
    c.Hq = 8, c.Hkv = hkv, c.seqlens = {5, 30}, c.Sq = 2, c.s_new = 2;
    check_case(c);
  }
}

TEST(KvCache, Paged) {
  for (int64_t bs : {int64_t{16}, int64_t{256}}) {
    SCOPED_TRACE("block_size " + std::to_string(bs));
    KvCase c;
    c.block_size = bs, c.max_blocks = bs == 16 ? 5 : 2, c.seqlens = {17, bs == 16 ? 70 : 300}, c.s_new = 4, c.Sq = 4;
    c.mask = Mask::CausalBottomRight;
    check_case(c);
  }
}

TEST(KvCache, PagedUnusedEntriesNotRead) {
  KvCase c;
  c.block_size = 16, c.max_blocks = 6, c.seqlens = {15, 31}, c.s_new = 1, c.unused_pages_invalid = true;
  check_case(c);
}

TEST(KvCache, PagedEqualsContiguousBitwise) {
  for (DType t : {DType::Float32, DType::BFloat16, DType::Float64}) {
    for (int64_t bs : {int64_t{16}, int64_t{256}}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " block_size " + std::to_string(bs));
      KvCase c;
      c.dtype = t, c.Sq = 3, c.s_new = 3, c.seqlens = {29, 200}, c.mask = Mask::CausalBottomRight;
      c.rotary_dim = 16;
      KvCase p = c;
      p.block_size = bs, p.max_blocks = (256 + bs - 1) / bs;
      c.S_cache = p.block_size * p.max_blocks;  // the same capacity (and rotary table)
      Harness hc(c), hp(p);
      ASSERT_NO_THROW(hc.run());
      ASSERT_NO_THROW(hp.run());
      EXPECT_EQ(hc.out, hp.out);
      EXPECT_EQ(0, std::memcmp(hc.lse.data(), hp.lse.data(), hc.lse.size() * sizeof(float)));
    }
  }
}

TEST(KvCache, BatchIdxAndLeftpad) {
  KvCase c;
  c.B = 3, c.batch_idx = true, c.seqlens = {10, 20, 33}, c.leftpad = {0, 7, 33}, c.S_cache = 40, c.Sq = 2,
  c.s_new = 2, c.mask = Mask::CausalBottomRight, c.rotary_dim = 32;
  check_case(c);
}

TEST(KvCache, Rotary) {
  for (bool inter : {true, false})
    for (int64_t rd : {int64_t{16}, int64_t{64}})
      for (Mask m : {Mask::None, Mask::CausalBottomRight}) {
        SCOPED_TRACE(std::string(inter ? "interleaved" : "neox") + " rotary_dim " + std::to_string(rd) + " " +
                     mask_name(m));
        KvCase c;
        c.rotary_dim = rd, c.interleaved = inter, c.mask = m, c.Sq = 3, c.s_new = 2, c.seqlens = {4, 50};
        check_case(c);
      }
}

TEST(KvCache, WindowSoftcapAlibi) {
  KvCase c;
  c.seqlens = {40, 9}, c.Sq = 4, c.s_new = 4, c.window_left = 8, c.window_right = 0, c.softcap = 5.0f, c.alibi = true;
  c.rotary_dim = 32;
  check_case(c);
  KvCase n = c;
  n.mask = Mask::CausalBottomRight, n.window_left = 3, n.window_right = -1, n.block_size = 16, n.max_blocks = 4;
  check_case(n);
}

TEST(KvCache, Dtypes) {
  for (DType t : {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64}) {
    SCOPED_TRACE(dtype_name(t));
    KvCase c;
    c.dtype = t, c.seqlens = {100, 3}, c.S_cache = 128, c.Sq = 2, c.s_new = 2, c.mask = Mask::CausalBottomRight;
    c.rotary_dim = 64, c.interleaved = false;
    check_case(c);
    KvCase p = c;
    p.block_size = 16, p.max_blocks = 8, p.Sq = 1, p.s_new = 1, p.D = 59, p.rotary_dim = 58;
    check_case(p);
  }
}

TEST(KvCache, StridedQueries) {
  KvCase c;
  c.q_pad = 24, c.seqlens = {6, 12}, c.Sq = 3, c.s_new = 1, c.D = 32;
  check_case(c);
}

// Decode steps (Sq = 1 and 4: the one-vector tiles) over caches of 1 to 2101 keys, around
// multiples of the key tile.
TEST(KvCache, LongDecode) {
  for (DType t : {DType::Float32, DType::BFloat16, DType::Float64}) {
    SCOPED_TRACE(dtype_name(t));
    KvCase c;
    c.dtype = t, c.B = 4, c.Hq = 4, c.Hkv = 2, c.D = 64, c.S_cache = 2200, c.s_new = 1, c.Sq = 1;
    c.seqlens = {0, 511, 512, 2100};  // 1, 512, 513 and 2101 keys
    c.mask = Mask::CausalBottomRight, c.rotary_dim = 32;
    check_case(c);
    KvCase q4 = c;
    q4.Sq = 4, q4.s_new = 2, q4.mask = Mask::None;
    check_case(q4);
  }
}

TEST(KvCache, LongDecodeWindow) {
  // A window of 100 keys over a long cache: the band skips all but the last key tiles.
  KvCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 1, c.D = 32, c.S_cache = 1600, c.Sq = 2, c.s_new = 2, c.seqlens = {1500, 3};
  c.mask = Mask::CausalBottomRight, c.window_left = 100, c.softcap = 10.0f, c.alibi = true;
  check_case(c);
}

// Bitwise the same over 1, 2 and 3 threads, paged or contiguous.
TEST(KvCache, DecodeThreadsAndPagedBitwise) {
  KvCase c;
  c.B = 2, c.Hq = 2, c.Hkv = 1, c.D = 48, c.Sq = 1, c.s_new = 1, c.seqlens = {1800, 700}, c.S_cache = 2048;
  c.mask = Mask::CausalBottomRight;
  KvCase p = c;
  p.block_size = 16, p.max_blocks = 128;
  std::vector<unsigned char> out0;
  std::vector<float> lse0;
  for (int threads : {1, 2, 3}) {
    for (const KvCase* k : {&c, &p}) {
      Harness h(*k);
      h.opts.num_threads = threads;
      ASSERT_NO_THROW(h.run());
      if (out0.empty()) {
        out0 = h.out, lse0 = h.lse;
        continue;
      }
      EXPECT_EQ(out0, h.out) << threads << " threads, " << (k == &p ? "paged" : "contiguous");
      EXPECT_EQ(0, std::memcmp(lse0.data(), h.lse.data(), lse0.size() * sizeof(float)));
    }
  }
}

// ---- refused inputs: error names argument and values, nothing written ---------------------------

template <class Mutate>
void expect_refused(const KvCase& c, Mutate&& mutate, Status status, const std::vector<std::string>& needles) {
  Harness h(c);
  mutate(h);
  const auto before = h.snapshot();
  try {
    h.run();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "\"" << e.what() << "\" lacks \"" << n << "\"";
  }
  EXPECT_TRUE(before == h.snapshot()) << "a refused call wrote something";
}

KvCase small() {
  KvCase c;
  c.seqlens = {5, 10};
  c.S_cache = 16;
  c.D = 16;
  c.Hq = 4;
  return c;
}
KvCase small_paged() {
  KvCase c = small();
  c.block_size = 16, c.max_blocks = 2;
  return c;
}

TEST(KvCacheBadInput, Capacity) {
  expect_refused(small(), [](Harness& h) { h.seqlens[1] = 16; }, Status::InvalidArgument,
                 {"cache_seqlens[1] + S_new = 16 + 1 = 17", "capacity 16"});
  expect_refused(small(), [](Harness& h) { h.seqlens[0] = -1; }, Status::InvalidArgument, {"cache_seqlens[0] = -1"});
  expect_refused(small_paged(), [](Harness& h) { h.seqlens[0] = 32; }, Status::InvalidArgument,
                 {"cache_seqlens[0] + S_new = 32 + 1 = 33", "capacity 32", "max_blocks_per_seq"});
}

TEST(KvCacheBadInput, BlockTable) {
  expect_refused(small_paged(), [](Harness& h) { h.table[0] = static_cast<int32_t>(h.num_blocks); },
                 Status::InvalidArgument, {"block_table[0, 0] = 7", "[0, 7)"});
  expect_refused(small_paged(), [](Harness& h) { h.table[2] = -1; }, Status::InvalidArgument,
                 {"block_table[1, 0] = -1"});
  expect_refused(small_paged(), [](Harness& h) { h.tbt.dtype = DType::Float32; }, Status::InvalidArgument,
                 {"block_table.dtype = float32", "int32"});
  expect_refused(small_paged(), [](Harness& h) { h.tbt.shape[0] = 1; }, Status::InvalidArgument,
                 {"block_table.shape = [1, 2]", "[2, max_blocks_per_seq"});
  expect_refused(small_paged(), [](Harness& h) { h.tbt.stride[1] = 2, h.tbt.shape[1] = 1, h.tbt.shape[1] = 2; },
                 Status::InvalidArgument, {"block_table.stride"});
  KvCase odd = small_paged();
  odd.block_size = 24;
  expect_refused(odd, [](Harness&) {}, Status::InvalidArgument, {"block_size) = 24", "multiple of 16"});
  expect_refused(small_paged(), [](Harness& h) { h.tbi = index_tensor(h.seqlens), h.kv.cache_batch_idx = &h.tbi; },
                 Status::InvalidArgument, {"cache_batch_idx cannot be combined with block_table"});
}

TEST(KvCacheBadInput, IndexArrays) {
  KvCase c = small();
  c.batch_idx = true;
  expect_refused(c, [](Harness& h) { h.bidx[1] = 3; }, Status::InvalidArgument, {"cache_batch_idx[1] = 3", "[0, 3)"});
  expect_refused(c, [](Harness& h) { h.bidx[1] = h.bidx[0]; }, Status::InvalidArgument,
                 {"cache_batch_idx names cache row 2 for two sequences"});
  KvCase l = small();
  l.leftpad = {0, 3};
  expect_refused(l, [](Harness& h) { h.leftpad[1] = 11; }, Status::InvalidArgument,
                 {"cache_leftpad[1] = 11", "cache_seqlens[1] = 10"});
  expect_refused(small(), [](Harness& h) { h.tsl.shape[0] = 3; }, Status::InvalidArgument,
                 {"cache_seqlens.shape = [3]", "[2]"});
  expect_refused(small(), [](Harness& h) { h.tsl.dtype = DType::Float32; }, Status::InvalidArgument,
                 {"cache_seqlens.dtype = float32"});
  expect_refused(small(), [](Harness& h) { h.kv.cache_seqlens = nullptr; }, Status::InvalidArgument,
                 {"cache_seqlens is NULL"});
  expect_refused(small(), [](Harness& h) { h.kv.v_new = nullptr; }, Status::InvalidArgument,
                 {"k_new is given but v_new is NULL"});
}

TEST(KvCacheBadInput, ShapesDtypesDevicesStrides) {
  expect_refused(small(), [](Harness& h) { h.tkn.dtype = DType::Float16; }, Status::InvalidArgument,
                 {"k_new.dtype = float16", "q.dtype = float32"});
  expect_refused(small(), [](Harness& h) { h.tvc.shape[1] = 8; }, Status::InvalidArgument,
                 {"v_cache.shape = [2, 8, 2, 16]", "[2, 16, 2, 16]"});
  expect_refused(small(), [](Harness& h) { h.tkn.shape[2] = 4; }, Status::InvalidArgument,
                 {"k_new.shape = [2, 1, 4, 16]", "[2, 1, 2, 16]"});
  expect_refused(small(), [](Harness& h) { h.tq.shape[2] = 3; h.tout.shape[2] = 3; }, Status::InvalidArgument,
                 {"does not divide q.shape[2] (query heads) = 3"});
  expect_refused(small(), [](Harness& h) { h.tlse.shape[2] = 2; }, Status::InvalidArgument,
                 {"lse.shape = [2, 4, 2]", "[2, 4, 1]"});
  expect_refused(small(), [](Harness& h) { h.tkc.ndim = 3; }, Status::InvalidArgument,
                 {"k_cache.ndim = 3", "[B_cache, S_cache, Hkv, D]"});
  expect_refused(small(), [](Harness& h) { h.tkc.stride[3] = 2; }, Status::InvalidArgument,
                 {"k_cache.stride[3] (head_dim) = 2"});
  expect_refused(small(), [](Harness& h) { h.tkn.device = 0; }, Status::InvalidArgument, {"k_new is on cuda:0"});
  expect_refused(small(), [](Harness& h) { h.tkc.shape[0] = 1; h.tvc.shape[0] = 1; }, Status::InvalidArgument,
                 {"k_cache.shape[0] (cache batch) = 1", "q.shape[0] (batch) = 2"});
}

TEST(KvCacheBadInput, Rotary) {
  KvCase c = small();
  c.rotary_dim = 8;
  expect_refused(c, [](Harness& h) { h.tcos.shape[1] = 9, h.tsin.shape[1] = 9, h.tcos.stride[0] = 9, h.tsin.stride[0] = 9, h.tcos.shape[0] = 10, h.tsin.shape[0] = 10; },
                 Status::InvalidArgument, {"rotary_dim = 2 * rotary_cos.shape[1] = 18", "head_dim = 16"});
  expect_refused(c, [](Harness& h) { h.tsin.shape[1] = 3; }, Status::InvalidArgument,
                 {"rotary_sin.shape = [17, 3]", "rotary_cos.shape = [17, 4]"});
  expect_refused(c, [](Harness& h) { h.tcos.shape[0] = 10, h.tsin.shape[0] = 10; }, Status::InvalidArgument,
                 {"rotary_cos.shape[0] = 10 is too short", "positions up to 10"});
  expect_refused(c, [](Harness& h) { h.kv.rotary_sin = nullptr; }, Status::InvalidArgument,
                 {"rotary_cos is given but rotary_sin is NULL"});
  expect_refused(c, [](Harness& h) { h.tcos.dtype = DType::Float16; }, Status::InvalidArgument,
                 {"rotary_cos.dtype = float16"});
  KvCase n = c;
  n.s_new = 0;  // rotary without an append (FlashAttention refuses it too)
  expect_refused(n, [](Harness&) {}, Status::InvalidArgument, {"rotary_cos / rotary_sin are given but k_new"});
}

TEST(KvCacheBadInput, Aliasing) {
  // out over q, lse over the cache, the caches over each other or over k_new.
  expect_refused(small(), [](Harness& h) { h.tout.data = h.q.data(); }, Status::InvalidArgument,
                 {"output out aliases input q"});
  expect_refused(small(), [](Harness& h) { h.tlse.data = h.kc.data(); }, Status::InvalidArgument,
                 {"lse", "k_cache"});
  expect_refused(small(), [](Harness& h) { h.tvc.data = h.kc.data(); }, Status::InvalidArgument,
                 {"k_cache and v_cache overlap"});
  expect_refused(small(), [](Harness& h) { h.tkn.data = h.kc.data(); }, Status::InvalidArgument,
                 {"output k_cache aliases input k_new"});
  KvCase n = small();
  n.s_new = 0;  // no append: the caches are inputs, out must still not overlap them
  expect_refused(n, [](Harness& h) { h.tout.data = h.vc.data(); }, Status::InvalidArgument,
                 {"output out aliases input v_cache"});
}

TEST(KvCacheBadInput, CApiStructSize) {
  Harness h(small());
  const auto before = h.snapshot();
  flashattn_kvcache kv;
  flashattn_kvcache_init(&kv);
  EXPECT_EQ(kv.struct_size, sizeof(flashattn_kvcache));
  EXPECT_EQ(kv.rotary_interleaved, 1);
  auto ct = [](const Tensor& t) {
    flashattn_tensor r{};
    r.data = t.data, r.dtype = static_cast<int32_t>(t.dtype), r.device = t.device, r.ndim = t.ndim;
    for (int i = 0; i < 4; ++i) r.shape[i] = t.shape[i], r.stride[i] = t.stride[i];
    return r;
  };
  const flashattn_tensor q = ct(h.tq), k = ct(h.tkc), v = ct(h.tvc), o = ct(h.tout), l = ct(h.tlse);
  kv.struct_size = sizeof(flashattn_kvcache) - 8;
  EXPECT_EQ(flashattn_forward_kvcache(&q, &k, &v, &o, &l, &kv, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("kv->struct_size"), std::string::npos) << flashattn_last_error();
  EXPECT_EQ(flashattn_forward_kvcache(&q, &k, &v, &o, &l, nullptr, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(before == h.snapshot());
}

}  // namespace
}  // namespace flashattn::test
