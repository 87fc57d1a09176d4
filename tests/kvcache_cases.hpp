// The KV-cache cases shared by the CPU (tests/test_kvcache.cpp) and GPU
// (tests/cuda/test_kvcache_cuda.cpp) suites: a case's host buffers and views (outputs
// NaN-poisoned), and the check of a call's results against the float64 reference per sequence,
// of the appended rows, and of every other cache byte (untouched).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"
#include "testing/reference.hpp"
#include "test_util.hpp"

namespace flashattn::test {


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
  int32_t num_splits = 0;           // KvCache::num_splits (CUDA split-KV)
  int64_t q_pad = 0;                // extra elements per q / out sequence row (strided views)
  uint64_t seed = 1;
};

inline double value(uint64_t seed, uint64_t tensor, uint64_t index) {
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + tensor * 0xbf58476d1ce4e5b9ull + index * 0x94d049bb133111ebull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53 * 4 - 2;  // U(-2, 2)
}

inline Tensor view4(void* data, DType t, int64_t a, int64_t b, int64_t c, int64_t d, int64_t row_pad = 0) {
  Tensor r;
  r.data = data;
  r.dtype = t;
  r.ndim = 4;
  const int64_t sh[4] = {a, b, c, d};
  const int64_t st[4] = {b * (c * d + row_pad), c * d + row_pad, d, 1};
  for (int i = 0; i < 4; ++i) r.shape[i] = sh[i], r.stride[i] = st[i];
  return r;
}

struct Harness;
using KvRunner = std::function<void(Harness&)>;

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
    kv.num_splits = c.num_splits;
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

  // Runs the call on these host buffers, or through `runner` (the GPU suite: device copies of
  // every buffer, the call there, the outputs and caches copied back).
  KvRunner runner;
  void run() {
    if (runner) return runner(*this);
    forward_kvcache(tq, tkc, tvc, tout, tlse, kv, opts);
  }

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

inline double tol_of(DType t) {
  switch (t) {
    case DType::Float64: return 1e-11;
    case DType::Float32: return 2e-5;
    case DType::Float16: return 4e-3;
    default: return 3e-2;
  }
}

// Runs the case and checks it against the reference: out and lse per sequence, the appended
// rows, and every other cache element bit for bit.
inline void check_case(const KvCase& kc, const KvRunner& runner = nullptr) {
  Harness h(kc);
  h.runner = runner;
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

}  // namespace flashattn::test
