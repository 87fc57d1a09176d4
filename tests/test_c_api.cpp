// The C ABI seen from C++: what only the C entry points can get wrong (NULL tensor pointers, the
// options' struct_size versioning, NULL options, the thread-local last error, status strings).
// tests/c_abi_test.c drives the same ABI from a C compiler.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <thread>

#include "core/c_options.hpp"
#include "flashattn/flashattn.h"
#include "test_util.hpp"

namespace flashattn::test {
namespace {

flashattn_tensor to_c(const Tensor& t) {
  flashattn_tensor c{};
  c.data = t.data;
  c.dtype = static_cast<int32_t>(t.dtype);
  c.device = t.device;
  c.ndim = t.ndim;
  for (int i = 0; i < 4; ++i) {
    c.shape[i] = t.shape[i];
    c.stride[i] = t.stride[i];
  }
  return c;
}

ProblemConfig small_config() {
  return make_config(2, 4, 2, 9, 6, 16, Mask::None, DType::Float32, testing::Layout::BHSD, 0.0f,
                     /*seed=*/41);
}

class CApi : public ::testing::Test {
 protected:
  CApi() : p(small_config()) { bind(); }
  void bind() {
    q = to_c(p.q.view);
    k = to_c(p.k.view);
    v = to_c(p.v.view);
    out = to_c(p.out.view);
    lse = to_c(p.lse.view);
    dout = to_c(p.dout.view);
    dq = to_c(p.dq.view);
    dk = to_c(p.dk.view);
    dv = to_c(p.dv.view);
  }
  int fwd(const flashattn_options* o) { return flashattn_forward(&q, &k, &v, &out, &lse, o); }
  int bwd(const flashattn_options* o) {
    return flashattn_backward(&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, o);
  }
  // forward + backward from freshly poisoned outputs; the bytes of every buffer.
  Snapshot run(const flashattn_options* o) {
    p.poison_outputs();
    EXPECT_EQ(fwd(o), FLASHATTN_OK) << flashattn_last_error();
    EXPECT_EQ(bwd(o), FLASHATTN_OK) << flashattn_last_error();
    return snapshot(p);
  }
  Problem p;
  flashattn_tensor q, k, v, out, lse, dout, dq, dk, dv;
};

bool contains(const char* hay, const std::string& needle) {
  return std::string(hay).find(needle) != std::string::npos;
}

TEST_F(CApi, NullTensorPointers) {
  const Snapshot before = snapshot(p);
  const flashattn_tensor* f[] = {&q, &k, &v, &out, &lse};
  const char* fn[] = {"q", "k", "v", "out", "lse"};
  for (int i = 0; i < 5; ++i) {
    const flashattn_tensor* a[5];
    for (int j = 0; j < 5; ++j) a[j] = j == i ? nullptr : f[j];
    EXPECT_EQ(flashattn_forward(a[0], a[1], a[2], a[3], a[4], nullptr),
              FLASHATTN_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(flashattn_last_error(), std::string(fn[i]) + " is NULL"))
        << flashattn_last_error();
  }
  const flashattn_tensor* b[] = {&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv};
  const char* bn[] = {"q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 9; ++i) {
    const flashattn_tensor* a[9];
    for (int j = 0; j < 9; ++j) a[j] = j == i ? nullptr : b[j];
    EXPECT_EQ(flashattn_backward(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], nullptr),
              FLASHATTN_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(flashattn_last_error(), std::string(bn[i]) + " is NULL"))
        << flashattn_last_error();
  }
  EXPECT_TRUE(snapshot(p) == before);
}

TEST_F(CApi, NdimOutOfRange) {
  const Snapshot before = snapshot(p);
  q.ndim = 5;
  EXPECT_EQ(fwd(nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "q.ndim = 5, expected 4")) << flashattn_last_error();
  bind();
  lse.ndim = -1;
  EXPECT_EQ(bwd(nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "lse.ndim = -1, expected 3"))
      << flashattn_last_error();
  bind();
  dv.ndim = 1000;
  EXPECT_EQ(bwd(nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "dv.ndim = 1000, expected 4"))
      << flashattn_last_error();
  EXPECT_TRUE(snapshot(p) == before);
}

TEST_F(CApi, StructSizeTooSmall) {
  const Snapshot before = snapshot(p);
  for (uint32_t size : {0u, 4u, 16u, FLASHATTN_OPTIONS_V1_SIZE - 1}) {
    flashattn_options o;
    flashattn_options_init(&o);
    o.struct_size = size;
    EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(flashattn_last_error(),
                         "opts->struct_size = " + std::to_string(size) + " is too small"))
        << flashattn_last_error();
    EXPECT_TRUE(contains(flashattn_last_error(), "at least 24")) << flashattn_last_error();
    EXPECT_EQ(bwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  }
  EXPECT_TRUE(snapshot(p) == before);
}

// A caller compiled against version 1 of the header passes a 24-byte struct: the library must
// read nothing past it and use defaults for the newer fields.
TEST_F(CApi, Version1OptionsIgnoreNewerFields) {
  static_assert(offsetof(flashattn_options, num_threads) == FLASHATTN_OPTIONS_V1_SIZE,
                "version 1 of flashattn_options is 24 bytes");
  flashattn_options full;
  flashattn_options_init(&full);
  full.mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  const Snapshot want = run(&full);

  // Exactly 24 bytes on the heap: a read past them is a heap-buffer-overflow under ASan.
  auto* v1 = static_cast<flashattn_options*>(std::malloc(FLASHATTN_OPTIONS_V1_SIZE));
  ASSERT_NE(v1, nullptr);
  std::memset(v1, 0, FLASHATTN_OPTIONS_V1_SIZE);
  v1->struct_size = FLASHATTN_OPTIONS_V1_SIZE;
  v1->mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  EXPECT_TRUE(run(v1) == want);
  std::free(v1);

  // Garbage in the newer fields is ignored when struct_size says they are absent...
  flashattn_options old = full;
  old.struct_size = FLASHATTN_OPTIONS_V1_SIZE;
  old.num_threads = -7;
  old.precision = 99;
  EXPECT_TRUE(run(&old) == want);
  // ...and read when it says they are present.
  old.struct_size = sizeof(flashattn_options);
  EXPECT_EQ(fwd(&old), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "options.precision = 99"))
      << flashattn_last_error();
  old.precision = FLASHATTN_PRECISION_FP32;
  EXPECT_EQ(fwd(&old), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "options.num_threads = -7"))
      << flashattn_last_error();
}

