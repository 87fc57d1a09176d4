// The CPU attention kernels: FlashAttention forward (tiled online softmax) and the backward in two
// designs with the same bits: the seed's split passes (D preprocess, dQ over query blocks, dK/dV
// over key blocks) and a fused pass over (sequence, kv head) pairs that takes dQ from the dK/dV
// pass's dS. docs/ALGORITHM.md ("CPU backend") has the pseudocode and the work model.
//
// This file is compiled once per instruction set by kernels_<isa>.cpp, which defines
//   FLASHATTN_CPU_ISA        the namespace (avx512, avx2, generic)
//   FLASHATTN_CPU_VEC_BYTES  the SIMD width the GCC vector types use (64, 32, 16)
// and the compiler flags of that instruction set. Everything here has internal linkage except the
// KernelSet at the bottom: an out-of-line copy of an inline function compiled with -mavx512f
// must never be shared with (and picked by) a baseline caller. For the same reason no std::
// templates are used below, and libm is reached through __builtin_ functions.
//
// Mask and scale. The mask arrives as a MaskRule (core/mask.hpp) built by the driver, and every
// pass visits exactly its band; the score transform is core/score.hpp's ScoreTransform.
//
// Numerics. Scores are kept in log2 units: ScoreTransform::prescale() (the softmax scale times
// log2(e)) is folded into the packed Q (forward, dQ pass) or K^T (dK/dV pass), so every
// exponential is an exp2 and LSE is converted to natural log once per row. A softcap or ALiBi
// adds a per-entry step on each product tile (ScoreMods below). float16/bfloat16/float32 tiles
// are converted to float32 when packed and accumulate in float32; float64 computes in double
// throughout.
//
// Determinism. Every output element is produced by exactly one task, and the sequence of
// floating-point operations a task performs depends only on the problem shape (tile sizes are
// compile-time constants of the instruction set), never on the thread count or the schedule.
#include <cstddef>
#include <cstdint>
#include <cstring>

// The mask rule and the score transform are shared with the CUDA kernels and the reference
// (FLASHATTN_HD helpers: always inlined, so the AVX-512 units leave no out-of-line copy a baseline
// caller could be linked to).
#include "core/mask.hpp"
#include "core/score.hpp"

#include "cpu/kernels.hpp"

#ifndef FLASHATTN_CPU_ISA
#error "define FLASHATTN_CPU_ISA and FLASHATTN_CPU_VEC_BYTES before including kernels_impl.hpp"
#endif

