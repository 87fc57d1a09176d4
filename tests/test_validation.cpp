// Every bad input gets an Error of the right kind whose message names the argument and the values,
// and nothing is written before it is raised: each case snapshots every buffer (inputs, and
// outputs still holding their NaN poison) and checks that the failed call left all bytes as they
// were. Legitimate but unusual layouts (interleaved packed outputs, broadcast inputs) must be
// accepted and computed correctly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "test_util.hpp"

#ifndef FLASHATTN_TEST_CUDA_BUILT
#define FLASHATTN_TEST_CUDA_BUILT 0
#endif

namespace flashattn::test {
namespace {

enum Dir { kFwd = 1, kBwd = 2, kBoth = 3 };

const char* const kNames[] = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"};

// Which directions take a tensor as an argument.
int dirs_of(const std::string& n) {
  return (n == "dout" || n == "dq" || n == "dk" || n == "dv") ? kBwd : kBoth;
}

std::string dims(const int64_t* d, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ProblemConfig base_config(DType dt = DType::Float32) {
  return make_config(2, 4, 2, 5, 7, 8, Mask::None, dt, testing::Layout::BHSD, 0.0f, /*seed=*/3);
}

class BadInput : public ::testing::Test {
 protected:
  explicit BadInput(DType dt = DType::Float32) : p(base_config(dt)) { reset(); }

  void reset() {
    q = p.q.view;
    k = p.k.view;
    v = p.v.view;
    out = p.out.view;
    lse = p.lse.view;
    dout = p.dout.view;
    dq = p.dq.view;
    dk = p.dk.view;
    dv = p.dv.view;
    o = Options{};
  }

  Tensor& t(const std::string& n) {
    if (n == "q") return q;
    if (n == "k") return k;
    if (n == "v") return v;
    if (n == "out") return out;
    if (n == "lse") return lse;
    if (n == "dout") return dout;
    if (n == "dq") return dq;
    if (n == "dk") return dk;
    if (n == "dv") return dv;
    ADD_FAILURE() << "no tensor " << n;
    return q;
  }

  // The forward and/or backward must fail with `status` and a message containing every needle,
  // and leave every buffer of the problem as it was.
  void expect(int dirs, Status status, const std::vector<std::string>& needles) {
    const Snapshot before = snapshot(p);
    if (dirs & kFwd) {
      EXPECT_TRUE(throws_error([&] { forward(q, k, v, out, lse, o); }, status, needles))
          << "forward";
      EXPECT_TRUE(snapshot(p) == before) << "the failed forward wrote to a buffer";
    }
    if (dirs & kBwd) {
      EXPECT_TRUE(
          throws_error([&] { backward(q, k, v, out, dout, lse, dq, dk, dv, o); }, status, needles))
          << "backward";
      EXPECT_TRUE(snapshot(p) == before) << "the failed backward wrote to a buffer";
    }
  }

  Problem p;
  Tensor q, k, v, out, lse, dout, dq, dk, dv;
  Options o;
};

TEST_F(BadInput, WrongNdim) {
  for (const std::string n : kNames) {
    SCOPED_TRACE(n);
    for (int32_t nd : {0, 2, 3, 4}) {
      const int32_t want = n == "lse" ? 3 : 4;
      if (nd == want) continue;
      reset();
      t(n).ndim = nd;
      expect(dirs_of(n), Status::InvalidArgument,
             {n + ".ndim = " + std::to_string(nd), "expected " + std::to_string(want)});
    }
  }
}

// Each dimension of each tensor, against the tensor it must match.
TEST_F(BadInput, MismatchedShapes) {
  struct Row {
    const char* name;
    int dim;
    const char* ref;
    const char* what;
  };
  const Row rows[] = {
      {"k", 0, "q", "batch"},      {"k", 3, "q", "head_dim"},   {"v", 0, "k", "batch"},
      {"v", 1, "k", "heads"},      {"v", 2, "k", "seq"},        {"v", 3, "k", "head_dim"},
      {"out", 0, "q", "batch"},    {"out", 1, "q", "heads"},    {"out", 2, "q", "seq"},
      {"out", 3, "q", "head_dim"}, {"dout", 0, "q", "batch"},   {"dout", 1, "q", "heads"},
      {"dout", 2, "q", "seq"},     {"dout", 3, "q", "head_dim"}, {"dq", 0, "q", "batch"},
      {"dq", 1, "q", "heads"},     {"dq", 2, "q", "seq"},       {"dq", 3, "q", "head_dim"},
      {"dk", 0, "k", "batch"},     {"dk", 1, "k", "heads"},     {"dk", 2, "k", "seq"},
      {"dk", 3, "k", "head_dim"},  {"dv", 0, "k", "batch"},     {"dv", 1, "k", "heads"},
      {"dv", 2, "k", "seq"},       {"dv", 3, "k", "head_dim"},  {"lse", 0, "q", "batch"},
      {"lse", 1, "q", "heads"},    {"lse", 2, "q", "seq_q"},
  };
  for (const Row& r : rows) {
    for (int64_t delta : {1, -1}) {
      reset();
      Tensor& x = t(r.name);
      const int64_t want = x.shape[r.dim];
      x.shape[r.dim] += delta;
      if (x.shape[r.dim] == 0) continue;
      SCOPED_TRACE(std::string(r.name) + " dim " + std::to_string(r.dim));
      const std::string n = r.name;
      expect(dirs_of(n), Status::InvalidArgument,
             {n + ".shape[" + std::to_string(r.dim) + "] (" + r.what + ") = " +
                  std::to_string(x.shape[r.dim]),
              std::string("does not match ") + r.ref + ".shape[" + std::to_string(r.dim) +
                  "] = " + std::to_string(want)});
    }
  }
  // Dimensions of q and k that define the problem: the first tensor that disagrees is named.
  reset();
  q.shape[0] = 3;
  expect(kBoth, Status::InvalidArgument, {"k.shape[0] (batch) = 2", "q.shape[0] = 3"});
  reset();
  q.shape[2] = 6;
  expect(kBoth, Status::InvalidArgument, {"out.shape[2] (seq) = 5", "q.shape[2] = 6"});
  reset();
  q.shape[3] = 9;
  expect(kBoth, Status::InvalidArgument, {"k.shape[3] (head_dim) = 8", "q.shape[3] = 9"});
  reset();
  k.shape[2] = 8;
  expect(kBoth, Status::InvalidArgument, {"v.shape[2] (seq) = 7", "k.shape[2] = 8"});
}

TEST_F(BadInput, KvHeadsNotDividingQueryHeads) {
  for (int64_t hkv : {3, 8}) {
    reset();
    for (Tensor* x : {&k, &v, &dk, &dv}) x->shape[1] = hkv;
    expect(kBoth, Status::InvalidArgument,
           {"k.shape[1] (kv heads) = " + std::to_string(hkv), "does not divide",
            "q.shape[1] (query heads) = 4"});
  }
}

TEST_F(BadInput, UnknownDtypeCode) {
  const std::pair<const char*, int32_t> cases[] = {{"q", 7},   {"k", -1}, {"v", 4},  {"out", 5},
                                                   {"lse", 9}, {"dout", 100}, {"dq", 4},
                                                   {"dk", -3}, {"dv", 1000}};
  for (const auto& [n, code] : cases) {
    SCOPED_TRACE(n);
    reset();
    t(n).dtype = static_cast<DType>(code);
    expect(dirs_of(n), Status::InvalidArgument,
           {std::string(n) + ".dtype = code " + std::to_string(code), "not a flashattn dtype"});
  }
}

TEST_F(BadInput, DtypeMismatch) {
  reset();
  k.dtype = DType::Float16;
  expect(kBoth, Status::InvalidArgument, {"same dtype", "q.dtype: float32", "k.dtype: float16"});
  reset();
  v.dtype = DType::BFloat16;
  expect(kBoth, Status::InvalidArgument, {"same dtype", "q.dtype: float32", "v.dtype: bfloat16"});
  const std::pair<const char*, DType> cases[] = {{"out", DType::Float64},
                                                 {"dout", DType::Float16},
                                                 {"dq", DType::BFloat16},
                                                 {"dk", DType::Float64},
                                                 {"dv", DType::Float16}};
  for (const auto& [n, dt] : cases) {
    SCOPED_TRACE(n);
    reset();
    t(n).dtype = dt;
    expect(dirs_of(n), Status::InvalidArgument,
           {std::string(n) + ".dtype = " + dtype_name(dt), "must equal q.dtype = float32"});
  }
}

TEST_F(BadInput, LseNotFloat32) {
  for (DType dt : {DType::Float64, DType::Float16, DType::BFloat16}) {
    reset();
    lse.dtype = dt;
    expect(kBoth, Status::InvalidArgument,
           {std::string("lse.dtype = ") + dtype_name(dt), "expected float32"});
  }
}

TEST_F(BadInput, HeadDimZero) {
  for (Tensor* x : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) x->shape[3] = 0;
  expect(kBoth, Status::InvalidArgument,
         {"q.shape = [2, 4, 5, 0]", "zero-size or negative dimension 3"});
}

TEST(BadInputHeadDim, HeadDim257IsUnsupported) {
  ProblemConfig c = base_config();
  c.batch = 1;
  c.heads_q = c.heads_kv = 1;
  c.seq_q = 2;
  c.seq_kv = 3;
  c.head_dim = 257;
  Problem p(c);
  const Snapshot before = snapshot(p);
  const std::vector<std::string> needles = {"q.shape[3] (head_dim) = 257", "not supported",
                                            "1..256"};
  EXPECT_TRUE(throws_error([&] { run_forward(p, Options{}); }, Status::Unsupported, needles));
  EXPECT_TRUE(throws_error([&] { run_backward(p, Options{}); }, Status::Unsupported, needles));
  EXPECT_TRUE(snapshot(p) == before);
}

TEST_F(BadInput, MixedDevices) {
  for (const std::string n : kNames) {
    if (n == "q") continue;
    SCOPED_TRACE(n);
    reset();
    t(n).device = 0;
    expect(dirs_of(n), Status::InvalidArgument,
           {"different devices", "q is on cpu", n + " is on cuda:0"});
  }
  reset();
  q.device = 1;
  expect(kBoth, Status::InvalidArgument, {"different devices", "q is on cuda:1", "k is on cpu"});
  reset();
  v.device = -2;
  expect(kBoth, Status::InvalidArgument, {"v.device = -2", "invalid"});
}

// Host memory described as CUDA device memory.
TEST_F(BadInput, CudaDeviceWithHostPointers) {
  for (const std::string n : kNames) t(n).device = 0;
  if (!FLASHATTN_TEST_CUDA_BUILT) {
    expect(kBoth, Status::Unsupported, {"q.device = 0", "no CUDA backend"});
  } else if (cuda_available()) {
    // The pointer check (cudaPointerGetAttributes) names the first tensor in host memory.
    expect(kBoth, Status::InvalidArgument, {"q.data", "q.device = 0"});
  } else {
    // CUDA compiled in but no device: refused before any write, the tensor named.
    const Snapshot before = snapshot(p);
    try {
      forward(q, k, v, out, lse, o);
      ADD_FAILURE() << "forward on host pointers as cuda:0 succeeded";
    } catch (const Error& e) {
      EXPECT_TRUE(e.status() == Status::InvalidArgument || e.status() == Status::Unsupported)
          << static_cast<int>(e.status()) << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("q."), std::string::npos) << e.what();
    }
    EXPECT_TRUE(snapshot(p) == before);
  }
}

TEST_F(BadInput, NullData) {
  for (const std::string n : kNames) {
    SCOPED_TRACE(n);
    reset();
    t(n).data = nullptr;
    expect(dirs_of(n), Status::InvalidArgument, {n + ".data is NULL"});
  }
}

TEST_F(BadInput, ZeroSizeAndNegativeDims) {
  for (const std::string n : kNames) {
    for (int d = 0; d < t(n).ndim; ++d)
      for (int64_t bad : {0, -1}) {
        SCOPED_TRACE(n + " dim " + std::to_string(d));
        reset();
        Tensor& x = t(n);
        x.shape[d] = bad;
        expect(dirs_of(n), Status::InvalidArgument,
               {n + ".shape = " + dims(x.shape, x.ndim),
                "zero-size or negative dimension " + std::to_string(d)});
      }
  }
}

TEST_F(BadInput, NegativeStrides) {
  for (const std::string n : kNames) {
    for (int d = 0; d < t(n).ndim; ++d) {
      SCOPED_TRACE(n + " dim " + std::to_string(d));
      reset();
      Tensor& x = t(n);
      x.stride[d] = -x.stride[d];
      expect(dirs_of(n), Status::InvalidArgument,
             {n + ".stride = " + dims(x.stride, x.ndim),
              "negative stride in dimension " + std::to_string(d)});
    }
  }
}

TEST_F(BadInput, HeadDimStrideNotOne) {
  for (const std::string n : kNames) {
    if (n == "lse") continue;
    SCOPED_TRACE(n);
    reset();
    t(n).stride[3] = 2;
    expect(dirs_of(n), Status::InvalidArgument,
           {n + ".stride[3] (head_dim) = 2", "must be 1"});
  }
}

TEST_F(BadInput, OverlappingOutputStrides) {
  struct Row {
    const char* name;
    int dim;
    int64_t stride;
  };
  // B=2, Hq=4, Hkv=2, Sq=5, Skv=7, D=8, contiguous.
  const Row rows[] = {{"out", 2, 0}, {"out", 1, 8},  {"lse", 2, 0}, {"lse", 1, 1},
                      {"dq", 1, 8},  {"dq", 0, 100}, {"dk", 0, 0},  {"dv", 2, 4}};
  for (const Row& r : rows) {
    SCOPED_TRACE(std::string(r.name) + " dim " + std::to_string(r.dim));
    reset();
    Tensor& x = t(r.name);
    x.stride[r.dim] = r.stride;
    // out and lse are inputs of the backward, where overlapping (e.g. broadcast) strides are fine.
    const std::string n = r.name;
    expect(n == "out" || n == "lse" ? kFwd : dirs_of(n), Status::InvalidArgument,
           {n + " has overlapping strides",
            "shape " + dims(x.shape, x.ndim) + ", stride " + dims(x.stride, x.ndim)});
  }
}

TEST_F(BadInput, OutputAliasesInput) {
  auto at = [](const Tensor& x, int64_t elems) {
    return static_cast<void*>(static_cast<char*>(x.data) + elems * dtype_size(x.dtype));
  };
  struct Row {
    const char* out;
    const char* in;
    int64_t offset;  // elements of the output's dtype
    int dirs;
  };
  const Row rows[] = {
      {"out", "q", 0, kFwd},   {"out", "q", 100, kFwd}, {"lse", "q", 0, kFwd},
      {"lse", "v", 7, kFwd},   {"dq", "dout", 0, kBwd}, {"dq", "q", 0, kBwd},
      {"dq", "out", 0, kBwd},  {"dk", "k", 0, kBwd},    {"dv", "v", 0, kBwd},
      {"dk", "q", 3, kBwd},    {"dv", "dout", 0, kBwd},
  };
  // Each view stays inside the buffer it is placed on (or, for out on q + 100, runs on only into
  // buffers that are checked later), so the first aliased input is the one named.
  for (const Row& r : rows) {
    SCOPED_TRACE(std::string(r.out) + " on " + r.in + " + " + std::to_string(r.offset));
    reset();
    t(r.out).data = at(t(r.in), r.offset);
    expect(r.dirs, Status::InvalidArgument,
           {std::string("output ") + r.out + " aliases input " + r.in});
  }
  // lse is an input of the backward: placed inside dv, it is refused too.
  reset();
  lse.data = dv.data;
  expect(kBwd, Status::InvalidArgument, {"output dv aliases input lse"});
  // A partial overlap: dout starts 8 elements into dq.
  reset();
  dout.data = static_cast<float*>(dq.data) + 8;
  expect(kBwd, Status::InvalidArgument, {"output dq aliases input dout"});
}

TEST_F(BadInput, OutputsAliasEachOther) {
  reset();
  lse.data = out.data;
  expect(kFwd, Status::InvalidArgument, {"outputs out and lse overlap"});
  reset();
  dv.data = dk.data;
  expect(kBwd, Status::InvalidArgument, {"outputs dk and dv overlap"});
  reset();
  dk.data = static_cast<float*>(dq.data) + 3;
  expect(kBwd, Status::InvalidArgument, {"outputs dq and dk overlap"});
  reset();
  dv.data = static_cast<float*>(dq.data) + 40;
  expect(kBwd, Status::InvalidArgument, {"outputs dq and dv overlap"});
}

TEST_F(BadInput, IndexArithmeticOverflows) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  reset();
  q.shape[0] = q.shape[1] = q.shape[2] = q.shape[3] = int64_t{1} << 16;  // 2^64 elements
  q.stride[0] = q.stride[1] = q.stride[2] = 0;
  expect(kBoth, Status::InvalidArgument,
         {"q with shape [65536, 65536, 65536, 65536]", "too large", "overflows int64"});
  reset();
  k.stride[0] = kMax;  // (B-1) * stride alone is INT64_MAX; the other dims push it over
  expect(kBoth, Status::InvalidArgument,
         {"k with shape [2, 2, 7, 8] and stride [" + std::to_string(kMax), "overflows int64"});
  reset();
  lse.stride[0] = int64_t{1} << 61;
  lse.stride[1] = int64_t{1} << 62;  // (Hq - 1) * 2^62 = 3 * 2^62 does not fit
  expect(kBoth, Status::InvalidArgument, {"lse with shape [2, 4, 5]", "overflows int64"});
  reset();
  dq.stride[0] = (int64_t{1} << 61) + 1;  // offsets fit, bytes (x4) do not
  expect(kBwd, Status::InvalidArgument, {"dq with shape [2, 4, 5, 8]", "byte extent overflows"});
}

TEST_F(BadInput, UnknownMask) {
  for (int32_t m : {3, -1, 100}) {
    reset();
    o.mask = static_cast<Mask>(m);
    expect(kBoth, Status::InvalidArgument, {"options.mask = " + std::to_string(m), "unknown"});
  }
}

TEST_F(BadInput, UnknownPrecision) {
  for (int32_t pr : {2, -1}) {
    reset();
    o.precision = static_cast<Precision>(pr);
    expect(kBoth, Status::InvalidArgument,
           {"options.precision = " + std::to_string(pr), "unknown"});
  }
}

TEST_F(BadInput, NonFiniteSoftmaxScale) {
  const std::pair<float, const char*> cases[] = {
      {std::numeric_limits<float>::quiet_NaN(), "nan"},
      {std::numeric_limits<float>::infinity(), "inf"},
      {-std::numeric_limits<float>::infinity(), "-inf"}};
  for (const auto& [s, text] : cases) {
    reset();
    o.softmax_scale = s;
    expect(kBoth, Status::InvalidArgument,
           {std::string("options.softmax_scale = ") + text, "not finite"});
  }
}

TEST_F(BadInput, NegativeNumThreads) {
  for (int32_t n : {-1, std::numeric_limits<int32_t>::min()}) {
    reset();
    o.num_threads = n;
    expect(kBoth, Status::InvalidArgument,
           {"options.num_threads = " + std::to_string(n), "negative"});
  }
}

TEST_F(BadInput, MisalignedPointers) {
  const std::pair<const char*, int> cases[] = {{"q", 1}, {"k", 2}, {"v", 3},  {"out", 1},
                                               {"lse", 2}, {"dout", 1}, {"dq", 3}, {"dk", 2},
                                               {"dv", 1}};
  for (const auto& [n, bytes] : cases) {
    SCOPED_TRACE(n);
    reset();
    t(n).data = static_cast<char*>(t(n).data) + bytes;
    expect(dirs_of(n), Status::InvalidArgument,
           {std::string(n) + ".data = ", "not aligned to its element size (4 bytes for float32)"});
  }
}

class BadInputHalf : public BadInput {
 protected:
  BadInputHalf() : BadInput(DType::Float16) {}
};

TEST_F(BadInputHalf, MisalignedPointers) {
  out.data = static_cast<char*>(out.data) + 1;
  expect(kFwd, Status::InvalidArgument, {"out.data = ", "(2 bytes for float16)"});
  reset();
  lse.data = static_cast<char*>(lse.data) + 2;  // lse stays float32
  expect(kBoth, Status::InvalidArgument, {"lse.data = ", "(4 bytes for float32)"});
}

// ---- sliding window, softcap, ALiBi slopes ----------------------------------------------------

TEST_F(BadInput, WindowBelowMinusOne) {
  for (const char* side : {"window_left", "window_right"})
    for (int64_t w : {int64_t{-2}, int64_t{-100}, std::numeric_limits<int64_t>::min()}) {
      SCOPED_TRACE(std::string(side) + " " + std::to_string(w));
      reset();
      (std::string(side) == "window_left" ? o.window_left : o.window_right) = w;
      expect(kBoth, Status::InvalidArgument,
             {std::string("options.") + side + " = " + std::to_string(w), "invalid", ">= 0, or -1"});
    }
}

TEST_F(BadInput, SoftcapNotFiniteOrNegative) {
  const std::pair<float, const char*> cases[] = {{std::numeric_limits<float>::quiet_NaN(), "nan"},
                                                 {std::numeric_limits<float>::infinity(), "inf"},
                                                 {-std::numeric_limits<float>::infinity(), "-inf"},
                                                 {-0.5f, "-0.5"},
                                                 {-1e-30f, "-1e-30"}};
  for (const auto& [cap, text] : cases) {
    SCOPED_TRACE(text);
    reset();
    o.softcap = cap;
    expect(kBoth, Status::InvalidArgument, {std::string("options.softcap = ") + text, "invalid"});
  }
}

// ALiBi slopes for the base problem (B = 2, Hq = 4): a [B, Hq] float32 buffer with room around it.
class BadAlibi : public BadInput {
 protected:
  BadAlibi() : slopes(64, 0.25f) { set(1); }
  void set(int32_t ndim) {
    alibi = Tensor{};
    alibi.data = slopes.data() + 8;
    alibi.dtype = DType::Float32;
    alibi.ndim = ndim;
    if (ndim == 1) {
      alibi.shape[0] = 4;
      alibi.stride[0] = 1;
    } else {
      alibi.shape[0] = 2;
      alibi.shape[1] = 4;
      alibi.stride[0] = 4;
      alibi.stride[1] = 1;
    }
    o.alibi_slopes = &alibi;
  }
  void reset_all(int32_t ndim = 1) {
    reset();
    set(ndim);
  }
  // As BadInput::expect, and the slopes are never written either.
  void expect_alibi(int dirs, Status status, const std::vector<std::string>& needles) {
    const std::vector<float> before = slopes;
    expect(dirs, status, needles);
    EXPECT_TRUE(slopes == before) << "the slopes were written";
  }
  std::vector<float> slopes;
  Tensor alibi;
};

TEST_F(BadAlibi, ValidSlopesAreAccepted) {
  for (int32_t nd : {1, 2}) {
    reset_all(nd);
    EXPECT_NO_THROW(forward(q, k, v, out, lse, o)) << "ndim " << nd;
    EXPECT_NO_THROW(backward(q, k, v, out, dout, lse, dq, dk, dv, o)) << "ndim " << nd;
  }
}

TEST_F(BadAlibi, WrongDtype) {
  for (DType dt : {DType::Float64, DType::Float16, DType::BFloat16}) {
    reset_all();
    alibi.dtype = dt;
    expect_alibi(kBoth, Status::InvalidArgument,
                 {std::string("alibi_slopes.dtype = ") + dtype_name(dt), "expected float32"});
  }
}

TEST_F(BadAlibi, WrongNdim) {
  for (int32_t nd : {0, 3, 4, -1}) {
    reset_all();
    alibi.ndim = nd;
    expect_alibi(kBoth, Status::InvalidArgument,
                 {"alibi_slopes.ndim = " + std::to_string(nd), "expected 1 or 2", "[4] or [2, 4]"});
  }
}

TEST_F(BadAlibi, WrongShape) {
  struct Row {
    int32_t ndim;
    int64_t s0, s1;
    const char* text;
  };
  const Row rows[] = {{1, 5, 0, "[5]"}, {1, 3, 0, "[3]"}, {1, 2, 0, "[2]"},
                      {2, 3, 4, "[3, 4]"}, {2, 2, 5, "[2, 5]"}, {2, 1, 4, "[1, 4]"}, {2, 4, 2, "[4, 2]"}};
  for (const Row& r : rows) {
    SCOPED_TRACE(r.text);
    reset_all(r.ndim);
    alibi.shape[0] = r.s0;
    if (r.ndim == 2) alibi.shape[1] = r.s1;
    expect_alibi(kBoth, Status::InvalidArgument,
                 {std::string("alibi_slopes.shape = ") + r.text, "does not match q", "[4] or [2, 4]"});
  }
}

TEST_F(BadAlibi, NullDataMisalignedNegativeStride) {
  reset_all();
  alibi.data = nullptr;
  expect_alibi(kBoth, Status::InvalidArgument, {"alibi_slopes.data is NULL"});
  reset_all(2);
  alibi.data = reinterpret_cast<char*>(slopes.data()) + 2;
  expect_alibi(kBoth, Status::InvalidArgument, {"alibi_slopes.data = ", "not aligned to 4 bytes"});
  reset_all();
  alibi.stride[0] = -1;
  expect_alibi(kBoth, Status::InvalidArgument, {"alibi_slopes.stride = [-1]", "negative or huge stride"});
  reset_all(2);
  alibi.stride[0] = int64_t{1} << 50;
  expect_alibi(kBoth, Status::InvalidArgument, {"alibi_slopes.stride = [" + std::to_string(int64_t{1} << 50),
                                                "negative or huge stride"});
}

TEST_F(BadAlibi, WrongDevice) {
  reset_all();
  alibi.device = 0;
  expect_alibi(kBoth, Status::InvalidArgument, {"different devices", "q is on cpu", "alibi_slopes is on cuda:0"});
  reset_all();
  alibi.device = -2;
  expect_alibi(kBoth, Status::InvalidArgument, {"alibi_slopes.device = -2", "invalid"});
}

TEST_F(BadAlibi, OverlappingAnOutput) {
  // The slopes are read while the outputs are written: an output over them is refused.
  const std::pair<const char*, int> rows[] = {
      {"out", kFwd}, {"lse", kFwd}, {"dq", kBwd}, {"dk", kBwd}, {"dv", kBwd}};
  for (const auto& [n, dirs] : rows) {
    SCOPED_TRACE(n);
    reset_all(2);
    alibi.data = static_cast<char*>(t(n).data) + 4 * 3;  // a few elements into the output
    const Snapshot before = snapshot(p);
    expect(dirs, Status::InvalidArgument, {std::string("output ") + n + " aliases input alibi_slopes"});
    EXPECT_TRUE(snapshot(p) == before);
  }
}

// ---- legitimate layouts that must be accepted ------------------------------------------------

// ALiBi slopes in any legal layout give the bits of contiguous ones: [Hq] with a stride, and
// [B, Hq] with stride 0 over the batch (one row broadcast) or padded rows.
TEST(LegitimateLayouts, AlibiSlopeViews) {
  ProblemConfig c = make_config(2, 4, 2, 37, 45, 16, Mask::CausalBottomRight, DType::Float32,
                                testing::Layout::BHSD, 0.0f, /*seed=*/8);
  c.softcap = 20.0f;
  c.window_left = 9;
  Problem p(c);
  const std::vector<float> heads = {0.5f, 0.0f, -0.125f, 0.25f};
  const std::vector<float> rows = {0.5f, 0.0f, -0.125f, 0.25f, 0.75f, 1.0f, 0.0f, -0.5f};
  auto run = [&](const Tensor& a) {
    Options o = options_for(c, 2);
    o.alibi_slopes = &a;
    p.poison_outputs();
    run_forward(p, o);
    run_backward(p, o);
    return snapshot(p);
  };
  auto view1 = [](float* d, int64_t stride) {
    Tensor t;
    t.data = d;
    t.dtype = DType::Float32;
    t.ndim = 1;
    t.shape[0] = 4;
    t.stride[0] = stride;
    return t;
  };
  auto view2 = [](float* d, int64_t s0, int64_t s1) {
    Tensor t;
    t.data = d;
    t.dtype = DType::Float32;
    t.ndim = 2;
    t.shape[0] = 2;
    t.shape[1] = 4;
    t.stride[0] = s0;
    t.stride[1] = s1;
    return t;
  };
  std::vector<float> contiguous = heads;
  const Snapshot want = run(view1(contiguous.data(), 1));
  std::vector<float> strided(13, std::numeric_limits<float>::quiet_NaN());
  for (int h = 0; h < 4; ++h) strided[h * 3] = heads[h];
  EXPECT_TRUE(run(view1(strided.data(), 3)) == want) << "[Hq] with stride 3";
  EXPECT_TRUE(run(view2(contiguous.data(), 0, 1)) == want) << "[B, Hq] broadcast over the batch";
  // Rows of their own: the problem's reference with these slopes judges them.
  std::vector<float> padded(2 * 6, std::numeric_limits<float>::quiet_NaN());
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h) padded[b * 6 + h] = rows[b * 4 + h];
  run(view2(padded.data(), 6, 1));
  testing::RefMods mods = p.ref_mods();
  mods.alibi.assign(rows.begin(), rows.end());
  const testing::RefShape rs = ref_shape(c);
  const double scale = c.scale();
  const auto f = testing::reference_forward(rs, p.to_double(p.q), p.to_double(p.k), p.to_double(p.v), scale,
                                            c.mask, mods);
  const auto g = testing::reference_backward(rs, p.to_double(p.q), p.to_double(p.k), p.to_double(p.v),
                                             p.to_double(p.dout), scale, c.mask, mods);
  const std::pair<const testing::HostTensor*, const std::vector<double>*> checks[] = {
      {&p.out, &f.out}, {&p.lse, &f.lse}, {&p.dq, &g.dq}, {&p.dk, &g.dk}, {&p.dv, &g.dv}};
  for (const auto& [t, r] : checks) {
    const auto e = testing::compare(p.to_double(*t), *r);
    EXPECT_EQ(e.nan, 0) << e.str();
    EXPECT_LE(e.rel, 2e-5) << e.str();
  }
  // The slopes themselves are never written.
  for (int b = 0; b < 2; ++b) EXPECT_TRUE(std::isnan(padded[b * 6 + 4]) && std::isnan(padded[b * 6 + 5]));
}


