// Coverage-guided fuzzer of the C ABI's KV-cache call, flashattn_forward_kvcache (FlashAttention's
// flash_attn_with_kvcache: decoding over a cache, the in-place append of k_new / v_new at
// cache_seqlens, rotary embedding, paged caches through block_table, cache_batch_idx,
// cache_leftpad, num_splits).
//
// Each input decodes into one call: a tiny problem (B <= 3, Hq <= 4, Sq <= 5, head_dim <= 32,
// caches of <= 40 rows or <= 3 pages of 8..48 rows; every dtype code), which optional parts it
// has (append, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, rotary tables, now and
// then in combinations the header forbids), the index arrays' contents (drawn valid: seqlens that
// leave room for the append, leftpads within them, distinct batch rows and pages, unused block
// table entries -1 or out of range), a layout per tensor ([B, S, H, D], padded, heads outer,
// head ranges of a wider buffer, broadcast), a placement (caches or new keys/values fused in one
// buffer or one view, or random offsets that alias), then mutations of the views (ndim, shapes,
// strides, dtype and device codes, NULL data, NULL pointers, misaligned pointers, other buffers)
// and of the index arrays' entries (capacity + 1, -1, duplicates, pages out of range, INT32_MAX,
// ...), the flashattn_kvcache struct (NULL, struct_size, num_splits, rotary_interleaved) and the
// options (as fuzz_c_abi: struct_size, scale, mask, threads, precision, window, softcap, ALiBi;
// and max_flops, a cancel callback that always or never cancels, workspace_query, a workspace
// pointer that CPU calls ignore).
//
// Invariants (any violation aborts, which the fuzzer reports as a crash):
//   - no crash, no ASan/UBSan report (build with -fsanitize=fuzzer,address,undefined);
//   - a non-zero status is a known code and comes with a non-empty flashattn_last_error(), and
//     a zero status with ""; FLASHATTN_ERROR_CANCELLED only from a callback that cancels;
//   - on error, no byte of any buffer changed (every byte, canaries and caches included: the
//     append must not happen when the call fails), nor the structs passed in;
//   - on success, the call was valid by the documented rules (model below: a call it finds
//     invalid must fail), only bytes of out and lse and of the cache rows the append writes
//     ([cache_seqlens[b], cache_seqlens[b] + S_new) of sequence b's batch row or pages, every kv
//     head) changed, nothing at all with workspace_query (which then reads 0); the appended v rows
//     are v_new's bytes, the k rows k_new's (the rotated dimensions: the rotation, exactly, for
//     the small inputs written here);
//   - on success, a query row that sees no key (under the mask, the window and Sk_b =
//     cache_seqlens[b] + S_new - cache_leftpad[b]) has out = 0 and lse = -inf exactly, whatever
//     the inputs hold; for finite small inputs at a moderate scale the other rows are finite (out
//     and lse are NaN-poisoned before the call, so an unwritten element shows), and for the
//     inputs written here (multiples of 1/4, |x| <= 2) they match a float64 reference of the
//     documented semantics (rotary, append, mask, window, softcap, ALiBi over Sk_b) within a
//     tolerance of the dtype and the scores' size. In half the inputs every cache element outside
//     the attended rows [cache_leftpad[b], cache_seqlens[b] + S_new) is NaN (a cache's unused
//     rows hold anything): those rows are no keys of the call, so this changes none of the above;
//   - a call the model finds valid succeeds (or is cancelled by its callback), except that it may
//     be refused for (conservatively assumed) overlap, with a message saying so.
// The model is three-valued: where the header does not settle a case (an index vector's stride
// when it has more than one entry, a negative stride of a size-1 index dimension, a first stride
// above 2^40 of block_table or the rotary tables, B_cache < B with cache_batch_idx, rotary tables
// sized for exactly one reading of "a sliding window is set" when window_left = window_right =
// -1), it claims neither success nor failure.
// Views that would reach outside their buffer are never handed to a call that could succeed:
// such a call gets an invalid mask (the library must refuse it before touching memory).
//
// FUZZ_KVCACHE_VERBOSE=1 prints valid calls refused as overlap; =2 every call's status and message.
//
// Built two ways: with libFuzzer (tests/fuzz/CMakeLists.txt, FLASHATTN_BUILD_FUZZ=ON, clang), and
// without it as a replay tool (FLASHATTN_FUZZ_REPLAY: main() runs the files and directories
// given) that CTest runs over tests/fuzz/corpus_kvcache in every build, sanitizer build included.
// What it shares with fuzz_c_abi.cpp (the reader, views, buffers, values, replay) is in
// fuzz_util.hpp.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flashattn/flashattn.h"
#include "fuzz_util.hpp"