// The size of the struct before `deterministic` was appended (the layout of version 2).
constexpr uint32_t kPreDeterministicSize = offsetof(flashattn_options, deterministic);
static_assert(offsetof(flashattn_options, deterministic) ==
                  offsetof(flashattn_options, precision) + sizeof(int32_t),
              "deterministic is appended right after precision");

// An exactly-`size`-byte heap copy of the first `size` bytes of `o`: under ASan, any read of a
// field past struct_size is a heap-buffer-overflow.
struct TruncatedOptions {
  TruncatedOptions(const flashattn_options& o, uint32_t size)
      : p(static_cast<flashattn_options*>(std::malloc(size))) {
    if (p == nullptr) throw std::bad_alloc();
    std::memcpy(p, &o, size);
    p->struct_size = size;
  }
  ~TruncatedOptions() { std::free(p); }
  TruncatedOptions(const TruncatedOptions&) = delete;
  TruncatedOptions& operator=(const TruncatedOptions&) = delete;
  flashattn_options* p;
};

// What the library makes of an older caller's struct, field by field: deterministic = true leaves
// no trace in CPU results (the CPU backward is always deterministic), so it is checked here on the
// conversion the C entry points use.
TEST(CApiOptions, OlderStructSizesDefaultDeterministicToFalse) {
  flashattn_options full;
  flashattn_options_init(&full);
  full.softmax_scale = 0.5f;
  full.mask = FLASHATTN_MASK_CAUSAL_TOP_LEFT;
  full.num_threads = 3;
  full.precision = FLASHATTN_PRECISION_TF32;
  full.deterministic = 1;

  const Options all = detail::options_from_c(&full);
  EXPECT_EQ(all.softmax_scale, 0.5f);
  EXPECT_EQ(all.mask, Mask::CausalTopLeft);
  EXPECT_EQ(all.num_threads, 3);
  EXPECT_EQ(all.precision, Precision::Tf32);
  EXPECT_TRUE(all.deterministic);

  {
    TruncatedOptions pre(full, kPreDeterministicSize);
    const Options r = detail::options_from_c(pre.p);
    EXPECT_EQ(r.softmax_scale, 0.5f);
    EXPECT_EQ(r.mask, Mask::CausalTopLeft);
    EXPECT_EQ(r.num_threads, 3);
    EXPECT_EQ(r.precision, Precision::Tf32);
    EXPECT_FALSE(r.deterministic);
  }
  {
    TruncatedOptions v1(full, FLASHATTN_OPTIONS_V1_SIZE);
    const Options r = detail::options_from_c(v1.p);
    EXPECT_EQ(r.softmax_scale, 0.5f);
    EXPECT_EQ(r.mask, Mask::CausalTopLeft);
    EXPECT_EQ(r.num_threads, 0);
    EXPECT_EQ(r.precision, Precision::Fp32);
    EXPECT_FALSE(r.deterministic);
  }
  // A struct_size that ends inside `deterministic` does not have the field either.
  full.struct_size = kPreDeterministicSize + 2;
  EXPECT_FALSE(detail::options_from_c(&full).deterministic);

  // Any nonzero value means true (C callers may pass a bool-ish int).
  full.struct_size = sizeof(flashattn_options);
  for (int32_t d : {2, -1, std::numeric_limits<int32_t>::min()}) {
    full.deterministic = d;
    EXPECT_TRUE(detail::options_from_c(&full).deterministic) << d;
  }
  full.deterministic = 0;
  EXPECT_FALSE(detail::options_from_c(&full).deterministic);
  EXPECT_FALSE(detail::options_from_c(nullptr).deterministic);
}

