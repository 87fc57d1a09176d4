// The parts of the C ABI fuzzers (fuzz_c_abi.cpp, fuzz_kvcache.cpp) that are the same in both:
// the input reader, tensor views and the byte ranges they reach, the buffers that hold them, the
// small exact values written into inputs, shared pieces of the decoding, the invariant abort and
// the replay main(). Kept in one place so that a fix to one (an off-by-one in a view's extent, a
// float16 bit pattern) reaches both fuzzers. Where the two differ (how an int32 dtype code counts,
// a mutation's target buffers, the special values drawn) the difference is a parameter, so every
// committed corpus input still decodes, byte for byte, into the call it made before.
#pragma once

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

namespace fuzz {

// ---- input decoding ----------------------------------------------------------------------------

// Little-endian reads of the input. Past its end a Reader returns 0, or, with random_tail, goes on
// as a pseudo-random stream seeded by the whole input (xorshift64 over an FNV-1a seed): a short
// input then still decodes into a whole call of varied sizes and options.
class Reader {
 public:
  Reader(const uint8_t* d, size_t n, bool random_tail = false) : d_(d), n_(n), random_tail_(random_tail) {
    if (!random_tail_) return;
    for (size_t i = 0; i < n; ++i) x_ = (x_ ^ d[i]) * 0x100000001b3ull;
    if (x_ == 0) x_ = 1;  // (xorshift's one fixed point)
  }
  uint8_t u8() {
    if (i_ < n_) return d_[i_++];
    if (!random_tail_) return 0;
    x_ ^= x_ << 13;
    x_ ^= x_ >> 7;
    x_ ^= x_ << 17;
    return static_cast<uint8_t>(x_ >> 32);
  }
  uint32_t u32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(u8()) << (8 * i);
    return v;
  }
  uint64_t u64() { return u32() | (static_cast<uint64_t>(u32()) << 32); }
  template <class T, size_t N>
  T pick(const T (&a)[N]) { return a[u8() % N]; }

 private:
  const uint8_t* d_;
  size_t n_, i_ = 0;
  bool random_tail_;
  uint64_t x_ = 0xcbf29ce484222325ull;
};

// Bytes per element of the floating-point dtype codes, 0 for every other code. (Each fuzzer's
// dtype_bytes starts from this: fuzz_kvcache also sizes its int32 index tensors, fuzz_c_abi
// treats int32 as a dtype its views cannot have.)
inline int64_t float_dtype_bytes(int32_t dt) {
  switch (dt) {
    case FLASHATTN_FLOAT32: return 4;
    case FLASHATTN_FLOAT16: return 2;
    case FLASHATTN_BFLOAT16: return 2;
    case FLASHATTN_FLOAT64: return 8;
    default: return 0;
  }
}

// Next to the current value, or a special one: a shape or stride mutation.
template <size_t N>
int64_t pick_i64(Reader& r, int64_t cur, const int64_t (&special)[N]) {
  const uint64_t u = static_cast<uint64_t>(cur);  // wrapping arithmetic: no UB in the fuzzer
  switch (r.u8() % 6) {
    case 0: return static_cast<int64_t>(u + 1);
    case 1: return static_cast<int64_t>(u - 1);
    case 2: return static_cast<int64_t>(0 - u);
    case 3: return static_cast<int64_t>(u * 2);
    case 4: return static_cast<int64_t>(r.u64());
    default: return r.pick(special);
  }
}

// ---- views -------------------------------------------------------------------------------------

constexpr int64_t kMaxBuffer = int64_t{1} << 22;  // bytes

// A tensor as the fuzzer builds it: which buffer holds it and where, and the fields of the
// flashattn_tensor it becomes.
struct View {
  bool used = false;      // the call passes it (optional tensors: a non-NULL field)
  bool null_ptr = false;  // ... but as a NULL pointer
  bool null_data = false;
  int buf = 0;
  int64_t byte_off = 0;
  int32_t dtype = 0, device = FLASHATTN_CPU, ndim = 4;
  int64_t shape[4] = {0, 0, 0, 0}, stride[4] = {0, 0, 0, 0};
  bool safe = false;  // every element lies inside its buffer (computed after mutation)
  bool passed() const { return used && !null_ptr; }
};

