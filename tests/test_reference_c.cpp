// libflashattn_reference (src/testing/reference_c.h), the C ABI through which the Python and Rust
// tests use the float64 reference: its results must be bitwise those of the C++ reference
// (reference.hpp) for every memory layout it accepts, it must write only inside its output views,
// and it must refuse bad arguments with a message and untouched outputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "flashattn/flashattn.h"
#include "testing/reference.hpp"
#include "testing/reference_c.h"

namespace flashattn::test {
namespace {

constexpr double kSentinel = -12345.5;  // fills the gaps of strided buffers

enum class Layout { Contiguous, Bhsd, Bshd, Padded, Reversed };

// Strides (in elements), buffer length and the base offset of element [0,0,0,0] for a logical
// [n0, n1, n2, n3] array in `layout`. Reversed walks the sequence backwards (negative stride).
struct Placement {
  int64_t strides[4];
  int64_t len, base;
};
Placement place(Layout layout, const int64_t (&n)[4]) {
  const int64_t b = n[0], h = n[1], s = n[2], d = n[3];
  switch (layout) {
    case Layout::Contiguous:
    case Layout::Bhsd: return {{h * s * d, s * d, d, 1}, b * h * s * d, 0};
    case Layout::Bshd: return {{s * h * d, d, h * d, 1}, b * s * h * d, 0};
    case Layout::Padded: {
      const int64_t row = d + 3, head = s * row + 5, batch = h * head + 7;
      return {{batch, head, row, 1}, b * batch, 0};
    }
    case Layout::Reversed:
      return {{h * s * d, s * d, -d, 1}, b * h * s * d, (s - 1) * d};
  }
  return {};
}

struct Buffer {
  std::vector<double> data;
  Placement p;
  double* ptr() { return data.data() + p.base; }
  const int64_t* strides(Layout layout) const {
    return layout == Layout::Contiguous ? nullptr : p.strides;
  }
};

Buffer lay_out(const std::vector<double>& logical, Layout layout, const int64_t (&n)[4]) {
  Buffer buf{std::vector<double>(0), place(layout, n)};
  buf.data.assign(buf.p.len, kSentinel);
  int64_t e = 0;
  for (int64_t i0 = 0; i0 < n[0]; ++i0)
    for (int64_t i1 = 0; i1 < n[1]; ++i1)
      for (int64_t i2 = 0; i2 < n[2]; ++i2)
        for (int64_t i3 = 0; i3 < n[3]; ++i3)
          buf.ptr()[i0 * buf.p.strides[0] + i1 * buf.p.strides[1] + i2 * buf.p.strides[2] +
                    i3 * buf.p.strides[3]] = logical[e++];
  return buf;
}

// The logical contents of a buffer; every element outside the view must still be the sentinel.
std::vector<double> read_back(const Buffer& buf, const int64_t (&n)[4]) {
  std::vector<double> out;
  std::vector<bool> inside(buf.data.size(), false);
  for (int64_t i0 = 0; i0 < n[0]; ++i0)
    for (int64_t i1 = 0; i1 < n[1]; ++i1)
      for (int64_t i2 = 0; i2 < n[2]; ++i2)
        for (int64_t i3 = 0; i3 < n[3]; ++i3) {
          const int64_t o = buf.p.base + i0 * buf.p.strides[0] + i1 * buf.p.strides[1] +
                            i2 * buf.p.strides[2] + i3 * buf.p.strides[3];
          inside[o] = true;
          out.push_back(buf.data[o]);
        }
  for (size_t i = 0; i < buf.data.size(); ++i)
    if (!inside[i]) EXPECT_EQ(buf.data[i], kSentinel) << "written outside the view at " << i;
  return out;
}

void expect_bitwise(const std::vector<double>& got, const std::vector<double>& want,
                    const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(double)), 0)
      << what << " differs from the C++ reference";
}

std::vector<double> normals(std::mt19937_64& rng, int64_t n) {
  std::normal_distribution<double> dist;
  std::vector<double> x(n);
  for (auto& e : x) e = dist(rng);
  return x;
}

