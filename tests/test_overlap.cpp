// The aliasing check on views of different shapes. A GQA model's fused projection gives one
// [B, S, Hq + 2 Hkv, D] buffer whose head ranges are q (or dq), k (dk) and v (dv): views with the
// same strides but different shapes. They share no element and must be accepted (the check used
// to be exact only for views of equal shapes and refused them as "dq and dk overlap"). Real
// overlaps between such views - a head range shifted into its neighbour, a view whose rows run
// into the next row of another, an lse placed over out's last elements - must still be refused,
// with a message naming both tensors, and nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

namespace flashattn::test {
namespace {

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// A view of heads [h0, h0 + h) of a fused buffer laid out as [B, S, H_total, D] (bshd) or
// [B, H_total, S, D] (bhsd).
Tensor heads_of(void* base, DType dt, bool bshd, int64_t B, int64_t S, int64_t Htot, int64_t D,
                int64_t h0, int64_t h) {
  Tensor t = Tensor::contiguous(static_cast<char*>(base) + h0 * (bshd ? D : S * D) * dtype_size(dt),
                                dt, B, h, S, D);
  t.stride[0] = S * Htot * D;
  t.stride[1] = bshd ? D : S * D;
  t.stride[2] = bshd ? Htot * D : D;
  t.stride[3] = 1;
  return t;
}

double tolerance(DType dt) { return dt == DType::Float32 ? 2e-5 : 5e-3; }

// Forward + backward on the views, every output against the float64 reference on their contents.
void check_against_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& lse, const Tensor& dout, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv, Mask mask) {
  check_views_against_reference(q, k, v, out, lse, dout, dq, dk, dv, mask, tolerance(q.dtype));
}

// The seeds of this file, spread over the generator's state.
void fill(const Tensor& t, uint64_t seed) { fill_uniform(t, seed * 0x9E3779B97F4A7C15ull + 1); }

struct FusedCase {
  DType dtype;
  bool bshd;
  Mask mask;
  const char* name;
};

void PrintTo(const FusedCase& c, std::ostream* os) { *os << c.name; }

class LegitimateLayoutsFused : public ::testing::TestWithParam<FusedCase> {};

// q, k, v as heads 0-3, 4-5, 6-7 of one fused qkv buffer and dq, dk, dv as the same heads of one
// fused gradient buffer [B, S, Hq + 2 Hkv, D] (GQA: Hq = 4, Hkv = 2).
TEST_P(LegitimateLayoutsFused, GqaQkvAndGradientBuffersAreAccepted) {
  const FusedCase& c = GetParam();
  const int64_t B = 2, S = 13, Hq = 4, Hkv = 2, Ht = Hq + 2 * Hkv, D = 16;
  const int64_t es = dtype_size(c.dtype), n = B * S * Ht * D;
  std::vector<unsigned char> qkv(static_cast<size_t>(n * es)), dqkv(qkv.size());
  auto view = [&](std::vector<unsigned char>& buf, int64_t h0, int64_t h) {
    return heads_of(buf.data(), c.dtype, c.bshd, B, S, Ht, D, h0, h);
  };
  const Tensor q = view(qkv, 0, Hq), k = view(qkv, Hq, Hkv), v = view(qkv, Hq + Hkv, Hkv);
  const Tensor dq = view(dqkv, 0, Hq), dk = view(dqkv, Hq, Hkv), dv = view(dqkv, Hq + Hkv, Hkv);
  const Tensor all = view(dqkv, 0, Ht);
  std::vector<unsigned char> outb(static_cast<size_t>(B * Hq * S * D * es)), doutb(outb.size());
  std::vector<float> lseb(static_cast<size_t>(B * Hq * S), kNan);
  const Tensor out = Tensor::bshd(outb.data(), c.dtype, B, Hq, S, D);
  const Tensor dout = Tensor::bshd(doutb.data(), c.dtype, B, Hq, S, D);
  const Tensor lse = Tensor::lse(lseb.data(), B, Hq, S);
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  fill(dout, 4);
  for (int64_t i = 0; i < n; ++i) testing::store_element(dqkv.data(), c.dtype, i, kNan);
  for (int64_t i = 0; i < B * Hq * S * D; ++i) testing::store_element(outb.data(), c.dtype, i, kNan);
  const std::vector<unsigned char> qkv_before = qkv;
  check_against_reference(q, k, v, out, lse, dout, dq, dk, dv, c.mask);
  EXPECT_TRUE(qkv == qkv_before) << "the fused inputs were modified";
  int64_t unwritten = 0;
  for (double x : gather(all)) unwritten += std::isnan(x);
  EXPECT_EQ(unwritten, 0) << "elements of the fused gradient buffer were not written";
}

INSTANTIATE_TEST_SUITE_P(
    Cpu, LegitimateLayoutsFused,
    ::testing::Values(FusedCase{DType::Float32, true, Mask::None, "f32_bshd"},
                      FusedCase{DType::Float32, true, Mask::CausalBottomRight, "f32_bshd_causal"},
                      FusedCase{DType::Float32, false, Mask::CausalTopLeft, "f32_bhsd_causal"},
                      FusedCase{DType::Float16, true, Mask::None, "f16_bshd"},
                      FusedCase{DType::BFloat16, false, Mask::None, "bf16_bhsd"}),
    [](const ::testing::TestParamInfo<FusedCase>& i) { return i.param.name; });

// lse (float32) stored in the row padding of a float16 out: views of different dtypes that share
// a buffer but no byte. Exact byte-level reasoning accepts it; one float to the left it covers
// out's last two elements of each row and is refused.
TEST(LegitimateLayoutsMixedDtype, LseInTheRowPaddingOfOut) {
  const int64_t B = 2, H = 3, S = 7, D = 8, row = D + 2;  // halves per row: D values + 4 bytes
  std::vector<uint16_t> outb(static_cast<size_t>(B * H * S * row));
  std::vector<uint16_t> q16(static_cast<size_t>(B * H * S * D)), k16(q16.size()), v16(q16.size());
  Tensor q = Tensor::contiguous(q16.data(), DType::Float16, B, H, S, D);
  Tensor k = Tensor::contiguous(k16.data(), DType::Float16, B, H, S, D);
  Tensor v = Tensor::contiguous(v16.data(), DType::Float16, B, H, S, D);
  fill(q, 5);
  fill(k, 6);
  fill(v, 7);
  Tensor out = Tensor::contiguous(outb.data(), DType::Float16, B, H, S, D);
  out.stride[2] = row;
  out.stride[1] = S * row;
  out.stride[0] = H * S * row;
  for (int64_t i = 0; i < B * H * S * row; ++i)
    testing::store_element(outb.data(), DType::Float16, i, kNan);
  Tensor lse = Tensor::lse(reinterpret_cast<float*>(outb.data() + D), B, H, S);
  lse.stride[2] = row / 2;
  lse.stride[1] = S * row / 2;
  lse.stride[0] = H * S * row / 2;
  ASSERT_NO_THROW(forward(q, k, v, out, lse, Options{}));
  const testing::RefShape s{B, H, H, S, S, D};
  const double scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const auto f = testing::reference_forward(s, gather(q), gather(k), gather(v), scale, Mask::None);
  const auto eo = testing::compare(gather(out), f.out), el = testing::compare(gather(lse), f.lse);
  EXPECT_EQ(eo.nan, 0) << eo.str();
  EXPECT_LE(eo.rel, 5e-3) << eo.str();
  EXPECT_EQ(el.nan, 0) << el.str();
  EXPECT_LE(el.rel, 2e-5) << el.str();

  lse.data = reinterpret_cast<float*>(outb.data() + D) - 1;
  const std::vector<uint16_t> before = outb;
  EXPECT_TRUE(throws_error([&] { forward(q, k, v, out, lse, Options{}); }, Status::InvalidArgument,
                           {"outputs out and lse overlap"}));
  EXPECT_TRUE(outb == before) << "written before the error";
}

// ---- real overlaps between views of different shapes ---------------------------------------

class BadInputOverlap : public ::testing::Test {
 protected:
  static constexpr int64_t B = 2, S = 6, Hq = 4, Hkv = 2, Ht = Hq + 2 * Hkv, D = 8;
  BadInputOverlap()
      : qkv(static_cast<size_t>(B * S * Ht * D)),
        dqkv(qkv.size() + Ht * D, kNan),  // one spare row: views shifted right stay inside
        outb(static_cast<size_t>(B * Hq * S * D), kNan),
        doutb(outb.size()),
        lseb(static_cast<size_t>(B * Hq * S), kNan) {
    q = fused(qkv, 0, Hq);
    k = fused(qkv, Hq, Hkv);
    v = fused(qkv, Hq + Hkv, Hkv);
    dq = fused(dqkv, 0, Hq);
    dk = fused(dqkv, Hq, Hkv);
    dv = fused(dqkv, Hq + Hkv, Hkv);
    out = Tensor::bshd(outb.data(), DType::Float32, B, Hq, S, D);
    dout = Tensor::bshd(doutb.data(), DType::Float32, B, Hq, S, D);
    lse = Tensor::lse(lseb.data(), B, Hq, S);
    fill(q, 11);
    fill(k, 12);
    fill(v, 13);
    fill(dout, 14);
  }
  Tensor fused(std::vector<float>& buf, int64_t h0, int64_t h) {
    return heads_of(buf.data(), DType::Float32, true, B, S, Ht, D, h0, h);
  }
  // The backward must fail naming both tensors and leave every buffer as it was.
  void expect_refused(const std::vector<std::string>& needles) {
    const auto a = qkv, b = dqkv, c = outb, d = doutb, e = lseb;
    EXPECT_TRUE(throws_error([&] { backward(q, k, v, out, dout, lse, dq, dk, dv); },
                             Status::InvalidArgument, needles));
    EXPECT_TRUE(same(a, qkv) && same(c, outb) && same(d, doutb) && same(e, lseb))
        << "an input was modified";
    EXPECT_TRUE(same(b, dqkv)) << "the gradient buffer was written before the error";
  }
  static bool same(const std::vector<float>& x, const std::vector<float>& y) {  // bytes: NaN too
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  }
  float* at(std::vector<float>& buf, int64_t elems) { return buf.data() + elems; }