// The same sizes through the C entry points: accepted, and (on the CPU, which is deterministic
// whatever the flag says) bitwise the results of the full struct.
TEST_F(CApi, PreDeterministicOptionsWork) {
  flashattn_options full;
  flashattn_options_init(&full);
  full.mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  full.num_threads = 2;
  const Snapshot want = run(&full);

  full.deterministic = 1;
  EXPECT_TRUE(run(&full) == want);

  // Garbage where `deterministic` would be cannot be read: the copy ends before it.
  full.deterministic = 0x5a5a5a5a;
  TruncatedOptions pre(full, kPreDeterministicSize);
  EXPECT_TRUE(run(pre.p) == want);
  // The fields that the older struct does have are still read.
  pre.p->num_threads = -1;
  EXPECT_EQ(fwd(pre.p), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "options.num_threads = -1"))
      << flashattn_last_error();
}

// ---- sliding window, softcap, ALiBi (the fields after version 2) ------------------------------

// The ALiBi slopes of small_config() (B = 2, Hq = 4) as [B, Hq], zero and negative ones included.
struct CSlopes {
  float values[8] = {0.5f, 0.0f, -0.125f, 0.25f, 1.0f, 0.0625f, 0.0f, -0.5f};
  flashattn_tensor t{};
  CSlopes() {
    t.data = values;
    t.dtype = FLASHATTN_FLOAT32;
    t.device = FLASHATTN_CPU;
    t.ndim = 2;
    t.shape[0] = 2;
    t.shape[1] = 4;
    t.stride[0] = 4;
    t.stride[1] = 1;
  }
};