// One mutation of a view, of the given kind (0..10): ndim, a shape or a stride, the dtype or
// device code, NULL data or pointer, a misaligned or shifted offset, or another buffer (one of the
// first `buffers`). es: the element size the fuzzer gives a dtype code.
template <size_t N>
void mutate_view(Reader& r, View& v, uint8_t kind, int buffers, const int64_t (&special)[N],
                 int64_t (*es)(int32_t)) {
  switch (kind) {
    case 0: v.ndim = static_cast<int8_t>(r.u8()) % 7; break;
    case 1: { const int d = r.u8() % 4; v.shape[d] = pick_i64(r, v.shape[d], special); break; }
    case 2:
    case 3: { const int d = r.u8() % 4; v.stride[d] = pick_i64(r, v.stride[d], special); break; }
    case 4: v.dtype = static_cast<int8_t>(r.u8()) % 6; break;
    case 5: {
      static const int32_t devs[] = {0, 1, -2, std::numeric_limits<int32_t>::min(), 7};
      v.device = r.pick(devs);
      break;
    }
    case 6: v.null_data = true; break;
    case 7: v.null_ptr = true; break;
    case 8: v.byte_off += 1 + r.u8() % 7; break;  // misaligned (for most dtypes)
    case 9: v.buf = r.u8() % buffers; break;       // into another tensor's buffer
    default: v.byte_off += static_cast<int64_t>(r.u8()) * std::max<int64_t>(1, es(v.dtype));
  }
}

// Byte range [lo, hi) that the elements of v (es bytes each) reach relative to its buffer start,
// or false when the view has no elements, an unknown dtype (es 0), more elements than a buffer has
// bytes, or arithmetic beyond int64.
inline bool extent(const View& v, int64_t es, __int128& lo, __int128& hi) {
  if (es == 0 || v.ndim < 0 || v.ndim > 4) return false;
  __int128 mn = 0, mx = 0, elems = 1;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] <= 0) return false;
    elems *= v.shape[d];
    if (elems > kMaxBuffer) return false;  // (stride-0 views of huge shapes fit any buffer)
    const __int128 span = static_cast<__int128>(v.shape[d] - 1) * v.stride[d];
    (span < 0 ? mn : mx) += span;
  }
  lo = v.byte_off + mn * es;
  hi = v.byte_off + (mx + 1) * es;
  return true;
}

// f(byte offset in the buffer) for every element of v (es bytes each); safe views only.
template <class F>
void for_each_element(const View& v, int64_t es, F&& f) {
  int64_t n[4] = {1, 1, 1, 1}, s[4] = {0, 0, 0, 0};
  for (int d = 0; d < v.ndim; ++d) {
    n[d] = v.shape[d];
    s[d] = v.stride[d];
  }
  for (int64_t a = 0; a < n[0]; ++a)
    for (int64_t b = 0; b < n[1]; ++b)
      for (int64_t c = 0; c < n[2]; ++c)
        for (int64_t d = 0; d < n[3]; ++d)
          f(v.byte_off + (a * s[0] + b * s[1] + c * s[2] + d * s[3]) * es);
}

// Marks the bytes of v's elements in m0 (its buffer's marks); true when one was marked already.
inline bool mark_bytes(const View& v, int64_t es, uint8_t* m0) {
  bool twice = false;
  for_each_element(v, es, [&](int64_t off) {
    uint8_t* m = m0 + off;
    for (int64_t j = 0; j < es; ++j) {
      twice |= m[j] != 0;
      m[j] = 1;
    }
  });
  return twice;
}

// Whether some byte of some buffer is marked in both.
inline bool marks_meet(const std::vector<std::vector<uint8_t>>& a, const std::vector<std::vector<uint8_t>>& b) {
  for (size_t k = 0; k < a.size(); ++k)
    for (size_t j = 0; j < a[k].size(); ++j)
      if (a[k][j] && b[k][j]) return true;
  return false;
}

// ---- buffers -----------------------------------------------------------------------------------

// Grows v's buffer (buf_size, by buffer) to hold v, and marks v safe when it fits; a view that
// reaches outside [0, kMaxBuffer) stays unsafe (and its offset, when out of range, becomes 0).
inline void size_for(View& v, int64_t es, int64_t* buf_size) {
  __int128 lo, hi;
  if (v.byte_off < 0 || v.byte_off > kMaxBuffer) v.byte_off = 0;
  if (extent(v, es, lo, hi) && lo >= 0 && hi <= kMaxBuffer) {
    v.safe = true;
    buf_size[v.buf] = std::max<int64_t>(buf_size[v.buf], static_cast<int64_t>(hi));
  }
  buf_size[v.buf] = std::max<int64_t>(buf_size[v.buf], v.byte_off);
}

