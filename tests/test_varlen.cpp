// Packed variable-length batches (flashattn_forward_varlen / _backward_varlen): every bad
// description of the sequences is refused with a message naming the argument and the values, and
// nothing is written before it is raised; the CPU backend's results against the float64 reference
// per sequence, bitwise against the dense call of each sequence, and across thread counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "grid_tolerance.hpp"

namespace flashattn::test {
namespace {

// A packed float32 problem on the CPU: lengths per sequence, heads, head dim.
struct Packed {
  std::vector<int32_t> lq, lk;  // per-sequence lengths
  int64_t hq, hkv, d;
  std::vector<int32_t> cu_q, cu_k, used_k;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  Tensor tq, tk, tv, tout, tlse, tdout, tdq, tdk, tdv, tcq, tck, tused;
  Varlen vl;

  Packed(std::vector<int32_t> lens_q, std::vector<int32_t> lens_k, int64_t hq_, int64_t hkv_, int64_t d_)
      : lq(std::move(lens_q)), lk(std::move(lens_k)), hq(hq_), hkv(hkv_), d(d_) {
    cu_q.push_back(0);
    cu_k.push_back(0);
    for (size_t b = 0; b < lq.size(); ++b) cu_q.push_back(cu_q.back() + lq[b]), cu_k.push_back(cu_k.back() + lk[b]);
    const int64_t tq_rows = cu_q.back(), tk_rows = cu_k.back();
    std::mt19937 g(7);
    std::normal_distribution<float> n;
    auto fill = [&](std::vector<float>& x, int64_t size) {
      x.resize(size);
      for (float& e : x) e = n(g);
    };
    fill(q, tq_rows * hq * d);
    fill(k, tk_rows * hkv * d);
    fill(v, tk_rows * hkv * d);
    fill(dout, tq_rows * hq * d);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    out.assign(tq_rows * hq * d, nan);
    dq.assign(tq_rows * hq * d, nan);
    dk.assign(tk_rows * hkv * d, nan);
    dv.assign(tk_rows * hkv * d, nan);
    lse.assign(hq * tq_rows, nan);
    tq = packed(q.data(), tq_rows, hq);
    tk = packed(k.data(), tk_rows, hkv);
    tv = packed(v.data(), tk_rows, hkv);
    tout = packed(out.data(), tq_rows, hq);
    tdout = packed(dout.data(), tq_rows, hq);
    tdq = packed(dq.data(), tq_rows, hq);
    tdk = packed(dk.data(), tk_rows, hkv);
    tdv = packed(dv.data(), tk_rows, hkv);
    tlse.data = lse.data();
    tlse.ndim = 2;
    tlse.shape[0] = hq, tlse.shape[1] = tq_rows;
    tlse.stride[0] = tq_rows, tlse.stride[1] = 1;
    tcq = index(cu_q);
    tck = index(cu_k);
    vl.cu_seqlens_q = &tcq;
    vl.cu_seqlens_k = &tck;
    vl.max_seqlen_q = *std::max_element(lq.begin(), lq.end());
    vl.max_seqlen_k = *std::max_element(lk.begin(), lk.end());
    if (vl.max_seqlen_q == 0) vl.max_seqlen_q = 1;
    if (vl.max_seqlen_k == 0) vl.max_seqlen_k = 1;
  }
  Tensor packed(float* p, int64_t rows, int64_t h) const {
    Tensor t;
    t.data = p;
    t.ndim = 3;
    t.shape[0] = rows, t.shape[1] = h, t.shape[2] = d;
    t.stride[0] = h * d, t.stride[1] = d, t.stride[2] = 1;
    return t;
  }
  static Tensor index(std::vector<int32_t>& x) {
    Tensor t;
    t.data = x.data();
    t.dtype = DType::Int32;
    t.ndim = 1;
    t.shape[0] = static_cast<int64_t>(x.size());
    t.stride[0] = 1;
    return t;
  }
  void forward(const Options& o = {}) { forward_varlen(tq, tk, tv, tout, tlse, vl, o); }
  void backward(const Options& o = {}) { backward_varlen(tq, tk, tv, tout, tdout, tlse, tdq, tdk, tdv, vl, o); }
  // Every output still holds its NaN poison.
  bool untouched() const {
    for (const auto* x : {&out, &lse, &dq, &dk, &dv})
      for (float e : *x)
        if (!std::isnan(e)) return false;
    return true;
  }
};

// Runs f, expecting Error(status) whose message contains every fragment, and no output written.
template <class F>
void expect_refused(Packed& p, F&& f, Status status, std::vector<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const std::string& s : fragments) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  }
  EXPECT_TRUE(p.untouched());
}