// Every new field through the C ABI gives bitwise the C++ API's results with the same options.
TEST_F(CApi, WindowSoftcapAlibiMatchTheCppApi) {
  CSlopes slopes;
  flashattn_options c;
  flashattn_options_init(&c);
  c.mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  c.sliding_window = 1;
  c.window_left = 2;
  c.window_right = -1;
  c.softcap = 7.5f;
  c.alibi_slopes = &slopes.t;
  const Snapshot got = run(&c);

  Tensor a;
  a.data = slopes.values;
  a.dtype = DType::Float32;
  a.ndim = 2;
  a.shape[0] = 2;
  a.shape[1] = 4;
  a.stride[0] = 4;
  a.stride[1] = 1;
  Options o;
  o.mask = Mask::CausalBottomRight;
  o.window_left = 2;
  o.window_right = -1;
  o.softcap = 7.5f;
  o.alibi_slopes = &a;
  p.poison_outputs();
  run_forward(p, o);
  run_backward(p, o);
  EXPECT_TRUE(snapshot(p) == got);

  // And each of them changes the result (the comparison above is not between two plain calls).
  flashattn_options plain;
  flashattn_options_init(&plain);
  plain.mask = FLASHATTN_MASK_CAUSAL_BOTTOM_RIGHT;
  const Snapshot none = run(&plain);
  for (int field = 0; field < 3; ++field) {
    flashattn_options one = plain;
    if (field == 0) {
      one.sliding_window = 1;
      one.window_left = 2;
      one.window_right = -1;
    }
    if (field == 1) one.softcap = 7.5f;
    if (field == 2) one.alibi_slopes = &slopes.t;
    EXPECT_FALSE(run(&one) == none) << "field " << field << " made no difference";
  }
}

// A version-2 caller (struct_size 40) has none of the new fields: garbage where they would be is
// never read, and the results are those of the defaults.
TEST_F(CApi, Version2OptionsIgnoreWindowSoftcapAlibi) {
  static_assert(offsetof(flashattn_options, window_left) >= FLASHATTN_OPTIONS_V2_SIZE,
                "the window starts after version 2");
  flashattn_options full;
  flashattn_options_init(&full);
  full.mask = FLASHATTN_MASK_CAUSAL_TOP_LEFT;
  full.num_threads = 2;
  const Snapshot want = run(&full);

  full.sliding_window = 1;
  full.window_left = -77;  // invalid if it were read
  full.window_right = 0;
  full.softcap = -3.0f;  // invalid if it were read
  full.alibi_slopes = reinterpret_cast<const flashattn_tensor*>(uintptr_t{0x10});
  TruncatedOptions v2(full, FLASHATTN_OPTIONS_V2_SIZE);
  EXPECT_TRUE(run(v2.p) == want);

  // The conversion, field by field.
  const Options r = detail::options_from_c(v2.p);
  EXPECT_EQ(r.window_left, -1);
  EXPECT_EQ(r.window_right, -1);
  EXPECT_EQ(r.softcap, 0.0f);
  EXPECT_EQ(r.alibi_slopes, nullptr);
  EXPECT_EQ(r.mask, Mask::CausalTopLeft);
  EXPECT_EQ(r.num_threads, 2);

  // Sizes that end inside the new fields have only the fields they cover.
  full.window_left = 3;
  full.window_right = 4;
  full.softcap = 2.5f;
  {
    TruncatedOptions cut(full, static_cast<uint32_t>(offsetof(flashattn_options, softcap)));
    const Options x = detail::options_from_c(cut.p);
    EXPECT_EQ(x.window_left, -1) << "sliding_window is past struct_size: no window";
    EXPECT_EQ(x.softcap, 0.0f);
  }
  {
    TruncatedOptions cut(full, static_cast<uint32_t>(offsetof(flashattn_options, sliding_window) + 4));
    const Options x = detail::options_from_c(cut.p);
    EXPECT_EQ(x.window_left, 3);
    EXPECT_EQ(x.window_right, 4);
    EXPECT_EQ(x.softcap, 2.5f);
    EXPECT_EQ(x.alibi_slopes, nullptr) << "alibi_slopes is past struct_size";
  }
}