// Runs forward + backward on the given views and checks them against the reference computed on
// their logical contents (float32 tolerance, see test_cpu_grid.cpp).
void check_against_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& lse, const Tensor& dout, const Tensor& dq,
                             const Tensor& dk, const Tensor& dv, Mask mask) {
  check_views_against_reference(q, k, v, out, lse, dout, dq, dk, dv, mask, 2e-5);
}

void fill(const Tensor& t, uint64_t seed) { fill_uniform(t, seed); }

// FlashAttention's packed layouts: q/k/v and dq/dk/dv as interleaved views of [B, S, 3, H, D]
// buffers. The views share no element, so they must be accepted.
TEST(LegitimateLayouts, PackedQkvAndInterleavedGradients) {
  const int64_t B = 2, S = 9, H = 3, D = 8;
  std::vector<float> qkv(B * S * 3 * H * D), dqkv(B * S * 3 * H * D,
                                                  std::numeric_limits<float>::quiet_NaN());
  std::vector<float> outb(B * S * H * D, std::numeric_limits<float>::quiet_NaN()),
      doutb(B * S * H * D), lseb(B * H * S, std::numeric_limits<float>::quiet_NaN());
  auto packed = [&](float* base, int which) {
    Tensor t = Tensor::contiguous(base + which * H * D, DType::Float32, B, H, S, D);
    t.stride[0] = S * 3 * H * D;
    t.stride[1] = D;
    t.stride[2] = 3 * H * D;
    t.stride[3] = 1;
    return t;
  };
  const Tensor q = packed(qkv.data(), 0), k = packed(qkv.data(), 1), v = packed(qkv.data(), 2);
  const Tensor dq = packed(dqkv.data(), 0), dk = packed(dqkv.data(), 1),
               dv = packed(dqkv.data(), 2);
  const Tensor out = Tensor::bshd(outb.data(), DType::Float32, B, H, S, D);
  const Tensor dout = Tensor::bshd(doutb.data(), DType::Float32, B, H, S, D);
  const Tensor lse = Tensor::lse(lseb.data(), B, H, S);
  fill(q, 1);
  fill(k, 2);
  fill(v, 3);
  fill(dout, 4);
  const std::vector<float> qkv_before = qkv;
  check_against_reference(q, k, v, out, lse, dout, dq, dk, dv, Mask::CausalTopLeft);
  EXPECT_TRUE(qkv == qkv_before) << "the packed inputs were modified";
  for (float x : dqkv) EXPECT_FALSE(std::isnan(x)) << "an element of the packed gradient was not written";
}

