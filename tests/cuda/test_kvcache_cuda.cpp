// KV-cache attention on the CUDA backend (flashattn_forward_kvcache, float16/bfloat16): the CPU
// suite's cases (tests/kvcache_cases.hpp) run on device copies of every buffer and are checked the
// same way - out and lse per sequence against the float64 reference, the appended rows (rotated
// keys), every other cache byte untouched - plus what is the GPU's own: both CTA shapes of the
// decode kernel (<= 16 and > 16 (query row, head) pairs per kv head), split-KV (forced and
// automatic, equal to the unsplit result within rounding, bitwise run to run), paged caches bitwise
// equal to contiguous ones, head dims 1..256, strided and unaligned views, NaN propagation, and
// the calls CUDA refuses. Outputs are NaN-poisoned before every call.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kvcache_cases.hpp"

namespace flashattn::test {
namespace {

// Runs a Harness's call on device 0: every buffer copied there (`offset` bytes past a 16-byte
// aligned base: 2 breaks the 16-byte vectors), the call, then out, lse and both caches copied back
// into the host buffers that check_case reads.
struct DeviceRun {
  std::vector<std::unique_ptr<DeviceBuffer>> bufs;
  int offset = 0;
  bool ok = true;
  // graph: the call captured into a CUDA graph on a stream of its own, then the graph launched;
  // a call that refuses the capture leaves its status in `refused` (the downloads still run, to
  // show what was written).
  bool graph = false;
  Status refused = Status::Ok;
  // catch_errors: a call that throws leaves its status and message here and the downloads still
  // run (to show that nothing was written).
  bool catch_errors = false;
  std::string message;

  Tensor upload(const Tensor& host, const void* bytes, size_t n) {
    bufs.push_back(std::make_unique<DeviceBuffer>(n + 32));
    Tensor t = host;
    char* base = static_cast<char*>(bufs.back()->ptr);
    if (base == nullptr || cudaMemcpy(base + offset, bytes, n, cudaMemcpyHostToDevice) != cudaSuccess) ok = false;
    t.data = base + offset;
    t.device = 0;
    return t;
  }
  template <class V>
  Tensor upload_vec(const Tensor& host, const V& v) {
    return upload(host, v.data(), v.size() * sizeof(v[0]));
  }
  bool download(void* dst, const Tensor& t, size_t n) {
    return cudaMemcpy(dst, t.data, n, cudaMemcpyDeviceToHost) == cudaSuccess;
  }