// sliding_window = 0 means no window whatever window_left / window_right hold.
TEST_F(CApi, SlidingWindowFlagGatesTheSizes) {
  flashattn_options o;
  flashattn_options_init(&o);
  const Snapshot want = run(&o);
  o.window_left = -9;  // invalid, but not read
  o.window_right = 0;
  EXPECT_TRUE(run(&o) == want);
  const Options r = detail::options_from_c(&o);
  EXPECT_EQ(r.window_left, -1);
  EXPECT_EQ(r.window_right, -1);
  // Read once the flag is set (any nonzero value).
  o.sliding_window = -1;
  EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "options.window_left = -9")) << flashattn_last_error();
  o.window_left = 0;
  EXPECT_FALSE(run(&o) == want) << "window (0, 0) made no difference";
}

TEST_F(CApi, BadNewFieldsAreRefusedAndWriteNothing) {
  CSlopes slopes;
  const Snapshot before = snapshot(p);
  flashattn_options o;
  flashattn_options_init(&o);
  o.softcap = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "options.softcap = nan")) << flashattn_last_error();
  EXPECT_EQ(bwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);

  flashattn_options_init(&o);
  o.sliding_window = 1;
  o.window_left = -1;
  o.window_right = -2;
  EXPECT_EQ(bwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "options.window_right = -2")) << flashattn_last_error();

  flashattn_options_init(&o);
  o.alibi_slopes = &slopes.t;
  slopes.t.ndim = 3;  // the C conversion refuses it before the view is built
  EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "opts->alibi_slopes->ndim = 3")) << flashattn_last_error();
  slopes.t.ndim = 2;
  slopes.t.dtype = FLASHATTN_FLOAT16;
  EXPECT_EQ(bwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "alibi_slopes.dtype = float16")) << flashattn_last_error();
  slopes.t.dtype = FLASHATTN_FLOAT32;
  slopes.t.shape[1] = 5;
  EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "alibi_slopes.shape = [2, 5]")) << flashattn_last_error();
  slopes.t.shape[1] = 4;
  slopes.t.data = p.out.view.data;  // the slopes inside the forward's output
  EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(flashattn_last_error(), "output out aliases input alibi_slopes"))
      << flashattn_last_error();
  EXPECT_TRUE(snapshot(p) == before);
  const float want[8] = {0.5f, 0.0f, -0.125f, 0.25f, 1.0f, 0.0625f, 0.0f, -0.5f};
  EXPECT_EQ(std::memcmp(slopes.values, want, sizeof want), 0) << "the slopes were written";
}

TEST_F(CApi, NullOptionsMeanDefaults) {
  flashattn_options o;
  flashattn_options_init(&o);
  const Snapshot want = run(&o);
  EXPECT_TRUE(run(nullptr) == want);
  // And the defaults are not causal: a causal run differs.
  o.mask = FLASHATTN_MASK_CAUSAL_TOP_LEFT;
  EXPECT_FALSE(run(&o) == want);
}

TEST_F(CApi, OptionsInit) {
  flashattn_options o;
  std::memset(&o, 0xAB, sizeof o);
  flashattn_options_init(&o);
  EXPECT_EQ(o.struct_size, sizeof(flashattn_options));
  EXPECT_EQ(o.softmax_scale, 0.0f);
  EXPECT_EQ(o.mask, FLASHATTN_MASK_NONE);
  EXPECT_EQ(o.stream, nullptr);
  EXPECT_EQ(o.num_threads, 0);
  EXPECT_EQ(o.precision, FLASHATTN_PRECISION_FP32);
  EXPECT_EQ(o.deterministic, 0);
  EXPECT_EQ(o.reserved0, 0);
  EXPECT_EQ(o.sliding_window, 0);
  EXPECT_EQ(o.window_left, 0);
  EXPECT_EQ(o.window_right, 0);
  EXPECT_EQ(o.softcap, 0.0f);
  EXPECT_EQ(o.alibi_slopes, nullptr);
  flashattn_options_init(nullptr);  // must not crash
}