TEST(VarlenBadInput, SequenceArrays) {
  const std::vector<int32_t> lq = {3, 0, 5}, lk = {4, 2, 5};
  {
    Packed p(lq, lk, 4, 2, 8);
    p.cu_q[0] = 1;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_q[0] = 1"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.cu_k[2] = 1;  // 4 -> 1: decreasing
    expect_refused(p, [&] { p.backward(); }, Status::InvalidArgument, {"cu_seqlens_k", "non-decreasing"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.cu_q[3] -= 1;  // the last sequence's end no longer matches total_q
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_q[3] = 7", "(8)"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.vl.max_seqlen_q = 4;  // sequence 2 has 5 queries
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"sequence 2", "max_seqlen_q = 4"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.vl.max_seqlen_k = 0;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"max_seqlen_k = 0"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.used_k = {4, 3, 1};  // sequence 1 has 2 keys
    p.tused = Packed::index(p.used_k);
    p.vl.seqused_k = &p.tused;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"seqused_k[1] = 3", "[0, 2]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.used_k = {4, 2};  // [B - 1]
    p.tused = Packed::index(p.used_k);
    p.vl.seqused_k = &p.tused;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"seqused_k.shape = [2]", "[3]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tck.shape[0] = 3;  // B + 1 must match cu_seqlens_q's
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_k.shape = [3]", "[4]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tcq.dtype = DType::Float32;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_q.dtype = float32", "int32"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tcq.stride[0] = 2;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_q.stride", "contiguous"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.vl.cu_seqlens_k = nullptr;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_k is NULL"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tcq.device = 0;  // the sequence arrays must be where q is
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"cu_seqlens_q"});
  }
}

TEST(VarlenBadInput, PackedShapes) {
  const std::vector<int32_t> lq = {3, 5}, lk = {4, 5};
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tq.ndim = 4;
    p.tq.shape[3] = 1;
    p.tq.stride[3] = 1;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"q.ndim = 4", "[total_q, Hq, D]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tlse.ndim = 3;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"lse.ndim = 3", "[Hq, total_q]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tlse.shape[0] = 8, p.tlse.shape[1] = 4;  // [total_q, Hq] instead of [Hq, total_q]
    p.tlse.stride[0] = 4;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"lse.shape = [8, 4]", "[4, 8]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tv.shape[0] = 8;  // v must match k
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"v.shape = [8, 2, 8]", "k.shape = [9, 2, 8]"});
  }
  {
    Packed p(lq, lk, 4, 3, 8);  // 3 kv heads do not divide 4
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"does not divide"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.tdk = p.tdq;  // dk must have k's shape
    expect_refused(p, [&] { p.backward(); }, Status::InvalidArgument, {"dk.shape"});
  }
  {
    // An output overlapping the sequence array: refused like any aliasing.
    Packed p(lq, lk, 1, 1, 1);
    p.tout.data = p.cu_q.data();
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"out", "cu_seqlens_q"});
  }
}

