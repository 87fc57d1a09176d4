// The packed-batch cases shared by the CPU (tests/test_varlen.cpp) and GPU
// (tests/cuda/test_varlen_cuda.cpp) suites: a problem of per-sequence lengths with its host buffers
// (outputs NaN-poisoned before every call), and the check of every sequence's outputs against the
// float64 reference of that sequence alone.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "flashattn/flashattn.hpp"
#include "grid_tolerance.hpp"

namespace flashattn::test {

// A packed problem of any dtype: per-sequence lengths (queries, keys, optionally seqused_k), the
// options, and buffers whose outputs are NaN-poisoned before every call.
struct VarCase {
  std::string name;
  std::vector<int32_t> lq, lk, used;  // used empty: no seqused_k
  int64_t hq = 4, hkv = 2, d = 16;
  DType dtype = DType::Float32;
  Mask mask = Mask::None;
  int64_t wl = -1, wr = -1;
  float softcap = 0.0f;
  testing::AlibiKind alibi = testing::AlibiKind::None;
  float scale = 0.0f;
};

inline void PrintTo(const VarCase& c, std::ostream* os) { *os << c.name; }

struct Buf {
  DType dt;
  int64_t n;
  std::vector<unsigned char> bytes;
  Tensor t;
  Buf(DType dt_, int64_t rows, int64_t h, int64_t d) : dt(dt_), n(rows * h * d), bytes(n * dtype_size(dt_)) {
    t.data = bytes.data();
    t.dtype = dt;
    t.ndim = 3;
    t.shape[0] = rows, t.shape[1] = h, t.shape[2] = d;
    t.stride[0] = h * d, t.stride[1] = d, t.stride[2] = 1;
  }
  double at(int64_t i) const { return testing::load_element(bytes.data(), dt, i); }
  void set(int64_t i, double x) { testing::store_element(bytes.data(), dt, i, x); }
  void poison() {
    for (int64_t i = 0; i < n; ++i) set(i, std::numeric_limits<double>::quiet_NaN());
  }
  void fill(uint64_t state) {
    for (int64_t i = 0; i < n; ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      set(i, static_cast<double>(state >> 11) * 0x1.0p-53 * 4 - 2);  // U(-2, 2)
    }
  }
};

struct VarRun {
  VarCase c;
  int64_t tq, tk;
  std::vector<int32_t> cu_q{0}, cu_k{0}, used;
  std::vector<float> slopes;
  Buf q, k, v, out, lse, dout, dq, dk, dv;
  Tensor tcq, tck, tused, tslopes;
  Varlen vl;

  static int64_t sum(const std::vector<int32_t>& x) {
    int64_t s = 0;
    for (int32_t e : x) s += e;
    return s;
  }
  explicit VarRun(const VarCase& c_)
      : c(c_), tq(sum(c_.lq)), tk(sum(c_.lk)), used(c_.used),
        q(c.dtype, tq, c.hq, c.d), k(c.dtype, tk, c.hkv, c.d), v(c.dtype, tk, c.hkv, c.d),
        out(c.dtype, tq, c.hq, c.d), lse(DType::Float32, c.hq, tq, 1), dout(c.dtype, tq, c.hq, c.d),
        dq(c.dtype, tq, c.hq, c.d), dk(c.dtype, tk, c.hkv, c.d), dv(c.dtype, tk, c.hkv, c.d) {
    for (size_t b = 0; b < c.lq.size(); ++b) cu_q.push_back(cu_q.back() + c.lq[b]), cu_k.push_back(cu_k.back() + c.lk[b]);
    q.fill(1), k.fill(2), v.fill(3), dout.fill(4);
    lse.t.ndim = 2;
    lse.t.shape[0] = c.hq, lse.t.shape[1] = tq;
    lse.t.stride[0] = tq, lse.t.stride[1] = 1;
    tcq = index_tensor(cu_q);
    tck = index_tensor(cu_k);
    vl.cu_seqlens_q = &tcq;
    vl.cu_seqlens_k = &tck;
    if (!used.empty()) {
      tused = index_tensor(used);
      vl.seqused_k = &tused;
    }
    vl.max_seqlen_q = std::max<int64_t>(1, *std::max_element(c.lq.begin(), c.lq.end()));
    vl.max_seqlen_k = std::max<int64_t>(1, *std::max_element(c.lk.begin(), c.lk.end()));
    const int64_t B = static_cast<int64_t>(c.lq.size());
    if (c.alibi != testing::AlibiKind::None) {
      const bool per_batch = c.alibi == testing::AlibiKind::BatchHeads;
      const std::vector<float> base = testing::standard_alibi_slopes(c.hq);
      for (int64_t b = 0; b < (per_batch ? B : 1); ++b)
        for (int64_t h = 0; h < c.hq; ++h) slopes.push_back(base[h] * (1.0f + 0.25f * static_cast<float>(b)));
      tslopes.data = slopes.data();
      tslopes.dtype = DType::Float32;
      tslopes.ndim = per_batch ? 2 : 1;
      if (per_batch) {
        tslopes.shape[0] = B, tslopes.shape[1] = c.hq;
        tslopes.stride[0] = c.hq, tslopes.stride[1] = 1;
      } else {
        tslopes.shape[0] = c.hq;
        tslopes.stride[0] = 1;
      }
    }
  }
  int64_t batch() const { return static_cast<int64_t>(c.lq.size()); }
  int64_t used_k(int64_t b) const { return used.empty() ? c.lk[b] : used[b]; }
  float slope(int64_t b, int64_t h) const {
    if (slopes.empty()) return 0.0f;
    return c.alibi == testing::AlibiKind::BatchHeads ? slopes[b * c.hq + h] : slopes[h];
  }
  Options options(int32_t threads) const {
    Options o;
    o.mask = c.mask;
    o.softmax_scale = c.scale;
    o.num_threads = threads;
    o.window_left = c.wl;
    o.window_right = c.wr;
    o.softcap = c.softcap;
    o.alibi_slopes = slopes.empty() ? nullptr : &tslopes;
    return o;
  }
  void run(int32_t threads = 2) {
    for (Buf* b : {&out, &lse, &dq, &dk, &dv}) b->poison();
    const Options o = options(threads);
    forward_varlen(q.t, k.t, v.t, out.t, lse.t, vl, o);
    backward_varlen(q.t, k.t, v.t, out.t, dout.t, lse.t, dq.t, dk.t, dv.t, vl, o);
  }
  // Rows [r0, r0 + n) of a packed [rows, H, D] buffer as a logical [1, H, n, D] array.
  static std::vector<double> slice(const Buf& x, int64_t r0, int64_t n, int64_t h, int64_t d) {
    std::vector<double> r(static_cast<size_t>(h * n * d));
    for (int64_t hh = 0; hh < h; ++hh)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t e = 0; e < d; ++e) r[(hh * n + i) * d + e] = x.at(((r0 + i) * h + hh) * d + e);
    return r;
  }
};