struct CAbiCase {
  flashattn_ref_shape s;
  Mask mask;
  double scale;
  testing::RefMods mods = {};  // through the _ex functions when any is set
};

bool has_mods(const testing::RefMods& m) {
  return m.window_left >= 0 || m.window_right >= 0 || m.softcap > 0 || !m.alibi.empty();
}

void check_case(const CAbiCase& c, Layout layout) {
  const auto& s = c.s;
  SCOPED_TRACE("layout " + std::to_string(static_cast<int>(layout)) + ", mask " +
               std::to_string(static_cast<int>(c.mask)) + ", Sq " + std::to_string(s.seq_q) +
               ", Skv " + std::to_string(s.seq_kv));
  std::mt19937_64 rng(s.seq_q * 1000 + s.seq_kv);
  const int64_t qn[4] = {s.batch, s.heads_q, s.seq_q, s.head_dim};
  const int64_t kn[4] = {s.batch, s.heads_kv, s.seq_kv, s.head_dim};
  // lse as a 4-d array with a trailing size-1 dimension, to reuse the layout helpers.
  const int64_t ln[4] = {s.batch, s.heads_q, s.seq_q, 1};
  const auto q = normals(rng, qn[0] * qn[1] * qn[2] * qn[3]);
  const auto k = normals(rng, kn[0] * kn[1] * kn[2] * kn[3]);
  const auto v = normals(rng, kn[0] * kn[1] * kn[2] * kn[3]);
  const auto dout = normals(rng, qn[0] * qn[1] * qn[2] * qn[3]);
  const testing::RefShape rs{s.batch, s.heads_q, s.heads_kv, s.seq_q, s.seq_kv, s.head_dim};
  const auto want_f = testing::reference_forward(rs, q, k, v, c.scale, c.mask, c.mods);
  const auto want_b = testing::reference_backward(rs, q, k, v, dout, c.scale, c.mask, c.mods);
  const bool ex = has_mods(c.mods);
  const flashattn_ref_mods cm{c.mods.window_left, c.mods.window_right, c.mods.softcap,
                              c.mods.alibi.empty() ? nullptr : c.mods.alibi.data()};

  auto qb = lay_out(q, layout, qn), kb = lay_out(k, layout, kn), vb = lay_out(v, layout, kn),
       db = lay_out(dout, layout, qn);
  const std::vector<double> zq(q.size(), 0.0), zk(k.size(), 0.0), zl(q.size() / s.head_dim, 0.0);
  auto ob = lay_out(zq, layout, qn), lb = lay_out(zl, layout, ln), dqb = lay_out(zq, layout, qn),
       dkb = lay_out(zk, layout, kn), dvb = lay_out(zk, layout, kn);
  const int64_t lse_strides[3] = {lb.p.strides[0], lb.p.strides[1], lb.p.strides[2]};
  const int mask = static_cast<int>(c.mask);
  const int64_t* ls = layout == Layout::Contiguous ? nullptr : lse_strides;
  const int fwd_rc =
      ex ? flashattn_ref_forward_ex(&s, qb.ptr(), qb.strides(layout), kb.ptr(), kb.strides(layout), vb.ptr(),
                                    vb.strides(layout), c.scale, mask, &cm, ob.ptr(), ob.strides(layout),
                                    lb.ptr(), ls)
         : flashattn_ref_forward(&s, qb.ptr(), qb.strides(layout), kb.ptr(), kb.strides(layout), vb.ptr(),
                                 vb.strides(layout), c.scale, mask, ob.ptr(), ob.strides(layout), lb.ptr(), ls);
  ASSERT_EQ(fwd_rc, FLASHATTN_REF_OK) << flashattn_ref_last_error();
  const int bwd_rc =
      ex ? flashattn_ref_backward_ex(&s, qb.ptr(), qb.strides(layout), kb.ptr(), kb.strides(layout),
                                     vb.ptr(), vb.strides(layout), db.ptr(), db.strides(layout), c.scale,
                                     mask, &cm, dqb.ptr(), dqb.strides(layout), dkb.ptr(),
                                     dkb.strides(layout), dvb.ptr(), dvb.strides(layout))
         : flashattn_ref_backward(&s, qb.ptr(), qb.strides(layout), kb.ptr(), kb.strides(layout), vb.ptr(),
                                  vb.strides(layout), db.ptr(), db.strides(layout), c.scale, mask,
                                  dqb.ptr(), dqb.strides(layout), dkb.ptr(), dkb.strides(layout),
                                  dvb.ptr(), dvb.strides(layout));
  ASSERT_EQ(bwd_rc, FLASHATTN_REF_OK) << flashattn_ref_last_error();
  expect_bitwise(read_back(ob, qn), want_f.out, "out");
  expect_bitwise(read_back(lb, ln), want_f.lse, "lse");
  expect_bitwise(read_back(dqb, qn), want_b.dq, "dq");
  expect_bitwise(read_back(dkb, kn), want_b.dk, "dk");
  expect_bitwise(read_back(dvb, kn), want_b.dv, "dv");
  // Inputs are read only.
  expect_bitwise(read_back(qb, qn), q, "q after the calls");
  expect_bitwise(read_back(kb, kn), k, "k after the calls");
}

