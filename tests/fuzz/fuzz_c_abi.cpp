// Coverage-guided fuzzer of the C ABI (flashattn_forward / flashattn_backward, and the packed
// flashattn_forward_varlen / _backward_varlen: run_varlen below).
//
// Each input decodes into one call: a problem (B, Hq, Hkv, Sq, Skv, D, dtype), a layout per tensor
// (bhsd, bshd, padded, head ranges of a fused buffer, broadcast), a placement of the tensors in a
// few real heap buffers (separate, fused qkv / dqkv, packed, or random offsets that alias), then
// mutations (ndim, shapes, strides incl. negative / zero / huge, dtype and device codes, NULL
// data, NULL tensor pointers, misaligned pointers) and an options struct (NULL, every
// struct_size, non-finite and out-of-range scales, masks, thread counts, precisions), and last the
// score modifications: sliding window sizes (with and without the sliding_window flag, invalid
// ones too), softcaps (non-finite and negative too) and an ALiBi slopes tensor ([Hq] or [B, Hq],
// strided, in its own buffer or placed in another tensor's, mutated like the others). Valid calls
// run the CPU backend on the tiny problem. (The modifications are decoded from the bytes after
// everything else, so inputs written before them decode as they did, with none.)
//
// Invariants (any violation aborts, which the fuzzer reports as a crash):
//   - no crash, no ASan/UBSan report (build with -fsanitize=fuzzer,address,undefined);
//   - a non-zero status is a known code and comes with a non-empty flashattn_last_error(), and
//     a zero status with "";
//   - on error, no byte of any buffer changed (every byte is compared, canaries included);
//   - on success, the call was valid by the documented rules (model_valid below), no output
//     shared a byte with an input or another output and no output reached an element twice
//     (checked exactly, byte by byte), only bytes of output elements changed, and for finite,
//     small inputs at a moderate scale the outputs are finite (lse may be -inf for a row that
//     sees no key);
//   - a valid call is refused only for (conservatively assumed) overlap, with a message saying so.
// Views that would reach outside their buffer are never handed to a call that could succeed:
// such a call gets an invalid mask (the library must refuse it before touching memory).
//
// FUZZ_C_ABI_VERBOSE=1 prints valid calls refused as overlap; =2 every call's status and message.
//
// Built two ways: with libFuzzer (tests/fuzz/CMakeLists.txt, FLASHATTN_BUILD_FUZZ=ON, clang), and
// without it as a replay tool (FLASHATTN_FUZZ_REPLAY: main() runs the files and directories
// given) that CTest runs over tests/fuzz/corpus in every build, sanitizer build included.
// What it shares with fuzz_kvcache.cpp (the reader, views, buffers, values, replay) is in
// fuzz_util.hpp; past the input's end its reader returns zeros.
#include <algorithm>
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

constexpr int kQ = 0, kK = 1, kV = 2, kOut = 3, kLse = 4, kDout = 5, kDq = 6, kDk = 7, kDv = 8;
constexpr int kTensors = 9;
const char* const kName[kTensors] = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"};
constexpr int kBuffers = 10;  // one per tensor, and the ALiBi slopes' own
constexpr int kAlibiBuffer = 9;

// The float dtypes only: an int32 code (a mutation) is no dtype a view of this fuzzer can have.
int64_t dtype_bytes(int32_t dt) { return float_dtype_bytes(dt); }

void set_strides(View& v, const int64_t (&order)[4], const int64_t (&pad)[4]) {
  // order: dims from innermost to outermost; pad: extra elements after each dim's extent.
  int64_t s = 1;
  for (int i = 0; i < 4; ++i) {
    const int d = static_cast<int>(order[i]);
    v.stride[d] = s;
    s = s * v.shape[d] + pad[i];
  }
}

struct Case {
  bool backward = false;
  View t[kTensors];
  View alibi;  // used: the options point at it (when their struct_size has the field)
  bool opts_null = true;
  std::vector<unsigned char> opts_bytes;  // exactly what the caller "owns"
  flashattn_options opts{};               // the fields as set (copied into opts_bytes)
  int64_t buf_size[kBuffers] = {};
  int64_t B = 1, Hq = 1, Hkv = 1, Sq = 1, Skv = 1, D = 1;
};