namespace flashattn::cpu::FLASHATTN_CPU_ISA {
namespace {

constexpr int kVecBytes = FLASHATTN_CPU_VEC_BYTES;

// ---- SIMD vocabulary (GCC vector extensions) --------------------------------------------------
typedef float vf __attribute__((vector_size(kVecBytes)));
typedef double vd __attribute__((vector_size(kVecBytes)));
typedef int32_t vi32 __attribute__((vector_size(kVecBytes)));
typedef uint32_t vu32 __attribute__((vector_size(kVecBytes)));
typedef int64_t vi64 __attribute__((vector_size(kVecBytes)));

template <class T>
struct Simd;
template <>
struct Simd<float> {
  using V = vf;
  static constexpr int W = kVecBytes / 4;
};
template <>
struct Simd<double> {
  using V = vd;
  static constexpr int W = kVecBytes / 8;
};

template <class V, class T>
inline V vload(const T* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
template <class V, class T>
inline void vstore(T* p, V v) {
  __builtin_memcpy(p, &v, sizeof v);
}
// x - 0 == x for every x (including -0), so the compiler folds this into a plain broadcast.
template <class V, class T>
inline V vbroadcast(T s) {
  return s - V{};
}
template <class V>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}

template <class T>
inline T smin(T a, T b) {
  return a < b ? a : b;
}
template <class T>
inline T smax(T a, T b) {
  return a > b ? a : b;
}
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr double kLog2e = 1.44269504088896340736;
constexpr double kLn2 = 0.69314718055994530942;

// exp2 for float32 vectors: 2^x = 2^n * 2^f with n = round(x), f in [-0.5, 0.5], and 2^f from its
// degree-7 Taylor polynomial (truncation error 5e-9 relative, below half an ulp; Horner adds about
// one ulp). Inputs below -64 (including -inf, the masked scores) give exactly 0, so a masked
// element never contributes; NaN propagates. The cut is at 2^-64 rather than at the smallest
// normal float: every use is a softmax weight or a rescale factor relative to a row's largest
// (P = 1 at the running max; >= 1/Skv in the backward), so a term below 2^-64 of it is invisible
// in a float32 sum, while weights near 2^-126 made P V, dS = P (dP - D) and the GEMMs that take
// them denormal, and each denormal operand costs a microcode assist (scores spread over 100+
// nats, as ALiBi's distant keys are: measured +16% on the backward).
// CAP1 (the backward's recomputed P = exp2(S - lse)): the argument is capped at 0, so P <= 1 as it
// is in exact arithmetic. S - lse can round above 0 by the float32 rounding of lse, about
// 2^-24 |lse|: far out (scores of 1e9 and more) that made P, and the gradients, overflow. The cap
// is the clamp below with another bound: no extra work. NaN still propagates.
template <bool CAP1 = false>
inline vf exp2v(vf x) {
  const vf lo = vbroadcast<vf>(-64.0f), hi = vbroadcast<vf>(CAP1 ? 0.0f : 127.0f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  // Adding 1.5 * 2^23 rounds to the nearest integer, which then sits in the low mantissa bits.
  const vf magic = vbroadcast<vf>(12582912.0f);
  vf t = xc + magic;
  vf n = t - magic;
  vf f = xc - n;
  vu32 tb;
  __builtin_memcpy(&tb, &t, sizeof tb);
  vu32 sb = (tb << 23) + vbroadcast<vu32>(127u << 23);  // (n + 127) << 23, n in [-64, 127]
  vf s;
  __builtin_memcpy(&s, &sb, sizeof s);
  // (ln 2)^k / k!
  vf p = vbroadcast<vf>(1.5252733804059840e-5f);
  p = p * f + 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  vf r = p * s;
  return x < lo ? vf{} : r;
}

// float64: a plain libm exp2 per lane (the float64 path serves gradient checks, not speed); CAP1
// as above (x > 0 is false for NaN, which stays NaN).
template <bool CAP1 = false>
inline vd exp2v(vd x) {
  vd r;
  for (int i = 0; i < Simd<double>::W; ++i) r[i] = __builtin_exp2(CAP1 && x[i] > 0.0 ? 0.0 : x[i]);
  return r;
}

// tanh for float32 vectors (the softcap), within 1.8e-7 relative of the exact value (tested against
// double tanh by tests/test_cpu_tanh.cpp, every instruction set). Two forms, both evaluated and
// one selected per lane, neither with a division (a vector divide, issued on one port, more than
// doubled the cost of the step in a measurement):
//   |x| >= 0.625: (1 - y) / (1 + y) = 1 - 2y / (1 + y) with y = exp(-2|x|) in (0, 0.2865] from
//     exp2v, and 1 / (1 + y) a degree-7 Chebyshev fit on that interval (5e-10 relative error);
//     no cancellation there (the result is >= 0.55), and y = 0 far out gives exactly 1;
//   |x| < 0.625: x + x^3 P(x^2), P a degree-5 Chebyshev fit of (tanh(a) - a) / a^3 on
//     [0, 0.625^2] (6e-10 relative error), which keeps small arguments accurate relative to
//     themselves where 1 - y would cancel.
// The sign is copied back, so tanh(-x) = -tanh(x) exactly; NaN propagates.
// tanhv_small is the second form alone, for tiles whose every |x| is below 0.625 (a softcap well
// above the scores, the common case), where tanhv would pick that form for every lane anyway: a
// third of the work.
inline vf tanh_small_abs(vf a) {
  const vf a2 = a * a;
  vf p = vbroadcast<vf>(2.2927448161781423e-3f);
  p = p * a2 - 8.3439455158391520e-3f;
  p = p * a2 + 2.1768918651028210e-2f;
  p = p * a2 - 5.3959259577204543e-2f;
  p = p * a2 + 1.3333303556915742e-1f;
  p = p * a2 - 3.3333333172140362e-1f;
  return a + a * a2 * p;
}
inline vf with_sign_of(vf r, vf x) {
  vu32 rb, xb;
  __builtin_memcpy(&rb, &r, sizeof rb);
  __builtin_memcpy(&xb, &x, sizeof xb);
  rb |= xb & vbroadcast<vu32>(0x80000000u);
  vf out;
  __builtin_memcpy(&out, &rb, sizeof out);
  return out;
}
inline vf abs_bits(vf x) {
  vu32 b;
  __builtin_memcpy(&b, &x, sizeof b);
  b &= vbroadcast<vu32>(0x7fffffffu);
  vf a;
  __builtin_memcpy(&a, &b, sizeof a);
  return a;
}
inline vf tanhv_small(vf x) { return with_sign_of(tanh_small_abs(abs_bits(x)), x); }
inline vf tanhv(vf x) {
  const vf a = abs_bits(x);
  const vf one = vbroadcast<vf>(1.0f);
  const vf y = exp2v(a * vbroadcast<vf>(static_cast<float>(-2.0 * kLog2e)));
  vf q = vbroadcast<vf>(-3.5365638600500007e-1f);
  q = q * y + 7.5895339012768616e-1f;
  q = q * y - 9.4764763585828360e-1f;
  q = q * y + 9.9339224139359496e-1f;
  q = q * y - 9.9953570182313117e-1f;
  q = q * y + 9.9998373513864681e-1f;
  q = q * y - 9.9999978060040286e-1f;
  q = q * y + 9.9999999951001053e-1f;
  const vf big = one - (y + y) * q;
  return with_sign_of(a < vbroadcast<vf>(0.625f) ? tanh_small_abs(a) : big, x);
}
constexpr float kTanhSmall = 0.625f;  // where tanhv switches forms

// float64: libm tanh per lane, so that the float64 path stays exact to ~1e-15.
inline vd tanhv(vd x) {
  vd r;
  for (int i = 0; i < Simd<double>::W; ++i) r[i] = __builtin_tanh(x[i]);
  return r;
}
inline vd tanhv_small(vd x) { return tanhv(x); }

template <class V>
inline V vabs(V x) {
  return x < V{} ? -x : x;
}

// ---- storage types ----------------------------------------------------------------------------
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

// Conversions with the same rounding as core/half.hpp (round to nearest even, NaN stays NaN,
// overflow gives inf), repeated here so that this translation unit stays self-contained.
inline float to_float(BF16 h) { return bits_f32(static_cast<uint32_t>(h.bits) << 16); }
// Branch-free so that packing loops vectorise: the 15 magnitude bits shifted into float position
// are the value times 2^-112 (exact for normal and subnormal halves), and exponent 31 (inf/NaN)
// maps to 255.
inline float to_float(F16 h) {
  const uint32_t em = static_cast<uint32_t>(h.bits & 0x7fffu) << 13;
  uint32_t r = f32_bits(bits_f32(em) * 0x1p112f);
  r = em >= 0x0f800000u ? (em | 0x7f800000u) : r;
  return bits_f32(r | (static_cast<uint32_t>(h.bits & 0x8000u) << 16));
}
inline BF16 to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return BF16{static_cast<uint16_t>(u >> 16)};
}
inline F16 to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u, au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return F16{static_cast<uint16_t>(sign | 0x7e00u)};
  if (au >= 0x477ff000u) return F16{static_cast<uint16_t>(sign | 0x7c00u)};
  if (au < 0x38800000u) {  // half subnormal or zero: round(|f| * 2^24) to nearest even
    float a = bits_f32(au) * 16777216.0f;
    uint32_t m = static_cast<uint32_t>(a);
    float rem = a - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return F16{static_cast<uint16_t>(sign | m)};
  }
  uint32_t h = (((au >> 23) - 112u) << 10) | ((au >> 13) & 0x3ffu);
  uint32_t r = au & 0x1fffu;
  if (r > 0x1000u || (r == 0x1000u && (h & 1u))) ++h;
  return F16{static_cast<uint16_t>(sign | h)};
}

// Load one stored element as the compute type C; store a computed value.
template <class C>
inline C load_as(const float* p) {
  return static_cast<C>(*p);
}
template <class C>
inline C load_as(const double* p) {
  return static_cast<C>(*p);
}
template <class C>
inline C load_as(const F16* p) {
  return static_cast<C>(to_float(*p));
}
template <class C>
inline C load_as(const BF16* p) {
  return static_cast<C>(to_float(*p));
}
template <class C>
inline void store_as(float* p, C v) {
  *p = static_cast<float>(v);
}
template <class C>
inline void store_as(double* p, C v) {
  *p = static_cast<double>(v);
}
template <class C>
inline void store_as(F16* p, C v) {
  *p = to_f16(static_cast<float>(v));
}
template <class C>
inline void store_as(BF16* p, C v) {
  *p = to_bf16(static_cast<float>(v));
}

template <class A, class B>
struct Same {
  static constexpr bool value = false;
};
template <class A>
struct Same<A, A> {
  static constexpr bool value = true;
};

// The compute type of a storage type.
template <class S>
struct ComputeOf {
  using type = float;
};
template <>
struct ComputeOf<double> {
  using type = double;
};

// ---- tiles ------------------------------------------------------------------------------------
// Tile sizes: BQ query rows x BK keys per step, per pass (each pass struct defines its own BQ and
// BK from these), all multiples of every panel width. The working set of one step
// (docs/ALGORITHM.md, work model) is sized for a 1-2 MiB L2 per core; 64 x 128 measured as well as
// any other choice within this machine's noise (docs/PERF.md), and keeps tasks small enough to
// balance two threads on short sequences. They are compile-time constants so that the partition
// of work, and with it every result bit, never depends on the thread count.
#ifndef FLASHATTN_CPU_BQ
#define FLASHATTN_CPU_BQ 64
#endif
#ifndef FLASHATTN_CPU_BK
#define FLASHATTN_CPU_BK 128
#endif
#ifndef FLASHATTN_CPU_FWD_BQ
#define FLASHATTN_CPU_FWD_BQ FLASHATTN_CPU_BQ
#endif
#ifndef FLASHATTN_CPU_FWD_BK
#define FLASHATTN_CPU_FWD_BK FLASHATTN_CPU_BK
#endif
#ifndef FLASHATTN_CPU_DQ_BQ
#define FLASHATTN_CPU_DQ_BQ FLASHATTN_CPU_BQ
#endif
#ifndef FLASHATTN_CPU_DQ_BK
#define FLASHATTN_CPU_DQ_BK FLASHATTN_CPU_BK
#endif
#ifndef FLASHATTN_CPU_DKV_BQ
#define FLASHATTN_CPU_DKV_BQ FLASHATTN_CPU_BQ
#endif
#ifndef FLASHATTN_CPU_DKV_BK
#define FLASHATTN_CPU_DKV_BK FLASHATTN_CPU_BK
#endif

// Register blocking of the micro-kernel: MR rows x NR vectors of accumulators, chosen so that
// MR*NR accumulators + NR B-vectors + 1 broadcast fit the register file (32 zmm with AVX-512,
// 32 NEON q registers on ARM64, 16 ymm/xmm otherwise) with enough independent FMA chains to hide
// latency. (6 x 4 on ARM64 follows the register count; it has not been timed on ARM hardware.)
#if defined(FLASHATTN_CPU_MR)
constexpr int MR = FLASHATTN_CPU_MR, NR = FLASHATTN_CPU_NR;
#elif FLASHATTN_CPU_VEC_BYTES >= 64 || defined(__aarch64__)
constexpr int MR = 6, NR = 4;
#else
constexpr int MR = 6, NR = 2;
#endif

// B operands are stored panel-major: the columns are cut into panels of PW = NR vectors, and each
// panel is contiguous (row k of panel p at ptr + p * bps + k * PW). The micro-kernel then streams
// one contiguous block, which the prefetchers follow and which cannot thrash an L1 set the way
// rows 512 bytes apart do (measured: O += P V from row-major V ran at 2/3 of the rate of
// S = K Q^T).
template <class T>
constexpr int64_t panel_width() {
  return NR * Simd<T>::W;
}
template <int64_t N>
constexpr bool whole_panels() {
  return N % panel_width<float>() == 0 && N % panel_width<double>() == 0;
}
static_assert(whole_panels<FLASHATTN_CPU_FWD_BQ>() && whole_panels<FLASHATTN_CPU_FWD_BK>() &&
                  whole_panels<FLASHATTN_CPU_DQ_BQ>() && whole_panels<FLASHATTN_CPU_DQ_BK>() &&
                  whole_panels<FLASHATTN_CPU_DKV_BQ>() && whole_panels<FLASHATTN_CPU_DKV_BK>(),
              "tiles must hold whole panels");

template <class T>
struct Panels {
  const T* ptr;
  int64_t bps;  // elements between consecutive panels
};

// C[m][n*W + l] (+)= sum_k A[m*ars + k*acs] * B[k*PW + n*W + l] for m < mr, n < nr.
// A is read one scalar at a time (broadcast), so any strides work and transposed operands
// (P^T, dS^T) need no explicit transpose.
template <class T, int mr, int nr, bool ACC>
void micro_kernel(int64_t K, const T* A, int64_t ars, int64_t acs, const T* B, T* C, int64_t ldc) {
  using V = typename Simd<T>::V;
  constexpr int W = Simd<T>::W;
  constexpr int64_t PW = panel_width<T>();
  V acc[mr][nr];
#pragma GCC unroll 8
  for (int m = 0; m < mr; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < nr; ++n) acc[m][n] = ACC ? vload<V>(C + m * ldc + n * W) : V{};
  const T* a[mr];
#pragma GCC unroll 8
  for (int m = 0; m < mr; ++m) a[m] = A + m * ars;
  for (int64_t k = 0; k < K; ++k) {
    V b[nr];
#pragma GCC unroll 8
    for (int n = 0; n < nr; ++n) b[n] = vload<V>(B + k * PW + n * W);
#pragma GCC unroll 8
    for (int m = 0; m < mr; ++m) {
      V av = vbroadcast<V>(a[m][k * acs]);
#pragma GCC unroll 8
      for (int n = 0; n < nr; ++n) acc[m][n] += av * b[n];
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < mr; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < nr; ++n) vstore(C + m * ldc + n * W, acc[m][n]);
}

template <class T>
using MicroFn = void (*)(int64_t, const T*, int64_t, int64_t, const T*, T*, int64_t);

template <class T, bool ACC, int... I>
struct MicroTable {
  static constexpr MicroFn<T> table[sizeof...(I)] = {
      &micro_kernel<T, I / NR + 1, I % NR + 1, ACC>...};
};
template <class T, bool ACC, int N, int... I>
struct MakeTable : MakeTable<T, ACC, N - 1, N - 1, I...> {};
template <class T, bool ACC, int... I>
struct MakeTable<T, ACC, 0, I...> {
  using type = MicroTable<T, ACC, I...>;
};

// C[M x NV*W] (+)= A[M x K] * B[K x NV*W] by micro-kernel tiles. K is split into slices of KC so
// that one B panel slice (KC x PW: 32 KiB for float32 with AVX-512) stays in a 48 KiB L1 while the
// row blocks sweep it; only D = 256 products are split.
#ifndef FLASHATTN_CPU_KC
#define FLASHATTN_CPU_KC 128
#endif
constexpr int64_t KC = FLASHATTN_CPU_KC;

template <class T, bool ACC>
void gemm(int64_t M, int64_t NV, int64_t K, const T* A, int64_t ars, int64_t acs, Panels<T> B, T* C,
          int64_t ldc) {
  constexpr int W = Simd<T>::W;
  constexpr int64_t PW = panel_width<T>();
  const auto& first = MakeTable<T, ACC, MR * NR>::type::table;
  const auto& rest = MakeTable<T, true, MR * NR>::type::table;
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += KC) {
    const int64_t kc = smin(KC, K - k0);
    const auto& table = k0 == 0 ? first : rest;
    for (int64_t n0 = 0; n0 < NV; n0 += NR) {
      const int nr = static_cast<int>(smin<int64_t>(NR, NV - n0));
      const T* Bp = B.ptr + (n0 / NR) * B.bps + k0 * PW;
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = static_cast<int>(smin<int64_t>(MR, M - m0));
        table[(mr - 1) * NR + (nr - 1)](kc, A + m0 * ars + k0 * acs, ars, acs, Bp,
                                        C + m0 * ldc + n0 * W, ldc);
      }
    }
  }
}

// Row r of a [B,H,S,D] operand.
template <class S>
inline const S* row_ptr(const In4& t, int64_t b, int64_t h, int64_t s) {
  return static_cast<const S*>(t.ptr) + b * t.sb + h * t.sh + s * t.ss;
}
template <class S>
inline S* row_ptr(const Out4& t, int64_t b, int64_t h, int64_t s) {
  return static_cast<S*>(t.ptr) + b * t.sb + h * t.sh + s * t.ss;
}

// The operand from row row0 on. A packed sequence's view (batch stride 0) starts at its first row
// in the packed tensor; row0 = 0 (every dense call) leaves the view as it is.
template <class S>
inline In4 from_row(const In4& t, int64_t row0) {
  return {static_cast<const S*>(t.ptr) + row0 * t.ss, t.sb, t.sh, t.ss};
}
template <class S>
inline Out4 from_row(const Out4& t, int64_t row0) {
  return {static_cast<S*>(t.ptr) + row0 * t.ss, t.sb, t.sh, t.ss};
}

// The K or V rows a forward task reads: an operand, or for KV-cache calls (map != nullptr) a
// cache reached through its row map (core/params.hpp: kv_offset), paged or not. The row map is
// resolved per row where the tiles are packed, so no call copies the cache.
struct KvRows {
  In4 t;
  const KvMap* map;
  // Rows of one (b, h) equally spaced by t.ss (a B operand may then be read in place): true
  // except through a page table, where a tile may span pages.
  bool strided() const { return map == nullptr || map->block_table == nullptr; }
};
template <class S>
inline const S* row_ptr(const KvRows& r, int64_t b, int64_t h, int64_t s) {
  if (r.map == nullptr) return row_ptr<S>(r.t, b, h, s);
  return static_cast<const S*>(r.t.ptr) + kv_offset(*r.map, r.t, b, h, s);
}
inline bool rows_strided(const In4&) { return true; }
inline bool rows_strided(const KvRows& r) { return r.strided(); }
inline int64_t row_stride(const In4& t) { return t.ss; }
inline int64_t row_stride(const KvRows& r) { return r.t.ss; }