// The n buffers, each exactly its size plus slack, filled with 0xA5 canaries. Exact sizes let
// ASan see a read one element past a view that ends its buffer.
inline void make_buffers(const int64_t* buf_size, int n, uint8_t slack, std::vector<std::vector<unsigned char>>& storage,
                         std::vector<unsigned char*>& base) {
  storage.assign(static_cast<size_t>(n), {});
  base.assign(static_cast<size_t>(n), nullptr);
  for (int b = 0; b < n; ++b) {
    storage[static_cast<size_t>(b)].assign(static_cast<size_t>(buf_size[b] + slack), 0xA5);
    // (a zero-size vector may have no storage: give every buffer a distinct real address)
    if (storage[static_cast<size_t>(b)].empty()) storage[static_cast<size_t>(b)].assign(1, 0xA5);
    base[static_cast<size_t>(b)] = storage[static_cast<size_t>(b)].data();
  }
}

// The flashattn_tensor of a view whose buffer starts at buf (zeroed first: no stray bytes).
inline void fill_tensor(flashattn_tensor& t, const View& v, unsigned char* buf) {
  std::memset(&t, 0, sizeof t);
  t.data = v.null_data ? nullptr : buf + v.byte_off;
  t.dtype = v.dtype;
  t.device = v.device;
  t.ndim = v.ndim;
  for (int d = 0; d < 4; ++d) {
    t.shape[d] = v.shape[d];
    t.stride[d] = v.stride[d];
  }
}

// A versioned struct in exactly as many bytes as its struct_size claims (at least 4), the bytes
// past the real struct 0xCD. (Vector storage comes from operator new: aligned for the struct.)
template <class T>
std::vector<unsigned char> claimed_bytes(const T& s, uint32_t struct_size) {
  std::vector<unsigned char> mem(std::max<size_t>(4, struct_size), 0xCD);
  std::memcpy(mem.data(), &s, std::min(mem.size(), sizeof s));
  return mem;
}

// ---- options -----------------------------------------------------------------------------------

// The softmax scale (one of scales, or any bit pattern) and the mask code (0-2, or any int32).
template <size_t N>
void decode_scale_and_mask(Reader& r, flashattn_options& o, const float (&scales)[N]) {
  const uint8_t s = r.u8();
  if (s < 200) {
    o.softmax_scale = scales[s % N];
  } else {
    const uint32_t bits = r.u32();
    std::memcpy(&o.softmax_scale, &bits, sizeof bits);
  }
  const uint8_t m = r.u8();
  o.mask = m < 240 ? m % 3 : static_cast<int32_t>(r.u32());
}

// Sliding window sizes (from sides), with the flag set, or cleared while sizes are set (then
// they must not be read).
template <size_t N>
void decode_window(Reader& r, flashattn_options& o, const int64_t (&sides)[N]) {
  const uint8_t w = r.u8();
  if (w & 3) {
    o.window_left = r.pick(sides);
    o.window_right = r.pick(sides);
    o.sliding_window = (w & 3) == 3 ? 0 : static_cast<int32_t>(w >> 2);
    if ((w & 3) == 1 && o.sliding_window == 0) o.sliding_window = 1;
  }
}

// The ALiBi slopes' view, drawn by byte a (a % 3 != 0): float32 [Hq] (sometimes strided) or
// [B, Hq] (broadcast over the batch, or padded), in buffer buf.
inline void alibi_view(View& v, uint8_t a, int buf, int64_t B, int64_t Hq) {
  v.used = true;
  v.dtype = FLASHATTN_FLOAT32;
  v.buf = buf;
  v.ndim = a % 3 == 1 ? 1 : 2;
  if (v.ndim == 1) {
    v.shape[0] = Hq;
    v.stride[0] = 1 + (a >> 6) % 3;  // sometimes strided
  } else {
    v.shape[0] = B;
    v.shape[1] = Hq;
    v.stride[1] = 1 + (a >> 6) % 2;
    v.stride[0] = (a & 0x20) ? 0 : Hq * v.stride[1] + ((a >> 3) & 1);  // broadcast or padded
  }
}

// Options that make the call invalid for sure (mask 77), for calls with a view outside its
// buffer: the library must refuse them before touching memory.
inline void force_invalid_mask(bool& opts_null, flashattn_options& o) {
  if (opts_null) {
    opts_null = false;
    flashattn_options_init(&o);
  }
  if (o.struct_size < FLASHATTN_OPTIONS_V1_SIZE) o.struct_size = FLASHATTN_OPTIONS_V1_SIZE;
  o.mask = 77;
}