// Canonical views of a valid problem, laid out and placed as the input says.
void decode_layout(Reader& r, Case& c) {
  const uint8_t mode = r.u8();
  c.backward = mode & 1;
  if (mode < 248) {  // tiny: everything within one tile of the kernels
    c.B = 1 + r.u8() % 3;
    c.Hkv = 1 + r.u8() % 3;
    c.Hq = c.Hkv * (1 + r.u8() % 3);
    c.Sq = 1 + r.u8() % 9;
    c.Skv = (r.u8() & 1) ? c.Sq : 1 + r.u8() % 9;
    static const int64_t dims[] = {1, 2, 3, 4, 5, 7, 8, 8, 8, 8, 16, 16, 16, 17, 24, 32,
                                   1, 2, 4, 8, 8, 16, 32, 33, 40, 64, 64, 80, 128, 255, 256, 257};
    c.D = r.pick(dims);
  } else {  // several tiles in both directions, ragged tails (rarely: it costs ~100x more)
    static const int64_t seqs[] = {17, 31, 64, 65, 100, 130};
    static const int64_t dims[] = {1, 8, 17, 64};
    c.B = 1;
    c.Hkv = 1;
    c.Hq = 1 + r.u8() % 2;
    c.Sq = r.pick(seqs);
    c.Skv = r.pick(seqs);
    c.D = r.pick(dims);
  }
  static const int32_t dtypes[] = {0, 0, 0, 1, 2, 3};
  const int32_t dt = r.pick(dtypes);
  const uint8_t placement = r.u8() % 5;

  for (int i = 0; i < kTensors; ++i) {
    View& v = c.t[i];
    v.used = c.backward || i <= kLse;
    if (!v.used) continue;
    v.dtype = i == kLse ? FLASHATTN_FLOAT32 : dt;
    v.buf = i;
    if (i == kLse) {
      v.ndim = 3;
      v.shape[0] = c.B;
      v.shape[1] = c.Hq;
      v.shape[2] = c.Sq;
      const int64_t pad = r.u8() % 3;
      v.stride[2] = 1 + pad;
      v.stride[1] = c.Sq * v.stride[2] + (r.u8() % 2);
      v.stride[0] = c.Hq * v.stride[1];
      continue;
    }
    const bool is_kv = i == kK || i == kV || i == kDk || i == kDv;
    v.shape[0] = c.B;
    v.shape[1] = is_kv ? c.Hkv : c.Hq;
    v.shape[2] = is_kv ? c.Skv : c.Sq;
    v.shape[3] = c.D;
    const uint8_t layout = r.u8() % 6;
    const bool input = i == kQ || i == kK || i == kV || i == kDout || (c.backward && i == kOut);
    switch (layout) {
      case 1:  // bshd
        set_strides(v, {3, 1, 2, 0}, {0, 0, 0, 0});
        break;
      case 2:  // padded bhsd
        set_strides(v, {3, 2, 1, 0}, {r.u8() % 4, r.u8() % 4, r.u8() % 4, 0});
        break;
      case 3: {  // a head range of a wider [B, S, Htot, D] buffer
        const int64_t extra = r.u8() % 4, h0 = extra ? r.u8() % (extra + 1) : 0;
        v.shape[1] += extra;
        set_strides(v, {3, 1, 2, 0}, {0, 0, 0, 0});
        v.shape[1] -= extra;
        v.byte_off += h0 * c.D * dtype_bytes(v.dtype);
        break;
      }
      case 4:  // broadcast (an input may read one element many times)
        set_strides(v, {3, 2, 1, 0}, {0, 0, 0, 0});
        if (input) v.stride[r.u8() & 1] = 0;
        break;
      default:
        set_strides(v, {3, 2, 1, 0}, {0, 0, 0, 0});
    }
  }

  // Placement. Fused (1) and packed (2) put q, k, v (and dq, dk, dv) as head ranges of one
  // buffer, the way fused projections lay them out; random (3, 4) aliases freely.
  auto fuse = [&](int a, int b, int d, int bufid, bool packed) {
    const int64_t Htot = packed ? 3 * c.Hq : c.Hq + 2 * c.Hkv;
    const int64_t h0[3] = {0, packed ? c.Hq : c.Hq, packed ? 2 * c.Hq : c.Hq + c.Hkv};
    const int ids[3] = {a, b, d};
    for (int j = 0; j < 3; ++j) {
      View& v = c.t[ids[j]];
      if (!v.used) continue;
      v.buf = bufid;
      v.stride[3] = 1;
      v.stride[1] = c.D;
      v.stride[2] = Htot * c.D;
      v.stride[0] = std::max(c.Sq, c.Skv) * Htot * c.D;
      v.byte_off = h0[j] * c.D * dtype_bytes(v.dtype);
    }
    // Sometimes shift one view by a few elements (a real overlap, or a near miss).
    if (r.u8() % 4 == 0) {
      View& v = c.t[ids[r.u8() % 3]];
      v.byte_off += (static_cast<int8_t>(r.u8()) % 9) * dtype_bytes(v.dtype) * (r.u8() % 2 ? 1 : c.D);
      if (v.byte_off < 0) v.byte_off = 0;
    }
  };
  if (placement == 1 || (placement == 2 && c.Hq == c.Hkv)) {
    fuse(kQ, kK, kV, kQ, placement == 2);
    if (c.backward) fuse(kDq, kDk, kDv, kDq, placement == 2);
  } else if (placement >= 3) {
    for (int i = 0; i < kTensors; ++i) {
      View& v = c.t[i];
      if (!v.used || (r.u8() & 3) == 0) continue;
      v.buf = r.u8() % 3;
      const int64_t es = std::max<int64_t>(1, dtype_bytes(v.dtype));
      v.byte_off = placement == 3 ? static_cast<int64_t>(r.u8()) * es : (r.u8() % 16) * es * c.D;
    }
  }
}

const int64_t kSpecial[] = {0,
                            -1,
                            1,
                            2,
                            3,
                            int64_t{1} << 31,
                            int64_t{1} << 40,
                            int64_t{1} << 62,
                            std::numeric_limits<int64_t>::max(),
                            std::numeric_limits<int64_t>::min(),
                            -(int64_t{1} << 62)};

int64_t pick_i64(Reader& r, int64_t cur) { return fuzz::pick_i64(r, cur, kSpecial); }

void decode_mutations(Reader& r, Case& c) {
  const int n = r.u8() % 8;  // 0-3 mutations half the time, none otherwise
  for (int m = 0; m < (n > 3 ? 0 : n); ++m) {
    View& v = c.t[r.u8() % kTensors];
    if (!v.used) continue;
    const uint8_t kind = r.u8() % 11;
    mutate_view(r, v, kind, 3, kSpecial, dtype_bytes);  // (other buffers: those of q, k, v)
  }
}