// ---- work decomposition -----------------------------------------------------------------------
// Tasks over (sequence, head, block of `block` rows). Dense: batch * heads * ceil(len / block),
// task = (b * heads + h) * nblk + blk, the order every pass had before packing. Packed: sequence
// b's tasks are [first[b], first[b + 1]) in the same head-major order over its own length, from a
// prefix table built once per call; a sequence without rows has no task. The partition depends on
// the shape and the sequence lengths only, never on the threads.
struct SeqBlocks {
  int64_t heads, nblk;   // dense: blocks per (batch, head)
  const int64_t* first;  // packed: [B + 1] prefix of task counts; nullptr when dense
  int64_t count, batch;
  struct Item {
    int64_t b, h, blk, nblk;
  };
  Item at(int64_t task) const {
    if (first == nullptr) {
      const int64_t bh = task / nblk;
      return {bh / heads, bh % heads, task % nblk, nblk};
    }
    // The last b with first[b] <= task; its sequence is not empty (first[b + 1] > task).
    int64_t lo = 0, hi = batch;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (first[mid] <= task)
        lo = mid;
      else
        hi = mid;
    }
    const int64_t n = (first[lo + 1] - first[lo]) / heads, t = task - first[lo];
    return {lo, t / n, t % n, n};
  }
};

// keys: blocks over each sequence's key rows (all of them, the ones past seqused_k too, whose
// gradients must be written), else over its query rows.
inline SeqBlocks seq_blocks(const Shape& sh, const Packing& pk, int64_t heads, int64_t block, bool keys,
                            Parallel& par) {
  const int64_t len = keys ? sh.seq_kv : sh.seq_q;
  const int64_t nblk = (len + block - 1) / block;
  if (!pk.on()) return SeqBlocks{heads, nblk, nullptr, nblk * sh.batch * heads, sh.batch};
  int64_t* first = static_cast<int64_t*>(par.alloc(static_cast<size_t>(sh.batch + 1) * sizeof(int64_t)));
  const int32_t* cu = keys ? pk.cu_k : pk.cu_q;
  first[0] = 0;
  for (int64_t b = 0; b < sh.batch; ++b)
    first[b + 1] = first[b] + (int64_t{cu[b + 1]} - cu[b] + block - 1) / block * heads;
  return SeqBlocks{heads, 0, first, first[sh.batch], sh.batch};
}

// One sequence of a task: its rows in the operands, its lengths, and its mask band and ALiBi
// diagonal, both relative to its own lengths. Dense calls take the call's band as the driver built
// it (tests/test_cpu_mask_band.cpp passes arbitrary ones).
struct Seq {
  SeqSpan sp;
  MaskRule rule;
};
inline Seq seq_of(const Shape& sh, const Numerics& num, const Packing& pk, const MaskRule& call_rule, int64_t b) {
  const SeqSpan sp = seq_span(sh, pk, b);
  if (!pk.on()) return Seq{sp, call_rule};
  return Seq{sp, make_mask_rule(static_cast<int32_t>(num.mask), sp.seq_q, sp.seq_kv, num.window_left,
                                num.window_right)};
}

// Sequence b of a KV-cache call: its queries are the dense q's, its keys the first seqlen_k[b]
// rows of its cache (KvRows), the band and the ALiBi diagonal over those lengths.
inline Seq seq_of_cache(const Shape& sh, const Numerics& num, const KvMap& kv, int64_t b) {
  const SeqSpan sp{0, 0, sh.seq_q, kv.seqlen_k[b]};
  return Seq{sp, make_mask_rule(static_cast<int32_t>(num.mask), sp.seq_q, sp.seq_kv, num.window_left,
                                num.window_right)};
}

// A block of rows used as a broadcast (A) operand: its pointer and row stride.
template <class C>
struct Rows {
  const C* ptr;
  int64_t ld;
};

// Rows [row0, row0 + n) of an operand (In4 or KvRows) as an A operand (only columns < D are
// read). Equally spaced rows stored in the compute type are used in place; others (converted, or
// gathered through a page table) are copied into dst (row stride D).
template <class S, class C, class T>
Rows<C> rows_of(const T& t, int64_t b, int64_t h, int64_t row0, int64_t n, int64_t D, C* dst) {
  if constexpr (Same<S, C>::value)
    if (rows_strided(t)) return {row_ptr<S>(t, b, h, row0), row_stride(t)};
  for (int64_t r = 0; r < n; ++r) {
    const S* src = row_ptr<S>(t, b, h, row0 + r);
    for (int64_t d = 0; d < D; ++d) dst[r * D + d] = load_as<C>(src + d);
  }
  return {dst, D};
}

// Rows [row0, row0 + n) times mul, copied into dst (row stride D) as an A operand: the dQ pass's
// K with the score fold, so that its products are those of the dK/dV pass (which folds into K^T)
// bit for bit, and the fused backward's dQ equals the split one's.
template <class S, class C>
Rows<C> scaled_rows(const In4& t, int64_t b, int64_t h, int64_t row0, int64_t n, int64_t D, C mul, C* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const S* src = row_ptr<S>(t, b, h, row0 + r);
    for (int64_t d = 0; d < D; ++d) dst[r * D + d] = load_as<C>(src + d) * mul;
  }
  return {dst, D};
}

// Columns of a panel-major B operand made from D, rounded up to whole panels.
template <class C>
inline int64_t panel_cols(int64_t D) {
  return round_up(D, panel_width<C>());
}

// Rows [row0, row0 + n) of an operand (n x D) as a panel-major B operand; columns past D are 0.
template <class S, class C, class T>
Panels<C> pack_panels(const T& t, int64_t b, int64_t h, int64_t row0, int64_t n, int64_t D,
                      C* dst) {
  constexpr int64_t PW = panel_width<C>();
  const int64_t np = panel_cols<C>(D) / PW;
#ifndef FLASHATTN_CPU_PACK_STREAMS
#define FLASHATTN_CPU_PACK_STREAMS 8
#endif
  // The rows are visited as S interleaved streams (row j*len + i for i, then j) rather than in
  // order: a block of cold rows spans many 4 KiB pages, and the hardware prefetchers, which
  // stop at page boundaries, then run on several pages at once (a cold 128 x 128 float32 block
  // packed in 6-7.5 us instead of 9.4-11.4 in a micro-benchmark). The order of independent copies
  // does not change any value.
  constexpr int64_t streams = FLASHATTN_CPU_PACK_STREAMS;
  const int64_t len = (n + streams - 1) / streams;
  for (int64_t i = 0; i < len; ++i) {
    for (int64_t r = i; r < n; r += len) {
      const S* src = row_ptr<S>(t, b, h, row0 + r);
      for (int64_t p = 0; p < np; ++p) {
        C* o = dst + p * n * PW + r * PW;
        const int64_t w = smin(PW, D - p * PW);
        for (int64_t c = 0; c < w; ++c) o[c] = load_as<C>(src + p * PW + c);
        for (int64_t c = w; c < PW; ++c) o[c] = C(0);
      }
    }
  }
  return {dst, n * PW};
}

// The transpose of rows [row0, row0 + n) times mul (D x ncols, ncols a multiple of PW) as a
// panel-major B operand; columns past n are 0.
template <class S, class C>
Panels<C> pack_transposed(const In4& t, int64_t b, int64_t h, int64_t row0, int64_t n, int64_t D,
                          C mul, C* dst, int64_t ncols) {
  constexpr int64_t PW = panel_width<C>();
  for (int64_t r = 0; r < n; ++r) {
    const S* src = row_ptr<S>(t, b, h, row0 + r);
    C* o = dst + (r / PW) * D * PW + r % PW;
    for (int64_t d = 0; d < D; ++d) o[d * PW] = load_as<C>(src + d) * mul;
  }
  for (int64_t r = n; r < ncols; ++r) {
    C* o = dst + (r / PW) * D * PW + r % PW;
    for (int64_t d = 0; d < D; ++d) o[d * PW] = C(0);
  }
  return {dst, D * PW};
}

template <class C>
inline C neg_inf() {
  return -__builtin_inf();
}

// ---- mask and score transform -----------------------------------------------------------------
// Every pass visits exactly the band of core/mask.hpp: a query block [i0, i0 + nq) sweeps keys
// [key_begin(i0), key_end(i0 + nq - 1)) and a key block [j0, j0 + nk) sweeps queries
// [row_begin(j0), row_end(j0 + nk - 1)), so blocks wholly before or after the band cost nothing.
// Entries are masked one by one only in tiles that tile_inside() does not vouch for, against both
// edges of the band, so any band (a sliding window, too) needs no change here.

// T holds keys [j0, j0 + nk) in rows and queries [i0, i0 + ncols) in columns (row stride ld):
// entries outside the band become `value`: -inf for scores (the forward), 0 for P and dS (the
// backward masks after the exponential, so that neither a NaN or -inf LSE nor a NaN D of the row
// makes a hidden entry NaN). Columns past the last query are padding nobody reads.
template <class C>
void mask_key_rows(C* T, int64_t ld, const MaskRule& rule, int64_t i0, int64_t ncols, int64_t j0,
                   int64_t nk, C value = neg_inf<C>()) {
  for (int64_t r = 0; r < nk; ++r) {
    // Queries that see key j0 + r, as columns: [cb, ce), empty when ce <= cb.
    const int64_t cb = MaskRule::clamp(rule.row_begin(j0 + r) - i0, 0, ncols);
    const int64_t ce = MaskRule::clamp(rule.row_end(j0 + r, i0 + ncols) - i0, cb, ncols);
    C* row = T + r * ld;
    for (int64_t c = 0; c < cb; ++c) row[c] = value;
    for (int64_t c = ce; c < ncols; ++c) row[c] = value;
  }
}

// T holds queries [i0, i0 + nq) in rows and keys [j0, j0 + ncols) in columns: the same with the
// roles swapped.
template <class C>
void mask_query_rows(C* T, int64_t ld, const MaskRule& rule, int64_t j0, int64_t ncols, int64_t i0,
                     int64_t nq, C value = neg_inf<C>()) {
  for (int64_t r = 0; r < nq; ++r) {
    const int64_t cb = MaskRule::clamp(rule.key_begin(i0 + r) - j0, 0, ncols);
    const int64_t ce = MaskRule::clamp(rule.key_end(i0 + r, j0 + ncols) - j0, cb, ncols);
    C* row = T + r * ld;
    for (int64_t c = 0; c < cb; ++c) row[c] = value;
    for (int64_t c = ce; c < ncols; ++c) row[c] = value;
  }
}