// GQA with k/v and dk/dv packed as [B, S, 2, Hkv, D].
TEST(LegitimateLayouts, PackedKvGqa) {
  const int64_t B = 1, Hq = 6, Hkv = 2, Sq = 11, Skv = 13, D = 16;
  std::vector<float> qb(B * Hq * Sq * D), doutb(B * Hq * Sq * D), kv(B * Skv * 2 * Hkv * D);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> outb(B * Hq * Sq * D, nan), dqb(B * Hq * Sq * D, nan),
      dkv(B * Skv * 2 * Hkv * D, nan), lseb(B * Hq * Sq, nan);
  auto packed = [&](float* base, int which) {
    Tensor t = Tensor::contiguous(base + which * Hkv * D, DType::Float32, B, Hkv, Skv, D);
    t.stride[0] = Skv * 2 * Hkv * D;
    t.stride[1] = D;
    t.stride[2] = 2 * Hkv * D;
    return t;
  };
  const Tensor q = Tensor::contiguous(qb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor dout = Tensor::contiguous(doutb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor out = Tensor::contiguous(outb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor dq = Tensor::contiguous(dqb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor lse = Tensor::lse(lseb.data(), B, Hq, Sq);
  const Tensor k = packed(kv.data(), 0), v = packed(kv.data(), 1);
  const Tensor dk = packed(dkv.data(), 0), dv = packed(dkv.data(), 1);
  fill(q, 5);
  fill(k, 6);
  fill(v, 7);
  fill(dout, 8);
  check_against_reference(q, k, v, out, lse, dout, dq, dk, dv, Mask::CausalBottomRight);
  for (float x : dkv) EXPECT_FALSE(std::isnan(x));
}

// The same packed buffer with the views shifted by half a head: now they do share elements.
TEST(BadInputPacked, MisplacedInterleavedGradientsAreRejected) {
  const int64_t B = 2, S = 9, H = 3, D = 8;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> qb(B * S * H * D, 0.5f), kb(qb), vb(qb), outb(qb), doutb(qb),
      lseb(B * H * S, 0.0f), dqkv(B * S * 3 * H * D, nan);
  auto view = [&](float* base) { return Tensor::bshd(base, DType::Float32, B, H, S, D); };
  auto packed = [&](float* base) {
    Tensor t = Tensor::contiguous(base, DType::Float32, B, H, S, D);
    t.stride[0] = S * 3 * H * D;
    t.stride[1] = D;
    t.stride[2] = 3 * H * D;
    return t;
  };
  const Tensor q = view(qb.data()), k = view(kb.data()), v = view(vb.data()), out = view(outb.data()),
               dout = view(doutb.data());
  const Tensor lse = Tensor::lse(lseb.data(), B, H, S);
  const Tensor dq = packed(dqkv.data()), dk = packed(dqkv.data() + H * D + D / 2),
               dv = packed(dqkv.data() + 2 * H * D);
  EXPECT_TRUE(throws_error([&] { backward(q, k, v, out, dout, lse, dq, dk, dv); },
                           Status::InvalidArgument, {"outputs dk and dv overlap"}));
  for (float x : dqkv) ASSERT_TRUE(std::isnan(x)) << "written before the error";
}

// Read-only inputs may overlap themselves: k and v broadcast over the batch (stride 0).
TEST(LegitimateLayouts, BroadcastInputs) {
  const int64_t B = 3, Hq = 4, Hkv = 2, Sq = 10, Skv = 12, D = 24;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> qb(B * Hq * Sq * D), doutb(qb.size()), kb(Hkv * Skv * D), vb(kb.size());
  std::vector<float> outb(qb.size(), nan), dqb(qb.size(), nan), dkb(B * Hkv * Skv * D, nan),
      dvb(dkb.size(), nan), lseb(B * Hq * Sq, nan);
  const Tensor q = Tensor::bshd(qb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor dout = Tensor::bshd(doutb.data(), DType::Float32, B, Hq, Sq, D);
  Tensor k = Tensor::contiguous(kb.data(), DType::Float32, B, Hkv, Skv, D);
  Tensor v = Tensor::contiguous(vb.data(), DType::Float32, B, Hkv, Skv, D);
  k.stride[0] = v.stride[0] = 0;
  const Tensor out = Tensor::bshd(outb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor dq = Tensor::bshd(dqb.data(), DType::Float32, B, Hq, Sq, D);
  const Tensor dk = Tensor::contiguous(dkb.data(), DType::Float32, B, Hkv, Skv, D);
  const Tensor dv = Tensor::contiguous(dvb.data(), DType::Float32, B, Hkv, Skv, D);
  const Tensor lse = Tensor::lse(lseb.data(), B, Hq, Sq);
  fill(q, 9);
  fill(Tensor::contiguous(kb.data(), DType::Float32, 1, Hkv, Skv, D), 10);
  fill(Tensor::contiguous(vb.data(), DType::Float32, 1, Hkv, Skv, D), 11);
  fill(dout, 12);
  check_against_reference(q, k, v, out, lse, dout, dq, dk, dv, Mask::None);
}

// Every tensor padded in every dimension (row, head and batch gaps; lse every third float): the
// kernels must write exactly the elements of each output view and leave the gaps alone.
TEST(LegitimateLayouts, PaddedViewsWriteOnlyTheirElements) {
  const int64_t B = 2, Hq = 4, Hkv = 2, Sq = 33, Skv = 47, D = 24;
  const float sentinel = 12345.0f;
  struct Padded {
    std::vector<float> buf;
    Tensor view;
  };
  auto make4 = [&](int64_t h, int64_t s) {
    Padded p;
    const int64_t ss = D + 8, sh = s * ss + 16, sb = h * sh + 32;
    p.buf.assign(static_cast<size_t>(B * sb), sentinel);
    p.view = Tensor::contiguous(p.buf.data(), DType::Float32, B, h, s, D);
    p.view.stride[0] = sb;
    p.view.stride[1] = sh;
    p.view.stride[2] = ss;
    return p;
  };
  Padded q = make4(Hq, Sq), k = make4(Hkv, Skv), v = make4(Hkv, Skv), dout = make4(Hq, Sq),
         out = make4(Hq, Sq), dq = make4(Hq, Sq), dk = make4(Hkv, Skv), dv = make4(Hkv, Skv);
  Padded lse;
  lse.buf.assign(static_cast<size_t>(B * (Hq * (Sq * 3 + 5) + 7)), sentinel);
  lse.view = Tensor::lse(lse.buf.data(), B, Hq, Sq);
  lse.view.stride[2] = 3;
  lse.view.stride[1] = Sq * 3 + 5;
  lse.view.stride[0] = Hq * (Sq * 3 + 5) + 7;
  fill(q.view, 21);
  fill(k.view, 22);
  fill(v.view, 23);
  fill(dout.view, 24);
  // Poison the elements of the outputs (not their gaps) so unwritten elements show up as NaN.
  for (Padded* o : {&out, &dq, &dk, &dv})
    for (int64_t a = 0; a < o->view.shape[0]; ++a)
      for (int64_t b = 0; b < o->view.shape[1]; ++b)
        for (int64_t c = 0; c < o->view.shape[2]; ++c)
          for (int64_t d = 0; d < D; ++d)
            o->buf[a * o->view.stride[0] + b * o->view.stride[1] + c * o->view.stride[2] + d] =
                std::numeric_limits<float>::quiet_NaN();
  check_against_reference(q.view, k.view, v.view, out.view, lse.view, dout.view, dq.view, dk.view,
                          dv.view, Mask::CausalBottomRight);
  // Count sentinels: each buffer must still hold exactly (size - elements of the view) of them.
  auto count = [&](const Padded& p) {
    int64_t n = 0;
    for (float x : p.buf) n += x == sentinel;
    return n;
  };
  const char* names[] = {"out", "dq", "dk", "dv", "lse"};
  const Padded* outs[] = {&out, &dq, &dk, &dv, &lse};
  for (int i = 0; i < 5; ++i) {
    int64_t elems = 1;
    for (int d = 0; d < outs[i]->view.ndim; ++d) elems *= outs[i]->view.shape[d];
    EXPECT_EQ(count(*outs[i]), static_cast<int64_t>(outs[i]->buf.size()) - elems)
        << names[i] << ": a gap between elements was overwritten";
  }
}

}  // namespace
}  // namespace flashattn::test