void decode_options(Reader& r, Case& c) {
  const uint8_t mode = r.u8() % 8;
  c.opts_null = mode == 0;
  if (c.opts_null) return;
  flashattn_options_init(&c.opts);
  static const uint32_t sizes[] = {0, 4, 8, 16, 23, 24, 25, 27, 28, 32, 33, 36,
                                   sizeof(flashattn_options), sizeof(flashattn_options) + 8, 1000};
  if (mode == 1) c.opts.struct_size = r.pick(sizes);
  static const float scales[] = {0.0f, 0.0f, 1.0f, 0.125f, -0.5f, 2.0f, 100.0f, 1e-30f, -0.0f,
                                 FLASHATTN_MAX_SOFTMAX_SCALE, -FLASHATTN_MAX_SOFTMAX_SCALE,
                                 1.0000001e6f, 1e30f, 3e38f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN(),
                                 std::numeric_limits<float>::denorm_min()};
  decode_scale_and_mask(r, c.opts, scales);
  static const int32_t threads[] = {0, 0, 1, 1, 2, 2, 3, 4, 7, -1, FLASHATTN_MAX_THREADS + 1,
                                    std::numeric_limits<int32_t>::max(),
                                    std::numeric_limits<int32_t>::min()};
  // Mostly 0 (all hardware threads): each new count rebuilds the pool, which costs more than a
  // tiny call.
  const uint8_t th = r.u8();
  c.opts.num_threads = th < 192   ? 0
                       : th == 255 ? FLASHATTN_MAX_THREADS
                                   : threads[th % (sizeof threads / sizeof threads[0])];
  static const int32_t precisions[] = {0, 0, 1, 2, -1};
  c.opts.precision = r.pick(precisions);
  c.opts.deterministic = r.u8() & 1;
  if (r.u8() % 8 == 0) c.opts.stream = reinterpret_cast<void*>(uintptr_t{0x1000});  // ignored on the CPU
}

// Window sizes, softcap and ALiBi slopes (the fields after version 2 of the options).
void decode_mods(Reader& r, Case& c) {
  if (c.opts_null) return;
  // Struct sizes that end inside or after the new fields (0: keep the size drawn before).
  static const uint32_t sizes[] = {0, 0, 0, 0, 0, 0, 0, 0, FLASHATTN_OPTIONS_V2_SIZE,
                                   offsetof(flashattn_options, window_right),
                                   offsetof(flashattn_options, softcap),
                                   offsetof(flashattn_options, sliding_window),
                                   offsetof(flashattn_options, sliding_window) + 4,
                                   offsetof(flashattn_options, alibi_slopes),
                                   offsetof(flashattn_options, alibi_slopes) + 4,
                                   sizeof(flashattn_options)};
  const uint32_t size = r.pick(sizes);
  if (size != 0) c.opts.struct_size = size;
  static const int64_t sides[] = {-1, -1, 0, 1, 2, 3, 7, 64, 1000, -2, -7,
                                  std::numeric_limits<int64_t>::min(),
                                  std::numeric_limits<int64_t>::max()};
  decode_window(r, c.opts, sides);
  static const float caps[] = {0.0f, 0.0f, 0.5f, 1.0f, 5.0f, 30.0f, 50.0f, 1e-30f, 1e30f, -0.0f,
                               -1.0f, std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::denorm_min()};
  c.opts.softcap = r.pick(caps);

  const uint8_t a = r.u8();
  if (a % 3 == 0) return;
  View& v = c.alibi;
  alibi_view(v, a, kAlibiBuffer, c.B, c.Hq);
  const uint8_t m = r.u8();
  switch (m % 12) {
    case 0: v.dtype = static_cast<int8_t>(r.u8()) % 6; break;
    case 1: v.ndim = static_cast<int8_t>(r.u8()) % 5; break;
    case 2: { const int d = r.u8() % 2; v.shape[d] = pick_i64(r, v.shape[d]); break; }
    case 3: { const int d = r.u8() % 2; v.stride[d] = pick_i64(r, v.stride[d]); break; }
    case 4: v.device = (r.u8() & 1) ? 0 : -2; break;
    case 5: v.null_data = true; break;
    case 6: v.null_ptr = true; break;
    case 7: v.byte_off += 1 + r.u8() % 3; break;  // misaligned
    case 8:
    case 9: {  // inside another tensor's buffer: an input (fine) or an output (refused)
      v.buf = r.u8() % kTensors;
      v.byte_off = static_cast<int64_t>(r.u8() % 64) * 4;
      break;
    }
    default: break;
  }
}

// ---- layout facts ------------------------------------------------------------------------------

template <class F>
void for_each_element(const View& v, F&& f) {  // f(byte offset in the buffer); safe views only
  fuzz::for_each_element(v, dtype_bytes(v.dtype), f);
}

bool is_output(const Case& c, int i) {
  return c.backward ? (i == kDq || i == kDk || i == kDv) : (i == kOut || i == kLse);
}

// Whether the call reads the ALiBi slopes' view: options whose struct_size has the pointer, and
// a non-NULL pointer.
bool alibi_read(const Case& c) {
  return !c.opts_null && c.alibi.used && !c.alibi.null_ptr &&
         c.opts.struct_size >= offsetof(flashattn_options, alibi_slopes) + sizeof(void*);
}