// The score transform is folded into the packed Q (forward) or into K (the backward: K^T in the
// dK/dV pass, the K rows in the dQ pass, so that both compute the same scores) operand:
// after ScoreTransform::prescale_as<C>() every product is a log2-unit logit (float64 compute takes
// the multiplier in double: a float's rounding, up to 3e-8 of every logit, would dominate the
// float64 path's error, checked to 1e-10 against the reference).
// The backward applies grad_scale() once, in the dQ and dK epilogues.
//
// Softcap and ALiBi (core/score.hpp) are not one multiply: they need a per-entry step on the
// product tile, right after its GEMM and before the mask (so masked entries are -inf whatever the
// transform would make of them). The fold changes with them:
//   softcap c: the fold is scale / c, so a product is the tanh argument x / c, and the step makes
//     it the log2-unit logit c * log2(e) * tanh(.); the backward's per-entry factor F = 1 - tanh^2
//     multiplies dP - D (so dS o F feeds both the dQ and the dK product);
//   ALiBi only: the fold stays scale * log2(e), and the step subtracts slope * log2(e) * |i + Skv
//     - Sq - j| (no factor: a constant bias has no gradient).
// After the step a tile holds log2-unit logits, exactly what the code after the no-mods fold
// sees, so everything after it is shared. Without softcap and ALiBi no step runs at all (one test
// per tile), and the fold is the one above. Every parameter is taken in the compute type, as the
// fold is: float32 rounds them as core/score.hpp's Head does; float64 keeps them in double and
// uses libm's tanh.
template <class C>
struct ScoreMods {
  bool on;       // a per-entry step runs (softcap or ALiBi)
  bool cap;      // softcap
  C fold;        // the multiplier folded into packed Q / K^T
  C cap2;        // softcap * log2(e)
  int64_t diag;  // Skv - Sq: the ALiBi distance of (i, j) is |j - i - diag|
  Alibi alibi;

  static ScoreMods make(const Shape& s, const Numerics& n) {
    const ScoreTransform st = ScoreTransform::make(s, n);
    ScoreMods m{false, st.has_softcap(), st.template prescale_as<C>(), C(0), s.seq_kv - s.seq_q, n.alibi};
    if (m.cap) {
      const C fold = static_cast<C>(n.scale) / static_cast<C>(n.softcap);
      const C afold = fold < C(0) ? -fold : fold;
      if (afold < static_cast<C>(0x1p-80)) {
        // A softcap this far above the scores is the identity: tanh(u) = u to double precision
        // for every product below 2^40 (u < 2^-40). Folding it would take a denormal multiplier
        // (a float32 softcap near its maximum), and softcap * log2(e) could overflow.
        m.cap = false;
      } else {
        // Beyond 2^64 tanh is +-1 for every product that is not ~0 (and the logit, at most the
        // softcap < scale * 2^-64, is nothing either way); a larger fold could overflow the
        // products or make 0 * inf = NaN (a denormal softcap).
        const C lim = static_cast<C>(0x1p64);
        m.fold = afold > lim ? (fold < C(0) ? -lim : lim) : fold;
        m.cap2 = static_cast<C>(n.softcap) * static_cast<C>(kLog2e);
      }
    }
    m.on = m.cap || st.has_alibi();
    return m;
  }
  // The transform of one sequence: ALiBi's diagonal is its own Skv - Sq (packed calls).
  ScoreMods of_seq(const SeqSpan& sp) const {
    ScoreMods m = *this;
    m.diag = sp.seq_kv - sp.seq_q;
    return m;
  }
  // The ALiBi slope of (batch b, query head h) in log2 units; 0 without ALiBi.
  C slope2(int64_t b, int64_t h) const {
    if (alibi.slopes == nullptr) return C(0);
    return static_cast<C>(alibi.slopes[b * alibi.sb + h * alibi.sh]) * static_cast<C>(kLog2e);
  }
};

// Lanes 0, 1, ..., W-1: the column offsets within one vector.
template <class V, class C>
inline V lane_index() {
  V r;
  for (int l = 0; l < static_cast<int>(sizeof(V) / sizeof(C)); ++l) r[l] = static_cast<C>(l);
  return r;
}

// The per-entry step on rows [0, nrows) x columns [0, ncols) of tile T (row stride ld; ncols a
// multiple of W). KEY_ROWS: rows are keys j0 + r and columns queries i0 + c (S^T of the forward
// and the dQ pass); else rows are queries i0 + r and columns keys j0 + c (S of the dK/dV pass).
// GRAD (softcap only): dP of the same layout becomes (dP - D) * F, D per query (dl: per column
// when KEY_ROWS, per row otherwise).
// SMALL: every |product| of the tile is below kTanhSmall (tanhv would take its small-argument
// form for each).
template <class C, bool CAP, bool ALIBI, bool KEY_ROWS, bool GRAD, bool SMALL = false>
void score_step_tile(C* T, int64_t ld, int64_t nrows, int64_t ncols, const ScoreMods<C>& m, C slope2,
                     int64_t i0, int64_t j0, C* dP, const C* dl) {
  using V = typename Simd<C>::V;
  constexpr int W = Simd<C>::W;
  const V lanes = lane_index<V, C>(), one = vbroadcast<V>(C(1)), cap2 = vbroadcast<V>(m.cap2),
          s2 = vbroadcast<V>(slope2);
  for (int64_t r = 0; r < nrows; ++r) {
    // j - i - diag at column 0; along the row it falls (KEY_ROWS: i grows) or rises (j grows).
    const C base = static_cast<C>(KEY_ROWS ? j0 + r - i0 - m.diag : j0 - (i0 + r) - m.diag);
    C* row = T + r * ld;
    C* drow = GRAD ? dP + r * ld : nullptr;
    for (int64_t c0 = 0; c0 < ncols; c0 += W) {
      const V s = vload<V>(row + c0);
      V x = s, f = one;
      if constexpr (CAP) {
        const V t = SMALL ? tanhv_small(s) : tanhv(s);
        x = cap2 * t;
        f = one - t * t;
      }
      if constexpr (ALIBI) {
        const V col = lanes + static_cast<C>(c0);
        const V d = KEY_ROWS ? vbroadcast<V>(base) - col : vbroadcast<V>(base) + col;
        x = x - s2 * vabs(d);
      }
      vstore(row + c0, x);
      if constexpr (GRAD) {
        const V dlv = KEY_ROWS ? vload<V>(dl + c0) : vbroadcast<V>(dl[r]);
        vstore(drow + c0, (vload<V>(drow + c0) - dlv) * f);
      }
    }
  }
}

// Dispatches the tile step on the call's transform (once per tile). dP == nullptr: no gradient
// factor (the forward, the float64 LSE pass, and the backward without a softcap, where F = 1).
template <class C, bool KEY_ROWS, bool SMALL>
void score_step_cap(C* T, int64_t ld, int64_t nrows, int64_t ncols, const ScoreMods<C>& m, C slope2,
                    int64_t i0, int64_t j0, C* dP, const C* dl) {
  const bool alibi = slope2 != C(0);
  if (dP != nullptr) {
    if (alibi)
      score_step_tile<C, true, true, KEY_ROWS, true, SMALL>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
    else
      score_step_tile<C, true, false, KEY_ROWS, true, SMALL>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
  } else {
    if (alibi)
      score_step_tile<C, true, true, KEY_ROWS, false, SMALL>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
    else
      score_step_tile<C, true, false, KEY_ROWS, false, SMALL>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
  }
}

// Whether every |entry| of rows [0, nrows) x columns [0, ncols) is below kTanhSmall (a NaN may
// pass unseen: both forms give NaN for it).
template <class C>
bool tile_below_tanh_switch(const C* T, int64_t ld, int64_t nrows, int64_t ncols) {
  using V = typename Simd<C>::V;
  constexpr int W = Simd<C>::W;
  V amax = V{};
  for (int64_t r = 0; r < nrows; ++r)
    for (int64_t c0 = 0; c0 < ncols; c0 += W) amax = vmax(amax, vabs(vload<V>(T + r * ld + c0)));
  bool small = true;
  for (int l = 0; l < W; ++l) small &= amax[l] < static_cast<C>(kTanhSmall);
  return small;
}

template <class C, bool KEY_ROWS>
void score_step(C* T, int64_t ld, int64_t nrows, int64_t ncols, const ScoreMods<C>& m, C slope2,
                int64_t i0, int64_t j0, C* dP = nullptr, const C* dl = nullptr) {
  if (m.cap) {
    // float32: one pass for the tile's largest |product| picks the cheap form of tanh when it is
    // the form every entry would take anyway (measured: softcap 30's forward overhead 23% -> 9%
    // at D = 64). It depends on the data only, never on threads. (float64 has one form.)
    if (Same<C, float>::value && tile_below_tanh_switch(T, ld, nrows, ncols))
      score_step_cap<C, KEY_ROWS, true>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
    else
      score_step_cap<C, KEY_ROWS, false>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
  } else if (slope2 != C(0)) {
    score_step_tile<C, false, true, KEY_ROWS, false>(T, ld, nrows, ncols, m, slope2, i0, j0, dP, dl);
  }
}

// Carves 64-byte aligned buffers out of one scratch block; `bytes()` sizes the block.
template <class C>
struct Carve {
  C* base;
  int64_t off = 0;
  C* take(int64_t n) {
    C* p = base ? base + off : nullptr;
    off += round_up(n, 64 / static_cast<int64_t>(sizeof(C)));
    return p;
  }
  size_t bytes() const { return static_cast<size_t>(off) * sizeof(C); }
  // n doubles (64-byte aligned like every slice) from a scratch of C.
  double* take_doubles(int64_t n) { return reinterpret_cast<double*>(take(n * static_cast<int64_t>(sizeof(double) / sizeof(C)))); }
};

// ---- forward ----------------------------------------------------------------------------------
// One task = one (batch, query head, query block). S is computed transposed (S^T = K Q^T, keys
// in rows, queries across vector lanes) so the row maximum, row sum and rescale factors of the
// online softmax are plain vector operations without horizontal reductions, and P^T is exactly
// the broadcast operand O += P V wants.
template <class S>
struct Forward {
  using C = typename ComputeOf<S>::type;
  using V = typename Simd<C>::V;
  static constexpr int W = Simd<C>::W;
  static constexpr int64_t BQ = FLASHATTN_CPU_FWD_BQ, BK = FLASHATTN_CPU_FWD_BK;

  // o: one key tile's P V (C); od, l: the running O and row sum in double. Summed key by key in
  // float32 across a whole row, O and l lose digits as they outgrow their terms (n equal terms:
  // ~n * 2^-24 relative, 1e-2 at 1M keys); here each tile's BK-term sums stay in C and the sums
  // over tiles in double, so the error is that of BK terms at any length (~1e-6 relative).
  // Per query block: qt, m, l, od; shared by the task's blocks: krows, vp, st, o (used by one
  // block at a time).
  struct Tiles {
    C *qt, *krows, *vp, *st, *o, *m;
    double *l, *od;
  };
  // A task's query blocks: 1, or 2 (PAIR) where the call has enough blocks to keep every thread
  // busy in pairs: the two blocks of a pair then share each key tile's K rows and V panels - a
  // tile packed once for both (packing V's tile into panels is ~10% of a block's time at D 128,
  // repeated by every query block of a head). Each block's arithmetic and tile boundaries are
  // those of a task of its own, so the result bits do not depend on the pairing.
  static constexpr int PAIR = 2;
  static Tiles carve(Carve<C>& cv, int64_t D, Tiles* second = nullptr) {
    const int64_t Dp = round_up(D, W);
    Tiles t;
    t.qt = cv.take(D * BQ);
    t.krows = cv.take(BK * D);
    t.vp = cv.take(BK * panel_cols<C>(D));
    t.st = cv.take(BK * BQ);
    t.o = cv.take(BQ * Dp);
    t.m = cv.take(BQ);
    t.l = cv.take_doubles(BQ);
    t.od = cv.take_doubles(BQ * Dp);
    if (second != nullptr) {
      *second = t;
      second->qt = cv.take(D * BQ);
      second->m = cv.take(BQ);
      second->l = cv.take_doubles(BQ);
      second->od = cv.take_doubles(BQ * Dp);
    }
    return t;
  }

