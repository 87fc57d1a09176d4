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
#include "varlen_cases.hpp"

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
    tcq = index_tensor(cu_q);
    tck = index_tensor(cu_k);
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
    p.tused = index_tensor(p.used_k);
    p.vl.seqused_k = &p.tused;
    expect_refused(p, [&] { p.forward(); }, Status::InvalidArgument, {"seqused_k[1] = 3", "[0, 2]"});
  }
  {
    Packed p(lq, lk, 4, 2, 8);
    p.used_k = {4, 2};  // [B - 1]
    p.tused = index_tensor(p.used_k);
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


using testing::AlibiKind;

class VarlenCpu : public ::testing::TestWithParam<VarCase> {};

TEST_P(VarlenCpu, MatchesReferencePerSequence) {
  VarRun r(GetParam());
  r.run();
  check_against_reference(r);
}

INSTANTIATE_TEST_SUITE_P(Cases, VarlenCpu, ::testing::ValuesIn(reference_cases()),
                         [](const ::testing::TestParamInfo<VarCase>& i) { return i.param.name; });


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

// The backward's two designs (FLASHATTN_CPU_BWD: split passes / fused per (sequence, kv head),
// test_cpu_backward_designs.cpp) give the same bits on packed batches too: sequences of mixed
// lengths, empty ones, keys past seqused_k, every score transform of the reference cases.
TEST(VarlenCpuDesigns, FusedEqualsSplitBitwise) {
  for (VarCase c : reference_cases()) {
    SCOPED_TRACE(c.name);
    VarRun split(c), fused(c);
    {
      const DesignEnv env("split");
      split.run(2);
    }
    {
      const DesignEnv env("fused");
      fused.run(1);
    }
    EXPECT_TRUE(split.dq.bytes == fused.dq.bytes) << "dq";
    EXPECT_TRUE(split.dk.bytes == fused.dk.bytes) << "dk";
    EXPECT_TRUE(split.dv.bytes == fused.dv.bytes) << "dv";
    int64_t unwritten = 0;  // (run() poisons every output with NaN first)
    for (const Buf* b : {&fused.dq, &fused.dk, &fused.dv})
      for (int64_t i = 0; i < b->n; ++i) unwritten += std::isnan(b->at(i));
    EXPECT_EQ(unwritten, 0) << "gradient elements left NaN";
  }
}

}  // namespace
}  // namespace flashattn::test