// The documented rules of flashattn.h (plus this build's: CPU only, head_dim <= 256), except
// aliasing, which the byte marks decide exactly.
bool model_valid(const Case& c, const std::vector<unsigned char*>& base, std::string* why) {
  auto no = [&](const std::string& s) {
    *why = s;
    return false;
  };
  const int n = c.backward ? kTensors : kLse + 1;
  for (int i = 0; i < n; ++i) {
    const View& v = c.t[i];
    const int want = i == kLse ? 3 : 4;
    if (v.null_ptr) return no(std::string(kName[i]) + " NULL");
    if (v.ndim != want) return no(std::string(kName[i]) + " ndim");
    if (v.null_data) return no(std::string(kName[i]) + " data NULL");
    const int64_t es = dtype_bytes(v.dtype);
    if (es == 0) return no(std::string(kName[i]) + " dtype");
    if (v.device != FLASHATTN_CPU) return no(std::string(kName[i]) + " device");
    for (int d = 0; d < v.ndim; ++d) {
      if (v.shape[d] <= 0) return no(std::string(kName[i]) + " shape");
      if (v.stride[d] < 0) return no(std::string(kName[i]) + " stride");
    }
    if (want == 4 && v.shape[3] > 1 && v.stride[3] != 1) return no(std::string(kName[i]) + " head stride");
    if (!v.safe) return no(std::string(kName[i]) + " outside its buffer");  // (such calls get a bad mask)
    const uintptr_t p = reinterpret_cast<uintptr_t>(base[static_cast<size_t>(v.buf)] + v.byte_off);
    if (p % static_cast<uintptr_t>(es) != 0) return no(std::string(kName[i]) + " misaligned");
  }
  const View &q = c.t[kQ], &k = c.t[kK], &v = c.t[kV], &lse = c.t[kLse];
  const int32_t dt = q.dtype;
  if (k.dtype != dt || v.dtype != dt) return no("qkv dtypes");
  for (int i : {kOut, kDout, kDq, kDk, kDv})
    if (i < n && i != kLse && c.t[i].dtype != dt) return no(std::string(kName[i]) + " dtype != q");
  if (lse.dtype != FLASHATTN_FLOAT32) return no("lse dtype");
  const int64_t B = q.shape[0], Hq = q.shape[1], Sq = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], Skv = k.shape[2];
  if (k.shape[0] != B || k.shape[3] != D) return no("k shape");
  for (int d = 0; d < 4; ++d)
    if (v.shape[d] != k.shape[d]) return no("v shape");
  if (Hq % Hkv != 0) return no("Hq % Hkv");
  for (int i : {kOut, kDout, kDq, kDk, kDv}) {
    if (i >= n) continue;
    const View& ref = (i == kDk || i == kDv) ? k : q;
    for (int d = 0; d < 4; ++d)
      if (c.t[i].shape[d] != ref.shape[d]) return no(std::string(kName[i]) + " shape");
  }
  if (lse.shape[0] != B || lse.shape[1] != Hq || lse.shape[2] != Sq) return no("lse shape");
  if (D > 256) return no("head_dim > 256");
  // Outputs: nested strides (each stride above the span of the dimensions with smaller ones).
  for (int i = 0; i < n; ++i) {
    if (!is_output(c, i)) continue;
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
  (void)Skv;
  if (!c.opts_null) {
    const flashattn_options& o = c.opts;
    const uint32_t size = o.struct_size;
    if (size < FLASHATTN_OPTIONS_V1_SIZE) return no("struct_size");
    if (!std::isfinite(o.softmax_scale) || std::fabs(o.softmax_scale) > FLASHATTN_MAX_SOFTMAX_SCALE)
      return no("scale");
    if (o.mask < 0 || o.mask > 2) return no("mask");
    if (size >= offsetof(flashattn_options, num_threads) + 4 &&
        (o.num_threads < 0 || o.num_threads > FLASHATTN_MAX_THREADS))
      return no("num_threads");
    if (size >= offsetof(flashattn_options, precision) + 4 && o.precision != 0 && o.precision != 1)
      return no("precision");
    if (size >= offsetof(flashattn_options, sliding_window) + 4 && o.sliding_window != 0 &&
        (o.window_left < -1 || o.window_right < -1))
      return no("window size");
    if (size >= offsetof(flashattn_options, softcap) + 4 && !(std::isfinite(o.softcap) && o.softcap >= 0.0f))
      return no("softcap");
    if (alibi_read(c)) {
      const View& a = c.alibi;
      if (a.ndim != 1 && a.ndim != 2) return no("alibi ndim");
      if (a.dtype != FLASHATTN_FLOAT32) return no("alibi dtype");
      if (a.null_data) return no("alibi data NULL");
      if (a.device != FLASHATTN_CPU) return no("alibi device");
      if (a.shape[a.ndim - 1] != Hq || (a.ndim == 2 && a.shape[0] != B)) return no("alibi shape");
      for (int d = 0; d < a.ndim; ++d)
        if (a.stride[d] < 0 || a.stride[d] > (int64_t{1} << 40)) return no("alibi stride");
      if (!a.safe) return no("alibi outside its buffer");
      const uintptr_t p = reinterpret_cast<uintptr_t>(base[static_cast<size_t>(a.buf)] + a.byte_off);
      if (p % 4 != 0) return no("alibi misaligned");
    }
  }
  return true;
}