// ---- values ------------------------------------------------------------------------------------

// The seed of the input values: FNV-1a of the input.
inline uint32_t input_hash(const uint8_t* data, size_t size) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < size; ++i) h = (h ^ data[i]) * 16777619u;
  return h;
}

// The next input value k/4 (|k| <= 8) of the stream h.
inline double small_value(uint32_t& h) {
  h = h * 1103515245u + 12345u;
  return static_cast<double>(static_cast<int>((h >> 16) % 17) - 8) / 4;
}

// The next ALiBi slope of the stream h: small, of both signs, zero included.
inline double small_slope(uint32_t& h) {
  static const double slopes[] = {0.0, 0.25, -0.125, 0.5, 1.0, 0.00390625, -0.5};
  h = h * 1103515245u + 12345u;
  return slopes[(h >> 16) % 7];
}

// Small values k/4 (|k| <= 8), exact in every dtype.
inline void store_value(unsigned char* p, int32_t dt, double x) {
  switch (dt) {
    case FLASHATTN_FLOAT32: { const float f = static_cast<float>(x); std::memcpy(p, &f, 4); break; }
    case FLASHATTN_FLOAT64: std::memcpy(p, &x, 8); break;
    case FLASHATTN_FLOAT16:
    case FLASHATTN_BFLOAT16: {
      // Exact in both formats: build the bits directly.
      uint16_t h = 0;
      if (x != 0) {
        const float f = static_cast<float>(x);
        uint32_t b;
        std::memcpy(&b, &f, 4);
        if (dt == FLASHATTN_BFLOAT16) {
          h = static_cast<uint16_t>(b >> 16);
        } else {
          const uint32_t sign = (b >> 16) & 0x8000, exp = (b >> 23) & 0xff, man = b & 0x7fffff;
          h = static_cast<uint16_t>(sign | ((exp - 127 + 15) << 10) | (man >> 13));
        }
      }
      std::memcpy(p, &h, 2);
      break;
    }
    default: break;
  }
}

inline double load_value(const unsigned char* p, int32_t dt) {
  switch (dt) {
    case FLASHATTN_FLOAT32: { float f; std::memcpy(&f, p, 4); return f; }
    case FLASHATTN_FLOAT64: { double d; std::memcpy(&d, p, 8); return d; }
    case FLASHATTN_BFLOAT16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t b = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
    case FLASHATTN_FLOAT16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
      const double sign = (h & 0x8000) ? -1 : 1;
      if (exp == 0x1f) return man ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
      if (exp == 0) return sign * std::ldexp(man, -24);
      return sign * std::ldexp(1024 + man, exp - 25);
    }
    default: return 0;
  }
}

// ---- reports -----------------------------------------------------------------------------------

// Aborts, which libFuzzer reports as a crash (and the replay as a failed test), naming the fuzzer.
[[noreturn]] inline void invariant_violated(const char* fuzzer, const char* what, const std::string& detail) {
  std::fprintf(stderr, "\n%s: INVARIANT VIOLATED: %s\n  %s\n", fuzzer, what, detail.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

#if defined(FLASHATTN_FUZZ_REPLAY)
// Replays files, and every file of directories (in name order), through the target: the fuzzers'
// main() without libFuzzer.
#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <iterator>

namespace fuzz {

inline int replay(const std::string& path, int& count) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return 1;
  }
  if (S_ISDIR(st.st_mode)) {
    std::vector<std::string> names;
    if (DIR* d = opendir(path.c_str())) {
      while (dirent* e = readdir(d))
        if (e->d_name[0] != '.') names.push_back(e->d_name);
      closedir(d);
    }
    std::sort(names.begin(), names.end());
    int rc = 0;
    for (const std::string& nm : names) rc |= replay(path + "/" + nm, count);
    return rc;
  }
  std::ifstream f(path, std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  ++count;
  return 0;
}

// main() of a replay build: every argument, a file or a directory; fails when one cannot be read
// or none was given.
inline int replay_main(int argc, char** argv, const char* fuzzer) {
  int count = 0, rc = 0;
  for (int i = 1; i < argc; ++i) rc |= replay(argv[i], count);
  std::printf("%s replay: %d inputs, invariants held\n", fuzzer, count);
  return rc != 0 || count == 0;
}

}  // namespace fuzz
#endif