TEST(ReferenceCheckCAbi, BitwiseTheCppReferenceInEveryLayout) {
  // GQA and MQA, Sq != Skv both ways (fully masked rows with bottom-right), every mask.
  const CAbiCase cases[] = {
      {{1, 1, 1, 1, 1, 1}, Mask::None, 1.0},
      {{2, 4, 2, 5, 7, 3}, Mask::None, 0.37},
      {{1, 3, 1, 6, 4, 5}, Mask::CausalTopLeft, 0.5},
      {{2, 2, 2, 7, 3, 4}, Mask::CausalBottomRight, 0.8},
      {{1, 6, 3, 4, 9, 8}, Mask::CausalBottomRight, 1.0 / std::sqrt(8.0)},
  };
  for (const auto& c : cases)
    for (Layout l :
         {Layout::Contiguous, Layout::Bhsd, Layout::Bshd, Layout::Padded, Layout::Reversed})
      check_case(c, l);
}

testing::RefMods ref_mods(int64_t left, int64_t right, double softcap, std::vector<double> alibi) {
  testing::RefMods m;
  m.window_left = left;
  m.window_right = right;
  m.softcap = softcap;
  m.alibi = std::move(alibi);
  return m;
}

// The _ex functions (window, softcap, ALiBi) are bitwise the C++ reference with the same RefMods.
TEST(ReferenceCheckCAbi, ModsBitwiseTheCppReferenceInEveryLayout) {
  const CAbiCase cases[] = {
      {{2, 4, 2, 5, 7, 3}, Mask::None, 0.37, ref_mods(1, 2, 0, {})},
      {{1, 3, 1, 6, 4, 5}, Mask::CausalTopLeft, 0.5, ref_mods(-1, -1, 1.5, {})},
      {{2, 2, 2, 7, 3, 4}, Mask::CausalBottomRight, 0.8, ref_mods(-1, -1, 0, {0.5, 0.0, -0.25, 1.0})},
      {{1, 6, 3, 4, 9, 8}, Mask::CausalBottomRight, 0.35,
       ref_mods(3, -1, 2.0, {0.5, 0.25, 0.125, 0.0625, -0.1, 0.0})},
  };
  for (const auto& c : cases)
    for (Layout l : {Layout::Contiguous, Layout::Bshd, Layout::Padded, Layout::Reversed}) check_case(c, l);
}