TEST_F(CApi, LastErrorIsSetClearedAndThreadLocal) {
  flashattn_options o;
  flashattn_options_init(&o);
  o.mask = 7;
  EXPECT_EQ(fwd(&o), FLASHATTN_ERROR_INVALID_ARGUMENT);
  const std::string msg = flashattn_last_error();
  EXPECT_TRUE(contains(msg.c_str(), "options.mask = 7")) << msg;

  // Another thread has its own (empty) message and its failures do not touch ours.
  std::string other_before, other_after;
  std::thread th([&] {
    other_before = flashattn_last_error();
    flashattn_options bad;
    flashattn_options_init(&bad);
    bad.softmax_scale = std::numeric_limits<float>::infinity();
    flashattn_forward(&q, &k, &v, &out, &lse, &bad);
    other_after = flashattn_last_error();
  });
  th.join();
  EXPECT_EQ(other_before, "");
  EXPECT_TRUE(contains(other_after.c_str(), "softmax_scale")) << other_after;
  EXPECT_EQ(std::string(flashattn_last_error()), msg);

  o.mask = FLASHATTN_MASK_NONE;
  EXPECT_EQ(fwd(&o), FLASHATTN_OK) << flashattn_last_error();
  EXPECT_STREQ(flashattn_last_error(), "");
}

TEST(CApiStatic, StatusStringsAndVersion) {
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_OK), "ok");
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_ERROR_INVALID_ARGUMENT), "invalid argument");
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_ERROR_UNSUPPORTED), "unsupported");
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_ERROR_BACKEND), "backend error");
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_ERROR_OUT_OF_MEMORY), "out of memory");
  EXPECT_STREQ(flashattn_status_string(FLASHATTN_ERROR_INTERNAL), "internal error");
  EXPECT_STREQ(flashattn_status_string(-1), "unknown status");
  EXPECT_STREQ(flashattn_status_string(12345), "unknown status");
  const std::string want = std::to_string(FLASHATTN_VERSION_MAJOR) + "." +
                           std::to_string(FLASHATTN_VERSION_MINOR) + "." +
                           std::to_string(FLASHATTN_VERSION_PATCH);
  EXPECT_EQ(std::string(flashattn_version()), want);
  const int avail = flashattn_cuda_available();
  EXPECT_TRUE(avail == 0 || avail == 1);
  EXPECT_EQ(avail == 1, cuda_available());
}

// The count of failed checks in captured calls' replays: a NULL out-pointer or a device that does
// not exist is an error with a message, never a crash; without a usable device, an error too.
TEST(CApiCheckFailures, Arguments) {
  EXPECT_EQ(flashattn_cuda_take_check_failures(0, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("failures is NULL"), std::string::npos) << flashattn_last_error();
  int64_t n = -1;
  EXPECT_EQ(flashattn_cuda_take_check_failures(-1, &n), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(flashattn_cuda_take_check_failures(1 << 20, &n), FLASHATTN_OK);
  EXPECT_STRNE(flashattn_last_error(), "");
  if (!flashattn_cuda_available()) {
    EXPECT_NE(flashattn_cuda_take_check_failures(0, &n), FLASHATTN_OK);
    EXPECT_EQ(n, -1) << "written on failure";
  } else {
    EXPECT_EQ(flashattn_cuda_take_check_failures(0, &n), FLASHATTN_OK) << flashattn_last_error();
    EXPECT_GE(n, 0);
  }
}

// A failure inside the library never escapes as an exception through the C ABI; the C++ status
// travels as the C status (here: a CUDA tensor in a build or machine without a usable GPU).
TEST_F(CApi, ErrorsBecomeStatusCodes) {
  if (flashattn_cuda_available()) GTEST_SKIP() << "a CUDA device is available";
  for (flashattn_tensor* t : {&q, &k, &v, &out, &lse}) t->device = 0;
  const Snapshot before = snapshot(p);
  const int st = fwd(nullptr);
  EXPECT_NE(st, FLASHATTN_OK);
  EXPECT_NE(st, FLASHATTN_ERROR_INTERNAL) << flashattn_last_error();
  EXPECT_STRNE(flashattn_last_error(), "");
  EXPECT_TRUE(snapshot(p) == before);
}

}  // namespace
}  // namespace flashattn::test