  struct Ctx {
    const ForwardParams* p;
    MaskRule rule;
    ScoreMods<C> mods;
    SeqBlocks tasks;  // over blocks of pair * BQ query rows
    int pair;         // query blocks per task (1 or PAIR)
  };

  // One query block's state through the key loop.
  struct Block {
    int64_t i0, nq, nqv, kbegin, kend;
    Panels<C> QT;
    C* mrow;
    double *lrow, *O;
  };

  static void task(const void* vctx, int64_t task, void* scratch) {
    const Ctx& ctx = *static_cast<const Ctx*>(vctx);
    const ForwardParams& p = *ctx.p;
    const Shape& sh = p.shape;
    // Head-major order: the two threads work on neighbouring query blocks of one head, so they
    // stream the same K/V blocks (shared in L3) instead of two different heads' (measured +1 to
    // +5 points of the sgemm ratio). Within a head, causal blocks late in the sequence cost the
    // most: they go first.
    const SeqBlocks::Item it = ctx.tasks.at(task);
    const int64_t b = it.b, h = it.h;
    const Seq seq = p.kv.on() ? seq_of_cache(sh, p.num, p.kv, b) : seq_of(sh, p.num, p.packing, ctx.rule, b);
    const MaskRule& rule = seq.rule;
    const ScoreMods<C> mods = ctx.mods.of_seq(seq.sp);
    const In4 q = from_row<S>(p.q, seq.sp.q0);
    const KvRows k{from_row<S>(p.k, seq.sp.k0), p.kv.on() ? &p.kv : nullptr},
        v{from_row<S>(p.v, seq.sp.k0), p.kv.on() ? &p.kv : nullptr};
    const Out4 outv = from_row<S>(p.out, seq.sp.q0);
    const int64_t D = sh.head_dim, Sq = seq.sp.seq_q, Skv = seq.sp.seq_kv, Dp = round_up(D, W);
    const int64_t hk = h / (sh.heads_q / sh.heads_kv);
    // The task's query blocks, latest first: task blk of nblk covers blocks nb - 1 - pair * blk
    // and below (nb = the sequence's blocks of BQ rows).
    const int64_t nb = (Sq + BQ - 1) / BQ, top = nb - 1 - ctx.pair * it.blk;
    const int nblocks = static_cast<int>(smin<int64_t>(ctx.pair, top + 1));
    Carve<C> cv{static_cast<C*>(scratch)};
    Tiles tiles[PAIR];
    tiles[0] = carve(cv, D, ctx.pair > 1 ? &tiles[1] : nullptr);
    C *ST = tiles[0].st, *T = tiles[0].o;
    const C slope2 = mods.slope2(b, h);
    Block blk[PAIR];
    for (int x = 0; x < nblocks; ++x) {
      Block& bl = blk[x];
      const Tiles& t = tiles[x];
      bl.i0 = (top - x) * BQ;
      bl.nq = smin(BQ, Sq - bl.i0);
      // The query columns the products and the softmax cover: the block's rows up to whole
      // vectors (one for a decode step's single row) and then up to the softmax's strip count (a
      // power of two), instead of the whole tile: a short sequence or a last block pays for its
      // rows. Each column's arithmetic is that of the full-width tile, so results do not change.
      bl.nqv = strip_count(bl.nq) * W;
      bl.QT = pack_transposed<S, C>(q, b, h, bl.i0, bl.nq, D, mods.fold, t.qt, round_up(bl.nqv, panel_width<C>()));
      bl.mrow = t.m;
      bl.lrow = t.l;
      bl.O = t.od;
      for (int64_t i = 0; i < bl.nqv * Dp; ++i) bl.O[i] = 0.0;
      for (int64_t c = 0; c < BQ; ++c) {
        bl.mrow[c] = neg_inf<C>();
        bl.lrow[c] = 0.0;
      }
      // An empty range (every row of the block sees no key) runs no step: the epilogue writes
      // O = 0, LSE = -inf.
      bl.kbegin = rule.key_begin(bl.i0);
      bl.kend = rule.key_end(bl.i0 + bl.nq - 1, Skv);
    }
    // One key tile of block bl (keys [j0, j0 + nk)), K and V already in K / Vp.
    auto step = [&](Block& bl, int64_t j0, int64_t nk, const Rows<C>& K, const Panels<C>& Vp) {
      gemm<C, false>(nk, bl.nqv / W, D, K.ptr, K.ld, 1, bl.QT, ST, BQ);  // S^T = K Q^T
      if (mods.on) score_step<C, true>(ST, BQ, nk, bl.nqv, mods, slope2, bl.i0, j0);
      if (!rule.tile_inside(bl.i0, bl.i0 + bl.nq, j0, j0 + nk)) mask_key_rows(ST, BQ, rule, bl.i0, bl.nqv, j0, nk);
      online_softmax(ST, nk, bl.mrow, bl.lrow, bl.O, Dp, bl.nqv / W);
      gemm<C, false>(bl.nq, Dp / W, nk, ST, 1, BQ, Vp, T, Dp);  // T = P V, P^T read in place
      for (int64_t i = 0; i < bl.nq * Dp; ++i) bl.O[i] += static_cast<double>(T[i]);  // O += T
    };
    // The key tiles of blocks [x0, x1) together, each tile's K rows and V panels copied once for
    // all of them (each block steps through its own range, so its tiles are those of a walk of
    // its own when the blocks' first keys are a whole number of tiles apart).
    auto walk = [&](int x0, int x1) {
      int64_t j_first = blk[x0].kbegin, j_end = blk[x0].kend;
      for (int x = x0 + 1; x < x1; ++x) {
        j_first = smin(j_first, blk[x].kbegin);
        j_end = smax(j_end, blk[x].kend);
      }
      for (int64_t j0 = j_first; j0 < j_end; j0 += BK) {
        const int64_t nk = smin(BK, j_end - j0);
        const Rows<C> K = rows_of<S, C>(k, b, hk, j0, nk, D, tiles[0].krows);
        const Panels<C> Vp = pack_panels<S, C>(v, b, hk, j0, nk, D, tiles[0].vp);
        for (int x = x0; x < x1; ++x)
          if (j0 >= blk[x].kbegin && j0 < blk[x].kend) step(blk[x], j0, smin(BK, blk[x].kend - j0), K, Vp);
      }
    };
    // Two blocks whose key tiles start in step (tile boundaries at the same keys: no mask,
    // causal; not a window's, whose first key moves with the rows) share each tile's copies;
    // otherwise each block walks its own tiles.
    if (nblocks == 2 && blk[0].kbegin < blk[0].kend && blk[1].kbegin < blk[1].kend &&
        (blk[0].kbegin - blk[1].kbegin) % BK == 0) {
      walk(0, 2);
    } else {
      for (int x = 0; x < nblocks; ++x) walk(x, x + 1);
    }

    // Epilogue: O / l and LSE = (m + log2 l) * ln 2, in IEEE arithmetic: a NaN score leaves l NaN
    // (exp2 of it is NaN whatever the max saw), a +inf score too (exp2(inf - inf)), and visible
    // scores that are all -inf leave l = 0 (O = 0/0 = NaN, LSE = -inf). Only rows that see no key
    // by the band are empty (decided once per row, never from l): O = 0, LSE = -inf, even where a
    // NaN in a value row shares the tile (their P is 0, and 0 * NaN is NaN).
    float* lse = p.lse.ptr + b * p.lse.sb + h * p.lse.sh + seq.sp.q0 * p.lse.ss;
    for (int x = 0; x < nblocks; ++x) {
      const Block& bl = blk[x];
      for (int64_t c = 0; c < bl.nq; ++c) {
        S* out = row_ptr<S>(outv, b, h, bl.i0 + c);
        const double l = bl.lrow[c];
        if (rule.row_sees_keys(bl.i0 + c, Skv)) {
          const double inv = 1.0 / l;
          for (int64_t d = 0; d < D; ++d) store_as<C>(out + d, static_cast<C>(bl.O[c * Dp + d] * inv));
          const double v2 = (static_cast<double>(bl.mrow[c]) + __builtin_log2(l)) * kLn2;
          lse[(bl.i0 + c) * p.lse.ss] = static_cast<float>(v2);
        } else {
          for (int64_t d = 0; d < D; ++d) store_as<C>(out + d, C(0));
          lse[(bl.i0 + c) * p.lse.ss] = -__builtin_inff();
        }
      }
    }
  }

  // ST [nk x BQ] holds scores (log2 units) on entry and P^T = exp2(S - m_new) on exit; the
  // running max m, sum l and the accumulator O rows are rescaled by exp2(m_old - m_new) (l and O
  // in double: see Tiles).
  // Only the first ns column strips are read and updated, ns a power of two up to BQ / W (see
  // strip_count); each a compile-time count, so the strips' chains stay in registers.
  static void online_softmax(C* ST, int64_t nk, C* mrow, double* lrow, double* O, int64_t Dp, int64_t ns = BQ / W) {
    switch (ns) {
      case 1: return softmax_strips<1>(ST, nk, mrow, lrow, O, Dp);
      case 2: if constexpr (BQ / W >= 2) return softmax_strips<2>(ST, nk, mrow, lrow, O, Dp); break;
      case 4: if constexpr (BQ / W >= 4) return softmax_strips<4>(ST, nk, mrow, lrow, O, Dp); break;
      case 8: if constexpr (BQ / W >= 8) return softmax_strips<8>(ST, nk, mrow, lrow, O, Dp); break;
      case 16: if constexpr (BQ / W >= 16) return softmax_strips<16>(ST, nk, mrow, lrow, O, Dp); break;
      case 32: if constexpr (BQ / W >= 32) return softmax_strips<32>(ST, nk, mrow, lrow, O, Dp); break;
      case 64: if constexpr (BQ / W >= 64) return softmax_strips<64>(ST, nk, mrow, lrow, O, Dp); break;
      default: break;
    }
    softmax_strips<BQ / W>(ST, nk, mrow, lrow, O, Dp);  // the whole tile
  }
  // The strips a block of nq query rows needs: nq / W rounded up to a power of two (the counts
  // online_softmax instantiates), at most the tile's BQ / W (which need not be a power of two).
  static int64_t strip_count(int64_t nq) {
    int64_t ns = 1;
    while (ns * W < nq && ns < BQ / W) ns *= 2;
    return ns < BQ / W ? ns : BQ / W;
  }
  template <int64_t NS>
  static void softmax_strips(C* ST, int64_t nk, C* mrow, double* lrow, double* O, int64_t Dp) {
    // Rows outer, the BQ / W column strips inner: the strips' running maxima and sums are
    // independent chains (a single vmaxps chain down 128 rows was latency-bound: 4 cycles a row),
    // and each row of ST is read contiguously. Per column the operations and their order are
    // those of a column-by-column loop.
    const int64_t ns = NS;
    V mnew[NS], muse[NS], sum[NS];
    for (int64_t s = 0; s < ns; ++s) mnew[s] = vload<V>(mrow + s * W);
    for (int64_t r = 0; r < nk; ++r)
      for (int64_t s = 0; s < ns; ++s) mnew[s] = vmax(mnew[s], vload<V>(ST + r * BQ + s * W));
    alignas(64) C alpha[BQ];
    const V ninf = vbroadcast<V>(neg_inf<C>());
    for (int64_t s = 0; s < ns; ++s) {
      // A column that has seen only masked keys keeps m = -inf; subtracting 0 instead keeps
      // exp2(-inf - m) = 0 rather than NaN.
      muse[s] = mnew[s] == ninf ? V{} : mnew[s];
      vstore(alpha + s * W, exp2v(vload<V>(mrow + s * W) - muse[s]));
      sum[s] = V{};
    }
    for (int64_t r = 0; r < nk; ++r)
      for (int64_t s = 0; s < ns; ++s) {
        V e = exp2v(vload<V>(ST + r * BQ + s * W) - muse[s]);
        vstore(ST + r * BQ + s * W, e);
        sum[s] += e;
      }
    alignas(64) C tsum[BQ];
    for (int64_t s = 0; s < ns; ++s) {
      vstore(tsum + s * W, sum[s]);
      vstore(mrow + s * W, mnew[s]);
    }
    for (int64_t c = 0; c < ns * W; ++c)
      lrow[c] = lrow[c] * static_cast<double>(alpha[c]) + static_cast<double>(tsum[c]);
    if (O == nullptr) return;  // row statistics only (float64 backward's LSE pass)
    for (int64_t c = 0; c < ns * W; ++c) {
      // Once the running maximum settles most rows keep alpha = 1: skipping them is exact.
      if (alpha[c] == C(1)) continue;
      const double a = alpha[c];
      for (int64_t d = 0; d < Dp; ++d) O[c * Dp + d] *= a;
    }
  }