  void operator()(Harness& h) {
    const Tensor q = upload_vec(h.tq, h.q), kc = upload_vec(h.tkc, h.kc), vc = upload_vec(h.tvc, h.vc);
    const Tensor out = upload_vec(h.tout, h.out);
    Tensor kn, vn, sl, bi, lp, bt, cs, sn, al;
    KvCache kv = h.kv;
    if (kv.k_new) kn = upload_vec(h.tkn, h.kn), vn = upload_vec(h.tvn, h.vn), kv.k_new = &kn, kv.v_new = &vn;
    // (The float32 lse and the index arrays keep 4-byte alignment: the offset applies to the
    // 16-bit tensors only, whose elements stay 2-byte aligned.)
    const int keep = offset;
    offset = 0;
    const Tensor lse = upload_vec(h.tlse, h.lse);
    if (kv.cache_seqlens) sl = upload_vec(h.tsl, h.seqlens), kv.cache_seqlens = &sl;
    if (kv.cache_batch_idx) bi = upload_vec(h.tbi, h.bidx), kv.cache_batch_idx = &bi;
    if (kv.cache_leftpad) lp = upload_vec(h.tlp, h.leftpad), kv.cache_leftpad = &lp;
    if (kv.block_table) bt = upload_vec(h.tbt, h.table), kv.block_table = &bt;
    Options o = h.opts;
    if (o.alibi_slopes) al = upload_vec(h.talibi, h.slopes), o.alibi_slopes = &al;
    offset = keep;
    if (kv.rotary_cos) cs = upload_vec(h.tcos, h.cos), sn = upload_vec(h.tsin, h.sin), kv.rotary_cos = &cs, kv.rotary_sin = &sn;
    ASSERT_TRUE(ok) << "device buffers";
    if (graph) {
      cudaStream_t st = nullptr;
      ASSERT_EQ(cudaSuccess, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      o.stream = st;
      cudaGraph_t g = nullptr;
      ASSERT_EQ(cudaSuccess, cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      try {
        forward_kvcache(q, kc, vc, out, lse, kv, o);
      } catch (const Error& e) {
        refused = e.status();
        message = e.what();
      }
      ASSERT_EQ(cudaSuccess, cudaStreamEndCapture(st, &g));
      if (refused == Status::Ok) {
        cudaGraphExec_t ex = nullptr;
        ASSERT_EQ(cudaSuccess, cudaGraphInstantiate(&ex, g, 0));
        ASSERT_EQ(cudaSuccess, cudaGraphLaunch(ex, st));
        ASSERT_EQ(cudaSuccess, cudaStreamSynchronize(st));
        ASSERT_EQ(cudaSuccess, cudaGraphExecDestroy(ex));
      }
      if (g != nullptr) ASSERT_EQ(cudaSuccess, cudaGraphDestroy(g));
      ASSERT_EQ(cudaSuccess, cudaStreamDestroy(st));
    } else if (catch_errors) {
      try {
        forward_kvcache(q, kc, vc, out, lse, kv, o);
      } catch (const Error& e) {
        refused = e.status();
        message = e.what();
      }
    } else {
      forward_kvcache(q, kc, vc, out, lse, kv, o);
    }
    ASSERT_EQ(cudaSuccess, cudaDeviceSynchronize());
    ASSERT_TRUE(download(h.out.data(), out, h.out.size()));
    ASSERT_TRUE(download(h.lse.data(), lse, h.lse.size() * sizeof(float)));
    ASSERT_TRUE(download(h.kc.data(), kc, h.kc.size()));
    ASSERT_TRUE(download(h.vc.data(), vc, h.vc.size()));
  }
};

KvRunner on_gpu(int offset = 0, bool graph = false) {
  return [offset, graph](Harness& h) {
    DeviceRun r;
    r.offset = offset;
    r.graph = graph;
    r(h);
    if (r.refused != Status::Ok) throw Error(r.refused, "the call refused the capture");
  };
}

void check_gpu(KvCase c, int offset = 0) {
  for (DType t : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(t));
    c.dtype = t;
    check_case(c, on_gpu(offset));
  }
}

// ---- the CPU suite's cases -----------------------------------------------------------------------

TEST(KvCacheCuda, DecodeContiguous) {
  REQUIRE_GPU();
  KvCase c;
  c.seqlens = {17, 40};
  check_gpu(c);
}

TEST(KvCacheCuda, DecodeNoAppendAndWholeCache) {
  REQUIRE_GPU();
  KvCase c;
  c.s_new = 0;
  c.seqlens = {1, 64};
  check_gpu(c);
  KvCase w;
  w.s_new = 0, w.S_cache = 33, w.Sq = 3, w.mask = Mask::CausalBottomRight;
  check_gpu(w);
}

TEST(KvCacheCuda, PrefillChunkEveryMask) {
  REQUIRE_GPU();
  for (Mask m : {Mask::None, Mask::CausalBottomRight, Mask::CausalTopLeft}) {
    SCOPED_TRACE(mask_name(m));
    KvCase c;
    c.Sq = 5, c.s_new = 5, c.seqlens = {0, 23}, c.S_cache = 40, c.mask = m;
    check_gpu(c);
    // Sq > S_new: some rows see no key under the causal masks.
    KvCase d;
    d.Sq = 7, d.s_new = 2, d.seqlens = {3, 1}, d.S_cache = 16, d.mask = m;
    check_gpu(d);
  }
}

TEST(KvCacheCuda, LongCachesOddHeadDim) {
  REQUIRE_GPU();
  KvCase c;
  c.seqlens = {1, 1000, 1234};
  c.B = 3, c.S_cache = 1300, c.Hq = 4, c.Hkv = 4, c.D = 40, c.s_new = 3, c.Sq = 3, c.mask = Mask::CausalBottomRight;
  check_gpu(c);
}

TEST(KvCacheCuda, GqaMqaAndBothCtaShapes) {
  REQUIRE_GPU();
  // (Sq, Hq / Hkv): 16 or fewer (row, head) pairs per kv head take the 16-row CTA whose warps split
  // the keys; more take 64-row CTAs (1 or 2 row blocks here).
  const int64_t shapes[][3] = {{1, 8, 2}, {2, 8, 1}, {4, 4, 1}, {7, 8, 2}, {33, 4, 2}, {97, 2, 2}};
  for (const auto& s : shapes) {
    SCOPED_TRACE("Sq " + std::to_string(s[0]) + " Hq " + std::to_string(s[1]) + " Hkv " + std::to_string(s[2]));
    KvCase c;
    c.Sq = s[0], c.Hq = s[1], c.Hkv = s[2], c.s_new = s[0] > 7 ? 4 : s[0], c.seqlens = {5, 130}, c.S_cache = 240;
    c.mask = Mask::CausalBottomRight;
    check_gpu(c);
  }
}

// Read on the host (FLASHATTN_CUDA_KV_CHECK=host; by default device-resident arrays are checked on
// the stream instead), the index arrays travel in the kernels' parameters up to 384 entries (3 per
// sequence here, 5 with batch rows and left pads) and are copied to the device beyond: both
// routes, with splits and the append, against the reference; a batch of 200 with batch rows and
// left pads takes the copy.
TEST(KvCacheCuda, IndexArraysInParametersAndCopied) {
  REQUIRE_GPU();
  EnvScope scope("FLASHATTN_CUDA_KV_CHECK", "host");
  for (int64_t b : {int64_t{5}, int64_t{128}, int64_t{200}}) {
    SCOPED_TRACE("B " + std::to_string(b));
    KvCase c;
    c.B = b, c.Hq = 4, c.Hkv = 2, c.D = 64, c.Sq = 1, c.s_new = 1, c.S_cache = 96;
    for (int64_t i = 0; i < b; ++i) c.seqlens.push_back(static_cast<int32_t>((i * 37) % 95));
    if (b == 200) {
      c.batch_idx = true;
      for (int64_t i = 0; i < b; ++i) c.leftpad.push_back(static_cast<int32_t>((i * 7) % (c.seqlens[i] + 1)));
    }
    c.mask = Mask::CausalBottomRight;
    check_gpu(c);
  }
}

// Captured into a CUDA graph: a call whose index arrays travel in the kernels' parameters runs
// from the graph (with splits and their dependent launches) and matches the reference; so does one
// with cache_seqlens in device memory (every decoding step; here with an append into pages),
// whose index check is captured with its kernels. Arrays that break a rule make the replay write
// nothing (out, lse, either cache) and count one failure (cuda_take_check_failures). With the
// host read (FLASHATTN_CUDA_KV_CHECK=host) such a call refuses the capture, writing nothing.
TEST(KvCacheCuda, GraphCapture) {
  REQUIRE_GPU();
  EXPECT_GE(cuda_take_check_failures(0), 0);  // (a clean count)
  for (int32_t splits : {1, 4}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    // (No cache_seqlens, hence no append: the whole cache is attended, the index arrays in the
    // kernels' parameters.)
    KvCase c;
    c.dtype = DType::BFloat16, c.B = 2, c.Hq = 8, c.Hkv = 2, c.D = 64, c.S_cache = 250, c.s_new = 0;
    c.num_splits = splits;
    check_case(c, on_gpu(0, true));
  }
  KvCase c;
  c.dtype = DType::BFloat16, c.block_size = 16, c.max_blocks = 8, c.seqlens = {17, 100}, c.s_new = 2, c.Sq = 2;
  check_case(c, on_gpu(0, true));
  KvCase sp;
  sp.dtype = DType::BFloat16, sp.B = 2, sp.Hq = 8, sp.Hkv = 2, sp.D = 128, sp.seqlens = {3000, 70}, sp.S_cache = 3100;
  sp.s_new = 1, sp.num_splits = 0, sp.rotary_dim = 32;
  check_case(sp, on_gpu(0, true));
  EXPECT_EQ(cuda_take_check_failures(0), 0);
  {
    Harness h(c);
    h.seqlens[1] = 127;  // + S_new = 129 > the 128 rows of 8 pages of 16
    const auto before = h.snapshot();
    DeviceRun r;
    r.graph = true;
    r(h);
    EXPECT_EQ(r.refused, Status::Ok) << r.message;
    EXPECT_TRUE(before == h.snapshot()) << "a replay with broken index arrays wrote something";
    EXPECT_EQ(cuda_take_check_failures(0), 1);
  }
  EnvScope scope("FLASHATTN_CUDA_KV_CHECK", "host");
  Harness h(c);
  const auto before = h.snapshot();
  DeviceRun r;
  r.graph = true;
  r(h);
  EXPECT_EQ(r.refused, Status::Unsupported);
  EXPECT_TRUE(before == h.snapshot()) << "written by a refused call";
}

TEST(KvCacheCuda, HeadDims) {
  REQUIRE_GPU();
  for (int64_t d : {int64_t{1}, int64_t{17}, int64_t{64}, int64_t{80}, int64_t{96}, int64_t{128}, int64_t{200},
                    int64_t{256}}) {
    SCOPED_TRACE("D " + std::to_string(d));
    KvCase c;
    c.D = d, c.seqlens = {70, 3}, c.S_cache = 100, c.Sq = 2, c.s_new = 2, c.mask = Mask::CausalBottomRight;
    check_gpu(c);
    c.num_splits = 2;  // the combine at every head dim (the partials' padded columns are never read)
    check_gpu(c);
  }
}

TEST(KvCacheCuda, Paged) {
  REQUIRE_GPU();
  for (int64_t bs : {int64_t{16}, int64_t{48}, int64_t{256}}) {
    SCOPED_TRACE("block_size " + std::to_string(bs));
    KvCase c;
    c.block_size = bs, c.max_blocks = (320 + bs - 1) / bs, c.seqlens = {17, 300}, c.s_new = 4, c.Sq = 4;
    c.mask = Mask::CausalBottomRight;
    check_gpu(c);
  }
  KvCase u;  // entries past the used pages are -1: never read
  u.block_size = 16, u.max_blocks = 6, u.seqlens = {15, 31}, u.s_new = 1, u.unused_pages_invalid = true;
  check_gpu(u);
}

TEST(KvCacheCuda, BatchIdxLeftpadRotary) {
  REQUIRE_GPU();
  for (bool inter : {true, false}) {
    SCOPED_TRACE(inter ? "interleaved" : "halves");
    KvCase c;
    c.B = 3, c.batch_idx = true, c.seqlens = {10, 20, 33}, c.leftpad = {0, 7, 33}, c.S_cache = 40, c.Sq = 2,
    c.s_new = 2, c.mask = Mask::CausalBottomRight, c.rotary_dim = 32, c.interleaved = inter;
    check_gpu(c);
    KvCase d;  // rotary on part of the head, no mask (q at cache_seqlens), paged
    d.rotary_dim = 16, d.interleaved = inter, d.seqlens = {5, 60}, d.block_size = 16, d.max_blocks = 4, d.Sq = 3,
    d.s_new = 3;
    check_gpu(d);
  }
}

TEST(KvCacheCuda, WindowSoftcapAlibi) {
  REQUIRE_GPU();
  KvCase base;
  base.seqlens = {90, 200}, base.S_cache = 256, base.Sq = 3, base.s_new = 3, base.mask = Mask::CausalBottomRight;
  KvCase w = base;
  w.window_left = 50, w.window_right = 0;
  check_gpu(w);
  KvCase w2 = base;
  w2.mask = Mask::None, w2.window_left = 20, w2.window_right = 5;
  check_gpu(w2);
  KvCase s = base;
  s.softcap = 5.0f;
  check_gpu(s);
  KvCase a = base;
  a.alibi = true;
  check_gpu(a);
  KvCase all = base;
  all.window_left = 64, all.softcap = 10.0f, all.alibi = true, all.num_splits = 3;
  check_gpu(all);
}

TEST(KvCacheCuda, StridedAndUnalignedViews) {
  REQUIRE_GPU();
  KvCase c;
  c.q_pad = 8, c.seqlens = {33, 100}, c.S_cache = 128, c.Sq = 2, c.s_new = 2, c.D = 64;
  check_gpu(c);
  // 2 bytes past an aligned base: no 16-byte vectors anywhere.
  check_gpu(c, 2);
}

// ---- split-KV --------------------------------------------------------------------------------------

TEST(KvCacheCuda, SplitsAgainstReference) {
  REQUIRE_GPU();
  for (int32_t splits : {1, 2, 7, 128, 0}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    KvCase c;
    c.B = 2, c.Hq = 8, c.Hkv = 2, c.D = 128, c.seqlens = {3000, 70}, c.S_cache = 3100, c.s_new = 1;
    c.num_splits = splits;
    check_gpu(c);
    KvCase p = c;  // paged, causal, more query rows
    p.block_size = 64, p.max_blocks = 50, p.Sq = 4, p.s_new = 4, p.mask = Mask::CausalBottomRight;
    check_gpu(p);
  }
}

// Every pipeline depth (FLASHATTN_CUDA_DECODE_STAGES) with every loader against the reference, on
// splits whose key ranges are shorter than the pipeline (1 or 2 tiles: the fill's empty groups),
// odd lengths (a partial last tile) and every head dim's padding (D = 256: four stages do not fit
// and the library takes three).
TEST(KvCacheCuda, PipelineStagesAgainstReference) {
  REQUIRE_GPU();
  for (const char* loader : {"bulk", "rows", "generic"})
    for (const char* stages : {"3", "4"}) {
      SCOPED_TRACE(std::string("loader ") + loader + ", stages " + stages);
      EnvScope scope("FLASHATTN_CUDA_DECODE_LOADER", loader);
      EnvScope scope_st("FLASHATTN_CUDA_DECODE_STAGES", stages);
      for (int64_t d : {64, 128, 256, 97}) {
        for (int32_t splits : {0, 1, 64}) {
          SCOPED_TRACE("D " + std::to_string(d) + ", num_splits " + std::to_string(splits));
          KvCase c;
          c.B = 2, c.Hq = 8, c.Hkv = 2, c.D = d, c.seqlens = {1000, 97}, c.S_cache = 1100, c.s_new = 1;
          c.num_splits = splits;
          check_gpu(c);
        }
      }
      KvCase p;  // paged, causal, more query rows (the 64-row CTA shape)
      p.B = 2, p.Hq = 64, p.Hkv = 2, p.D = 128, p.seqlens = {3000, 70}, p.S_cache = 3100, p.s_new = 4, p.Sq = 4;
      p.block_size = 64, p.max_blocks = 50, p.mask = Mask::CausalBottomRight;
      check_gpu(p);
    }
}

// The same logical call several ways: splits 1 against the automatic choice (close), each bitwise
// equal run to run, paged caches bitwise equal to contiguous ones, and every K/V loader
// (FLASHATTN_CUDA_DECODE_LOADER: bulk copies on sm_90, whole-tile cp.async, the general cp.async
// loader; contiguous and paged) at every pipeline depth bitwise equal to the default: the loaders
// move the same bytes into different shared-memory layouts, and the arithmetic is the same.
TEST(KvCacheCuda, DeterministicAndPagedBitwise) {
  REQUIRE_GPU();
  for (DType t : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(t));
    KvCase c;
    c.dtype = t, c.B = 1, c.Hq = 32, c.Hkv = 8, c.D = 128, c.Sq = 1, c.s_new = 1, c.seqlens = {8000}, c.S_cache = 8192;
    c.rotary_dim = 64;
    KvCase p = c;
    p.block_size = 256, p.max_blocks = 32;
    auto run = [](const KvCase& k) {
      Harness h(k);
      h.runner = on_gpu();
      h.run();
      return std::make_pair(h.out, h.lse);
    };
    const auto a1 = run(c), a2 = run(c), pg = run(p);
    // (The stage count moves the automatic split count - it sets the CTAs per multiprocessor -
    // and with it the partial sums: the loaders are compared at a fixed count.)
    KvCase c4 = c, p4 = p;
    c4.num_splits = p4.num_splits = 4;
    const auto base4 = run(c4);
    for (const char* loader : {"bulk", "rows", "generic"})
      for (const char* stages : {"2", "3", "4"}) {
        SCOPED_TRACE(std::string("loader ") + loader + ", stages " + stages);
        EnvScope scope("FLASHATTN_CUDA_DECODE_LOADER", loader);
        EnvScope scope_st("FLASHATTN_CUDA_DECODE_STAGES", stages);
        for (const KvCase* k : {&c4, &p4}) {
          const auto l = run(*k);
          EXPECT_EQ(base4.first, l.first) << "out differs from the default loader's";
          EXPECT_EQ(0, std::memcmp(base4.second.data(), l.second.data(), base4.second.size() * 4));
        }
      }
    EXPECT_EQ(a1.first, a2.first) << "out differs run to run";
    EXPECT_EQ(0, std::memcmp(a1.second.data(), a2.second.data(), a1.second.size() * 4));
    EXPECT_EQ(a1.first, pg.first) << "paged out differs from contiguous";
    EXPECT_EQ(0, std::memcmp(a1.second.data(), pg.second.data(), a1.second.size() * 4));
    KvCase one = c;
    one.num_splits = 1;
    const auto o = run(one);
    double worst = 0;
    for (size_t i = 0; i < a1.second.size(); ++i) worst = std::max(worst, std::fabs(double(a1.second[i]) - o.second[i]));
    EXPECT_LE(worst, 1e-4) << "lse: auto splits against none";
  }
}

// Index arrays in device memory are checked on the stream by default (the call's kernels queue
// behind the check and write nothing when it fails); FLASHATTN_CUDA_KV_CHECK=host reads and checks
// them on the host instead. Both ways: the suite's kinds of calls against the reference (append and
// rotary, batch rows and left pads, pages, split-KV), then every rule broken once: the host check's
// own error, and not a byte of out, lse or either cache written.
static void index_arrays_checked(bool on_device) {
  {
    KvCase c;
    c.seqlens = {17, 40};
    check_gpu(c);
  }
  {
    KvCase c;
    c.B = 3, c.batch_idx = true, c.seqlens = {10, 20, 33}, c.leftpad = {0, 7, 33}, c.S_cache = 40, c.Sq = 2,
    c.s_new = 2, c.mask = Mask::CausalBottomRight, c.rotary_dim = 32;
    check_gpu(c);
  }
  for (int32_t splits : {0, 1, 7}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    KvCase p;
    p.B = 2, p.Hq = 8, p.Hkv = 2, p.D = 128, p.seqlens = {3000, 70}, p.S_cache = 3100, p.s_new = 1;
    p.num_splits = splits;
    check_gpu(p);
    p.block_size = 64, p.max_blocks = 50, p.Sq = 4, p.s_new = 4, p.mask = Mask::CausalBottomRight;
    check_gpu(p);
  }
  auto small = [] {
    KvCase c;
    c.dtype = DType::BFloat16;
    c.seqlens = {5, 10};
    c.S_cache = 16;
    c.D = 16;
    c.Hq = 4;
    return c;
  };
  auto expect_refused = [](const KvCase& c, auto&& mutate, const std::vector<std::string>& needles) {
    Harness h(c);
    mutate(h);
    const auto before = h.snapshot();
    DeviceRun r;
    r.catch_errors = true;
    r(h);
    EXPECT_EQ(r.refused, Status::InvalidArgument) << r.message;
    for (const std::string& n : needles)
      EXPECT_NE(r.message.find(n), std::string::npos) << "\"" << r.message << "\" lacks \"" << n << "\"";
    EXPECT_TRUE(before == h.snapshot()) << "a refused call wrote something";
  };
  expect_refused(small(), [](Harness& h) { h.seqlens[1] = 16; }, {"cache_seqlens[1] + S_new = 16 + 1 = 17", "capacity 16"});
  expect_refused(small(), [](Harness& h) { h.seqlens[0] = -1; }, {"cache_seqlens[0] = -1"});
  KvCase paged = small();
  paged.block_size = 16, paged.max_blocks = 2;
  expect_refused(paged, [](Harness& h) { h.seqlens[0] = 32; }, {"cache_seqlens[0] + S_new = 32 + 1 = 33", "capacity 32"});
  expect_refused(paged, [](Harness& h) { h.table[0] = static_cast<int32_t>(h.num_blocks); }, {"block_table[0, 0] = 7"});
  expect_refused(paged, [](Harness& h) { h.table[2] = -1; }, {"block_table[1, 0] = -1"});
  KvCase bi = small();
  bi.batch_idx = true;
  expect_refused(bi, [](Harness& h) { h.bidx[1] = 3; }, {"cache_batch_idx[1] = 3", "[0, 3)"});
  expect_refused(bi, [](Harness& h) { h.bidx[1] = h.bidx[0]; }, {"cache_batch_idx names cache row 2 for two sequences"});
  KvCase lp = small();
  lp.leftpad = {0, 3};
  expect_refused(lp, [](Harness& h) { h.leftpad[1] = 11; }, {"cache_leftpad[1] = 11", "cache_seqlens[1] = 10"});
  KvCase ro = small();
  ro.rotary_dim = 8;
  expect_refused(ro, [](Harness& h) { h.tcos.shape[0] = 10, h.tsin.shape[0] = 10; },
                 {"rotary_cos.shape[0] = 10 is too short", "positions up to 10"});
  // The good arrays again: the call runs (a refused call leaves nothing behind).
  check_gpu(small());
  // The path asked for was taken: under capture the device check is captured (and the call
  // matches the reference from the graph), the host read refuses.
  KvCase cap = small();
  if (on_device) {
    check_case(cap, on_gpu(0, true));
  } else {
    Harness h(cap);
    DeviceRun r;
    r.graph = true;
    r(h);
    EXPECT_EQ(r.refused, Status::Unsupported);
    EXPECT_NE(r.message.find("reads its index tensors"), std::string::npos) << r.message;
  }
}

TEST(KvCacheCuda, IndexArraysCheckedOnDevice) {  // the default
  REQUIRE_GPU();
  EnvScope scope("FLASHATTN_CUDA_KV_CHECK", nullptr);
  index_arrays_checked(true);
}

TEST(KvCacheCuda, IndexArraysCheckedOnHost) {
  REQUIRE_GPU();
  EnvScope scope("FLASHATTN_CUDA_KV_CHECK", "host");
  index_arrays_checked(false);
}

// ---- NaN, refusals ----------------------------------------------------------------------------------

TEST(KvCacheCuda, NanPropagates) {
  REQUIRE_GPU();
  for (int32_t splits : {1, 4}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    KvCase c;
    c.dtype = DType::BFloat16, c.B = 1, c.Hq = 4, c.Hkv = 1, c.D = 64, c.Sq = 1, c.s_new = 0, c.seqlens = {1000};
    c.S_cache = 1024, c.num_splits = splits;
    Harness h(c);
    // q of head 2 NaN: that head's row is NaN, the others finite.
    testing::store_element(h.q.data(), c.dtype, 2 * c.D + 5, std::nan(""));
    h.runner = on_gpu();
    h.run();
    for (int64_t hh = 0; hh < c.Hq; ++hh) {
      const double o = testing::load_element(h.out.data(), c.dtype, hh * c.D + 7);
      EXPECT_EQ(std::isnan(o), hh == 2) << "head " << hh << " out " << o;
      EXPECT_EQ(std::isnan(h.lse[hh]), hh == 2) << "head " << hh << " lse " << h.lse[hh];
    }
  }
}

TEST(KvCacheCuda, Float32Refused) {
  REQUIRE_GPU();
  KvCase c;
  c.dtype = DType::Float32, c.seqlens = {3, 4};
  Harness h(c);
  const std::vector<unsigned char> kc0 = h.kc, out0 = h.out;
  h.runner = on_gpu();
  try {
    h.run();
    FAIL() << "a float32 KV-cache call on CUDA was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported);
    EXPECT_NE(std::string(e.what()).find("float32"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flashattn::test