  std::vector<float> qkv, dqkv, outb, doutb, lseb;
  Tensor q, k, v, out, lse, dout, dq, dk, dv;
};

TEST_F(BadInputOverlap, TheDisjointFusedLayoutIsAccepted) {
  ASSERT_NO_THROW(forward(q, k, v, out, lse));
  EXPECT_NO_THROW(backward(q, k, v, out, dout, lse, dq, dk, dv));
  for (size_t i = 0; i < qkv.size(); ++i)
    ASSERT_FALSE(std::isnan(dqkv[i])) << "element " << i << " of the gradient buffer was not written";
}

TEST_F(BadInputOverlap, HeadRangesThatShareAHead) {
  dk.data = at(dqkv, 3 * D);  // heads 3-4: head 3 is dq's
  expect_refused({"outputs dq and dk overlap"});
  dk.data = at(dqkv, Hq * D);
  dv.data = at(dqkv, (Hq + 1) * D);  // heads 5-6: head 5 is dk's
  expect_refused({"outputs dk and dv overlap"});
  dv.data = at(dqkv, 0);  // heads 0-1, inside dq
  expect_refused({"outputs dq and dv overlap"});
}

TEST_F(BadInputOverlap, HalfAHeadOver) {
  dk.data = at(dqkv, Hq * D - D / 2);  // first half of dk's head 0 is the end of dq's head 3
  expect_refused({"outputs dq and dk overlap"});
  dk.data = at(dqkv, Hq * D + D / 2);  // second half of dk's head 1 is the start of dv's head 0
  expect_refused({"outputs dk and dv overlap"});
}

// dk at the last head of each row: its second head is head 0 of the next row, which is dq's (for
// every row but the last of the last batch). Head ranges alone look disjoint; elements are not.
TEST_F(BadInputOverlap, RowsRunningIntoTheNextRow) {
  dk.data = at(dqkv, (Ht - 1) * D);
  dv.data = at(dqkv, Hq * D);  // out of the way (dk's old place); dv vs dk is checked after dq
  expect_refused({"outputs dq and dk overlap"});
}

// Only the very last element of dq is the very first of dv (spans touching by one element).
TEST_F(BadInputOverlap, OneSharedElement) {
  // dq's last element: b = B-1, s = S-1, h = Hq-1, d = D-1.
  const int64_t last = (B - 1) * S * Ht * D + (S - 1) * Ht * D + (Hq - 1) * D + (D - 1);
  const int64_t nkv = B * Hkv * S * D;
  std::vector<float> big(static_cast<size_t>(last + 1 + nkv), kNan), other(static_cast<size_t>(nkv), kNan);
  dq = heads_of(big.data(), DType::Float32, true, B, S, Ht, D, 0, Hq);
  dk = Tensor::contiguous(other.data(), DType::Float32, B, Hkv, S, D);
  dv = Tensor::contiguous(big.data() + last, DType::Float32, B, Hkv, S, D);
  ASSERT_NO_THROW(forward(q, k, v, out, lse));
  EXPECT_TRUE(throws_error([&] { backward(q, k, v, out, dout, lse, dq, dk, dv); },
                           Status::InvalidArgument, {"outputs dq and dv overlap"}));
  for (float x : big) ASSERT_TRUE(std::isnan(x)) << "written before the error";
  // One element further on, they share nothing.
  dv.data = big.data() + last + 1;
  EXPECT_NO_THROW(backward(q, k, v, out, dout, lse, dq, dk, dv));
}

// Outputs placed on the fused input buffer: the input they hit is named.
TEST_F(BadInputOverlap, OutputsOnTheFusedInputs) {
  dq.data = at(qkv, 2 * D);  // heads 2-5 of qkv: q's heads 2-3 and k's 4-5
  expect_refused({"output dq aliases input q"});
  dq.data = at(dqkv, 0);
  dk.data = at(qkv, (Hq + Hkv) * D);  // exactly v's heads
  expect_refused({"output dk aliases input v"});
  dk.data = at(dqkv, Hq * D);
  dv.data = at(qkv, Hq * D + 1);  // one element into k's heads
  expect_refused({"output dv aliases input k"});
}

}  // namespace
}  // namespace flashattn::test
