// Packed variable-length batches on the CUDA backend (flashattn_forward_varlen / _backward_varlen):
// every sequence's outputs against the float64 reference of that sequence alone (the CPU suite's
// cases, tests/varlen_cases.hpp, plus head dims and lengths of the GPU tiles: 1..4096 in one
// batch), in the default and the deterministic backward; each sequence bit for bit equal to the
// dense call of that sequence on the same kernels; the sequence arrays checked on the device. Outputs are poisoned
// (NaN) before each call, so an element no kernel wrote fails.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "varlen_cases.hpp"

namespace flashattn::test {
namespace {

// A VarRun's buffers on device 0: inputs copied, outputs poisoned before every call and copied
// back into the VarRun's host buffers after it (so check_against_reference judges the device's
// results).
struct DeviceVarRun {
  VarRun& r;
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  Tensor q, k, v, out, lse, dout, dq, dk, dv, cq, ck, used, slopes;
  Varlen vl;
  bool ok = true;

  explicit DeviceVarRun(VarRun& r_) : r(r_) {
    q = upload(r.q.t, r.q.bytes);
    k = upload(r.k.t, r.k.bytes);
    v = upload(r.v.t, r.v.bytes);
    dout = upload(r.dout.t, r.dout.bytes);
    out = upload(r.out.t, r.out.bytes);
    lse = upload(r.lse.t, r.lse.bytes);
    dq = upload(r.dq.t, r.dq.bytes);
    dk = upload(r.dk.t, r.dk.bytes);
    dv = upload(r.dv.t, r.dv.bytes);
    cq = upload_index(r.cu_q);
    ck = upload_index(r.cu_k);
    vl = r.vl;
    vl.cu_seqlens_q = &cq;
    vl.cu_seqlens_k = &ck;
    if (!r.used.empty()) {
      used = upload_index(r.used);
      vl.seqused_k = &used;
    }
    if (!r.slopes.empty()) {
      std::vector<unsigned char> b(r.slopes.size() * 4);
      std::memcpy(b.data(), r.slopes.data(), b.size());
      slopes = upload(r.tslopes, b);
    }
  }
  Tensor upload(const Tensor& host, const std::vector<unsigned char>& bytes) {
    bufs.push_back(std::make_unique<DeviceBuffer>(bytes.size() + 16));
    Tensor t = host;
    t.data = bufs.back()->ptr;
    t.device = 0;
    if (t.data == nullptr || cudaMemcpy(t.data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      ok = false;
    return t;
  }
  Tensor upload_index(std::vector<int32_t>& x) {
    std::vector<unsigned char> b(x.size() * 4);
    std::memcpy(b.data(), x.data(), b.size());
    return upload(index_tensor(x), b);
  }
  Options options(bool deterministic, Precision prec) const {
    Options o = r.options(1);
    o.deterministic = deterministic;
    o.precision = prec;
    o.alibi_slopes = r.slopes.empty() ? nullptr : &slopes;
    return o;
  }
  void poison() {
    const Tensor* o[] = {&out, &lse, &dq, &dk, &dv};
    const Buf* h[] = {&r.out, &r.lse, &r.dq, &r.dk, &r.dv};
    for (int i = 0; i < 5; ++i) (void)cudaMemset(o[i]->data, 0xff, h[i]->bytes.size());
  }
  void run(bool deterministic, Precision prec = Precision::Fp32) {
    poison();
    const Options o = options(deterministic, prec);
    forward_varlen(q, k, v, out, lse, vl, o);
    backward_varlen(q, k, v, out, dout, lse, dq, dk, dv, vl, o);
    download();
  }
  // Whether every output byte on the device is still poison() (0xff): nothing was written.
  bool untouched() {
    EXPECT_EQ(cudaSuccess, cudaDeviceSynchronize());
    const Tensor* o[] = {&out, &lse, &dq, &dk, &dv};
    const Buf* h[] = {&r.out, &r.lse, &r.dq, &r.dk, &r.dv};
    for (int i = 0; i < 5; ++i) {
      std::vector<unsigned char> b(h[i]->bytes.size());
      EXPECT_EQ(cudaSuccess, cudaMemcpy(b.data(), o[i]->data, b.size(), cudaMemcpyDeviceToHost));
      for (unsigned char x : b)
        if (x != 0xff) return false;
    }
    return true;
  }
  void download() {
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    const Tensor* o[] = {&out, &lse, &dq, &dk, &dv};
    Buf* h[] = {&r.out, &r.lse, &r.dq, &r.dk, &r.dv};
    for (int i = 0; i < 5; ++i)
      ASSERT_EQ(cudaSuccess, cudaMemcpy(h[i]->bytes.data(), o[i]->data, h[i]->bytes.size(), cudaMemcpyDeviceToHost));
  }
};

using testing::AlibiKind;

// The CPU suite's cases (float64 is CPU-only) and cases at the GPU kernels' head dims and tiles.
std::vector<VarCase> cuda_cases() {
  std::vector<VarCase> v;
  for (const VarCase& c : reference_cases())
    if (c.dtype != DType::Float64) v.push_back(c);
  const std::vector<int32_t> lq = {1, 300, 77, 0, 129, 64}, lk = {1, 200, 500, 9, 129, 0};
  v.push_back({"Bf16D128GqaCausal", lq, lk, {}, 8, 2, 128, DType::BFloat16, Mask::CausalBottomRight});
  v.push_back({"F16D64WindowSoftcap", lq, lk, {}, 4, 4, 64, DType::Float16, Mask::None, 48, 16, 20.0f});
  v.push_back({"F16D96TopLeft", lq, lk, {}, 2, 1, 96, DType::Float16, Mask::CausalTopLeft});
  v.push_back({"Bf16D256AlibiSequsedK", lq, lk, {1, 150, 500, 3, 0, 0}, 2, 1, 256, DType::BFloat16,
               Mask::CausalBottomRight, -1, -1, 0.0f, AlibiKind::BatchHeads});
  v.push_back({"F32D64Gqa", lq, lk, {}, 6, 3, 64, DType::Float32, Mask::CausalBottomRight});
  v.push_back({"F32D128WindowAlibi", lq, lk, {}, 2, 1, 128, DType::Float32, Mask::None, 100, 0, 0.0f,
               AlibiKind::Heads});
  v.push_back({"F32D256", {3, 70, 129}, {5, 33, 200}, {}, 2, 2, 256, DType::Float32, Mask::None});
  // Mixed 1..4096 in one batch.
  v.push_back({"Bf16Mixed1To4096", {4096, 1, 2049, 77, 1000}, {4096, 3, 2049, 500, 1}, {}, 2, 1, 64,
               DType::BFloat16, Mask::CausalBottomRight});
  // More sequences than the compact grid's table pre-pass scans per chunk (1024): the running
  // total carried across chunks; lengths 0..7 (the last sequence without queries).
  std::vector<int32_t> mq, mk;
  for (int i = 0; i < 1500; ++i) {
    mq.push_back(i == 1499 ? 0 : (i * 5) % 8);
    mk.push_back((i * 3) % 8 + 1);
  }
  v.push_back({"Bf16Many1500Short", mq, mk, {}, 2, 1, 64, DType::BFloat16, Mask::CausalBottomRight});
  return v;
}

class VarlenCuda : public ::testing::TestWithParam<VarCase> {};

// The kernel families a packed call of this dtype can run on this GPU: 16-bit calls on the sm_90a
// kernels (per-sequence tensor maps) and on the mma.sync ones (FLASHATTN_CUDA_ARCH = sm80); float32
// calls on the mma.sync ones only ("sm80" is also their default on a 9.0 device).
// "sm90-compact": the sm_90a kernels with the forward's compact grid (FLASHATTN_CUDA_PACKED_GRID).
std::vector<const char*> arches(DType t) {
  if (t == DType::Float32) return {"sm80"};
  return {"sm90", "sm90-compact", "sm80"};
}
// The overrides of one entry of arches().
struct ArchScope {
  EnvScope arch, grid;
  explicit ArchScope(const std::string& name)
      : arch("FLASHATTN_CUDA_ARCH", name == "sm80" ? "sm80" : "sm90"),
        grid("FLASHATTN_CUDA_PACKED_GRID", name == "sm90-compact" ? "compact" : "dense") {}
};

// The default backward (the atomic design for 16-bit types: the sm_90a dK/dV kernel where it
// exists) and the deterministic one, each against the float64 reference per sequence, on every
// kernel family.
TEST_P(VarlenCuda, MatchesReferencePerSequence) {
  REQUIRE_GPU();
  VarRun r(GetParam());
  DeviceVarRun d(r);
  ASSERT_TRUE(d.ok) << "cudaMalloc / cudaMemcpy failed";
  for (const char* arch : arches(GetParam().dtype)) {
    ArchScope env(arch);
    for (bool det : {false, true}) {
      SCOPED_TRACE(std::string(arch) + (det ? " deterministic" : " default"));
      d.run(det);
      if (HasFatalFailure()) return;
      check_against_reference(r);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, VarlenCuda, ::testing::ValuesIn(cuda_cases()),
                         [](const ::testing::TestParamInfo<VarCase>& i) { return i.param.name; });

// Each sequence of a packed call equals the dense call of that sequence (B = 1, views into the
// packed buffers) on the same kernels, bit for bit: every kernel family (arches), every float32
// precision, both backward designs (the atomic one's dQ sums in no fixed order: its dQ is
// compared with the reference by VarlenCuda instead).
class VarlenCudaDense : public ::testing::TestWithParam<VarCase> {};

TEST_P(VarlenCudaDense, PackedEqualsDensePerSequenceBitwise) {
  REQUIRE_GPU();
  const VarCase& c = GetParam();
  const std::vector<Precision> precs =
      c.dtype == DType::Float32 ? std::vector<Precision>{Precision::Fp32, Precision::Tf32} : std::vector<Precision>{Precision::Fp32};
  for (const char* arch_name : arches(c.dtype))
  for (bool det : {true, false})
  for (Precision prec : precs) {
    SCOPED_TRACE(std::string(arch_name) + (det ? " deterministic " : " default ") + (prec == Precision::Tf32 ? "tf32" : "fp32"));
    ArchScope arch(arch_name);
    // Packed calls never take the GQA head split (a CTA per query head, the group's dK/dV summed
    // per head: another float order than one CTA per kv head), which dense ones may by rule:
    // both runs here without it.
    EnvScope no_split_a("FLASHATTN_CUDA_ATOMIC_HEADS", "0"), no_split_o("FLASHATTN_CUDA_ORD_HEADS", "0");
    VarRun r(c);
    DeviceVarRun d(r);
    ASSERT_TRUE(d.ok) << "cudaMalloc / cudaMemcpy failed";
    d.run(det, prec);
    if (HasFatalFailure()) return;
    const int64_t D = c.d, Hq = c.hq, Hkv = c.hkv, es = dtype_size(c.dtype);
    for (int64_t b = 0; b < r.batch(); ++b) {
      const int64_t sq = c.lq[b], skv = r.used_k(b), q0 = r.cu_q[b], k0 = r.cu_k[b];
      if (sq == 0 || skv == 0) continue;  // dense shapes are positive (the reference test covers these)
      SCOPED_TRACE("sequence " + std::to_string(b));
      auto view = [&](const Tensor& x, int64_t r0, int64_t n, int64_t h) {
        return Tensor::bshd(static_cast<char*>(x.data) + r0 * h * D * es, c.dtype, 1, h, n, D, 0);
      };
      DeviceBuffer out(sq * Hq * D * es), dq(sq * Hq * D * es), dk(skv * Hkv * D * es), dv(skv * Hkv * D * es),
          lse(Hq * sq * 4);
      ASSERT_TRUE(out.ptr && dq.ptr && dk.ptr && dv.ptr && lse.ptr);
      for (DeviceBuffer* x : {&out, &dq, &dk, &dv, &lse}) (void)cudaMemset(x->ptr, 0xff, x->bytes);
      Options o = d.options(det, prec);
      Tensor sl;
      if (!r.slopes.empty()) {
        sl = d.slopes;
        sl.ndim = 1;
        sl.shape[0] = Hq;
        sl.stride[0] = 1;
        if (c.alibi == AlibiKind::BatchHeads) sl.data = static_cast<float*>(d.slopes.data) + b * Hq;
        o.alibi_slopes = &sl;
      }
      const Tensor tout = Tensor::bshd(out.ptr, c.dtype, 1, Hq, sq, D, 0), tdq = Tensor::bshd(dq.ptr, c.dtype, 1, Hq, sq, D, 0),
                   tdk = Tensor::bshd(dk.ptr, c.dtype, 1, Hkv, skv, D, 0), tdv = Tensor::bshd(dv.ptr, c.dtype, 1, Hkv, skv, D, 0);
      const Tensor tlse = Tensor::lse(static_cast<float*>(lse.ptr), 1, Hq, sq, 0);
      forward(view(d.q, q0, sq, Hq), view(d.k, k0, skv, Hkv), view(d.v, k0, skv, Hkv), tout, tlse, o);
      backward(view(d.q, q0, sq, Hq), view(d.k, k0, skv, Hkv), view(d.v, k0, skv, Hkv), tout,
               view(d.dout, q0, sq, Hq), tlse, tdq, tdk, tdv, o);
      ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
      auto host = [](const DeviceBuffer& x) {
        std::vector<unsigned char> h(x.bytes);
        (void)cudaMemcpy(h.data(), x.ptr, x.bytes, cudaMemcpyDeviceToHost);
        return h;
      };
      EXPECT_TRUE(host(out) == rows_bytes(r.out, q0, sq, Hq * D)) << "out";
      if (det) EXPECT_TRUE(host(dq) == rows_bytes(r.dq, q0, sq, Hq * D)) << "dq";
      EXPECT_TRUE(host(dk) == rows_bytes(r.dk, k0, skv, Hkv * D)) << "dk";
      EXPECT_TRUE(host(dv) == rows_bytes(r.dv, k0, skv, Hkv * D)) << "dv";
      const std::vector<unsigned char> l = host(lse);
      int64_t lse_diff = 0;
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < sq; ++i)
          lse_diff += std::memcmp(&l[(h * sq + i) * 4], &r.lse.bytes[(h * r.tq + q0 + i) * 4], 4) != 0;
      EXPECT_EQ(lse_diff, 0) << "lse";
    }
  }
}

std::vector<VarCase> dense_cases() {
  std::vector<VarCase> v;
  for (const VarCase& c : cuda_cases())
    if (c.name != "Bf16Mixed1To4096" && c.name != "Bf16Many1500Short") v.push_back(c);
  return v;
}
INSTANTIATE_TEST_SUITE_P(Cases, VarlenCudaDense, ::testing::ValuesIn(dense_cases()),
                         [](const ::testing::TestParamInfo<VarCase>& i) { return i.param.name; });

// The sequence arrays must be on the call's device. Their contents are checked there
// (common/seq_check.hpp: the call's kernels queue behind the check and see only empty sequences
// when it fails), and the call raises validation's own error with every output as it was: forward
// and backward, each kernel family (16-bit on the sm_90a and the mma.sync kernels, float32), each
// rule, and a good call after the failures on the same buffers.
TEST(VarlenCudaBadInput, SequenceArrays) {
  REQUIRE_GPU();
  for (DType t : {DType::BFloat16, DType::Float32})
    for (const char* arch : arches(t)) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " " + arch);
      ArchScope scope(arch);
      VarCase c{"bad", {3, 0, 5}, {4, 2, 5}, {2, 1, 5}, 2, 1, 64, t};
      VarRun r(c);
      DeviceVarRun d(r);
      ASSERT_TRUE(d.ok);
      const Options o = d.options(false, Precision::Fp32);
      auto expect_error = [&](const Varlen& vl, const std::string& fragment) {
        for (int pass = 0; pass < 2; ++pass) {
          SCOPED_TRACE(pass == 0 ? "forward" : "backward");
          d.poison();
          try {
            if (pass == 0)
              forward_varlen(d.q, d.k, d.v, d.out, d.lse, vl, o);
            else
              backward_varlen(d.q, d.k, d.v, d.out, d.dout, d.lse, d.dq, d.dk, d.dv, vl, o);
            ADD_FAILURE() << "accepted";
          } catch (const Error& e) {
            EXPECT_EQ(e.status(), Status::InvalidArgument) << e.what();
            EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
          }
          EXPECT_TRUE(d.untouched()) << "an output was written";
        }
      };
      {
        Varlen vl = d.vl;
        Tensor host_cq = index_tensor(r.cu_q);  // on the CPU while q is on device 0
        vl.cu_seqlens_q = &host_cq;
        expect_error(vl, "cu_seqlens_q");
      }
      // Each rule broken once, on the device: (array, contents, the error's words).
      struct Bad {
        int which;  // 0 cu_seqlens_q, 1 cu_seqlens_k, 2 seqused_k
        std::vector<int32_t> v;
        const char* fragment;
      };
      const std::vector<Bad> bads = {
          {0, {0, 3, 2, 8}, "non-decreasing"},
          {0, {1, 3, 3, 8}, "cu_seqlens_q[0] = 1"},
          {0, {0, 3, 3, 7}, "does not match"},
          {1, {0, 4, 6, 12}, "max_seqlen_k"},
          {2, {2, 3, 5}, "seqused_k[1] = 3"},
          {2, {-1, 1, 5}, "seqused_k[0] = -1"},
      };
      for (const Bad& bad : bads) {
        SCOPED_TRACE(bad.fragment);
        DeviceBuffer buf(64);
        ASSERT_EQ(cudaSuccess, cudaMemcpy(buf.ptr, bad.v.data(), bad.v.size() * 4, cudaMemcpyHostToDevice));
        std::vector<int32_t> shape_of = bad.v;
        Tensor tb = index_tensor(shape_of);
        tb.data = buf.ptr;
        tb.device = 0;
        Varlen vl = d.vl;
        (bad.which == 0 ? vl.cu_seqlens_q : bad.which == 1 ? vl.cu_seqlens_k : vl.seqused_k) = &tb;
        expect_error(vl, bad.fragment);
      }
      // The good arrays after all that: the call runs and writes its outputs.
      d.run(false);
      EXPECT_FALSE(d.untouched());
      check_against_reference(r);
    }
}

// Under CUDA graph capture a packed call's check of its sequence arrays is captured with its
// kernels (nothing waits for it): the replayed graph computes what the eager calls compute, bit
// for bit (the same kernels on the same inputs; the deterministic backward); arrays broken on the
// device before a replay make it write nothing and count one failure per checked call
// (cuda_take_check_failures), and once mended the same graph computes the same results again.
TEST(VarlenCudaGraph, CapturedAndReplayed) {
  REQUIRE_GPU();
  VarCase c{"capture", {3, 0, 5}, {4, 2, 5}, {}, 2, 1, 64, DType::BFloat16};
  VarRun r(c);
  DeviceVarRun d(r);
  ASSERT_TRUE(d.ok);
  EXPECT_GE(cuda_take_check_failures(0), 0);  // (a clean count)
  d.run(true);
  check_against_reference(r);
  const std::vector<unsigned char> out0 = r.out.bytes, lse0 = r.lse.bytes, dq0 = r.dq.bytes, dk0 = r.dk.bytes,
                                   dv0 = r.dv.bytes;
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  Options o = d.options(true, Precision::Fp32);
  o.stream = st;
  cudaGraph_t g = nullptr;
  ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  try {
    forward_varlen(d.q, d.k, d.v, d.out, d.lse, d.vl, o);
    backward_varlen(d.q, d.k, d.v, d.out, d.dout, d.lse, d.dq, d.dk, d.dv, d.vl, o);
  } catch (const Error& e) {
    ADD_FAILURE() << "refused under capture: " << e.what();
  }
  ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(st, &g));
  cudaGraphExec_t ex = nullptr;
  ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&ex, g, 0));
  auto replay = [&] {
    d.poison();
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    ASSERT_EQ(cudaSuccess, cudaGraphLaunch(ex, st));
    ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(st));
    d.download();
  };
  replay();
  EXPECT_TRUE(r.out.bytes == out0 && r.lse.bytes == lse0) << "the replayed forward differs from the eager one";
  EXPECT_TRUE(r.dq.bytes == dq0 && r.dk.bytes == dk0 && r.dv.bytes == dv0)
      << "the replayed backward differs from the eager one";
  EXPECT_EQ(cuda_take_check_failures(0), 0);
  // cu_seqlens_q decreasing, written into the captured array.
  const std::vector<int32_t> bad = {0, 3, 2, 8};
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d.cq.data, bad.data(), bad.size() * 4, cudaMemcpyHostToDevice));
  replay();
  EXPECT_TRUE(d.untouched()) << "a replay with broken arrays wrote an output";
  EXPECT_EQ(cuda_take_check_failures(0), 2) << "the forward's and the backward's checks";
  ASSERT_EQ(cudaSuccess, cudaMemcpy(d.cq.data, r.cu_q.data(), r.cu_q.size() * 4, cudaMemcpyHostToDevice));
  replay();
  EXPECT_TRUE(r.out.bytes == out0 && r.dq.bytes == dq0 && r.dk.bytes == dk0 && r.dv.bytes == dv0);
  EXPECT_EQ(cuda_take_check_failures(0), 0);
  EXPECT_EQ(cudaSuccess, cudaGraphExecDestroy(ex));
  EXPECT_EQ(cudaSuccess, cudaGraphDestroy(g));
  EXPECT_EQ(cudaSuccess, cudaStreamDestroy(st));
}

}  // namespace
}  // namespace flashattn::test