TEST(ReferenceCheckCAbi, BadModsAreRefused) {
  std::vector<double> a(64, 1.0), out(64, 7.0), lse(16, 7.0);
  const double* x = a.data();
  const flashattn_ref_shape good{1, 1, 1, 2, 2, 2};
  const flashattn_ref_mods bad[] = {{-2, -1, 0, nullptr},
                                    {-1, -7, 0, nullptr},
                                    {-1, -1, -1.0, nullptr},
                                    {-1, -1, std::nan(""), nullptr}};
  for (const flashattn_ref_mods& m : bad) {
    EXPECT_EQ(flashattn_ref_forward_ex(&good, x, nullptr, x, nullptr, x, nullptr, 1.0, 0, &m, out.data(),
                                       nullptr, lse.data(), nullptr),
              FLASHATTN_REF_INVALID_ARGUMENT);
    EXPECT_STRNE(flashattn_ref_last_error(), "");
  }
  for (double o : out) EXPECT_EQ(o, 7.0) << "an output was written by a refused call";
  // NULL mods: none.
  EXPECT_EQ(flashattn_ref_forward_ex(&good, x, nullptr, x, nullptr, x, nullptr, 1.0, 0, nullptr, out.data(),
                                     nullptr, lse.data(), nullptr),
            FLASHATTN_REF_OK);
}

TEST(ReferenceCheckCAbi, OutputsMayAliasInputs) {
  const flashattn_ref_shape s{1, 2, 1, 5, 6, 4};
  std::mt19937_64 rng(3);
  auto q = normals(rng, 2 * 5 * 4), k = normals(rng, 6 * 4), v = normals(rng, 6 * 4);
  const testing::RefShape rs{1, 2, 1, 5, 6, 4};
  const auto want = testing::reference_forward(rs, q, k, v, 0.5, Mask::CausalTopLeft);
  std::vector<double> lse(10);
  ASSERT_EQ(flashattn_ref_forward(&s, q.data(), nullptr, k.data(), nullptr, v.data(), nullptr, 0.5,
                                  1, q.data(), nullptr, lse.data(), nullptr),
            FLASHATTN_REF_OK);
  expect_bitwise(q, want.out, "out written over q");
}

TEST(ReferenceCheckCAbi, BadArgumentsAreRefusedWithAMessage) {
  std::vector<double> a(64, 1.0), out(64, 7.0), lse(16, 7.0);
  const double* x = a.data();
  auto fwd = [&](const flashattn_ref_shape* s, int mask) {
    return flashattn_ref_forward(s, x, nullptr, x, nullptr, x, nullptr, 1.0, mask, out.data(),
                                 nullptr, lse.data(), nullptr);
  };
  auto expect_refused = [&](int rc, const char* needle) {
    EXPECT_EQ(rc, FLASHATTN_REF_INVALID_ARGUMENT);
    EXPECT_NE(std::string(flashattn_ref_last_error()).find(needle), std::string::npos)
        << "message: " << flashattn_ref_last_error();
  };
  const flashattn_ref_shape gqa_3_2{1, 3, 2, 2, 2, 2}, no_keys{1, 1, 1, 2, 0, 2},
      negative_d{1, 1, 1, 2, 2, -1}, good{1, 1, 1, 2, 2, 2};
  expect_refused(fwd(&gqa_3_2, 0), "heads_kv does not divide heads_q");
  expect_refused(fwd(&no_keys, 0), "seq_kv = 0");
  expect_refused(fwd(&negative_d, 0), "head_dim = -1");
  expect_refused(fwd(&good, 3), "mask 3");
  expect_refused(fwd(nullptr, 0), "shape is NULL");
  expect_refused(flashattn_ref_backward(&good, x, nullptr, nullptr, nullptr, x, nullptr, x,
                                        nullptr, 1.0, 0, out.data(), nullptr, out.data(), nullptr,
                                        out.data(), nullptr),
                 "k is NULL");
  for (double o : out) EXPECT_EQ(o, 7.0) << "an output was written by a refused call";
  for (double l : lse) EXPECT_EQ(l, 7.0) << "an output was written by a refused call";
  // A good call afterwards succeeds.
  EXPECT_EQ(fwd(&good, 2), FLASHATTN_REF_OK);
  EXPECT_NE(out[0], 7.0);
}