// Every output of every sequence against the float64 reference of that sequence alone (B = 1),
// with the tolerances of the score-mods grid; exact zeros (and -inf) where nothing is visible.
inline void check_against_reference(VarRun& r) {
  const VarCase& c = r.c;
  const Tolerance tol = tolerance(c.dtype);
  const int64_t D = c.d, Hq = c.hq, Hkv = c.hkv;
  for (int64_t b = 0; b < r.batch(); ++b) {
    const int64_t sq = c.lq[b], skv = r.used_k(b), kall = c.lk[b], q0 = r.cu_q[b], k0 = r.cu_k[b];
    SCOPED_TRACE("sequence " + std::to_string(b) + ": " + std::to_string(sq) + " queries, " +
                 std::to_string(skv) + " of " + std::to_string(kall) + " keys");
    const auto out = VarRun::slice(r.out, q0, sq, Hq, D), dq = VarRun::slice(r.dq, q0, sq, Hq, D);
    const auto dk = VarRun::slice(r.dk, k0, kall, Hkv, D), dv = VarRun::slice(r.dv, k0, kall, Hkv, D);
    std::vector<double> lse;
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < sq; ++i) lse.push_back(r.lse.at(h * r.tq + q0 + i));
    // Keys past seqused_k, and every key of a sequence without queries or keys: exact zeros.
    int64_t nonzero = 0;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = (sq == 0 ? 0 : skv); j < kall; ++j)
        for (int64_t e = 0; e < D; ++e) {
          const size_t x = static_cast<size_t>((h * kall + j) * D + e);
          nonzero += !(dk[x] == 0.0) + !(dv[x] == 0.0);
        }
    EXPECT_EQ(nonzero, 0) << "dk/dv of keys nobody attends are not exact zeros";
    if (sq == 0) continue;
    if (skv == 0) {
      int64_t bad = 0;
      for (double x : out) bad += !(x == 0.0);
      for (double x : dq) bad += !(x == 0.0);
      for (double x : lse) bad += !(x == -std::numeric_limits<double>::infinity());
      EXPECT_EQ(bad, 0) << "a sequence without keys: out and dq must be 0, lse -inf";
      continue;
    }
    ProblemConfig pc = make_config(1, Hq, Hkv, sq, skv, D, c.mask, c.dtype, testing::Layout::BHSD, c.scale);
    pc.window_left = c.wl, pc.window_right = c.wr, pc.softcap = c.softcap;
    testing::RefMods mods;
    mods.window_left = c.wl, mods.window_right = c.wr, mods.softcap = c.softcap;
    if (!r.slopes.empty())
      for (int64_t h = 0; h < Hq; ++h) mods.alibi.push_back(r.slope(b, h));
    const auto qs = VarRun::slice(r.q, q0, sq, Hq, D), ks = VarRun::slice(r.k, k0, skv, Hkv, D),
               vs = VarRun::slice(r.v, k0, skv, Hkv, D), dos = VarRun::slice(r.dout, q0, sq, Hq, D);
    const testing::RefShape rs{1, Hq, Hkv, sq, skv, D};
    const double scale = static_cast<double>(pc.scale());
    const testing::RefForward rf = testing::reference_forward(rs, qs, ks, vs, scale, c.mask, mods);
    const testing::RefBackward rb = testing::reference_backward(rs, qs, ks, vs, dos, scale, c.mask, mods);
    EXPECT_TRUE(close("out", out, rf.out, tol.out));
    EXPECT_TRUE(close("lse", lse, rf.lse, tol.lse));
    const Magnitudes mag = grad_magnitudes(pc, qs, ks, vs, dos, rf.out, mods);
    const double acc = 2 * tol.acc * std::max(1.0, max_abs(rf.lse)), store = 2 * tol.store;
    std::vector<double> dku, dvu;
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t j = 0; j < skv; ++j)
        for (int64_t e = 0; e < D; ++e) {
          dku.push_back(dk[static_cast<size_t>((h * kall + j) * D + e)]);
          dvu.push_back(dv[static_cast<size_t>((h * kall + j) * D + e)]);
        }
    EXPECT_TRUE(close("dq", dq, rb.dq, tol.grad, acc * mag.dq + store * mag.dq_from_d));
    EXPECT_TRUE(close("dk", dku, rb.dk, tol.grad, acc * mag.dk + store * mag.dk_from_d));
    EXPECT_TRUE(close("dv", dvu, rb.dv, tol.grad, acc * mag.dv));
  }
}