// Counts for the summary printed at exit: how often a call was valid, and how often a valid
// call that aliases nothing was refused as a (conservatively assumed) overlap.
struct Stats {
  long calls = 0, ok = 0, valid_refused_as_overlap = 0, varlen_calls = 0, varlen_ok = 0;
  Stats() {
    std::atexit([] {
      const Stats& s = get();
      std::fprintf(stderr,
                   "fuzz_c_abi: %ld calls, %ld succeeded, %ld valid calls refused as overlap; %ld packed (varlen) "
                   "calls, %ld succeeded\n",
                   s.calls, s.ok, s.valid_refused_as_overlap, s.varlen_calls, s.varlen_ok);
    });
  }
  static Stats& get() {
    static Stats s;
    return s;
  }
};

[[noreturn]] void violation(const char* what, const std::string& detail) {
  invariant_violated("fuzz_c_abi", what, detail);
}

// ---- packed (varlen) calls ----------------------------------------------------------------------
// One in eight inputs (by the byte after the modifications: earlier inputs decode as before) makes
// a packed call instead (flashattn_forward_varlen / _backward_varlen): 1..5 sequences of 0..8
// queries and keys, GQA, any dtype code, contiguous [total, H, D] tensors in buffers of their own,
// cu_seqlens_q / cu_seqlens_k / seqused_k drawn valid, then perhaps one mutation (a prefix sum
// moved, cu[0] != 0, max_seqlen too small or 0, seqused_k out of its sequence, an index tensor of
// another dtype, length, stride or device, NULL, a packed total off by one, lse transposed).
// Invariants: a known status with a message; a failed call writes nothing (index arrays included);
// a call that succeeds had sequence arrays that satisfy flashattn.h's rules, changed only its
// outputs, and gave finite outputs for small finite inputs (lse -inf only for rows of a sequence
// with no key). (No claim that a valid call succeeds: a packed call has further rules, e.g. on the
// options, that this mode does not model.)
struct VarBuf {
  std::vector<unsigned char> bytes;
  flashattn_tensor t{};
};

