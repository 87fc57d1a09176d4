// KV-cache attention (flashattn_forward_kvcache / forward_kvcache) on the CPU: results against the
// float64 reference per sequence (testing::reference_kvcache, which appends and rotates from the
// definitions), the append itself (new rows written exactly, every other cache byte untouched),
// paged caches bitwise equal to contiguous ones, and refused inputs that write nothing, the
// caches included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "testing/problem.hpp"
#include "testing/reference.hpp"
#include "kvcache_cases.hpp"
#include "test_util.hpp"

namespace flashattn::test {
namespace {
// ---- results against the reference -------------------------------------------------------------

TEST(KvCache, DecodeContiguous) {
  KvCase c;
  c.seqlens = {17, 40};
  check_case(c);
}

TEST(KvCache, DecodeNoAppend) {
  KvCase c;
  c.s_new = 0;
  c.seqlens = {1, 64};
  check_case(c);
}

TEST(KvCache, WholeCacheWithoutSeqlens) {
  KvCase c;
  c.s_new = 0;
  c.S_cache = 33;
  c.Sq = 3;
  c.mask = Mask::CausalBottomRight;
  check_case(c);
}

TEST(KvCache, PrefillChunkCausal) {
  for (Mask m : {Mask::None, Mask::CausalBottomRight, Mask::CausalTopLeft}) {
    SCOPED_TRACE(mask_name(m));
    KvCase c;
    c.Sq = 5, c.s_new = 5, c.seqlens = {0, 23}, c.S_cache = 40, c.mask = m;
    check_case(c);
  }
}

TEST(KvCache, SqLargerThanNew) {
  // Sq > S_new: queries see keys the append did not add (and, causal, some see none).
  KvCase c;
  c.Sq = 7, c.s_new = 2, c.seqlens = {3, 1}, c.S_cache = 16, c.mask = Mask::CausalBottomRight;
  check_case(c);
}

TEST(KvCache, LongCaches) {
  KvCase c;
  c.seqlens = {1, 1000, 1234};
  c.B = 3, c.S_cache = 1300, c.Hq = 4, c.Hkv = 4, c.D = 40, c.s_new = 3, c.Sq = 3, c.mask = Mask::CausalBottomRight;
  check_case(c);
}

TEST(KvCache, GqaAndMqa) {
  for (int64_t hkv : {int64_t{2}, int64_t{1}}) {
    KvCase c;
    c.Hq = 8, c.Hkv = hkv, c.seqlens = {5, 30}, c.Sq = 2, c.s_new = 2;
    check_case(c);
  }
}

TEST(KvCache, Paged) {
  for (int64_t bs : {int64_t{16}, int64_t{256}}) {
    SCOPED_TRACE("block_size " + std::to_string(bs));
    KvCase c;
    c.block_size = bs, c.max_blocks = bs == 16 ? 5 : 2, c.seqlens = {17, bs == 16 ? 70 : 300}, c.s_new = 4, c.Sq = 4;
    c.mask = Mask::CausalBottomRight;
    check_case(c);
  }
}

TEST(KvCache, PagedUnusedEntriesNotRead) {
  KvCase c;
  c.block_size = 16, c.max_blocks = 6, c.seqlens = {15, 31}, c.s_new = 1, c.unused_pages_invalid = true;
  check_case(c);
}

TEST(KvCache, PagedEqualsContiguousBitwise) {
  for (DType t : {DType::Float32, DType::BFloat16, DType::Float64}) {
    for (int64_t bs : {int64_t{16}, int64_t{256}}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " block_size " + std::to_string(bs));
      KvCase c;
      c.dtype = t, c.Sq = 3, c.s_new = 3, c.seqlens = {29, 200}, c.mask = Mask::CausalBottomRight;
      c.rotary_dim = 16;
      KvCase p = c;
      p.block_size = bs, p.max_blocks = (256 + bs - 1) / bs;
      c.S_cache = p.block_size * p.max_blocks;  // the same capacity (and rotary table)
      Harness hc(c), hp(p);
      ASSERT_NO_THROW(hc.run());
      ASSERT_NO_THROW(hp.run());
      EXPECT_EQ(hc.out, hp.out);
      EXPECT_EQ(0, std::memcmp(hc.lse.data(), hp.lse.data(), hc.lse.size() * sizeof(float)));
    }
  }
}

TEST(KvCache, BatchIdxAndLeftpad) {
  KvCase c;
  c.B = 3, c.batch_idx = true, c.seqlens = {10, 20, 33}, c.leftpad = {0, 7, 33}, c.S_cache = 40, c.Sq = 2,
  c.s_new = 2, c.mask = Mask::CausalBottomRight, c.rotary_dim = 32;
  check_case(c);
}

TEST(KvCache, Rotary) {
  for (bool inter : {true, false})
    for (int64_t rd : {int64_t{16}, int64_t{64}})
      for (Mask m : {Mask::None, Mask::CausalBottomRight}) {
        SCOPED_TRACE(std::string(inter ? "interleaved" : "neox") + " rotary_dim " + std::to_string(rd) + " " +
                     mask_name(m));
        KvCase c;
        c.rotary_dim = rd, c.interleaved = inter, c.mask = m, c.Sq = 3, c.s_new = 2, c.seqlens = {4, 50};
        check_case(c);
      }
}

TEST(KvCache, WindowSoftcapAlibi) {
  KvCase c;
  c.seqlens = {40, 9}, c.Sq = 4, c.s_new = 4, c.window_left = 8, c.window_right = 0, c.softcap = 5.0f, c.alibi = true;
  c.rotary_dim = 32;
  check_case(c);
  KvCase n = c;
  n.mask = Mask::CausalBottomRight, n.window_left = 3, n.window_right = -1, n.block_size = 16, n.max_blocks = 4;
  check_case(n);
}

TEST(KvCache, Dtypes) {
  for (DType t : {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64}) {
    SCOPED_TRACE(dtype_name(t));
    KvCase c;
    c.dtype = t, c.seqlens = {100, 3}, c.S_cache = 128, c.Sq = 2, c.s_new = 2, c.mask = Mask::CausalBottomRight;
    c.rotary_dim = 64, c.interleaved = false;
    check_case(c);
    KvCase p = c;
    p.block_size = 16, p.max_blocks = 8, p.Sq = 1, p.s_new = 1, p.D = 59, p.rotary_dim = 58;
    check_case(p);
  }
}

TEST(KvCache, StridedQueries) {
  KvCase c;
  c.q_pad = 24, c.seqlens = {6, 12}, c.Sq = 3, c.s_new = 1, c.D = 32;
  check_case(c);
}

// Decode steps (Sq = 1 and 4: the one-vector tiles) over caches of 1 to 2101 keys, around
// multiples of the key tile.
TEST(KvCache, LongDecode) {
  for (DType t : {DType::Float32, DType::BFloat16, DType::Float64}) {
    SCOPED_TRACE(dtype_name(t));
    KvCase c;
    c.dtype = t, c.B = 4, c.Hq = 4, c.Hkv = 2, c.D = 64, c.S_cache = 2200, c.s_new = 1, c.Sq = 1;
    c.seqlens = {0, 511, 512, 2100};  // 1, 512, 513 and 2101 keys
    c.mask = Mask::CausalBottomRight, c.rotary_dim = 32;
    check_case(c);
    KvCase q4 = c;
    q4.Sq = 4, q4.s_new = 2, q4.mask = Mask::None;
    check_case(q4);
  }
}

TEST(KvCache, LongDecodeWindow) {
  // A window of 100 keys over a long cache: the band skips all but the last key tiles.
  KvCase c;
  c.B = 2, c.Hq = 4, c.Hkv = 1, c.D = 32, c.S_cache = 1600, c.Sq = 2, c.s_new = 2, c.seqlens = {1500, 3};
  c.mask = Mask::CausalBottomRight, c.window_left = 100, c.softcap = 10.0f, c.alibi = true;
  check_case(c);
}

// Bitwise the same over 1, 2 and 3 threads, paged or contiguous.
TEST(KvCache, DecodeThreadsAndPagedBitwise) {
  KvCase c;
  c.B = 2, c.Hq = 2, c.Hkv = 1, c.D = 48, c.Sq = 1, c.s_new = 1, c.seqlens = {1800, 700}, c.S_cache = 2048;
  c.mask = Mask::CausalBottomRight;
  KvCase p = c;
  p.block_size = 16, p.max_blocks = 128;
  std::vector<unsigned char> out0;
  std::vector<float> lse0;
  for (int threads : {1, 2, 3}) {
    for (const KvCase* k : {&c, &p}) {
      Harness h(*k);
      h.opts.num_threads = threads;
      ASSERT_NO_THROW(h.run());
      if (out0.empty()) {
        out0 = h.out, lse0 = h.lse;
        continue;
      }
      EXPECT_EQ(out0, h.out) << threads << " threads, " << (k == &p ? "paged" : "contiguous");
      EXPECT_EQ(0, std::memcmp(lse0.data(), h.lse.data(), lse0.size() * sizeof(float)));
    }
  }
}

// ---- refused inputs: error names argument and values, nothing written ---------------------------

template <class Mutate>
void expect_refused(const KvCase& c, Mutate&& mutate, Status status, const std::vector<std::string>& needles) {
  Harness h(c);
  mutate(h);
  const auto before = h.snapshot();
  try {
    h.run();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "\"" << e.what() << "\" lacks \"" << n << "\"";
  }
  EXPECT_TRUE(before == h.snapshot()) << "a refused call wrote something";
}

KvCase small() {
  KvCase c;
  c.seqlens = {5, 10};
  c.S_cache = 16;
  c.D = 16;
  c.Hq = 4;
  return c;
}
KvCase small_paged() {
  KvCase c = small();
  c.block_size = 16, c.max_blocks = 2;
  return c;
}

TEST(KvCacheBadInput, Capacity) {
  expect_refused(small(), [](Harness& h) { h.seqlens[1] = 16; }, Status::InvalidArgument,
                 {"cache_seqlens[1] + S_new = 16 + 1 = 17", "capacity 16"});
  expect_refused(small(), [](Harness& h) { h.seqlens[0] = -1; }, Status::InvalidArgument, {"cache_seqlens[0] = -1"});
  expect_refused(small_paged(), [](Harness& h) { h.seqlens[0] = 32; }, Status::InvalidArgument,
                 {"cache_seqlens[0] + S_new = 32 + 1 = 33", "capacity 32", "max_blocks_per_seq"});
}

TEST(KvCacheBadInput, BlockTable) {
  expect_refused(small_paged(), [](Harness& h) { h.table[0] = static_cast<int32_t>(h.num_blocks); },
                 Status::InvalidArgument, {"block_table[0, 0] = 7", "[0, 7)"});
  expect_refused(small_paged(), [](Harness& h) { h.table[2] = -1; }, Status::InvalidArgument,
                 {"block_table[1, 0] = -1"});
  expect_refused(small_paged(), [](Harness& h) { h.tbt.dtype = DType::Float32; }, Status::InvalidArgument,
                 {"block_table.dtype = float32", "int32"});
  expect_refused(small_paged(), [](Harness& h) { h.tbt.shape[0] = 1; }, Status::InvalidArgument,
                 {"block_table.shape = [1, 2]", "[2, max_blocks_per_seq"});
  expect_refused(small_paged(), [](Harness& h) { h.tbt.stride[1] = 2, h.tbt.shape[1] = 1, h.tbt.shape[1] = 2; },
                 Status::InvalidArgument, {"block_table.stride"});
  KvCase odd = small_paged();
  odd.block_size = 24;
  expect_refused(odd, [](Harness&) {}, Status::InvalidArgument, {"block_size) = 24", "multiple of 16"});
  expect_refused(small_paged(), [](Harness& h) { h.tbi = index_tensor(h.seqlens), h.kv.cache_batch_idx = &h.tbi; },
                 Status::InvalidArgument, {"cache_batch_idx cannot be combined with block_table"});
}

TEST(KvCacheBadInput, IndexArrays) {
  KvCase c = small();
  c.batch_idx = true;
  expect_refused(c, [](Harness& h) { h.bidx[1] = 3; }, Status::InvalidArgument, {"cache_batch_idx[1] = 3", "[0, 3)"});
  expect_refused(c, [](Harness& h) { h.bidx[1] = h.bidx[0]; }, Status::InvalidArgument,
                 {"cache_batch_idx names cache row 2 for two sequences"});
  KvCase l = small();
  l.leftpad = {0, 3};
  expect_refused(l, [](Harness& h) { h.leftpad[1] = 11; }, Status::InvalidArgument,
                 {"cache_leftpad[1] = 11", "cache_seqlens[1] = 10"});
  expect_refused(small(), [](Harness& h) { h.tsl.shape[0] = 3; }, Status::InvalidArgument,
                 {"cache_seqlens.shape = [3]", "[2]"});
  expect_refused(small(), [](Harness& h) { h.tsl.dtype = DType::Float32; }, Status::InvalidArgument,
                 {"cache_seqlens.dtype = float32"});
  expect_refused(small(), [](Harness& h) { h.kv.cache_seqlens = nullptr; }, Status::InvalidArgument,
                 {"cache_seqlens is NULL"});
  expect_refused(small(), [](Harness& h) { h.kv.v_new = nullptr; }, Status::InvalidArgument,
                 {"k_new is given but v_new is NULL"});
}

TEST(KvCacheBadInput, ShapesDtypesDevicesStrides) {
  expect_refused(small(), [](Harness& h) { h.tkn.dtype = DType::Float16; }, Status::InvalidArgument,
                 {"k_new.dtype = float16", "q.dtype = float32"});
  expect_refused(small(), [](Harness& h) { h.tvc.shape[1] = 8; }, Status::InvalidArgument,
                 {"v_cache.shape = [2, 8, 2, 16]", "[2, 16, 2, 16]"});
  expect_refused(small(), [](Harness& h) { h.tkn.shape[2] = 4; }, Status::InvalidArgument,
                 {"k_new.shape = [2, 1, 4, 16]", "[2, 1, 2, 16]"});
  expect_refused(small(), [](Harness& h) { h.tq.shape[2] = 3; h.tout.shape[2] = 3; }, Status::InvalidArgument,
                 {"does not divide q.shape[2] (query heads) = 3"});
  expect_refused(small(), [](Harness& h) { h.tlse.shape[2] = 2; }, Status::InvalidArgument,
                 {"lse.shape = [2, 4, 2]", "[2, 4, 1]"});
  expect_refused(small(), [](Harness& h) { h.tkc.ndim = 3; }, Status::InvalidArgument,
                 {"k_cache.ndim = 3", "[B_cache, S_cache, Hkv, D]"});
  expect_refused(small(), [](Harness& h) { h.tkc.stride[3] = 2; }, Status::InvalidArgument,
                 {"k_cache.stride[3] (head_dim) = 2"});
  expect_refused(small(), [](Harness& h) { h.tkn.device = 0; }, Status::InvalidArgument, {"k_new is on cuda:0"});
  expect_refused(small(), [](Harness& h) { h.tkc.shape[0] = 1; h.tvc.shape[0] = 1; }, Status::InvalidArgument,
                 {"k_cache.shape[0] (cache batch) = 1", "q.shape[0] (batch) = 2"});
}

TEST(KvCacheBadInput, Rotary) {
  KvCase c = small();
  c.rotary_dim = 8;
  expect_refused(c, [](Harness& h) { h.tcos.shape[1] = 9, h.tsin.shape[1] = 9, h.tcos.stride[0] = 9, h.tsin.stride[0] = 9, h.tcos.shape[0] = 10, h.tsin.shape[0] = 10; },
                 Status::InvalidArgument, {"rotary_dim = 2 * rotary_cos.shape[1] = 18", "head_dim = 16"});
  expect_refused(c, [](Harness& h) { h.tsin.shape[1] = 3; }, Status::InvalidArgument,
                 {"rotary_sin.shape = [17, 3]", "rotary_cos.shape = [17, 4]"});
  expect_refused(c, [](Harness& h) { h.tcos.shape[0] = 10, h.tsin.shape[0] = 10; }, Status::InvalidArgument,
                 {"rotary_cos.shape[0] = 10 is too short", "positions up to 10"});
  expect_refused(c, [](Harness& h) { h.kv.rotary_sin = nullptr; }, Status::InvalidArgument,
                 {"rotary_cos is given but rotary_sin is NULL"});
  expect_refused(c, [](Harness& h) { h.tcos.dtype = DType::Float16; }, Status::InvalidArgument,
                 {"rotary_cos.dtype = float16"});
  KvCase n = c;
  n.s_new = 0;  // rotary without an append (FlashAttention refuses it too)
  expect_refused(n, [](Harness&) {}, Status::InvalidArgument, {"rotary_cos / rotary_sin are given but k_new"});
}

TEST(KvCacheBadInput, Aliasing) {
  // out over q, lse over the cache, the caches over each other or over k_new.
  expect_refused(small(), [](Harness& h) { h.tout.data = h.q.data(); }, Status::InvalidArgument,
                 {"output out aliases input q"});
  expect_refused(small(), [](Harness& h) { h.tlse.data = h.kc.data(); }, Status::InvalidArgument,
                 {"lse", "k_cache"});
  expect_refused(small(), [](Harness& h) { h.tvc.data = h.kc.data(); }, Status::InvalidArgument,
                 {"k_cache and v_cache overlap"});
  expect_refused(small(), [](Harness& h) { h.tkn.data = h.kc.data(); }, Status::InvalidArgument,
                 {"output k_cache aliases input k_new"});
  KvCase n = small();
  n.s_new = 0;  // no append: the caches are inputs, out must still not overlap them
  expect_refused(n, [](Harness& h) { h.tout.data = h.vc.data(); }, Status::InvalidArgument,
                 {"output out aliases input v_cache"});
}

TEST(KvCacheBadInput, CApiStructSize) {
  Harness h(small());
  const auto before = h.snapshot();
  flashattn_kvcache kv;
  flashattn_kvcache_init(&kv);
  EXPECT_EQ(kv.struct_size, sizeof(flashattn_kvcache));
  EXPECT_EQ(kv.rotary_interleaved, 1);
  auto ct = [](const Tensor& t) {
    flashattn_tensor r{};
    r.data = t.data, r.dtype = static_cast<int32_t>(t.dtype), r.device = t.device, r.ndim = t.ndim;
    for (int i = 0; i < 4; ++i) r.shape[i] = t.shape[i], r.stride[i] = t.stride[i];
    return r;
  };
  const flashattn_tensor q = ct(h.tq), k = ct(h.tkc), v = ct(h.tvc), o = ct(h.tout), l = ct(h.tlse);
  kv.struct_size = sizeof(flashattn_kvcache) - 8;
  EXPECT_EQ(flashattn_forward_kvcache(&q, &k, &v, &o, &l, &kv, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(flashattn_last_error()).find("kv->struct_size"), std::string::npos) << flashattn_last_error();
  EXPECT_EQ(flashattn_forward_kvcache(&q, &k, &v, &o, &l, nullptr, nullptr), FLASHATTN_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(before == h.snapshot());
}

}  // namespace
}  // namespace flashattn::test