inline std::vector<VarCase> reference_cases() {
  std::vector<VarCase> v;
  // Lengths 0 (queries or keys), 1, odd, beyond a tile; Sq != Skv per sequence.
  const std::vector<int32_t> lq = {0, 1, 17, 300, 5, 97, 3}, lk = {5, 1, 33, 300, 0, 64, 130};
  for (Mask m : {Mask::None, Mask::CausalBottomRight, Mask::CausalTopLeft})
    v.push_back({std::string("Lengths_") + mask_name(m), lq, lk, {}, 4, 2, 16, DType::Float32, m});
  // Mixed 1..1100 in one batch.
  v.push_back({"Mixed1To1100", {1100, 1, 513, 64, 129, 2}, {1100, 7, 400, 1000, 129, 1}, {}, 2, 1, 32,
               DType::Float32, Mask::CausalBottomRight});
  // GQA 6:2 / MQA 4:1 with a window.
  v.push_back({"GqaWindow", lq, lk, {}, 6, 2, 24, DType::Float32, Mask::CausalBottomRight, 20, 0});
  v.push_back({"MqaWindowBoth", lq, lk, {}, 4, 1, 8, DType::Float32, Mask::None, 7, 3});
  // Softcap, ALiBi [Hq] and [B, Hq] (the diagonal is each sequence's own Skv - Sq).
  v.push_back({"SoftcapAlibiHeads", lq, lk, {}, 4, 2, 16, DType::Float32, Mask::None, -1, -1, 5.0f, testing::AlibiKind::Heads});
  v.push_back({"AlibiBatchHeadsCausal", lq, lk, {}, 4, 2, 16, DType::Float32, Mask::CausalBottomRight, -1, -1, 0.0f,
               testing::AlibiKind::BatchHeads});
  v.push_back({"AlibiBatchHeadsTopLeftWindow", lq, lk, {}, 2, 2, 16, DType::Float32, Mask::CausalTopLeft, 40, -1,
               0.0f, testing::AlibiKind::BatchHeads, 0.5f});
  // seqused_k: partly used, none used (0), all used, on a sequence without queries.
  v.push_back({"SequsedK", {4, 200, 5, 0, 70}, {10, 300, 40, 6, 70}, {3, 250, 0, 6, 70}, 4, 2, 16, DType::Float32,
               Mask::CausalBottomRight});
  v.push_back({"SequsedKSoftcapAlibi", {4, 200, 5, 0, 70}, {10, 300, 40, 6, 70}, {3, 129, 0, 2, 1}, 4, 2, 16,
               DType::Float32, Mask::None, 50, 10, 8.0f, testing::AlibiKind::BatchHeads});
  // float64, float16, bfloat16.
  v.push_back({"Float64", lq, lk, {}, 4, 2, 16, DType::Float64, Mask::CausalBottomRight, 30, -1, 6.0f,
               testing::AlibiKind::Heads});
  v.push_back({"Float64SequsedK", {4, 200, 5, 0, 70}, {10, 300, 40, 6, 70}, {3, 250, 0, 6, 70}, 2, 1, 8,
               DType::Float64, Mask::None});
  v.push_back({"Float16", lq, lk, {}, 4, 2, 16, DType::Float16, Mask::CausalBottomRight});
  v.push_back({"BFloat16SoftcapAlibi", lq, lk, {0, 1, 30, 250, 0, 64, 100}, 4, 2, 16, DType::BFloat16,
               Mask::None, -1, -1, 10.0f, testing::AlibiKind::BatchHeads});
  return v;
}


// Bytes of rows [r0, r0 + n) of a packed buffer.
inline std::vector<unsigned char> rows_bytes(const Buf& x, int64_t r0, int64_t n, int64_t row_elems) {
  const int64_t es = dtype_size(x.dt);
  return std::vector<unsigned char>(x.bytes.begin() + r0 * row_elems * es, x.bytes.begin() + (r0 + n) * row_elems * es);
}

}  // namespace flashattn::test