void run_varlen(Reader& r, const Case& dense) {
  const bool bwd = dense.backward;
  static const int32_t kDtypes[] = {FLASHATTN_FLOAT32, FLASHATTN_FLOAT16, FLASHATTN_BFLOAT16, FLASHATTN_FLOAT64, 99};
  const int32_t dt = kDtypes[r.u8() % 5];
  const int64_t es = std::max<int64_t>(1, dtype_bytes(dt));
  const int64_t hkv = 1 + r.u8() % 2, hq = hkv * (1 + r.u8() % 3), d = 1 + r.u8() % 20;
  const int nb = 1 + r.u8() % 5;
  std::vector<int32_t> cq(static_cast<size_t>(2 * (nb + 3)), 0), ck(cq.size(), 0), used(cq.size(), 0);
  int64_t max_q = 1, max_k = 1;
  for (int b = 0; b < nb; ++b) {
    const int32_t lq = r.u8() % 9, lk = r.u8() % 9;
    cq[b + 1] = cq[b] + lq;
    ck[b + 1] = ck[b] + lk;
    max_q = std::max<int64_t>(max_q, lq);
    max_k = std::max<int64_t>(max_k, lk);
    used[b] = static_cast<int32_t>(r.u8() % (lk + 1));
  }
  const bool with_used = r.u8() % 3 == 0;
  int64_t total_q = cq[nb], total_k = ck[nb];
  // Index tensors: entries in the first nb + 1 (nb) elements, room for the mutations.
  auto index = [](std::vector<int32_t>& x, int64_t n) {
    flashattn_tensor t{};
    t.data = x.data();
    t.dtype = FLASHATTN_INT32;
    t.device = FLASHATTN_CPU;
    t.ndim = 1;
    t.shape[0] = n;
    t.stride[0] = 1;
    return t;
  };
  flashattn_tensor tcq = index(cq, nb + 1), tck = index(ck, nb + 1), tus = index(used, nb);
  flashattn_varlen vl;
  std::memset(&vl, 0, sizeof vl);
  vl.struct_size = sizeof vl;
  vl.cu_seqlens_q = &tcq;
  vl.cu_seqlens_k = &tck;
  vl.seqused_k = with_used ? &tus : nullptr;
  int64_t shape_q0 = total_q, lse_swap = 0;
  const int mutation = r.u8() % 16;
  const int at = r.u8() % (nb + 1);
  const int32_t delta = static_cast<int32_t>(r.u8() % 7) - 3;
  switch (mutation) {
    case 0: cq[at] += delta; break;
    case 1: ck[at] += delta; break;
    case 2: max_q -= 1; break;
    case 3: max_k = 0; break;
    case 4: used[at % nb] = (at & 1) ? -1 : (ck[at % nb + 1] - ck[at % nb] + 1); break;
    case 5: tcq.dtype = FLASHATTN_FLOAT32; break;
    case 6: tck.shape[0] = nb + 2; break;
    case 7: tcq.stride[0] = 2; break;
    case 8: vl.cu_seqlens_q = nullptr; break;
    case 9: shape_q0 += 1; break;
    case 10: lse_swap = 1; break;
    case 11: tck.device = 0; break;
    case 12: cq[0] = 1; break;
    case 13: tus.shape[0] = nb + 1; break;
    default: break;
  }
  vl.max_seqlen_q = max_q;
  vl.max_seqlen_k = max_k;

  // Tensors: q, k, v, out, lse (forward) + dout, dq, dk, dv (backward), each in its own buffer.
  const char* names[] = {"q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv"};
  const bool out_of[] = {false, false, false, !bwd, !bwd, false, true, true, true};
  const int n = bwd ? 9 : 5;
  VarBuf buf[9];
  uint32_t h = 2166136261u ^ static_cast<uint32_t>(nb * 131 + d);
  for (int i = 0; i < n; ++i) {
    flashattn_tensor& t = buf[i].t;
    const bool is_k = i == 1 || i == 2 || i == 7 || i == 8;
    t.dtype = i == 4 ? FLASHATTN_FLOAT32 : dt;
    t.device = FLASHATTN_CPU;
    if (i == 4) {  // lse [Hq, total_q]
      t.ndim = 2;
      t.shape[0] = lse_swap ? total_q : hq;
      t.shape[1] = lse_swap ? hq : total_q;
      t.stride[0] = t.shape[1];
      t.stride[1] = 1;
    } else {
      t.ndim = 3;
      t.shape[0] = is_k ? total_k : (i == 0 ? shape_q0 : total_q);
      t.shape[1] = is_k ? hkv : hq;
      t.shape[2] = d;
      t.stride[0] = t.shape[1] * d;
      t.stride[1] = d;
      t.stride[2] = 1;
    }
    const int64_t elems = t.ndim == 2 ? t.shape[0] * t.shape[1] : t.shape[0] * t.shape[1] * t.shape[2];
    const int64_t eb = i == 4 ? 4 : es;
    buf[i].bytes.assign(static_cast<size_t>(std::max<int64_t>(1, elems * eb)), 0xA5);
    t.data = buf[i].bytes.data();
    if (!out_of[i] && dtype_bytes(t.dtype) > 0)
      for (int64_t e = 0; e < elems; ++e) {
        store_value(buf[i].bytes.data() + e * eb, t.dtype, small_value(h));
      }
  }
  flashattn_options o;
  flashattn_options_init(&o);
  o.mask = static_cast<int32_t>(r.u8() % 3);
  o.deterministic = r.u8() & 1;
  o.num_threads = 1 + r.u8() % 2;

  std::vector<std::vector<unsigned char>> before;
  for (int i = 0; i < n; ++i) before.push_back(buf[i].bytes);
  const std::vector<int32_t> cq0 = cq, ck0 = ck, used0 = used;
  const flashattn_tensor* p[9];
  for (int i = 0; i < n; ++i) p[i] = &buf[i].t;
  const int status = bwd ? flashattn_backward_varlen(p[0], p[1], p[2], p[3], p[5], p[4], p[6], p[7], p[8], &vl, &o)
                         : flashattn_forward_varlen(p[0], p[1], p[2], p[3], p[4], &vl, &o);
  const std::string msg = flashattn_last_error();
  const std::string dir = std::string(bwd ? "backward_varlen" : "forward_varlen") + " (mutation " +
                          std::to_string(mutation) + ")";
  Stats& stats = Stats::get();
  ++stats.calls;
  ++stats.varlen_calls;
  stats.ok += status == FLASHATTN_OK;
  if (cq != cq0 || ck != ck0 || used != used0) violation("a varlen call wrote its sequence arrays", dir);
  if (status != FLASHATTN_OK) {
    if (status != FLASHATTN_ERROR_INVALID_ARGUMENT && status != FLASHATTN_ERROR_UNSUPPORTED)
      violation("unexpected status", dir + ": status " + std::to_string(status) + ": " + msg);
    if (msg.empty()) violation("error without a message", dir);
    for (int i = 0; i < n; ++i)
      if (buf[i].bytes != before[static_cast<size_t>(i)]) violation("a failed call wrote memory", dir + ": " + msg);
    return;
  }
  ++stats.varlen_ok;
  if (!msg.empty()) violation("success with a message", msg);
  // The rules a successful call's sequence arrays satisfy.
  std::string bad;
  if (vl.cu_seqlens_q != &tcq || tcq.dtype != FLASHATTN_INT32 || tcq.stride[0] != 1 || tck.shape[0] != nb + 1 ||
      tck.device != FLASHATTN_CPU || (with_used && tus.shape[0] != nb))
    bad = "a malformed index tensor";
  if (shape_q0 != total_q || (lse_swap && hq != total_q)) bad = "packed shapes that do not match";
  if (max_q < 1 || max_k < 1) bad = "max_seqlen < 1";
  for (const auto* c : {&cq, &ck}) {
    if ((*c)[0] != 0) bad = "cu_seqlens[0] != 0";
    for (int b = 0; b < nb; ++b)
      if ((*c)[b + 1] < (*c)[b] || (*c)[b + 1] - (*c)[b] > (c == &cq ? max_q : max_k)) bad = "a bad prefix sum";
  }
  if (cq[nb] != total_q || ck[nb] != total_k) bad = "cu_seqlens not ending at the totals";
  if (with_used)
    for (int b = 0; b < nb; ++b)
      if (used[b] < 0 || used[b] > ck[b + 1] - ck[b]) bad = "seqused_k outside its sequence";
  if (!bad.empty()) violation("an invalid varlen call succeeded", dir + ": " + bad);
  for (int i = 0; i < n; ++i)
    if (!out_of[i] && buf[i].bytes != before[static_cast<size_t>(i)]) violation("a varlen call wrote an input", dir + ": " + names[i]);
  // Finite outputs from small finite inputs (as the dense mode's rule; float16 gradients excepted).
  if (bwd && dt == FLASHATTN_FLOAT16) return;
  for (int i = 0; i < n; ++i) {
    if (!out_of[i]) continue;
    const flashattn_tensor& t = buf[i].t;
    const int64_t elems = t.ndim == 2 ? t.shape[0] * t.shape[1] : t.shape[0] * t.shape[1] * t.shape[2];
    const int64_t eb = i == 4 ? 4 : es;
    for (int64_t e = 0; e < elems; ++e) {
      const double x = load_value(buf[i].bytes.data() + e * eb, t.dtype);
      if (std::isnan(x) || (std::isinf(x) && !(i == 4 && x < 0)))
        violation("a non-finite output from small finite inputs", dir + ": " + names[i] + " = " + std::to_string(x));
    }
  }
}