// flashattn_ref_kvcache: bitwise reference_kvcache for one sequence (rotary, GQA, mods), and refusals
// that write nothing.
TEST(ReferenceCheckCAbi, KvcacheBitwiseTheCppReference) {
  std::mt19937_64 gen(11);
  std::normal_distribution<double> nd;
  auto randn = [&](size_t n) {
    std::vector<double> x(n);
    for (double& e : x) e = nd(gen);
    return x;
  };
  const int64_t Hq = 4, Hkv = 2, Sq = 3, D = 8, L = 5, N = 3, pos0 = 7, rd = 6, rows = 12;
  testing::RefKvcacheSeq rs;
  rs.heads_q = Hq, rs.heads_kv = Hkv, rs.seq_q = Sq, rs.head_dim = D, rs.len_old = L, rs.seq_new = N;
  rs.pos0 = pos0, rs.q_advances = true;
  rs.q = randn(Hq * Sq * D), rs.k_old = randn(Hkv * L * D), rs.v_old = randn(Hkv * L * D);
  rs.k_new = randn(Hkv * N * D), rs.v_new = randn(Hkv * N * D);
  testing::RefRotary rot;
  rot.cos = randn(rows * rd / 2), rot.sin = randn(rows * rd / 2);
  rot.rotary_dim = rd, rot.interleaved = false, rot.round_to = DType::BFloat16;
  testing::RefMods mods;
  mods.window_left = 4, mods.softcap = 3.0, mods.alibi = {0.5, 0.25, 0.125, 0.0625};
  const auto want = testing::reference_kvcache(rs, rot, 0.4, Mask::CausalBottomRight, mods);

  const flashattn_ref_kvcache_seq s{Hq, Hkv, Sq, D, L, N, pos0, 1, 0, rd, rows, FLASHATTN_BFLOAT16};
  const flashattn_ref_mods m{4, -1, 3.0, mods.alibi.data()};
  std::vector<double> out(Hq * Sq * D, 7.0), lse(Hq * Sq, 7.0), k_app(Hkv * N * D, 7.0);
  ASSERT_EQ(flashattn_ref_kvcache(&s, rs.q.data(), rs.k_old.data(), rs.v_old.data(), rs.k_new.data(),
                                  rs.v_new.data(), rot.cos.data(), rot.sin.data(), 0.4, 2, &m, out.data(),
                                  lse.data(), k_app.data()),
            FLASHATTN_REF_OK)
      << flashattn_ref_last_error();
  expect_bitwise(out, want.fwd.out, "out");
  expect_bitwise(lse, want.fwd.lse, "lse");
  expect_bitwise(k_app, want.k_appended, "k_appended");

  // Refused: rotary tables too short for the positions used, and a NULL table; nothing written.
  std::vector<double> out2(out.size(), 7.0), lse2(lse.size(), 7.0), k2(k_app.size(), 7.0);
  auto call = [&](const flashattn_ref_kvcache_seq& seq, const double* cos) {
    return flashattn_ref_kvcache(&seq, rs.q.data(), rs.k_old.data(), rs.v_old.data(), rs.k_new.data(),
                                 rs.v_new.data(), cos, rot.sin.data(), 0.4, 2, &m, out2.data(), lse2.data(),
                                 k2.data());
  };
  flashattn_ref_kvcache_seq short_table = s;
  short_table.rotary_rows = pos0 + N - 1;
  EXPECT_EQ(call(short_table, rot.cos.data()), FLASHATTN_REF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_ref_last_error()).find("rotary_rows"), std::string::npos);
  EXPECT_EQ(call(s, nullptr), FLASHATTN_REF_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_ref_last_error()).find("rotary_cos is NULL"), std::string::npos);
  for (const auto* v : {&out2, &lse2, &k2})
    for (double e : *v) EXPECT_EQ(e, 7.0) << "a refused call wrote an output";
}

}  // namespace
}  // namespace flashattn::test