namespace {

using namespace fuzz;

// ---- input decoding ----------------------------------------------------------------------------

// Past the input's end the bytes go on as a pseudo-random stream seeded by the input (the Reader's
// random tail): a short input still decodes into a whole call of varied sizes and options.
// (Coverage here is that of the validation code; the kernels, which run the valid calls, are not
// instrumented and would not reward inputs that spell out larger problems.)
constexpr int kQ = 0, kKc = 1, kVc = 2, kOut = 3, kLse = 4, kKn = 5, kVn = 6, kSeqlens = 7, kBidx = 8,
              kLeftpad = 9, kTable = 10, kCos = 11, kSin = 12, kAlibi = 13;
constexpr int kTensors = 14;  // one buffer each
const char* const kName[kTensors] = {"q",     "k_cache",         "v_cache",       "out",         "lse",
                                     "k_new", "v_new",           "cache_seqlens", "cache_batch_idx",
                                     "cache_leftpad", "block_table", "rotary_cos", "rotary_sin", "alibi_slopes"};

// The float dtypes, and int32 (the index tensors).
int64_t dtype_bytes(int32_t dt) { return dt == FLASHATTN_INT32 ? 4 : float_dtype_bytes(dt); }
bool float_dtype(int32_t dt) { return dt >= FLASHATTN_FLOAT32 && dt <= FLASHATTN_FLOAT64; }

// order: dims from innermost to outermost (ndim of them); pad: extra elements after each extent.
void set_strides(View& v, const int* order, const int64_t* pad) {
  int64_t s = 1;
  for (int i = 0; i < v.ndim; ++i) {
    const int d = order[i];
    v.stride[d] = s;
    s = s * v.shape[d] + pad[i];
  }
}

enum CancelMode { kNoCancel = 0, kCancelAlways = 1, kCancelNever = 2 };

struct Case {
  View t[kTensors];
  // The problem as decoded (the model reads the views and the buffers, not these).
  int64_t B = 1, Hq = 1, Hkv = 1, Sq = 1, D = 1, Sc = 1, Bc = 1, max_blocks = 0, s_new = 0, capacity = 1;
  int32_t dt = FLASHATTN_FLOAT32;
  bool paged = false;
  std::vector<int32_t> vals[kTensors];  // contents of the index tensors, in logical order
  // flashattn_kvcache
  bool kv_null = false;
  uint32_t kv_size = sizeof(flashattn_kvcache);
  int32_t interleaved = 1, num_splits = 0;
  // options
  bool opts_null = true;
  flashattn_options opts{};
  CancelMode cancel = kNoCancel;
  bool query = false;
  int64_t buf_size[kTensors] = {};
};

// The problem, which optional parts the call has, and the index arrays' contents (valid).
void decode_problem(Reader& r, Case& c) {
  c.B = 1 + r.u8() % 3;
  c.Hkv = 1 + r.u8() % 2;
  c.Hq = std::min<int64_t>(4, c.Hkv * (1 + r.u8() % 4));
  c.Sq = 1 + r.u8() % 5;
  static const int64_t dims[] = {1, 2, 3, 4, 4, 5, 6, 8, 8, 8, 8, 12, 16, 16, 16, 32};
  c.D = r.pick(dims);
  static const int32_t dtypes[] = {0, 0, 0, 1, 1, 2, 2, 3};
  c.dt = r.pick(dtypes);
  const uint8_t f = r.u8(), g = r.u8();
  const bool odd = g % 16 == 0;  // now and then a combination the header forbids
  c.paged = f & 1;
  const bool append = (f & 6) != 0;
  const bool with_seqlens = append || (f & 8) || (odd && (g & 16));
  const bool with_bidx = (f & 16) && (!c.paged || odd);
  const bool with_leftpad = (f & 32) && (!c.paged || odd);
  const bool with_rotary = (f & 64) && (append || odd);
  const bool append_no_seqlens = odd && (g & 32);  // an append without cache_seqlens (refused)

  if (c.paged) {
    static const int64_t blocks[] = {16, 16, 16, 32, 32, 48, 8, 24};
    c.Sc = r.pick(blocks);
    c.max_blocks = 1 + r.u8() % 3;
    c.Bc = c.B * c.max_blocks + r.u8() % 3;  // number of pages
    c.capacity = c.Sc * c.max_blocks;
  } else {
    c.Sc = 1 + r.u8() % 40;
    c.Bc = c.B + r.u8() % (with_bidx ? 3 : 2);
    c.capacity = c.Sc;
  }
  c.s_new = append ? 1 + r.u8() % 4 : 0;

  std::vector<int32_t> sl(static_cast<size_t>(c.B), static_cast<int32_t>(c.capacity));
  const int64_t room = c.capacity - c.s_new;
  if (with_seqlens)
    for (int64_t b = 0; b < c.B; ++b) sl[b] = room >= 0 ? static_cast<int32_t>(r.u8() % (room + 1)) : 0;
  if (with_seqlens && !(append_no_seqlens && append)) c.vals[kSeqlens] = sl;
  if (with_leftpad)
    for (int64_t b = 0; b < c.B; ++b) c.vals[kLeftpad].push_back(static_cast<int32_t>(r.u8() % (sl[b] + 1)));
  if (with_bidx && !append && !c.paged && (g & 64)) {  // no append: rows may repeat, B_cache < B
    c.Bc = 1 + r.u8() % (c.B + 1);
    for (int64_t b = 0; b < c.B; ++b) c.vals[kBidx].push_back(static_cast<int32_t>(r.u8() % c.Bc));
  } else if (with_bidx) {
    std::vector<int32_t> perm(static_cast<size_t>(c.Bc));
    for (int64_t i = 0; i < c.Bc; ++i) perm[i] = static_cast<int32_t>(i);
    for (int64_t i = c.Bc - 1; i > 0; --i) std::swap(perm[i], perm[r.u8() % (i + 1)]);
    c.vals[kBidx].assign(perm.begin(), perm.begin() + c.B);
  }
  if (c.paged) {
    std::vector<int32_t> perm(static_cast<size_t>(c.Bc));
    for (int64_t i = 0; i < c.Bc; ++i) perm[i] = static_cast<int32_t>(i);
    for (int64_t i = c.Bc - 1; i > 0; --i) std::swap(perm[i], perm[r.u8() % (i + 1)]);
    const uint8_t unused = r.u8() % 4;
    for (int64_t b = 0; b < c.B; ++b) {
      const int64_t used = (sl[b] + c.s_new + c.Sc - 1) / c.Sc;
      for (int64_t i = 0; i < c.max_blocks; ++i) {
        int32_t e = perm[b * c.max_blocks + i];
        if (i >= used && unused == 1) e = -1;  // entries past the used pages are not read
        if (i >= used && unused == 2) e = static_cast<int32_t>(c.Bc + 5);
        if (i >= used && unused == 3) e = std::numeric_limits<int32_t>::max();
        c.vals[kTable].push_back(e);
      }
    }
  }

  // The views: q, caches, out, lse and the new keys and values get their layouts below; the
  // index tensors and rotary tables are plain (their mutations come later).
  for (int i = 0; i < kTensors; ++i) {
    c.t[i].buf = i;
    c.t[i].dtype = c.dt;
  }
  auto shape4 = [](View& v, int64_t a, int64_t b, int64_t cc, int64_t d) {
    v.ndim = 4;
    v.shape[0] = a, v.shape[1] = b, v.shape[2] = cc, v.shape[3] = d;
  };
  for (int i : {kQ, kOut}) c.t[i].used = true, shape4(c.t[i], c.B, c.Sq, c.Hq, c.D);
  for (int i : {kKc, kVc}) c.t[i].used = true, shape4(c.t[i], c.Bc, c.Sc, c.Hkv, c.D);
  for (int i : {kKn, kVn}) c.t[i].used = append, shape4(c.t[i], c.B, std::max<int64_t>(c.s_new, 1), c.Hkv, c.D);
  View& lse = c.t[kLse];
  lse.used = true;
  lse.dtype = FLASHATTN_FLOAT32;
  lse.ndim = 3;
  lse.shape[0] = c.B, lse.shape[1] = c.Hq, lse.shape[2] = c.Sq;
  for (int i : {kSeqlens, kBidx, kLeftpad}) {
    View& v = c.t[i];
    v.used = !c.vals[i].empty();
    v.dtype = FLASHATTN_INT32;
    v.ndim = 1;
    v.shape[0] = c.B;
    v.stride[0] = 1;
  }
  View& bt = c.t[kTable];
  bt.used = c.paged;
  bt.dtype = FLASHATTN_INT32;
  bt.ndim = 2;
  bt.shape[0] = c.B;
  bt.shape[1] = std::max<int64_t>(c.max_blocks, 1);
  bt.stride[1] = 1;
  bt.stride[0] = bt.shape[1] + r.u8() % 2;
  if (with_rotary) {
    const int64_t half = 1 + r.u8() % std::max<int64_t>(1, c.D / 2);
    int64_t rows = c.capacity + c.Sq;  // covers every position
    if (r.u8() % 4 == 0) rows -= r.u8() % (c.Sq + c.s_new + 1);
    const int64_t pad = r.u8() % 3;
    for (int i : {kCos, kSin}) {
      View& v = c.t[i];
      v.used = true;
      v.ndim = 2;
      v.shape[0] = rows;
      v.shape[1] = half;
      v.stride[0] = half + pad;
      v.stride[1] = 1;
    }
    c.interleaved = r.u8() & 1;
  }

  // Layouts of the 4-d views: [B, S, H, D] memory order, padded, heads outer ([B, H, S, D]
  // memory), a head range of a wider buffer, broadcast (inputs only: a stride-0 dimension).
  for (int i : {kQ, kKc, kVc, kOut, kKn, kVn}) {
    View& v = c.t[i];
    const uint8_t lay = r.u8() % 6;
    static const int bshd[4] = {3, 2, 1, 0}, bhsd[4] = {3, 1, 2, 0};
    const int64_t zero[4] = {0, 0, 0, 0};
    switch (lay) {
      case 1: {
        const int64_t pad[4] = {r.u8() % 3, r.u8() % 3, r.u8() % 3, 0};
        set_strides(v, bshd, pad);
        break;
      }
      case 2: set_strides(v, bhsd, zero); break;
      case 3: {
        const int64_t extra = 1 + r.u8() % 3, h0 = r.u8() % (extra + 1);
        v.shape[2] += extra;
        set_strides(v, bshd, zero);
        v.shape[2] -= extra;
        v.byte_off += h0 * v.shape[3] * dtype_bytes(v.dtype);
        break;
      }
      case 4:
        set_strides(v, bshd, zero);
        if (i != kOut) v.stride[r.u8() & 1] = 0;  // (caches: refused as outputs when appending)
        break;
      default: set_strides(v, bshd, zero);
    }
  }
  {
    const uint8_t lay = r.u8() % 3;
    static const int bhs[3] = {2, 1, 0}, bsh[3] = {1, 2, 0};
    const int64_t pad[3] = {lay == 1 ? 1 + r.u8() % 2 : 0, 0, 0}, zero[3] = {0, 0, 0};
    set_strides(lse, lay == 2 ? bsh : bhs, lay == 1 ? pad : zero);
  }

  // Placement: caches (and new keys/values) as head ranges of one [.., 2 * Hkv, D] buffer, or as
  // one view; now and then random buffers and offsets that alias.
  auto fuse = [&](int a, int b, bool same) {
    View &x = c.t[a], &y = c.t[b];
    if (same) {
      y = x;
      return;
    }
    const int64_t es = dtype_bytes(c.dt), H2 = 2 * x.shape[2];
    for (View* v : {&x, &y}) {
      v->buf = a;
      v->stride[3] = 1;
      v->stride[2] = v->shape[3];
      v->stride[1] = H2 * v->shape[3];
      v->stride[0] = v->shape[1] * v->stride[1];
      v->byte_off = 0;
    }
    y.byte_off = x.shape[2] * x.shape[3] * es;
  };
  const uint8_t p = r.u8();
  if ((p & 3) == 1 || (p & 3) == 2) fuse(kKc, kVc, (p & 3) == 2);
  if (append && (((p >> 2) & 3) == 1 || ((p >> 2) & 3) == 2)) fuse(kKn, kVn, ((p >> 2) & 3) == 2);
  if ((p >> 4) % 8 == 0) {
    static const int bufs[] = {kQ, kKc, kVc, kOut};
    for (int i : {kQ, kKc, kVc, kOut, kLse, kKn, kVn}) {
      View& v = c.t[i];
      if (!v.used || (r.u8() & 3) == 0) continue;
      v.buf = r.pick(bufs);
      const int64_t es = std::max<int64_t>(1, dtype_bytes(v.dtype));
      v.byte_off = (r.u8() & 1) ? static_cast<int64_t>(r.u8()) * es : (r.u8() % 16) * es * c.D;
    }
  }
}

const int64_t kSpecial[] = {0,
                            -1,
                            1,
                            2,
                            3,
                            16,
                            int64_t{1} << 31,
                            int64_t{1} << 40,
                            (int64_t{1} << 40) + 1,
                            int64_t{1} << 62,
                            std::numeric_limits<int64_t>::max(),
                            std::numeric_limits<int64_t>::min(),
                            -(int64_t{1} << 62)};

// Mutations of the views, then of the index arrays' entries.
void decode_mutations(Reader& r, Case& c) {
  const int n = r.u8() % 8;  // 0-3 mutations half the time, none otherwise
  for (int m = 0; m < (n > 3 ? 0 : n); ++m) {
    View& v = c.t[r.u8() % kTensors];
    const uint8_t kind = r.u8() % 11;
    if (!v.used) continue;
    mutate_view(r, v, kind, kTensors, kSpecial, dtype_bytes);
  }
  const int nv = r.u8() % 6;  // 0-2 entries changed half the time
  for (int m = 0; m < (nv > 2 ? 0 : nv); ++m) {
    static const int which[] = {kSeqlens, kBidx, kLeftpad, kTable};
    std::vector<int32_t>& x = c.vals[r.pick(which)];
    const uint8_t at = r.u8(), how = r.u8();
    if (x.empty()) continue;
    int32_t& e = x[at % x.size()];
    const int64_t cands[] = {-1,
                             0,
                             1,
                             c.capacity - c.s_new + 1,
                             c.capacity,
                             c.Bc,
                             c.Bc - 1,
                             std::numeric_limits<int32_t>::max(),
                             std::numeric_limits<int32_t>::min(),
                             int64_t{e} + 1,
                             int64_t{e} - 1,
                             x[(at + 1) % x.size()]};
    e = static_cast<int32_t>(cands[how % (sizeof cands / sizeof cands[0])]);
  }
}

void decode_kv(Reader& r, Case& c) {
  const uint8_t m = r.u8();
  c.kv_null = m == 255;
  static const uint32_t sizes[] = {0, 4, sizeof(flashattn_kvcache) - 8, sizeof(flashattn_kvcache) - 4,
                                   sizeof(flashattn_kvcache) + 8, 4096};
  if (m >= 240 && m < 255) c.kv_size = r.pick(sizes);
  static const int32_t splits[] = {0, 0, 0, 0, 1, 2, 7, 128, 129, -1, std::numeric_limits<int32_t>::min()};
  c.num_splits = r.pick(splits);
  if (r.u8() % 16 == 0) c.interleaved = static_cast<int32_t>(r.u32());  // any nonzero is GPT-J
}

// The options (as fuzz_c_abi's: everything up to the ALiBi slopes), then the bounds.
void decode_options(Reader& r, Case& c) {
  const uint8_t mode = r.u8() % 8;
  c.opts_null = mode == 0;
  if (c.opts_null) return;
  flashattn_options_init(&c.opts);
  static const uint32_t sizes[] = {0, 4, 16, 23, 24, 25, 28, 32, 36, 40,
                                   offsetof(flashattn_options, window_right),
                                   offsetof(flashattn_options, softcap),
                                   offsetof(flashattn_options, sliding_window) + 4,
                                   offsetof(flashattn_options, alibi_slopes) + 4,
                                   FLASHATTN_OPTIONS_V3_SIZE,
                                   offsetof(flashattn_options, max_flops) + 8,
                                   FLASHATTN_OPTIONS_V4_SIZE,
                                   sizeof(flashattn_options) - 8,
                                   sizeof(flashattn_options), sizeof(flashattn_options) + 8, 1000};
  if (mode == 1) c.opts.struct_size = r.pick(sizes);
  static const float scales[] = {0.0f, 0.0f, 0.0f, 1.0f, 0.125f, -0.5f, 2.0f, 100.0f, 1e-30f, -0.0f,
                                 FLASHATTN_MAX_SOFTMAX_SCALE, 1.0000001e6f, 1e30f,
                                 std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::denorm_min()};
  decode_scale_and_mask(r, c.opts, scales);
  // Mostly 0 (all hardware threads): each new count rebuilds the pool, which costs more than a
  // tiny call.
  static const int32_t threads[] = {1, 2, 3, -1, FLASHATTN_MAX_THREADS + 1};
  const uint8_t th = r.u8();
  c.opts.num_threads = th < 224 ? 0 : threads[th % (sizeof threads / sizeof threads[0])];
  static const int32_t precisions[] = {0, 0, 0, 1, 2, -1};
  c.opts.precision = r.pick(precisions);
  c.opts.deterministic = r.u8() & 1;
  if (r.u8() % 8 == 0) c.opts.stream = reinterpret_cast<void*>(uintptr_t{0x1000});  // ignored on the CPU

  static const int64_t sides[] = {-1, -1, 0, 1, 2, 3, 7, 64, -2, std::numeric_limits<int64_t>::min(),
                                  std::numeric_limits<int64_t>::max()};
  decode_window(r, c.opts, sides);
  static const float caps[] = {0.0f, 0.0f, 0.0f, 0.5f, 1.0f, 5.0f, 30.0f, 1e-30f, 1e30f, -0.0f, -1.0f,
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  c.opts.softcap = r.pick(caps);

  const uint8_t a = r.u8();
  if (a % 3 != 0) alibi_view(c.t[kAlibi], a, kAlibi, c.B, c.Hq);

  static const double flops[] = {0.0, 0.0, 0.0, 0.0, 0.0, 1e30, 1.0, -1.0,
                                 std::numeric_limits<double>::quiet_NaN(),
                                 std::numeric_limits<double>::infinity()};
  const uint8_t b = r.u8();
  c.opts.max_flops = b < 192 ? 0.0 : flops[b % (sizeof flops / sizeof flops[0])];
  const uint8_t k = r.u8();
  c.cancel = k < 224 ? kNoCancel : (k & 1) ? kCancelAlways : kCancelNever;
  c.query = r.u8() % 16 == 0;
  if (r.u8() % 16 == 0) {  // caller scratch: ignored by CPU calls, whatever it is
    c.opts.workspace = reinterpret_cast<void*>(uintptr_t{0x1001});
    c.opts.workspace_bytes = 7;
  }
}

// ---- layout facts ------------------------------------------------------------------------------

template <class F>
void for_each_element(const View& v, F&& f) {  // f(byte offset in the buffer); safe views only
  fuzz::for_each_element(v, dtype_bytes(v.dtype), f);
}

// Byte offset of element (i0, i1, i2, i3) of a view (the trailing indices of a smaller ndim 0).
int64_t at(const View& v, int64_t i0, int64_t i1 = 0, int64_t i2 = 0, int64_t i3 = 0) {
  return v.byte_off + (i0 * v.stride[0] + i1 * v.stride[1] + i2 * v.stride[2] + i3 * v.stride[3]) * dtype_bytes(v.dtype);
}

// Whether the call reads the ALiBi slopes' view: options whose struct_size has the pointer, and
// a non-NULL pointer.
bool alibi_read(const Case& c) {
  return !c.opts_null && c.t[kAlibi].passed() &&
         c.opts.struct_size >= offsetof(flashattn_options, alibi_slopes) + sizeof(void*);
}
bool has_field(const Case& c, size_t offset, size_t size) { return !c.opts_null && c.opts.struct_size >= offset + size; }
bool cancel_read(const Case& c) {
  return c.cancel != kNoCancel && has_field(c, offsetof(flashattn_options, cancel_arg), sizeof(void*));
}
bool query_read(const Case& c) {
  return c.query && has_field(c, offsetof(flashattn_options, workspace_query), sizeof(void*));
}

// ---- values --------------------------------------------------------------------------------------

[[noreturn]] void violation(const char* what, const std::string& detail) {
  invariant_violated("fuzz_kvcache", what, detail);
}

int32_t load_i32(const unsigned char* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// ---- the model ---------------------------------------------------------------------------------

enum Verdict { kValid, kInvalid, kUnsure };

// What a valid call does, per the header: sequence b's cache rows and their use.
struct Plan {
  bool append = false, paged = false, rotary = false, alibi = false;
  int64_t B = 0, Sq = 0, Hq = 0, D = 0, Bc = 0, Sc = 0, Hkv = 0, s_new = 0, capacity = 0, max_blocks = 0;
  int64_t half = 0;                  // rotary_dim / 2
  std::vector<int64_t> sl, lp, row;  // cache_seqlens (before the append), leftpad, batch row
  std::vector<int64_t> table;        // [B * max_blocks] (paged)
  int32_t mask = 0;
  int64_t wl = -1, wr = -1;  // -1: unbounded (also when no window is read)
  bool q_adv = false;        // query row i at position sl + i (else every row at sl)
  bool q_adv_ambiguous = false;
  float scale = 1, softcap = 0;
  int64_t sk(int64_t b) const { return sl[b] + s_new - lp[b]; }
};

// Byte offset, in the cache view v, of (sequence b, absolute cache row r, kv head h, dim d).
int64_t cache_at(const Plan& p, const View& v, int64_t b, int64_t r, int64_t h, int64_t d) {
  if (p.paged) return at(v, p.table[b * p.max_blocks + r / p.Sc], r % p.Sc, h, d);
  return at(v, p.row[b], r, h, d);
}

// The documented rules of flashattn.h (this build's: CPU only, head_dim <= 256), except
// aliasing, which the byte marks decide exactly. Reads the index arrays from the buffers.
Verdict model(const Case& c, const std::vector<unsigned char*>& base, Plan& p, std::string* why) {
  bool unsure = false;
  auto no = [&](const std::string& s) {
    *why = s;
    return kInvalid;
  };
  auto maybe = [&](const std::string& s) {
    if (!unsure) *why = "unsure: " + s;
    unsure = true;
  };
  auto aligned = [&](const View& v, int64_t a) {
    return reinterpret_cast<uintptr_t>(base[static_cast<size_t>(v.buf)] + v.byte_off) % static_cast<uintptr_t>(a) == 0;
  };
  if (c.kv_null) return no("kv NULL");
  if (c.kv_size < sizeof(flashattn_kvcache)) return no("kv struct_size");
  const View &q = c.t[kQ], &kc = c.t[kKc], &vc = c.t[kVc], &out = c.t[kOut], &lse = c.t[kLse], &kn = c.t[kKn],
             &vn = c.t[kVn];
  for (int i : {kQ, kKc, kVc, kOut, kLse})
    if (c.t[i].null_ptr) return no(std::string(kName[i]) + " NULL");
  p.append = kn.passed();
  if (kn.passed() != vn.passed()) return no("k_new without v_new or v_new without k_new");
  const View &cs = c.t[kCos], &sn = c.t[kSin], &sl = c.t[kSeqlens], &bi = c.t[kBidx], &lp = c.t[kLeftpad],
             &bt = c.t[kTable];
  if (cs.passed() != sn.passed()) return no("one rotary table");
  p.rotary = cs.passed();
  if (p.rotary && !p.append) return no("rotary without an append");
  if (p.append && !sl.passed()) return no("append without cache_seqlens");
  p.paged = bt.passed();
  if (p.paged && bi.passed()) return no("block_table with cache_batch_idx");
  if (p.paged && lp.passed()) return no("block_table with cache_leftpad");
  if (c.num_splits < 0 || c.num_splits > 128) return no("num_splits");

  // The data tensors: ndim, pointer, dtype, device, positive shapes, non-negative strides, unit
  // head_dim stride, inside the buffer, aligned.
  std::vector<int> data = {kQ, kKc, kVc, kOut, kLse};
  if (p.append) data.push_back(kKn), data.push_back(kVn);
  for (int i : data) {
    const View& v = c.t[i];
    const int want = i == kLse ? 3 : 4;
    if (v.ndim != want) return no(std::string(kName[i]) + " ndim");
    if (v.null_data) return no(std::string(kName[i]) + " data NULL");
    if (!float_dtype(v.dtype)) return no(std::string(kName[i]) + " dtype");
    if (v.device != FLASHATTN_CPU) return no(std::string(kName[i]) + " device");
    for (int d = 0; d < v.ndim; ++d) {
      if (v.shape[d] <= 0) return no(std::string(kName[i]) + " shape");
      if (v.stride[d] < 0) return no(std::string(kName[i]) + " stride");
    }
    if (want == 4 && v.shape[3] > 1 && v.stride[3] != 1) return no(std::string(kName[i]) + " head stride");
    if (!v.safe) return no(std::string(kName[i]) + " outside its buffer");  // (such calls get a bad mask)
    if (!aligned(v, dtype_bytes(v.dtype))) return no(std::string(kName[i]) + " misaligned");
  }
  const int32_t dt = q.dtype;
  for (int i : data)
    if (i != kLse && c.t[i].dtype != dt) return no(std::string(kName[i]) + " dtype != q");
  if (lse.dtype != FLASHATTN_FLOAT32) return no("lse dtype");
  p.B = q.shape[0], p.Sq = q.shape[1], p.Hq = q.shape[2], p.D = q.shape[3];
  p.Bc = kc.shape[0], p.Sc = kc.shape[1], p.Hkv = kc.shape[2];
  for (int d = 0; d < 4; ++d) {
    if (out.shape[d] != q.shape[d]) return no("out shape");
    if (vc.shape[d] != kc.shape[d]) return no("v_cache shape");
  }
  if (kc.shape[3] != p.D) return no("k_cache head_dim");
  if (p.Hq % p.Hkv != 0) return no("Hq % Hkv");
  if (lse.shape[0] != p.B || lse.shape[1] != p.Hq || lse.shape[2] != p.Sq) return no("lse shape");
  if (p.D > 256) return no("head_dim > 256");
  p.s_new = p.append ? kn.shape[1] : 0;
  if (p.append) {
    const int64_t want[4] = {p.B, p.s_new, p.Hkv, p.D};
    for (int d = 0; d < 4; ++d)
      if (kn.shape[d] != want[d] || vn.shape[d] != want[d]) return no("k_new / v_new shape");
  }
  if (!p.paged && !bi.passed() && p.Bc < p.B) return no("cache batch < B");
  // (The header's layout line says B_cache >= B; with cache_batch_idx naming the rows, a smaller
  // cache batch is what FlashAttention allows.)
  if (!p.paged && bi.passed() && p.Bc < p.B) maybe("B_cache < B with cache_batch_idx");
  if (p.paged && p.Sc % 16 != 0) return no("block_size not a multiple of 16");

  // Index tensors: int32 [B] (block_table [B, max_blocks >= 1], unit last stride), present,
  // aligned, on the CPU.
  for (int i : {kSeqlens, kBidx, kLeftpad}) {
    const View& v = c.t[i];
    if (!v.passed()) continue;
    if (v.dtype != FLASHATTN_INT32) return no(std::string(kName[i]) + " dtype");
    if (v.ndim != 1) return no(std::string(kName[i]) + " ndim");
    if (v.shape[0] != p.B) return no(std::string(kName[i]) + " shape");
    if (v.null_data) return no(std::string(kName[i]) + " data NULL");
    if (v.device != FLASHATTN_CPU) return no(std::string(kName[i]) + " device");
    if (!v.safe) return no(std::string(kName[i]) + " outside its buffer");
    if (!aligned(v, 4)) return no(std::string(kName[i]) + " misaligned");
    // (The header gives these vectors no stride rule; the library reads them as plain arrays.)
    if (v.shape[0] > 1 && v.stride[0] != 1) maybe(std::string(kName[i]) + " stride " + std::to_string(v.stride[0]));
    if (v.shape[0] == 1 && v.stride[0] < 0) maybe(std::string(kName[i]) + " negative stride of a size-1 vector");
  }
  if (p.paged) {
    if (bt.dtype != FLASHATTN_INT32) return no("block_table dtype");
    if (bt.ndim != 2) return no("block_table ndim");
    if (bt.shape[0] != p.B || bt.shape[1] < 1) return no("block_table shape");
    if (bt.null_data) return no("block_table data NULL");
    if (bt.device != FLASHATTN_CPU) return no("block_table device");
    if (bt.stride[0] < 0) return no("block_table stride");
    if (bt.shape[1] > 1 && bt.stride[1] != 1) return no("block_table last stride");
    if (!bt.safe) return no("block_table outside its buffer");
    if (!aligned(bt, 4)) return no("block_table misaligned");
    if (bt.shape[1] == 1 && bt.stride[1] < 0) maybe("block_table: negative stride of a size-1 dimension");
    if (bt.stride[0] > (int64_t{1} << 40)) maybe("block_table: a stride above 2^40");
    p.max_blocks = bt.shape[1];
  }
  if (p.rotary) {
    for (const View* v : {&cs, &sn}) {
      if (v->ndim != 2) return no("rotary ndim");
      if (v->dtype != dt) return no("rotary dtype");
      if (v->null_data) return no("rotary data NULL");
      if (v->device != FLASHATTN_CPU) return no("rotary device");
      if (v->shape[0] < 1 || v->shape[1] < 1) return no("rotary shape");
      if (v->stride[0] < 0) return no("rotary stride");
      if (v->shape[1] > 1 && v->stride[1] != 1) return no("rotary last stride");
      if (!v->safe) return no("rotary outside its buffer");
      if (!aligned(*v, dtype_bytes(dt))) return no("rotary misaligned");
      if (v->shape[1] == 1 && v->stride[1] < 0) maybe("rotary: negative stride of a size-1 dimension");
      if (v->stride[0] > (int64_t{1} << 40)) maybe("rotary: a stride above 2^40");
    }
    if (sn.shape[0] != cs.shape[0] || sn.shape[1] != cs.shape[1]) return no("rotary_sin shape != rotary_cos");
    if (2 * cs.shape[1] > p.D) return no("rotary_dim > head_dim");
    p.half = cs.shape[1];
  }

  // Outputs: nested strides (each stride above the span of the dimensions with smaller ones).
  std::vector<int> outputs = {kOut, kLse};
  if (p.append) outputs.push_back(kKc), outputs.push_back(kVc);
  for (int i : outputs) {
    const View& o = c.t[i];
    int dims[4], nd = 0;
    for (int d = 0; d < o.ndim; ++d)
      if (o.shape[d] > 1) dims[nd++] = d;
    std::sort(dims, dims + nd, [&](int a, int b) { return o.stride[a] < o.stride[b]; });
    int64_t span = 0;
    for (int j = 0; j < nd; ++j) {
      if (o.stride[dims[j]] <= span) return no(std::string(kName[i]) + " strides not nested");
      span += (o.shape[dims[j]] - 1) * o.stride[dims[j]];
    }
  }

  // Options.
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.D)));
  if (!c.opts_null) {
    const flashattn_options& o = c.opts;
    const uint32_t size = o.struct_size;
    if (size < FLASHATTN_OPTIONS_V1_SIZE) return no("struct_size");
    if (!std::isfinite(o.softmax_scale) || std::fabs(o.softmax_scale) > FLASHATTN_MAX_SOFTMAX_SCALE)
      return no("scale");
    if (o.softmax_scale != 0.0f) p.scale = o.softmax_scale;
    if (o.mask < 0 || o.mask > 2) return no("mask");
    p.mask = o.mask;
    if (size >= offsetof(flashattn_options, num_threads) + 4 &&
        (o.num_threads < 0 || o.num_threads > FLASHATTN_MAX_THREADS))
      return no("num_threads");
    if (size >= offsetof(flashattn_options, precision) + 4 && o.precision != 0 && o.precision != 1)
      return no("precision");
    if (size >= offsetof(flashattn_options, sliding_window) + 4 && o.sliding_window != 0) {
      if (o.window_left < -1 || o.window_right < -1) return no("window size");
      p.wl = o.window_left;
      p.wr = o.window_right;
      p.q_adv_ambiguous = p.wl < 0 && p.wr < 0 && p.mask == 0;  // "a sliding window is set"?
    }
    if (size >= offsetof(flashattn_options, softcap) + 4) {
      if (!(std::isfinite(o.softcap) && o.softcap >= 0.0f)) return no("softcap");
      p.softcap = o.softcap;
    }
    if (size >= offsetof(flashattn_options, max_flops) + 8 && !(std::isfinite(o.max_flops) && o.max_flops >= 0))
      return no("max_flops");
    if (alibi_read(c)) {
      const View& a = c.t[kAlibi];
      if (a.ndim != 1 && a.ndim != 2) return no("alibi ndim");
      if (a.dtype != FLASHATTN_FLOAT32) return no("alibi dtype");
      if (a.null_data) return no("alibi data NULL");
      if (a.device != FLASHATTN_CPU) return no("alibi device");
      if (a.shape[a.ndim - 1] != p.Hq || (a.ndim == 2 && a.shape[0] != p.B)) return no("alibi shape");
      for (int d = 0; d < a.ndim; ++d)
        if (a.stride[d] < 0 || a.stride[d] > (int64_t{1} << 40)) return no("alibi stride");
      if (!a.safe) return no("alibi outside its buffer");
      if (!aligned(a, 4)) return no("alibi misaligned");
      p.alibi = true;
    }
  }
  p.q_adv = p.mask != 0 || p.wl >= 0 || p.wr >= 0;