  static void run(const ForwardParams& p, const MaskRule& rule, Parallel& par) {
    const Shape& sh = p.shape;
    // Pairs where the call has at least 8 single blocks per thread (the pairs then still leave
    // every thread 4 tasks to balance); the pairing changes no bit.
    const SeqBlocks single = seq_blocks(sh, p.packing, sh.heads_q, BQ, false, par);
    const int pair = single.count >= 8 * static_cast<int64_t>(par.threads()) ? PAIR : 1;
    Carve<C> cv{nullptr};
    Tiles second;
    carve(cv, sh.head_dim, pair > 1 ? &second : nullptr);
    const Ctx ctx{&p, rule, ScoreMods<C>::make(sh, p.num),
                  pair > 1 ? seq_blocks(sh, p.packing, sh.heads_q, pair * BQ, false, par) : single, pair};
    par.run(ctx.tasks.count, cv.bytes(), &task, &ctx);
  }
};

// ---- backward ---------------------------------------------------------------------------------
template <class S>
struct Backward {
  using C = typename ComputeOf<S>::type;
  using V = typename Simd<C>::V;
  static constexpr int W = Simd<C>::W;

  struct Ctx {
    const BackwardParams* p;
    MaskRule rule;
    ScoreTransform st;
    ScoreMods<C> mods;
    C* delta;       // D = rowsum(dO * O), [B, Hq, Sq] contiguous ([Hq, total_q] when packed)
    const C* lse2;  // float64 only: LSE recomputed in double, log2 units, as delta; else null
    int64_t stat_b, stat_h;  // strides of delta and lse2 (packed: 0 and total_q)
    SeqBlocks dq_tasks, dkv_tasks;
    // Where row 0 of (b, h) of a sequence starting at query row q0 lies in delta and lse2.
    int64_t stat(int64_t b, int64_t h, int64_t q0) const { return b * stat_b + h * stat_h + q0; }
  };

  // float64 only: the row LSE recomputed in double (the forward's row statistics without the PV
  // product). The LSE the API carries is float32; used as is it would limit float64 gradients to
  // about 1e-7 relative error, 1e-5 with large scores, which is too coarse for gradient checks.
  struct LseCtx {
    const Ctx* ctx;
    C* out;
    SeqBlocks tasks;
  };
  static void lse_task(const void* vctx, int64_t task, void* scratch) {
    using F = Forward<S>;
    constexpr int64_t BQ = F::BQ, BK = F::BK;
    const LseCtx& lc = *static_cast<const LseCtx*>(vctx);
    const BackwardParams& p = *lc.ctx->p;
    const Shape& sh = p.shape;
    const SeqBlocks::Item it = lc.tasks.at(task);
    const int64_t qb = it.nblk - 1 - it.blk, b = it.b, h = it.h;
    const Seq seq = seq_of(sh, p.num, p.packing, lc.ctx->rule, b);
    const MaskRule& rule = seq.rule;
    const ScoreMods<C> mods = lc.ctx->mods.of_seq(seq.sp);
    const In4 q = from_row<S>(p.q, seq.sp.q0), k = from_row<S>(p.k, seq.sp.k0);
    const int64_t D = sh.head_dim, Sq = seq.sp.seq_q, Skv = seq.sp.seq_kv;
    const int64_t hk = h / (sh.heads_q / sh.heads_kv);
    const int64_t i0 = qb * BQ, nq = smin(BQ, Sq - i0);
    Carve<C> cv{static_cast<C*>(scratch)};
    const typename F::Tiles t = F::carve(cv, D);
    const Panels<C> QT = pack_transposed<S, C>(q, b, h, i0, nq, D, mods.fold, t.qt, BQ);
    const C slope2 = mods.slope2(b, h);
    for (int64_t c = 0; c < BQ; ++c) {
      t.m[c] = neg_inf<C>();
      t.l[c] = 0.0;
    }
    // The forward's key sweep and masking, without the PV product.
    const int64_t kbegin = rule.key_begin(i0), kend = rule.key_end(i0 + nq - 1, Skv);
    for (int64_t j0 = kbegin; j0 < kend; j0 += BK) {
      const int64_t nk = smin(BK, kend - j0);
      const Rows<C> K = rows_of<S, C>(k, b, hk, j0, nk, D, t.krows);
      gemm<C, false>(nk, BQ / W, D, K.ptr, K.ld, 1, QT, t.st, BQ);
      if (mods.on) score_step<C, true>(t.st, BQ, nk, BQ, mods, slope2, i0, j0);
      if (!rule.tile_inside(i0, i0 + nq, j0, j0 + nk))
        mask_key_rows(t.st, BQ, rule, i0, BQ, j0, nk);
      F::online_softmax(t.st, nk, t.m, t.l, nullptr, 0);
    }
    // As the forward's LSE (NaN, or -inf for visible scores all -inf, propagate); an empty row's
    // value is never used (its every entry is masked after the exponential).
    C* out = lc.out + lc.ctx->stat(b, h, seq.sp.q0);
    for (int64_t c = 0; c < nq; ++c)
      out[i0 + c] = t.m[c] + static_cast<C>(__builtin_log2(t.l[c]));
  }

  // D preprocess: one task per (batch or sequence, query head).
  static void delta_task(const void* vctx, int64_t task, void*) {
    const Ctx& ctx = *static_cast<const Ctx*>(vctx);
    const BackwardParams& p = *ctx.p;
    const Shape& sh = p.shape;
    const int64_t b = task / sh.heads_q, h = task % sh.heads_q;
    const SeqSpan sp = seq_span(sh, p.packing, b);
    const In4 out = from_row<S>(p.out, sp.q0), dout = from_row<S>(p.dout, sp.q0);
    C* dst = ctx.delta + ctx.stat(b, h, sp.q0);
    for (int64_t i = 0; i < sp.seq_q; ++i) {
      const S* o = row_ptr<S>(out, b, h, i);
      const S* g = row_ptr<S>(dout, b, h, i);
      C acc = C(0);
      for (int64_t d = 0; d < sh.head_dim; ++d) acc += load_as<C>(o + d) * load_as<C>(g + d);
      dst[i] = acc;
    }
  }

  // LSE of row i in log2 units (row i of the sequence that starts at query row q0), as the
  // forward gave it: NaN and -inf stay what they are, so that P = exp2(S - lse) of a visible entry
  // is what IEEE arithmetic makes of them (a row whose visible scores were all -inf: -inf + inf =
  // NaN). Masked entries, and with them every entry of an empty row, are set to P = dS = 0 after
  // the exponential (mask_key_rows / mask_query_rows with 0), whatever lse is.
  static C lse2_of(const Ctx& ctx, int64_t b, int64_t h, int64_t q0, int64_t i) {
    const BackwardParams& p = *ctx.p;
    if (ctx.lse2) return ctx.lse2[ctx.stat(b, h, q0) + i];
    const float v = p.lse.ptr[b * p.lse.sb + h * p.lse.sh + (q0 + i) * p.lse.ss];
    return static_cast<C>(v) * static_cast<C>(kLog2e);
  }

  // The key rows of sequence b whose dK / dV the backward writes: all of them, also those packed
  // past seqused_k (attended by nobody: dK = dV = 0), where Skv counts the used ones.
  static int64_t key_rows(const BackwardParams& p, int64_t b, int64_t Skv) {
    return p.packing.on() ? int64_t{p.packing.cu_k[b + 1]} - p.packing.cu_k[b] : Skv;
  }
  // One row of dQ from its accumulator: times the gradient scale, or exactly 0 for a row without
  // keys (its dS is 0, but 0 times a NaN or inf in a K row that shares the tile would still be NaN).
  static void store_dq_row(S* dst, const C* acc, int64_t D, bool seen, C gs) {
    for (int64_t d = 0; d < D; ++d) store_as<C>(dst + d, seen ? acc[d] * gs : C(0));
  }

  // ---- dQ pass: one task = one (batch, query head, query block); keys stream through. ----
  struct Dq {
    static constexpr int64_t BQ = FLASHATTN_CPU_DQ_BQ, BK = FLASHATTN_CPU_DQ_BK;
    struct DqTiles {
      C *qt, *dot, *krows, *kp, *vrows, *st, *dpt, *dq, *lse2, *dlt;
    };
    static DqTiles dq_carve(Carve<C>& cv, int64_t D) {
      const int64_t Dp = round_up(D, W);
      DqTiles t;
      t.qt = cv.take(D * BQ);
      t.dot = cv.take(D * BQ);
      t.krows = cv.take(BK * D);
      t.kp = cv.take(BK * panel_cols<C>(D));
      t.vrows = cv.take(BK * D);
      t.st = cv.take(BK * BQ);
      t.dpt = cv.take(BK * BQ);
      t.dq = cv.take(BQ * Dp);
      t.lse2 = cv.take(BQ);
      t.dlt = cv.take(BQ);
      return t;
    }