void run_case(const uint8_t* data, size_t size) {
  Reader r(data, size);
  Case c;
  decode_layout(r, c);
  decode_mutations(r, c);
  decode_options(r, c);
  const int n = c.backward ? kTensors : kLse + 1;
  const uint8_t slack = r.u8() % 4 == 0 ? r.u8() % 16 : 0;
  decode_mods(r, c);
  if (r.u8() % 8 == 7) return run_varlen(r, c);

  // Buffers sized to the views they hold (exactly, plus optional slack), so ASan sees a read one
  // element past a view that ends its buffer.
  for (int i = 0; i < n; ++i) size_for(c.t[i], dtype_bytes(c.t[i].dtype), c.buf_size);
  if (c.alibi.used) size_for(c.alibi, dtype_bytes(c.alibi.dtype), c.buf_size);
  std::vector<std::vector<unsigned char>> storage;
  std::vector<unsigned char*> base;
  make_buffers(c.buf_size, kBuffers, slack, storage, base);

  // Inputs get small values k/4 (|k| <= 8) in their dtype; outputs keep the 0xA5 canaries.
  uint32_t h = input_hash(data, size);
  for (int i = 0; i < n; ++i) {
    const View& v = c.t[i];
    if (!v.safe || is_output(c, i)) continue;
    for_each_element(v, [&](int64_t off) { store_value(base[static_cast<size_t>(v.buf)] + off, v.dtype, small_value(h)); });
  }

  // Slopes in their own buffer: small values of both signs (zero included); elsewhere they read
  // whatever the buffer holds.
  if (c.alibi.used && c.alibi.safe && c.alibi.buf == kAlibiBuffer)
    for_each_element(c.alibi, [&](int64_t off) { store_value(base[kAlibiBuffer] + off, c.alibi.dtype, small_slope(h)); });

  // Exact aliasing facts from byte marks.
  std::vector<std::vector<uint8_t>> in_mark(kBuffers), out_count(kBuffers);
  for (int b = 0; b < kBuffers; ++b) {
    in_mark[static_cast<size_t>(b)].assign(storage[static_cast<size_t>(b)].size(), 0);
    out_count[static_cast<size_t>(b)].assign(storage[static_cast<size_t>(b)].size(), 0);
  }
  std::string alias;  // why the call aliases, "" when it does not
  for (int i = 0; i < n; ++i) {
    const View& v = c.t[i];
    if (!v.safe) continue;
    const int64_t es = dtype_bytes(v.dtype);
    const bool out = is_output(c, i);
    auto& marks = out ? out_count[static_cast<size_t>(v.buf)] : in_mark[static_cast<size_t>(v.buf)];
    const bool twice = mark_bytes(v, es, marks.data());
    if (out && twice && alias.empty())
      alias = std::string(kName[i]) + " reaches a byte twice or shares it with another output";
  }
  // The slopes are an input when the call reads them (dtype-size bytes of each element).
  if (alibi_read(c) && c.alibi.safe)
    mark_bytes(c.alibi, dtype_bytes(c.alibi.dtype), in_mark[static_cast<size_t>(c.alibi.buf)].data());
  if (alias.empty() && marks_meet(in_mark, out_count)) alias = "an output shares a byte with an input";

  std::string why_invalid;
  bool valid = model_valid(c, base, &why_invalid);
  // A view outside its buffer must not reach the kernels: make such a call invalid for sure.
  bool any_unsafe = false;
  for (int i = 0; i < n; ++i) any_unsafe |= !c.t[i].safe && !c.t[i].null_ptr;
  any_unsafe |= alibi_read(c) && !c.alibi.safe;
  if (any_unsafe) {
    force_invalid_mask(c.opts_null, c.opts);
    valid = false;
  }

  // Small finite inputs (|x| <= 2) at a moderate scale must give finite outputs. The forward's
  // out is a convex combination of v rows. The backward takes out and lse as given (here not
  // the forward's), so exp(S - lse) is bounded only by |S| + 2, with |S| <= |scale| * 4 D (or
  // the softcap, when smaller) plus the ALiBi bias, |slope| * (Sq + Skv) at most: checked when
  // that stays below 62 (float32 exp overflows at 88), and not for float16 gradients.
  const double eff_scale = c.opts_null || c.opts.softmax_scale == 0.0f
                               ? 1.0 / std::sqrt(static_cast<double>(c.D))
                               : std::fabs(static_cast<double>(c.opts.softmax_scale));
  double max_score = eff_scale * 4 * static_cast<double>(c.D);
  if (valid && !c.opts_null && c.opts.struct_size >= offsetof(flashattn_options, softcap) + 4 &&
      c.opts.softcap > 0.0f)
    max_score = std::min(max_score, static_cast<double>(c.opts.softcap));
  double max_slope = 0;
  if (valid && alibi_read(c))
    for_each_element(c.alibi, [&](int64_t off) {
      const double x = load_value(base[static_cast<size_t>(c.alibi.buf)] + off, c.alibi.dtype);
      max_slope = std::isfinite(x) ? std::max(max_slope, std::fabs(x)) : HUGE_VAL;
    });
  const double max_bias = max_slope * static_cast<double>(c.Sq + c.Skv);
  bool numeric_check =
      valid && max_slope <= 1e3 &&
      (c.backward ? c.t[kQ].dtype != FLASHATTN_FLOAT16 && max_score + max_bias <= 60
                  : eff_scale <= 100);
  for (int i = 0; i < n && numeric_check; ++i) {
    const View& v = c.t[i];
    if (is_output(c, i)) continue;
    for_each_element(v, [&](int64_t off) {
      const double x = load_value(base[static_cast<size_t>(v.buf)] + off, v.dtype);
      if (!(std::fabs(x) <= 2)) numeric_check = false;
    });
  }

  // The C structs, and the options in exactly as many bytes as struct_size claims.
  flashattn_tensor ct[kTensors];
  const flashattn_tensor* cp[kTensors];
  for (int i = 0; i < kTensors; ++i) {
    const View& v = c.t[i];
    fill_tensor(ct[i], v, base[static_cast<size_t>(v.buf)]);
    cp[i] = v.null_ptr ? nullptr : &ct[i];
  }
  flashattn_tensor ca;
  std::memset(&ca, 0, sizeof ca);
  if (c.alibi.used) {
    const View& a = c.alibi;
    fill_tensor(ca, a, base[static_cast<size_t>(a.buf)]);
    c.opts.alibi_slopes = a.null_ptr ? nullptr : &ca;
  }
  const flashattn_options* op = nullptr;
  std::vector<unsigned char> opts_mem;
  if (!c.opts_null) {
    opts_mem = claimed_bytes(c.opts, c.opts.struct_size);
    op = reinterpret_cast<const flashattn_options*>(opts_mem.data());
  }

  const std::vector<std::vector<unsigned char>> before = storage;
  const int status =
      c.backward ? flashattn_backward(cp[kQ], cp[kK], cp[kV], cp[kOut], cp[kDout], cp[kLse], cp[kDq],
                                      cp[kDk], cp[kDv], op)
                 : flashattn_forward(cp[kQ], cp[kK], cp[kV], cp[kOut], cp[kLse], op);
  const std::string msg = flashattn_last_error();
  const char* dir = c.backward ? "backward" : "forward";
  Stats& stats = Stats::get();
  ++stats.calls;
  stats.ok += status == FLASHATTN_OK;

  if (const char* verbose = std::getenv("FUZZ_C_ABI_VERBOSE"); verbose && *verbose == '2')
    std::fprintf(stderr, "%s: status %d: %s\n", dir, status, msg.c_str());
  if (status != FLASHATTN_OK) {
    if (status != FLASHATTN_ERROR_INVALID_ARGUMENT && status != FLASHATTN_ERROR_UNSUPPORTED)
      violation("unexpected status", std::string(dir) + ": status " + std::to_string(status) + ": " + msg);
    if (msg.empty()) violation("error without a message", std::string(dir) + ": status " + std::to_string(status));
    for (int b = 0; b < kBuffers; ++b)
      if (storage[static_cast<size_t>(b)] != before[static_cast<size_t>(b)])
        violation("a failed call wrote memory", std::string(dir) + ": " + msg);
    if (valid && alias.empty()) {
      if (msg.find("overlap") == std::string::npos && msg.find("alias") == std::string::npos)
        violation("a valid call was refused", std::string(dir) + ": " + msg);
      ++stats.valid_refused_as_overlap;
      if (std::getenv("FUZZ_C_ABI_VERBOSE")) std::fprintf(stderr, "refused as overlap: %s\n", msg.c_str());
    }
    return;
  }
  if (!msg.empty()) violation("success with a message", msg);
  if (!valid) violation("an invalid call succeeded", std::string(dir) + ": " + why_invalid);
  if (!alias.empty()) violation("an aliasing call succeeded", std::string(dir) + ": " + alias);
  for (int b = 0; b < kBuffers; ++b) {
    if (storage[static_cast<size_t>(b)] == before[static_cast<size_t>(b)]) continue;
    for (size_t j = 0; j < storage[static_cast<size_t>(b)].size(); ++j)
      if (storage[static_cast<size_t>(b)][j] != before[static_cast<size_t>(b)][j] &&
          !out_count[static_cast<size_t>(b)][j])
        violation("a byte outside the outputs changed",
                  std::string(dir) + ": buffer " + std::to_string(b) + " byte " + std::to_string(j));
  }
  if (numeric_check) {
    for (int i = 0; i < n; ++i) {
      if (!is_output(c, i)) continue;
      const View& v = c.t[i];
      for_each_element(v, [&](int64_t off) {
        const double x = load_value(base[static_cast<size_t>(v.buf)] + off, v.dtype);
        if (std::isnan(x) || (std::isinf(x) && !(i == kLse && x < 0)))
          violation("a non-finite output from small finite inputs",
                    std::string(dir) + ": " + kName[i] + " = " + std::to_string(x));
      });
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  run_case(data, size);
  return 0;
}

#if defined(FLASHATTN_FUZZ_REPLAY)
int main(int argc, char** argv) { return fuzz::replay_main(argc, argv, "fuzz_c_abi"); }
#endif