  // The index arrays' contents.
  p.capacity = p.paged ? p.max_blocks * p.Sc : p.Sc;
  auto entry = [&](const View& v, int64_t i) { return load_i32(base[static_cast<size_t>(v.buf)] + at(v, i)); };
  p.sl.assign(static_cast<size_t>(p.B), p.capacity);
  p.lp.assign(static_cast<size_t>(p.B), 0);
  p.row.resize(static_cast<size_t>(p.B));
  for (int64_t b = 0; b < p.B; ++b) {
    if (sl.passed()) p.sl[b] = entry(sl, b);
    if (lp.passed()) p.lp[b] = entry(lp, b);
    p.row[b] = bi.passed() ? entry(bi, b) : b;
    const std::string sb = "[" + std::to_string(b) + "]";
    if (p.sl[b] < 0) return no("cache_seqlens" + sb + " < 0");
    if (p.sl[b] + p.s_new > p.capacity) return no("cache_seqlens" + sb + " + S_new > capacity");
    if (p.lp[b] < 0 || p.lp[b] > p.sl[b]) return no("cache_leftpad" + sb + " outside [0, cache_seqlens]");
    if (p.row[b] < 0 || p.row[b] >= p.Bc) return no("cache_batch_idx" + sb + " outside [0, B_cache)");
  }
  if (p.append && bi.passed())
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t b2 = 0; b2 < b; ++b2)
        if (p.row[b] == p.row[b2]) return no("cache_batch_idx repeats a row while appending");
  if (p.paged) {
    p.table.resize(static_cast<size_t>(p.B * p.max_blocks));
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t i = 0; i < p.max_blocks; ++i) {
        p.table[b * p.max_blocks + i] = load_i32(base[static_cast<size_t>(bt.buf)] + at(bt, b, i));
        const bool used = i * p.Sc < p.sl[b] + p.s_new;  // a row of page i is in [0, sl + S_new)
        if (used && (p.table[b * p.max_blocks + i] < 0 || p.table[b * p.max_blocks + i] >= p.Bc))
          return no("block_table entry of a used page outside [0, num_blocks)");
      }
  }
  if (p.rotary) {
    // Positions used: new key j at sl + j; query row i at sl + i (q_adv) or sl.
    auto fits = [&](bool adv) {
      for (int64_t b = 0; b < p.B; ++b)
        if (p.sl[b] + std::max(p.s_new, adv ? p.Sq : 1) > cs.shape[0]) return false;
      return true;
    };
    const bool a = fits(p.q_adv), b = fits(true);
    if (!a && (!p.q_adv_ambiguous || !b)) return no("rotary tables too short");
    if (p.q_adv_ambiguous && a != b) maybe("rotary tables sized for one reading of the window flag with -1, -1");
  }
  if (has_field(c, offsetof(flashattn_options, max_flops), 8) && c.opts.max_flops > 0) {
    int64_t max_sk = 1;
    for (int64_t b = 0; b < p.B; ++b) max_sk = std::max(max_sk, p.sk(b));
    const double f = 4.0 * static_cast<double>(p.B) * static_cast<double>(p.Hq) * static_cast<double>(p.Sq) *
                     static_cast<double>(max_sk) * static_cast<double>(p.D);
    if (f > c.opts.max_flops) return no("max_flops exceeded");
  }
  return unsure ? kUnsure : kValid;
}