TEST(VarlenBadInput, CAbi) {
  Packed p({3, 5}, {4, 5}, 4, 2, 8);
  auto ct = [](const Tensor& t) {
    flashattn_tensor r{};
    r.data = t.data;
    r.dtype = static_cast<int32_t>(t.dtype);
    r.device = t.device;
    r.ndim = t.ndim;
    for (int i = 0; i < 4; ++i) r.shape[i] = t.shape[i], r.stride[i] = t.stride[i];
    return r;
  };
  flashattn_tensor q = ct(p.tq), k = ct(p.tk), v = ct(p.tv), out = ct(p.tout), lse = ct(p.tlse), cq = ct(p.tcq),
                   ck = ct(p.tck);
  flashattn_varlen vl{};
  vl.struct_size = sizeof(vl);
  vl.cu_seqlens_q = &cq;
  vl.cu_seqlens_k = &ck;
  vl.max_seqlen_q = 5;
  vl.max_seqlen_k = 5;
  EXPECT_EQ(flashattn_forward_varlen(&q, &k, &v, &out, &lse, nullptr, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("varlen is NULL"), std::string::npos);
  vl.struct_size = 8;
  EXPECT_EQ(flashattn_forward_varlen(&q, &k, &v, &out, &lse, &vl, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("struct_size = 8"), std::string::npos);
  vl.struct_size = sizeof(vl);
  p.cu_k[1] = 7;  // 7 > 5 = max_seqlen_k
  EXPECT_EQ(flashattn_forward_varlen(&q, &k, &v, &out, &lse, &vl, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("max_seqlen_k = 5"), std::string::npos) << flashattn_last_error();
  EXPECT_TRUE(p.untouched());
}


// ---- the CPU backend on packed batches ------------------------------------------------------------
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

void PrintTo(const VarCase& c, std::ostream* os) { *os << c.name; }

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
    tcq = Packed::index(cu_q);
    tck = Packed::index(cu_k);
    vl.cu_seqlens_q = &tcq;
    vl.cu_seqlens_k = &tck;
    if (!used.empty()) {
      tused = Packed::index(used);
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
void check_against_reference(VarRun& r) {
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

using testing::AlibiKind;
std::vector<VarCase> reference_cases() {
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
  v.push_back({"SoftcapAlibiHeads", lq, lk, {}, 4, 2, 16, DType::Float32, Mask::None, -1, -1, 5.0f, AlibiKind::Heads});
  v.push_back({"AlibiBatchHeadsCausal", lq, lk, {}, 4, 2, 16, DType::Float32, Mask::CausalBottomRight, -1, -1, 0.0f,
               AlibiKind::BatchHeads});
  v.push_back({"AlibiBatchHeadsTopLeftWindow", lq, lk, {}, 2, 2, 16, DType::Float32, Mask::CausalTopLeft, 40, -1,
               0.0f, AlibiKind::BatchHeads, 0.5f});
  // seqused_k: partly used, none used (0), all used, on a sequence without queries.
  v.push_back({"SequsedK", {4, 200, 5, 0, 70}, {10, 300, 40, 6, 70}, {3, 250, 0, 6, 70}, 4, 2, 16, DType::Float32,
               Mask::CausalBottomRight});
  v.push_back({"SequsedKSoftcapAlibi", {4, 200, 5, 0, 70}, {10, 300, 40, 6, 70}, {3, 129, 0, 2, 1}, 4, 2, 16,
               DType::Float32, Mask::None, 50, 10, 8.0f, AlibiKind::BatchHeads});
  // float64, float16, bfloat16.
  v.push_back({"Float64", lq, lk, {}, 4, 2, 16, DType::Float64, Mask::CausalBottomRight, 30, -1, 6.0f,
               AlibiKind::Heads});
  v.push_back({"Float64SequsedK", {4, 200, 5, 0, 70}, {10, 300, 40, 6, 70}, {3, 250, 0, 6, 70}, 2, 1, 8,
               DType::Float64, Mask::None});
  v.push_back({"Float16", lq, lk, {}, 4, 2, 16, DType::Float16, Mask::CausalBottomRight});
  v.push_back({"BFloat16SoftcapAlibi", lq, lk, {0, 1, 30, 250, 0, 64, 100}, 4, 2, 16, DType::BFloat16,
               Mask::None, -1, -1, 10.0f, AlibiKind::BatchHeads});
  return v;
}

class VarlenCpu : public ::testing::TestWithParam<VarCase> {};

TEST_P(VarlenCpu, MatchesReferencePerSequence) {
  VarRun r(GetParam());
  r.run();
  check_against_reference(r);
}

INSTANTIATE_TEST_SUITE_P(Cases, VarlenCpu, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<VarCase>& i) { return i.param.name; });

// Bytes of rows [r0, r0 + n) of a packed buffer.
std::vector<unsigned char> rows_bytes(const Buf& x, int64_t r0, int64_t n, int64_t row_elems) {
  const int64_t es = dtype_size(x.dt);
  return std::vector<unsigned char>(x.bytes.begin() + r0 * row_elems * es, x.bytes.begin() + (r0 + n) * row_elems * es);
}

// A packed float32 batch equals the dense call of each sequence, bit for bit: the dense API on views
// of the sequence's rows (B = 1, BSHD strides into the packed buffers), same options.
TEST(VarlenCpuDense, PackedEqualsDensePerSequenceBitwise) {
  for (VarCase c : reference_cases()) {
    if (c.dtype != DType::Float32) continue;
    SCOPED_TRACE(c.name);
    VarRun r(c);
    r.run();
    const int64_t D = c.d, Hq = c.hq, Hkv = c.hkv;
    for (int64_t b = 0; b < r.batch(); ++b) {
      const int64_t sq = c.lq[b], skv = r.used_k(b), q0 = r.cu_q[b], k0 = r.cu_k[b];
      if (sq == 0 || skv == 0) continue;  // dense shapes are positive (checked by the reference test)
      SCOPED_TRACE("sequence " + std::to_string(b));
      auto view = [&](const Buf& x, int64_t r0, int64_t n, int64_t h) {
        Tensor t = Tensor::bshd(const_cast<unsigned char*>(x.bytes.data()) + r0 * h * D * 4, DType::Float32, 1, h, n, D);
        return t;
      };
      Buf out(DType::Float32, sq, Hq, D), dq(DType::Float32, sq, Hq, D), dk(DType::Float32, skv, Hkv, D),
          dv(DType::Float32, skv, Hkv, D), lse(DType::Float32, Hq, sq, 1);
      for (Buf* x : {&out, &dq, &dk, &dv, &lse}) x->poison();
      Options o = r.options(2);
      Tensor slopes;
      if (!r.slopes.empty()) {
        slopes = r.tslopes;
        slopes.ndim = 1;
        slopes.shape[0] = Hq;
        slopes.stride[0] = 1;
        if (c.alibi == AlibiKind::BatchHeads) slopes.data = r.slopes.data() + b * Hq;
        o.alibi_slopes = &slopes;
      }
      const Tensor tout = view(out, 0, sq, Hq), tdq = view(dq, 0, sq, Hq), tdk = view(dk, 0, skv, Hkv),
                   tdv = view(dv, 0, skv, Hkv);
      const Tensor tlse = Tensor::lse(reinterpret_cast<float*>(lse.bytes.data()), 1, Hq, sq);
      forward(view(r.q, q0, sq, Hq), view(r.k, k0, skv, Hkv), view(r.v, k0, skv, Hkv), tout, tlse, o);
      backward(view(r.q, q0, sq, Hq), view(r.k, k0, skv, Hkv), view(r.v, k0, skv, Hkv), tout,
               view(r.dout, q0, sq, Hq), tlse, tdq, tdk, tdv, o);
      EXPECT_TRUE(out.bytes == rows_bytes(r.out, q0, sq, Hq * D)) << "out";
      EXPECT_TRUE(dq.bytes == rows_bytes(r.dq, q0, sq, Hq * D)) << "dq";
      EXPECT_TRUE(dk.bytes == rows_bytes(r.dk, k0, skv, Hkv * D)) << "dk";
      EXPECT_TRUE(dv.bytes == rows_bytes(r.dv, k0, skv, Hkv * D)) << "dv";
      int64_t lse_diff = 0;
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < sq; ++i)
          lse_diff += std::memcmp(&lse.bytes[(h * sq + i) * 4], &r.lse.bytes[(h * r.tq + q0 + i) * 4], 4) != 0;
      EXPECT_EQ(lse_diff, 0) << "lse";
    }
  }
}

// 1 thread and several give the same bits (the partition depends on the lengths only).
TEST(VarlenCpuDeterminism, ThreadCounts) {
  for (VarCase c : reference_cases()) {
    if (c.name != "Mixed1To1100" && c.name != "SequsedKSoftcapAlibi" && c.name != "Float64" && c.name != "Float16")
      continue;
    SCOPED_TRACE(c.name);
    VarRun a(c), b(c);
    a.run(1);
    b.run(3);
    EXPECT_TRUE(a.out.bytes == b.out.bytes) << "out";
    EXPECT_TRUE(a.lse.bytes == b.lse.bytes) << "lse";
    EXPECT_TRUE(a.dq.bytes == b.dq.bytes) << "dq";
    EXPECT_TRUE(a.dk.bytes == b.dk.bytes) << "dk";
    EXPECT_TRUE(a.dv.bytes == b.dv.bytes) << "dv";
  }
}

}  // namespace
}  // namespace flashattn::test