    static void dq_task(const Ctx& ctx, int64_t task, void* scratch) {
      const BackwardParams& p = *ctx.p;
      const Shape& sh = p.shape;
      const SeqBlocks::Item it = ctx.dq_tasks.at(task);
      const int64_t qb = it.nblk - 1 - it.blk, b = it.b, h = it.h;  // head-major, as the forward
      const Seq seq = seq_of(sh, p.num, p.packing, ctx.rule, b);
      const MaskRule& rule = seq.rule;
      const ScoreMods<C> mods = ctx.mods.of_seq(seq.sp);
      const int64_t q0 = seq.sp.q0;
      const In4 q = from_row<S>(p.q, q0), dout = from_row<S>(p.dout, q0);
      const In4 k = from_row<S>(p.k, seq.sp.k0), v = from_row<S>(p.v, seq.sp.k0);
      const Out4 dqv = from_row<S>(p.dq, q0);
      const int64_t D = sh.head_dim, Sq = seq.sp.seq_q, Skv = seq.sp.seq_kv, Dp = round_up(D, W);
      const int64_t hk = h / (sh.heads_q / sh.heads_kv);
      const int64_t i0 = qb * BQ, nq = smin(BQ, Sq - i0);
      // The query columns the products cover: the block's rows up to whole panels (a short block -
      // a short sequence's, or the last - computes no padding beyond them). ST and dPT keep their
      // row stride BQ.
      const int64_t NQ = round_up(nq, panel_width<C>());
      Carve<C> cv{static_cast<C*>(scratch)};
      const DqTiles t = dq_carve(cv, D);
      C *ST = t.st, *dPT = t.dpt, *dQ = t.dq, *lse2 = t.lse2, *dlt = t.dlt;

      // (The score fold goes into K, not Q^T: see scaled_rows.)
      const Panels<C> QT = pack_transposed<S, C>(q, b, h, i0, nq, D, C(1), t.qt, NQ);
      const Panels<C> dOT = pack_transposed<S, C>(dout, b, h, i0, nq, D, C(1), t.dot, NQ);
      const C slope2 = mods.slope2(b, h);
      const C* delta = ctx.delta + ctx.stat(b, h, q0);
      for (int64_t c = 0; c < NQ; ++c) {
        // Padding columns get P = 0 (lse2 = +inf) so they stay finite.
        lse2[c] = c < nq ? lse2_of(ctx, b, h, q0, i0 + c) : static_cast<C>(__builtin_inf());
        dlt[c] = c < nq ? delta[i0 + c] : C(0);
      }
      for (int64_t i = 0; i < nq * Dp; ++i) dQ[i] = C(0);

      // The forward's key range: rows without a visible key have P = dS = 0 (masked) and dQ = 0.
      const int64_t kbegin = rule.key_begin(i0), kend = rule.key_end(i0 + nq - 1, Skv);
      for (int64_t j0 = kbegin; j0 < kend; j0 += BK) {
        const int64_t nk = smin(BK, kend - j0);
        const Rows<C> K = scaled_rows<S, C>(k, b, hk, j0, nk, D, mods.fold, t.krows);
        const Rows<C> Vr = rows_of<S, C>(v, b, hk, j0, nk, D, t.vrows);
        const Panels<C> Kp = pack_panels<S, C>(k, b, hk, j0, nk, D, t.kp);
        gemm<C, false>(nk, NQ / W, D, K.ptr, K.ld, 1, QT, ST, BQ);      // S^T = K Q^T
        gemm<C, false>(nk, NQ / W, D, Vr.ptr, Vr.ld, 1, dOT, dPT, BQ);  // dP^T = V dO^T
        // Under a softcap the step leaves (dP - D) o F in dPT.
        if (mods.on)
          score_step<C, true>(ST, BQ, nk, NQ, mods, slope2, i0, j0, mods.cap ? dPT : nullptr, dlt);
        if (mods.cap) {
          for (int64_t r = 0; r < nk; ++r)
            for (int64_t c0 = 0; c0 < NQ; c0 += W) {
              V pv = exp2v<true>(vload<V>(ST + r * BQ + c0) - vload<V>(lse2 + c0));
              vstore(ST + r * BQ + c0, pv * vload<V>(dPT + r * BQ + c0));
            }
        } else {
          for (int64_t r = 0; r < nk; ++r) {
            for (int64_t c0 = 0; c0 < NQ; c0 += W) {
              V pv = exp2v<true>(vload<V>(ST + r * BQ + c0) - vload<V>(lse2 + c0));
              V ds = pv * (vload<V>(dPT + r * BQ + c0) - vload<V>(dlt + c0));
              vstore(ST + r * BQ + c0, ds);
            }
          }
        }
        // Hidden entries: dS = 0 (after the exponential: see mask_key_rows).
        if (!rule.tile_inside(i0, i0 + nq, j0, j0 + nk))
          mask_key_rows(ST, BQ, rule, i0, NQ, j0, nk, C(0));
        gemm<C, true>(nq, Dp / W, nk, ST, 1, BQ, Kp, dQ, Dp);  // dQ += dS K, dS^T read in place
      }
      const C gs = static_cast<C>(ctx.st.grad_scale());
      for (int64_t c = 0; c < nq; ++c)
        store_dq_row(row_ptr<S>(dqv, b, h, i0 + c), dQ + c * Dp, D, rule.row_sees_keys(i0 + c, Skv), gs);
    }
  };

  // ---- dK/dV pass: one task = one (batch, kv head, key block); every query head of the kv
  // group and every query block that sees the keys stream through, so dK and dV are summed over
  // the group inside one task, in a fixed order, without atomics. ----
  struct Dkv {
    static constexpr int64_t BQ = FLASHATTN_CPU_DKV_BQ, BK = FLASHATTN_CPU_DKV_BK;
    struct DkvTiles {
      C *kt, *vt, *kp, *qrows, *qp, *dorows, *dop, *s, *dp, *dk, *dv, *lse2, *dlt;
    };
    // fused: also K as a B operand (the fused backward's dQ += dS K).
    static DkvTiles dkv_carve(Carve<C>& cv, int64_t D, bool fused) {
      const int64_t Dp = round_up(D, W);
      DkvTiles t;
      t.kt = cv.take(D * BK);
      t.vt = cv.take(D * BK);
      t.kp = fused ? cv.take(BK * panel_cols<C>(D)) : nullptr;
      t.qrows = cv.take(BQ * D);
      t.qp = cv.take(BQ * panel_cols<C>(D));
      t.dorows = cv.take(BQ * D);
      t.dop = cv.take(BQ * panel_cols<C>(D));
      t.s = cv.take(BQ * BK);
      t.dp = cv.take(BQ * BK);
      t.dk = cv.take(BK * Dp);
      t.dv = cv.take(BK * Dp);
      t.lse2 = cv.take(BQ);
      t.dlt = cv.take(BQ);
      return t;
    }

    // Key block kb of (sequence b, kv head hk): its rows' dK and dV, written to the outputs. With
    // dq (the fused backward: [group][Sq][Dp] accumulators of the group's query rows), also
    // dQ += dS K for every row that sees the block, from the dS this block computes anyway. The
    // dQ pass computes the same dS (K folded alike) and sums a row's terms in the same key order,
    // so the two designs agree bit for bit (tests/test_cpu_backward_designs.cpp).
    static void key_block(const Ctx& ctx, const Seq& seq, int64_t b, int64_t hk, int64_t kb, const DkvTiles& t,
                          C* dq) {
      const BackwardParams& p = *ctx.p;
      const Shape& sh = p.shape;
      const int64_t group = sh.heads_q / sh.heads_kv;
      const MaskRule& rule = seq.rule;
      const ScoreMods<C> mods = ctx.mods.of_seq(seq.sp);
      const int64_t q0 = seq.sp.q0;
      const In4 q = from_row<S>(p.q, q0), dout = from_row<S>(p.dout, q0);
      const In4 k = from_row<S>(p.k, seq.sp.k0), v = from_row<S>(p.v, seq.sp.k0);
      const Out4 dkv = from_row<S>(p.dk, seq.sp.k0), dvv = from_row<S>(p.dv, seq.sp.k0);
      const int64_t D = sh.head_dim, Sq = seq.sp.seq_q, Skv = seq.sp.seq_kv, Dp = round_up(D, W);
      // The block's rows [j0, j0 + nrows) of the sequence's keys (key_rows); those at or past
      // seqused_k (nk <= nrows) get dK = dV = 0.
      const int64_t j0 = kb * BK, nrows = smin(BK, key_rows(p, b, Skv) - j0);
      const int64_t nk = MaskRule::clamp(Skv - j0, 0, nrows);
      // The key columns the products cover: the block's keys up to whole panels (as dQ's NQ).
      const int64_t NK = round_up(nk, panel_width<C>());
      C *Sb = t.s, *dP = t.dp, *dK = t.dk, *dV = t.dv, *lse2 = t.lse2, *dlt = t.dlt;

      const Panels<C> KT = pack_transposed<S, C>(k, b, hk, j0, nk, D, mods.fold, t.kt, NK);
      const Panels<C> VT = pack_transposed<S, C>(v, b, hk, j0, nk, D, C(1), t.vt, NK);
      const Panels<C> Kp = dq != nullptr ? pack_panels<S, C>(k, b, hk, j0, nk, D, t.kp) : Panels<C>{nullptr, 0};
      for (int64_t i = 0; i < nk * Dp; ++i) dK[i] = dV[i] = C(0);

      // The queries that see some key of the block; keys no query sees get dK = dV = 0 (the
      // epilogue).
      const int64_t ibegin = rule.row_begin(j0), iend = nk > 0 ? rule.row_end(j0 + nk - 1, Sq) : ibegin;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        const C* delta = ctx.delta + ctx.stat(b, h, q0);
        const C slope2 = mods.slope2(b, h);
        for (int64_t i0 = ibegin; i0 < iend; i0 += BQ) {
          const int64_t nq = smin(BQ, iend - i0);
          const Rows<C> Q = rows_of<S, C>(q, b, h, i0, nq, D, t.qrows);
          const Rows<C> dO = rows_of<S, C>(dout, b, h, i0, nq, D, t.dorows);
          const Panels<C> Qp = pack_panels<S, C>(q, b, h, i0, nq, D, t.qp);
          const Panels<C> dOp = pack_panels<S, C>(dout, b, h, i0, nq, D, t.dop);
          for (int64_t r = 0; r < nq; ++r) {
            lse2[r] = lse2_of(ctx, b, h, q0, i0 + r);
            dlt[r] = delta[i0 + r];
          }
          gemm<C, false>(nq, NK / W, D, Q.ptr, Q.ld, 1, KT, Sb, BK);    // S = Q K^T
          gemm<C, false>(nq, NK / W, D, dO.ptr, dO.ld, 1, VT, dP, BK);  // dP = dO V^T
          // Under a softcap the step leaves (dP - D) o F in dP.
          if (mods.on)
            score_step<C, false>(Sb, BK, nq, NK, mods, slope2, i0, j0, mods.cap ? dP : nullptr, dlt);
          if (mods.cap) {
            for (int64_t r = 0; r < nq; ++r) {
              const V l2 = vbroadcast<V>(lse2[r]);
              for (int64_t c0 = 0; c0 < NK; c0 += W) {
                V pv = exp2v<true>(vload<V>(Sb + r * BK + c0) - l2);
                vstore(Sb + r * BK + c0, pv);
                vstore(dP + r * BK + c0, pv * vload<V>(dP + r * BK + c0));
              }
            }
          } else {
            for (int64_t r = 0; r < nq; ++r) {
              const V l2 = vbroadcast<V>(lse2[r]), dl = vbroadcast<V>(dlt[r]);
              for (int64_t c0 = 0; c0 < NK; c0 += W) {
                V pv = exp2v<true>(vload<V>(Sb + r * BK + c0) - l2);
                vstore(Sb + r * BK + c0, pv);
                vstore(dP + r * BK + c0, pv * (vload<V>(dP + r * BK + c0) - dl));
              }
            }
          }
          // Hidden entries: P = dS = 0 (after the exponential: see mask_key_rows).
          if (!rule.tile_inside(i0, i0 + nq, j0, j0 + nk)) {
            mask_query_rows(Sb, BK, rule, j0, NK, i0, nq, C(0));
            mask_query_rows(dP, BK, rule, j0, NK, i0, nq, C(0));
          }
          gemm<C, true>(nk, Dp / W, nq, Sb, 1, BK, dOp, dV, Dp);  // dV += P^T dO
          gemm<C, true>(nk, Dp / W, nq, dP, 1, BK, Qp, dK, Dp);   // dK += dS^T Q
          if (dq != nullptr)  // dQ += dS K (the first nk columns: the block's keys)
            gemm<C, true>(nq, Dp / W, nk, dP, BK, 1, Kp, dq + (g * Sq + i0) * Dp, Dp);
        }
      }
      const C gs = static_cast<C>(ctx.st.grad_scale());
      for (int64_t r = 0; r < nk; ++r) {
        S* dk = row_ptr<S>(dkv, b, hk, j0 + r);
        S* dv = row_ptr<S>(dvv, b, hk, j0 + r);
        const bool seen = rule.key_seen(j0 + r, Sq);  // a key without rows: exactly 0 (as dQ's)
        for (int64_t d = 0; d < D; ++d) {
          store_as<C>(dk + d, seen ? dK[r * Dp + d] * gs : C(0));
          store_as<C>(dv + d, seen ? dV[r * Dp + d] : C(0));
        }
      }
      for (int64_t r = nk; r < nrows; ++r) {
        S* dk = row_ptr<S>(dkv, b, hk, j0 + r);
        S* dv = row_ptr<S>(dvv, b, hk, j0 + r);
        for (int64_t d = 0; d < D; ++d) {
          store_as<C>(dk + d, C(0));
          store_as<C>(dv + d, C(0));
        }
      }
    }