// Counts for the summary printed at exit.
struct Stats {
  long calls = 0, ok = 0, valid = 0, unsure = 0, refused_as_overlap = 0, cancelled = 0, queries = 0, appends = 0,
       paged = 0, rotary = 0, reference = 0;
  Stats() {
    std::atexit([] {
      const Stats& s = get();
      std::fprintf(stderr,
                   "fuzz_kvcache: %ld calls, %ld succeeded (%ld appended, %ld paged, %ld rotary; %ld checked against "
                   "the reference), %ld valid by the model, %ld undecided, %ld valid calls refused as overlap, %ld "
                   "cancelled, %ld workspace queries\n",
                   s.calls, s.ok, s.appends, s.paged, s.rotary, s.reference, s.valid, s.unsure, s.refused_as_overlap,
                   s.cancelled, s.queries);
    });
  }
  static Stats& get() {
    static Stats s;
    return s;
  }
};

std::atomic<long> g_cancel_calls{0};
int cancel_always(void*) {
  g_cancel_calls.fetch_add(1, std::memory_order_relaxed);
  return 1;
}
int cancel_never(void*) {
  g_cancel_calls.fetch_add(1, std::memory_order_relaxed);
  return 0;
}

// ---- one input -----------------------------------------------------------------------------------

void run_case(const uint8_t* data, size_t size) {
  Reader r(data, size, /*random_tail=*/true);
  Case c;
  decode_problem(r, c);
  decode_mutations(r, c);
  decode_kv(r, c);
  decode_options(r, c);
  const uint8_t slack = r.u8() % 4 == 0 ? r.u8() % 16 : 0;
  const bool poison = r.u8() & 1;  // cache rows no sequence attends hold NaN

  // Buffers sized to the views they hold (exactly, plus optional slack), so ASan sees a read one
  // element past a view that ends its buffer.
  for (int i = 0; i < kTensors; ++i)
    if (c.t[i].used) size_for(c.t[i], dtype_bytes(c.t[i].dtype), c.buf_size);
  std::vector<std::vector<unsigned char>> storage;
  std::vector<unsigned char*> base;
  make_buffers(c.buf_size, kTensors, slack, storage, base);
  auto ptr = [&](const View& v, int64_t off) { return base[static_cast<size_t>(v.buf)] + off; };

  // Contents: out and lse NaN-poisoned (0xFF bytes); q, caches, new keys and values and the rotary
  // tables small values k/4 (|k| <= 8) in their dtype; slopes small values of both signs; last
  // the index arrays' entries (int32 views only).
  for (int i : {kOut, kLse}) {
    const View& v = c.t[i];
    if (!v.safe) continue;
    const int64_t es = dtype_bytes(v.dtype);
    for_each_element(v, [&](int64_t off) { std::memset(ptr(v, off), 0xFF, static_cast<size_t>(es)); });
  }
  uint32_t h = input_hash(data, size);
  for (int i : {kQ, kKc, kVc, kKn, kVn, kCos, kSin}) {
    const View& v = c.t[i];
    if (!v.used || !v.safe || !float_dtype(v.dtype)) continue;
    for_each_element(v, [&](int64_t off) { store_value(ptr(v, off), v.dtype, small_value(h)); });
  }
  if (c.t[kAlibi].used && c.t[kAlibi].safe && c.t[kAlibi].dtype == FLASHATTN_FLOAT32)
    for_each_element(c.t[kAlibi], [&](int64_t off) { store_value(ptr(c.t[kAlibi], off), FLASHATTN_FLOAT32, small_slope(h)); });
  for (int i : {kSeqlens, kBidx, kLeftpad, kTable}) {
    const View& v = c.t[i];
    if (!v.used || !v.safe || v.dtype != FLASHATTN_INT32) continue;
    size_t e = 0;
    for_each_element(v, [&](int64_t off) {
      const int32_t x = e < c.vals[i].size() ? c.vals[i][e] : 0;
      std::memcpy(ptr(v, off), &x, 4);
      ++e;
    });
  }

  // The roles: outputs are out and lse, and the caches when appending; the other passed tensors
  // are inputs. Exact aliasing facts from byte marks.
  const bool append = c.t[kKn].passed();
  auto is_output = [&](int i) { return i == kOut || i == kLse || (append && (i == kKc || i == kVc)); };
  auto is_read = [&](int i) { return i == kAlibi ? alibi_read(c) : c.t[i].passed(); };
  std::vector<std::vector<uint8_t>> in_mark(kTensors), out_mark(kTensors);
  for (int b = 0; b < kTensors; ++b) {
    in_mark[static_cast<size_t>(b)].assign(storage[static_cast<size_t>(b)].size(), 0);
    out_mark[static_cast<size_t>(b)].assign(storage[static_cast<size_t>(b)].size(), 0);
  }
  std::string alias;  // why the call aliases, "" when it does not
  for (int i = 0; i < kTensors; ++i) {
    const View& v = c.t[i];
    if (!is_read(i) || !v.safe) continue;
    const int64_t es = dtype_bytes(v.dtype);
    const bool o = is_output(i);
    const bool twice = mark_bytes(v, es, (o ? out_mark : in_mark)[static_cast<size_t>(v.buf)].data());
    if (o && twice && alias.empty()) alias = std::string(kName[i]) + " reaches a byte twice or shares it with another output";
  }
  if (alias.empty() && marks_meet(in_mark, out_mark)) alias = "an output shares a byte with an input";

  Plan plan;
  std::string why;
  Verdict verdict = model(c, base, plan, &why);
  // A view outside its buffer must not reach the kernels: make such a call invalid for sure.
  bool any_unsafe = false;
  for (int i = 0; i < kTensors; ++i) any_unsafe |= is_read(i) && !c.t[i].safe;
  if (any_unsafe) {
    force_invalid_mask(c.opts_null, c.opts);
    verdict = kInvalid;
    why = "a view outside its buffer (mask 77)";
  }

  // The C structs, and the kv description and options in exactly as many bytes as their
  // struct_size claims.
  flashattn_tensor ct[kTensors];
  const flashattn_tensor* cp[kTensors];
  for (int i = 0; i < kTensors; ++i) {
    const View& v = c.t[i];
    fill_tensor(ct[i], v, ptr(v, 0));
    cp[i] = v.passed() ? &ct[i] : nullptr;
  }
  flashattn_kvcache kv;
  flashattn_kvcache_init(&kv);
  kv.struct_size = c.kv_size;
  kv.k_new = cp[kKn];
  kv.v_new = cp[kVn];
  kv.cache_seqlens = cp[kSeqlens];
  kv.cache_batch_idx = cp[kBidx];
  kv.cache_leftpad = cp[kLeftpad];
  kv.block_table = cp[kTable];
  kv.rotary_cos = cp[kCos];
  kv.rotary_sin = cp[kSin];
  kv.rotary_interleaved = c.interleaved;
  kv.num_splits = c.num_splits;
  const std::vector<unsigned char> kv_mem = claimed_bytes(kv, c.kv_size);
  const flashattn_kvcache* kvp = c.kv_null ? nullptr : reinterpret_cast<const flashattn_kvcache*>(kv_mem.data());
  uint64_t query_result = 0x5EEDu;
  if (!c.opts_null) {
    c.opts.alibi_slopes = cp[kAlibi];
    if (c.cancel != kNoCancel) c.opts.cancel = c.cancel == kCancelAlways ? cancel_always : cancel_never;
    if (c.query) c.opts.workspace_query = &query_result;
  }
  const flashattn_options* op = nullptr;
  std::vector<unsigned char> opts_mem;
  if (!c.opts_null) {
    opts_mem = claimed_bytes(c.opts, c.opts.struct_size);
    op = reinterpret_cast<const flashattn_options*>(opts_mem.data());
  }

  // The cache elements the call attends: rows [leftpad, cache_seqlens + S_new) of each sequence
  // (appended rows included). With `poison`, every other element of the caches becomes NaN: rows
  // outside that range are no keys of the call, and must not reach its outputs.
  std::vector<std::vector<uint8_t>> attended(kTensors);
  if (verdict != kInvalid) {
    for (int b = 0; b < kTensors; ++b) attended[static_cast<size_t>(b)].assign(storage[static_cast<size_t>(b)].size(), 0);
    for (int i : {kKc, kVc}) {
      const View& v = c.t[i];
      const int64_t es = dtype_bytes(v.dtype);
      for (int64_t b = 0; b < plan.B; ++b)
        for (int64_t row = plan.lp[b]; row < plan.sl[b] + plan.s_new; ++row)
          for (int64_t hh = 0; hh < plan.Hkv; ++hh)
            for (int64_t d = 0; d < plan.D; ++d) {
              const int64_t off = cache_at(plan, v, b, row, hh, d);
              for (int64_t x = 0; x < es; ++x) attended[static_cast<size_t>(v.buf)][static_cast<size_t>(off + x)] = 1;
            }
    }
    // (Bytes of the other tensors a cache buffer may hold stay as they are.)
    std::vector<std::vector<uint8_t>> keep = attended;
    for (int i = 0; i < kTensors; ++i) {
      const View& v = c.t[i];
      if (i == kKc || i == kVc || !is_read(i) || !v.safe) continue;
      const int64_t es = dtype_bytes(v.dtype);
      for_each_element(v, [&](int64_t off) {
        for (int64_t x = 0; x < es; ++x) keep[static_cast<size_t>(v.buf)][static_cast<size_t>(off + x)] = 1;
      });
    }
    if (poison)
      for (int i : {kKc, kVc}) {
        const View& v = c.t[i];
        const int64_t es = dtype_bytes(v.dtype);
        const uint8_t* m = keep[static_cast<size_t>(v.buf)].data();
        for_each_element(v, [&](int64_t off) {
          for (int64_t x = 0; x < es; ++x)
            if (m[off + x]) return;
          std::memset(ptr(v, off), 0xFF, static_cast<size_t>(es));  // NaN in every float dtype
        });
      }
  }

  // Precondition of the numeric checks: every value the call reads (of the caches: the attended
  // elements) is finite and small (|x| <= 2; `nice`: also a multiple of 1/4, as written above:
  // then the rotations are exact in every dtype), at a moderate scale and with moderate slopes.
  bool small = verdict != kInvalid, nice = small;
  for (int i : {kQ, kKc, kVc, kKn, kVn, kCos, kSin}) {
    const View& v = c.t[i];
    if (!small || !v.passed()) continue;
    const uint8_t* m = attended[static_cast<size_t>(v.buf)].data();
    for_each_element(v, [&](int64_t off) {
      if ((i == kKc || i == kVc) && !m[off]) return;
      const double x = load_value(ptr(v, off), v.dtype);
      if (!(std::fabs(x) <= 2)) small = nice = false;
      if (x * 4 != std::floor(x * 4)) nice = false;
    });
  }
  double max_slope = 0;
  if (verdict != kInvalid && plan.alibi)
    for_each_element(c.t[kAlibi], [&](int64_t off) {
      const double x = load_value(ptr(c.t[kAlibi], off), FLASHATTN_FLOAT32);
      max_slope = std::isfinite(x) ? std::max(max_slope, std::fabs(x)) : HUGE_VAL;
    });
  small = small && max_slope <= 1e3 && std::fabs(plan.scale) <= 100;
  nice = nice && small && max_slope <= 8 && std::fabs(plan.scale) <= 4 && !(plan.rotary && plan.q_adv_ambiguous);

  const std::vector<std::vector<unsigned char>> before = storage;
  const std::vector<unsigned char> kv_before = kv_mem, opts_before = opts_mem;
  unsigned char ct_before[sizeof ct];
  std::memcpy(ct_before, ct, sizeof ct);
  const long cancel_calls0 = g_cancel_calls.load();
  const int status = flashattn_forward_kvcache(cp[kQ], cp[kKc], cp[kVc], cp[kOut], cp[kLse], kvp, op);
  const std::string msg = flashattn_last_error();
  Stats& stats = Stats::get();
  ++stats.calls;
  stats.ok += status == FLASHATTN_OK;
  stats.valid += verdict == kValid;
  stats.unsure += verdict == kUnsure;
  if (const char* verbose = std::getenv("FUZZ_KVCACHE_VERBOSE"); verbose && *verbose == '2') {
    std::string call;  // the call's shape, for calls the model does not refuse
    if (verdict != kInvalid)
      call = " dtype " + std::to_string(c.t[kQ].dtype) + " B " + std::to_string(plan.B) + " Sq " + std::to_string(plan.Sq) +
             " Hq " + std::to_string(plan.Hq) + " Hkv " + std::to_string(plan.Hkv) + " D " + std::to_string(plan.D) +
             (plan.paged ? " paged " + std::to_string(plan.Sc) + "x" + std::to_string(plan.max_blocks)
                         : " cache " + std::to_string(plan.Sc)) +
             (plan.append ? " append " + std::to_string(plan.s_new) : "") +
             (c.t[kSeqlens].passed() ? " seqlens" : "") + (c.t[kBidx].passed() ? " batch_idx" : "") +
             (c.t[kLeftpad].passed() ? " leftpad" : "") +
             (plan.rotary ? " rotary " + std::to_string(2 * plan.half) + (c.interleaved ? " gptj" : " neox") : "") +
             " mask " + std::to_string(plan.mask) +
             (plan.wl >= 0 || plan.wr >= 0 ? " window " + std::to_string(plan.wl) + "," + std::to_string(plan.wr) : "") +
             (plan.softcap > 0 ? " softcap" : "") + (plan.alibi ? " alibi" : "") + (poison ? " poison" : "") +
             (nice ? " reference" : "");
    std::fprintf(stderr, "kvcache: status %d: %s (model: %s)%s\n", status, msg.c_str(),
                 verdict == kValid ? "valid" : why.c_str(), call.c_str());
  }

  if (kv_mem != kv_before || opts_mem != opts_before || std::memcmp(ct_before, ct, sizeof ct) != 0)
    violation("the call wrote a struct passed to it", msg);
  const bool cancelling = cancel_read(c) && c.cancel == kCancelAlways;
  if (!cancel_read(c) && g_cancel_calls.load() != cancel_calls0) violation("a cancel callback past struct_size was called", msg);
  if (status != FLASHATTN_OK) {
    if (status != FLASHATTN_ERROR_INVALID_ARGUMENT && status != FLASHATTN_ERROR_UNSUPPORTED &&
        !(status == FLASHATTN_ERROR_CANCELLED && cancelling))
      violation("unexpected status", "status " + std::to_string(status) + ": " + msg);
    if (msg.empty()) violation("error without a message", "status " + std::to_string(status));
    for (int b = 0; b < kTensors; ++b)
      if (storage[static_cast<size_t>(b)] != before[static_cast<size_t>(b)]) {
        size_t j = 0;
        while (storage[static_cast<size_t>(b)][j] == before[static_cast<size_t>(b)][j]) ++j;
        violation("a failed call wrote memory", std::string("buffer of ") + kName[b] + ", byte " + std::to_string(j) +
                                                    ": status " + std::to_string(status) + ": " + msg);
      }
    if (query_result != 0x5EEDu) violation("a failed call stored a workspace size", msg);
    if (status == FLASHATTN_ERROR_CANCELLED) {
      ++stats.cancelled;
      if (verdict == kInvalid) violation("an invalid call was cancelled instead of refused", why);
      return;
    }
    if (verdict == kValid && alias.empty()) {
      if (msg.find("overlap") == std::string::npos && msg.find("alias") == std::string::npos)
        violation("a valid call was refused", msg);
      ++stats.refused_as_overlap;
      if (std::getenv("FUZZ_KVCACHE_VERBOSE")) std::fprintf(stderr, "refused as overlap: %s\n", msg.c_str());
    }
    return;
  }
  if (!msg.empty()) violation("success with a message", msg);
  if (verdict == kInvalid) violation("an invalid call succeeded", why);
  if (!alias.empty()) violation("an aliasing call succeeded", alias);
  if (cancelling) violation("a call succeeded although its cancel callback cancels", "");
  if (query_read(c)) {
    ++stats.queries;
    if (query_result != 0) violation("a CPU workspace query stored a nonzero size", std::to_string(query_result));
    for (int b = 0; b < kTensors; ++b)
      if (storage[static_cast<size_t>(b)] != before[static_cast<size_t>(b)]) violation("a workspace query wrote memory", kName[b]);
    return;
  }
  if (query_result != 0x5EEDu) violation("a workspace size stored without a query", "");
  const Plan& p = plan;
  stats.appends += p.append;
  stats.paged += p.paged;
  stats.rotary += p.rotary;

  // The bytes the call may change: out's and lse's elements, and the appended cache rows.
  std::vector<std::vector<uint8_t>> may(kTensors);
  for (int b = 0; b < kTensors; ++b) may[static_cast<size_t>(b)].assign(storage[static_cast<size_t>(b)].size(), 0);
  for (int i : {kOut, kLse}) {
    const View& v = c.t[i];
    const int64_t es = dtype_bytes(v.dtype);
    for_each_element(v, [&](int64_t off) {
      for (int64_t j = 0; j < es; ++j) may[static_cast<size_t>(v.buf)][static_cast<size_t>(off + j)] = 1;
    });
  }
  const int64_t es = dtype_bytes(p.append ? c.t[kKc].dtype : 1);
  for (int i : {kKc, kVc}) {
    if (!p.append) break;
    const View& v = c.t[i];
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t j = 0; j < p.s_new; ++j)
        for (int64_t hh = 0; hh < p.Hkv; ++hh)
          for (int64_t d = 0; d < p.D; ++d) {
            const int64_t off = cache_at(p, v, b, p.sl[b] + j, hh, d);
            for (int64_t x = 0; x < es; ++x) ++may[static_cast<size_t>(v.buf)][static_cast<size_t>(off + x)];
          }
  }
  for (int b = 0; b < kTensors; ++b) {
    if (storage[static_cast<size_t>(b)] == before[static_cast<size_t>(b)]) continue;
    for (size_t j = 0; j < storage[static_cast<size_t>(b)].size(); ++j)
      if (storage[static_cast<size_t>(b)][j] != before[static_cast<size_t>(b)][j] && !may[static_cast<size_t>(b)][j])
        violation("a byte outside the outputs and the appended rows changed",
                  std::string("buffer of ") + kName[b] + ", byte " + std::to_string(j));
  }

  // The appended rows: v_new's bytes, k_new's (rotated dimensions: the rotation).
  const int32_t dt = c.t[kQ].dtype;
  auto rot_at = [&](int i, int64_t pos, int64_t k) { return load_value(ptr(c.t[i], at(c.t[i], pos, k)), dt); };
  for (int64_t b = 0; b < p.B && p.append; ++b)
    for (int64_t j = 0; j < p.s_new; ++j)
      for (int64_t hh = 0; hh < p.Hkv; ++hh)
        for (int64_t d = 0; d < p.D; ++d) {
          const View &kc = c.t[kKc], &vc = c.t[kVc], &kn = c.t[kKn], &vn = c.t[kVn];
          const int64_t ko = cache_at(p, kc, b, p.sl[b] + j, hh, d), vo = cache_at(p, vc, b, p.sl[b] + j, hh, d);
          // (pages shared by two sequences are written twice: either may win)
          if (may[static_cast<size_t>(kc.buf)][static_cast<size_t>(ko)] > 1 ||
              may[static_cast<size_t>(vc.buf)][static_cast<size_t>(vo)] > 1)
            continue;
          const std::string where = "sequence " + std::to_string(b) + ", new row " + std::to_string(j) + ", head " +
                                    std::to_string(hh) + ", dim " + std::to_string(d);
          if (std::memcmp(ptr(vc, vo), ptr(vn, at(vn, b, j, hh, d)), static_cast<size_t>(es)) != 0)
            violation("an appended v_cache element is not v_new's", where);
          if (!p.rotary || d >= 2 * p.half) {
            if (std::memcmp(ptr(kc, ko), ptr(kn, at(kn, b, j, hh, d)), static_cast<size_t>(es)) != 0)
              violation("an appended k_cache element is not k_new's", where);
            continue;
          }
          if (!nice) continue;
          const int64_t pos = p.sl[b] + j, i = c.interleaved ? d / 2 : d % p.half;
          const int64_t d0 = c.interleaved ? 2 * i : i, d1 = c.interleaved ? 2 * i + 1 : i + p.half;
          const double x0 = load_value(ptr(kn, at(kn, b, j, hh, d0)), dt), x1 = load_value(ptr(kn, at(kn, b, j, hh, d1)), dt);
          const double co = rot_at(kCos, pos, i), si = rot_at(kSin, pos, i);
          const double want = d == d0 ? x0 * co - x1 * si : x0 * si + x1 * co;
          const double got = load_value(ptr(kc, ko), dt);
          if (got != want)
            violation("an appended k_cache element is not the rotated k_new",
                      where + ": " + std::to_string(got) + " != " + std::to_string(want));
        }

  // A page used twice (by two sequences, or twice by one: block tables the header lets through)
  // while appending: what a sequence attends then depends on the order of the writes, so no
  // reference.
  if (p.paged && p.append) {
    std::vector<int64_t> pages;
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t i = 0; i * p.Sc < p.sl[b] + p.s_new; ++i) pages.push_back(p.table[b * p.max_blocks + i]);
    std::sort(pages.begin(), pages.end());
    if (std::adjacent_find(pages.begin(), pages.end()) != pages.end()) nice = false;
  }

  // Per query row: rows that see no key are exactly out = 0, lse = -inf; the others finite for
  // small inputs, and against the float64 reference for the inputs written here.
  stats.reference += nice;
  const View &q = c.t[kQ], &out = c.t[kOut], &lse = c.t[kLse], &kc = c.t[kKc], &vc = c.t[kVc];
  const double ulp = dt == FLASHATTN_FLOAT16 ? 9.8e-4 : dt == FLASHATTN_BFLOAT16 ? 7.9e-3 : 2.4e-7;
  std::vector<double> qv(static_cast<size_t>(p.D)), s, w, o(static_cast<size_t>(p.D));
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t Sk = p.sk(b);
    for (int64_t hh = 0; hh < p.Hq; ++hh) {
      const int64_t g = hh / (p.Hq / p.Hkv);
      for (int64_t i = 0; i < p.Sq; ++i) {
        const std::string where = "sequence " + std::to_string(b) + ", head " + std::to_string(hh) + ", row " +
                                  std::to_string(i) + " (Sk " + std::to_string(Sk) + ")";
        // Visible keys j (cache row lp + j), by the header's band over Skv = Sk_b.
        std::vector<int64_t> vis;
        const __int128 diag = static_cast<__int128>(i) + Sk - p.Sq;
        for (int64_t j = 0; j < Sk; ++j) {
          if (p.mask == 1 && j > i) continue;
          if (p.mask == 2 && j > diag) continue;
          if (p.wl >= 0 && j < diag - p.wl) continue;
          if (p.wr >= 0 && j > diag + p.wr) continue;
          vis.push_back(j);
        }
        const double l = load_value(ptr(lse, at(lse, b, hh, i)), FLASHATTN_FLOAT32);
        if (vis.empty()) {
          if (!(std::isinf(l) && l < 0)) violation("a row that sees no key has lse != -inf", where + ": " + std::to_string(l));
          for (int64_t d = 0; d < p.D; ++d)
            if (load_value(ptr(out, at(out, b, i, hh, d)), dt) != 0.0)
              violation("a row that sees no key has out != 0", where + ", dim " + std::to_string(d));
          continue;
        }
        if (!small) continue;
        if (!std::isfinite(l)) violation("a non-finite lse from small finite inputs", where + ": " + std::to_string(l));
        for (int64_t d = 0; d < p.D; ++d)
          if (!std::isfinite(load_value(ptr(out, at(out, b, i, hh, d)), dt)))
            violation("a non-finite out from small finite inputs", where + ", dim " + std::to_string(d));
        if (!nice) continue;
        // q rotated at its position (exact here), scores, softcap, ALiBi, softmax.
        for (int64_t d = 0; d < p.D; ++d) qv[d] = load_value(ptr(q, at(q, b, i, hh, d)), dt);
        if (p.rotary) {
          const int64_t pos = p.sl[b] + (p.q_adv ? i : 0);
          for (int64_t k = 0; k < p.half; ++k) {
            const int64_t d0 = c.interleaved ? 2 * k : k, d1 = c.interleaved ? 2 * k + 1 : k + p.half;
            const double co = rot_at(kCos, pos, k), si = rot_at(kSin, pos, k), x0 = qv[d0], x1 = qv[d1];
            qv[d0] = x0 * co - x1 * si;
            qv[d1] = x0 * si + x1 * co;
          }
        }
        const View& al = c.t[kAlibi];
        const double slope =
            !p.alibi ? 0 : load_value(ptr(al, al.ndim == 2 ? at(al, b, hh) : at(al, hh)), FLASHATTN_FLOAT32);
        s.clear();
        double big = 0, m = -HUGE_VAL, maxv = 0;
        for (int64_t j : vis) {
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d) dot += qv[d] * load_value(ptr(kc, cache_at(p, kc, b, p.lp[b] + j, g, d)), dt);
          double x = static_cast<double>(p.scale) * dot;
          const double bias = slope * std::fabs(static_cast<double>(diag - j));
          big = std::max(big, std::fabs(x) + std::fabs(bias));  // (before the softcap: its error)
          if (p.softcap > 0) x = p.softcap * std::tanh(x / p.softcap);
          x -= bias;
          s.push_back(x);
          m = std::max(m, x);
        }
        double sum = 0;
        for (double x : s) sum += std::exp(x - m);
        const double want_l = m + std::log(sum);
        std::fill(o.begin(), o.end(), 0.0);
        for (size_t k = 0; k < vis.size(); ++k)
          for (int64_t d = 0; d < p.D; ++d) {
            const double vv = load_value(ptr(vc, cache_at(p, vc, b, p.lp[b] + vis[k], g, d)), dt);
            maxv = std::max(maxv, std::fabs(vv));
            o[d] += std::exp(s[k] - want_l) * vv;
          }
        // Float32 scores (one rounding of scale * q.k, exp2 and tanh approximations, float32
        // sums): errors grow with the scores' size and the head dim.
        const double delta = 1e-6 * static_cast<double>(p.D + 8) * (1 + big);
        if (!(std::fabs(l - want_l) <= delta + 1e-5 * (1 + std::fabs(want_l))))
          violation("lse differs from the reference", where + ": " + std::to_string(l) + " vs " + std::to_string(want_l));
        for (int64_t d = 0; d < p.D; ++d) {
          const double got = load_value(ptr(out, at(out, b, i, hh, d)), dt);
          const double tol = (4 * delta + 4e-5 + ulp) * (maxv + 1e-3) + ulp * std::fabs(o[d]);
          if (!(std::fabs(got - o[d]) <= tol))
            violation("out differs from the reference",
                      where + ", dim " + std::to_string(d) + ": " + std::to_string(got) + " vs " + std::to_string(o[d]));
        }
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run_case(data, size);
  return 0;
}

#if defined(FLASHATTN_FUZZ_REPLAY)
int main(int argc, char** argv) { return fuzz::replay_main(argc, argv, "fuzz_kvcache"); }
#endif