    static void dkv_task(const Ctx& ctx, int64_t task, void* scratch) {
      const BackwardParams& p = *ctx.p;
      // Head-major (threads share the group's Q/dO blocks); causal: early key blocks are seen
      // by the most queries: they go first.
      const SeqBlocks::Item it = ctx.dkv_tasks.at(task);
      const Seq seq = seq_of(p.shape, p.num, p.packing, ctx.rule, it.b);
      Carve<C> cv{static_cast<C*>(scratch)};
      const DkvTiles t = dkv_carve(cv, p.shape.head_dim, false);
      key_block(ctx, seq, it.b, it.h, it.blk, t, nullptr);
    }
  };

  // ---- The fused backward: one task = one (batch or sequence, kv head); its key blocks in
  // order, each as a dK/dV task computes it, plus dQ += dS K into float32 (compute-type)
  // accumulators of the group's query rows, written out at the end. Five products per tile
  // instead of the split passes' seven (S and dP are computed once, not once per pass), at the
  // price of coarser tasks (B * Hkv of them) and group * Sq * Dp accumulators per thread; the
  // driver's cost model (use_fused) picks it where enough such tasks keep the threads busy. Its
  // dQ, dK and dV equal the split passes' bit for bit, so the choice never shows in a result.
  struct Fused {
    // The tiles and the accumulators, [group][Sq][Dp] for Sq up to the shape's seq_q (a packed
    // call's max_seqlen_q, which validation makes a bound of every sequence's).
    struct Tiles {
      typename Dkv::DkvTiles kv;
      C* dq;
    };
    static Tiles carve(Carve<C>& cv, const Shape& sh) {
      const typename Dkv::DkvTiles kv = Dkv::dkv_carve(cv, sh.head_dim, true);
      return {kv, cv.take(sh.heads_q / sh.heads_kv * sh.seq_q * round_up(sh.head_dim, W))};
    }
    static void task(const void* vctx, int64_t task, void* scratch) {
      const Ctx& ctx = *static_cast<const Ctx*>(vctx);
      const BackwardParams& p = *ctx.p;
      const Shape& sh = p.shape;
      const int64_t group = sh.heads_q / sh.heads_kv, b = task / sh.heads_kv, hk = task % sh.heads_kv;
      const Seq seq = seq_of(sh, p.num, p.packing, ctx.rule, b);
      const int64_t D = sh.head_dim, Dp = round_up(D, W), Sq = seq.sp.seq_q, Skv = seq.sp.seq_kv;
      Carve<C> cv{static_cast<C*>(scratch)};
      const Tiles t = carve(cv, sh);
      C* dq = t.dq;
      for (int64_t i = 0; i < group * Sq * Dp; ++i) dq[i] = C(0);
      for (int64_t kb = 0; kb * Dkv::BK < key_rows(p, b, Skv); ++kb) Dkv::key_block(ctx, seq, b, hk, kb, t.kv, dq);
      const Out4 dqv = from_row<S>(p.dq, seq.sp.q0);
      const C gs = static_cast<C>(ctx.st.grad_scale());
      for (int64_t g = 0; g < group; ++g)
        for (int64_t i = 0; i < Sq; ++i)
          store_dq_row(row_ptr<S>(dqv, b, hk * group + g, i), dq + (g * Sq + i) * Dp, D,
                       seq.rule.row_sees_keys(i, Skv), gs);
    }
  };

  // Whether the fused backward serves this call. Its tasks are whole (sequence, kv head) pairs;
  // the split passes' are blocks, which balance any thread count, but do 7/5 of the products.
  // The fused makespan is estimated by handing the tasks, in order, to the least loaded of the
  // threads (as the pool's shared counter does), each weighing its sequence's Sq * Skv; the split
  // one as the total over the threads times 7/5. The accumulators must fit kFusedScratch per
  // thread. The choice depends on the thread count; the results do not (Fused).
  static constexpr double kSplitCost = 7.0 / 5.0;
  static constexpr size_t kFusedScratch = size_t{64} << 20;
  static bool use_fused(const BackwardParams& p, Parallel& par, size_t fused_bytes) {
    if (par.backward_design() == Parallel::kSplit) return false;
    if (par.backward_design() == Parallel::kFused) return true;
    if (fused_bytes > kFusedScratch) return false;
    const Shape& sh = p.shape;
    const int64_t T = par.threads();
    if (T == 1) return true;
    const int64_t n = sh.batch * sh.heads_kv;
    if (n < T) return false;
    // Dense: equal tasks, the makespan is ceil(n / T) of them.
    if (!p.packing.on()) return static_cast<double>((n + T - 1) / T) <= kSplitCost * static_cast<double>(n) / T;
    if (T > 256 || n * T > (int64_t{1} << 22)) return true;  // (many tasks per thread: balanced)
    double load[256] = {}, total = 0.0;
    for (int64_t b = 0; b < sh.batch; ++b) {
      const SeqSpan sp = seq_span(sh, p.packing, b);
      const double w = static_cast<double>(sp.seq_q) * static_cast<double>(smax<int64_t>(sp.seq_kv, 1));
      for (int64_t hk = 0; hk < sh.heads_kv; ++hk) {
        int64_t m = 0;
        for (int64_t x = 1; x < T; ++x)
          if (load[x] < load[m]) m = x;
        load[m] += w;
        total += w;
      }
    }
    double makespan = 0.0;
    for (int64_t x = 0; x < T; ++x) makespan = load[x] > makespan ? load[x] : makespan;
    return makespan <= kSplitCost * total / static_cast<double>(T);
  }

  // dQ and dK/dV tasks share one parallel run: the dK/dV tasks (the larger ones) come first.
  struct MainCtx {
    Ctx ctx;
    int64_t n_dkv;
  };
  static void main_task(const void* vctx, int64_t task, void* scratch) {
    const MainCtx& m = *static_cast<const MainCtx*>(vctx);
    if (task < m.n_dkv)
      Dkv::dkv_task(m.ctx, task, scratch);
    else
      Dq::dq_task(m.ctx, task - m.n_dkv, scratch);
  }

  static void run(const BackwardParams& p, const MaskRule& rule, Parallel& par) {
    const Shape& sh = p.shape;
    // Row statistics (delta, lse2) per (batch, head, row): [B, Hq, Sq], or [Hq, total_q] packed.
    const int64_t total_q = p.packing.on() ? int64_t{p.packing.cu_q[sh.batch]} : sh.batch * sh.seq_q;
    const size_t rows = static_cast<size_t>(sh.heads_q * total_q);
    const int64_t stat_b = p.packing.on() ? 0 : sh.heads_q * sh.seq_q;
    const int64_t stat_h = p.packing.on() ? total_q : sh.seq_q;
    Ctx ctx{&p,
            rule,
            ScoreTransform::make(sh, p.num),
            ScoreMods<C>::make(sh, p.num),
            static_cast<C*>(par.alloc(rows * sizeof(C))),
            nullptr,
            stat_b,
            stat_h,
            seq_blocks(sh, p.packing, sh.heads_q, Dq::BQ, false, par),
            seq_blocks(sh, p.packing, sh.heads_kv, Dkv::BK, true, par)};
    par.run(sh.batch * sh.heads_q, 0, &delta_task, &ctx);
    if constexpr (Same<C, double>::value) {
      LseCtx lc{&ctx, static_cast<C*>(par.alloc(rows * sizeof(C))),
                seq_blocks(sh, p.packing, sh.heads_q, Forward<S>::BQ, false, par)};
      Carve<C> cv{nullptr};
      Forward<S>::carve(cv, sh.head_dim);
      par.run(lc.tasks.count, cv.bytes(), &lse_task, &lc);
      ctx.lse2 = lc.out;
    }
    Carve<C> cf{nullptr};
    Fused::carve(cf, sh);
    if (use_fused(p, par, cf.bytes())) {
      par.run(sh.batch * sh.heads_kv, cf.bytes(), &Fused::task, &ctx);
      return;
    }
    MainCtx m{ctx, ctx.dkv_tasks.count};
    Carve<C> c1{nullptr}, c2{nullptr};
    Dq::dq_carve(c1, sh.head_dim);
    Dkv::dkv_carve(c2, sh.head_dim, false);
    par.run(m.n_dkv + ctx.dq_tasks.count, smax(c1.bytes(), c2.bytes()), &main_task, &m);
  }

};

template <template <class> class K, class P>
void dispatch_dtype(const P& p, const MaskRule& rule, Parallel& par) {
  switch (p.num.dtype) {
    case DType::Float32:
      K<float>::run(p, rule, par);
      break;
    case DType::Float16:
      K<F16>::run(p, rule, par);
      break;
    case DType::BFloat16:
      K<BF16>::run(p, rule, par);
      break;
    case DType::Float64:
      K<double>::run(p, rule, par);
      break;
  }
}

void forward_entry(const ForwardParams& p, const MaskRule& rule, Parallel& par) {
  dispatch_dtype<Forward>(p, rule, par);
}
void backward_entry(const BackwardParams& p, const MaskRule& rule, Parallel& par) {
  dispatch_dtype<Backward>(p, rule, par);
}
void tanh_entry(const float* x, float* y, int64_t n) {
  constexpr int W = Simd<float>::W;
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, tanhv(vload<vf>(x + i)));
  if (i < n) {
    float buf[W] = {};
    for (int64_t l = 0; l < n - i; ++l) buf[l] = x[i + l];
    vstore(buf, tanhv(vload<vf>(buf)));
    for (int64_t l = 0; l < n - i; ++l) y[i + l] = buf[l];
  }
}

#define FLASHATTN_STR2(x) #x
#define FLASHATTN_STR(x) FLASHATTN_STR2(x)

}  // namespace

extern const KernelSet kernels;
const KernelSet kernels = {FLASHATTN_STR(FLASHATTN_CPU_ISA),
                           kVecBytes,
                           static_cast<int>(FLASHATTN_CPU_FWD_BQ),
                           static_cast<int>(FLASHATTN_CPU_FWD_BK),
                           &forward_entry,
                           &backward_entry,
                           &tanh_entry};

}  // namespace flashattn::cpu::FLASHATTN_CPU_ISA
