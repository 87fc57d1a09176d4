// The CPU side of KV-cache calls (flashattn_forward_kvcache) that precedes the attention: the
// append of the new keys and values into the caches (keys rotated), and the rotated copy of q.
// Both are O(rows * D) element copies, small next to the attention, and run on the calling
// thread; the attention itself is the forward kernel reading the caches through p.kv
// (kernels_impl.hpp: KvRows).
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/half.hpp"
#include "core/params.hpp"
#include "cpu/kvcache.hpp"

namespace flashattn::cpu {
namespace {

// Storage <-> compute: float32 for float32/float16/bfloat16 (as the forward), double for float64.
template <class C>
C load(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::Float16: return static_cast<C>(fp16_to_float(static_cast<const uint16_t*>(base)[i]));
    case DType::BFloat16: return static_cast<C>(bf16_to_float(static_cast<const uint16_t*>(base)[i]));
    case DType::Float64: return static_cast<C>(static_cast<const double*>(base)[i]);
    default: return static_cast<C>(static_cast<const float*>(base)[i]);
  }
}
template <class C>
void store(void* base, DType t, int64_t i, C x) {
  switch (t) {
    case DType::Float16: static_cast<uint16_t*>(base)[i] = float_to_fp16(static_cast<float>(x)); break;
    case DType::BFloat16: static_cast<uint16_t*>(base)[i] = float_to_bf16(static_cast<float>(x)); break;
    case DType::Float64: static_cast<double*>(base)[i] = static_cast<double>(x); break;
    default: static_cast<float*>(base)[i] = static_cast<float>(x); break;
  }
}

// dst[0, D) = src[0, D) rotated at position pos (dims >= rotary_dim copied bit for bit); dst and
// src are element offsets into their bases.
template <class C>
void rotate_row(const KvRotary& r, DType t, int64_t pos, const void* src, int64_t so, void* dst, int64_t dof,
                int64_t D) {
  const int64_t e = element_bytes(t), half = r.rotary_dim / 2;
  const int64_t rd = r.cos != nullptr ? r.rotary_dim : 0;
  for (int64_t i = 0; i < rd / 2; ++i) {
    const C c = load<C>(r.cos, t, pos * r.cos_ss + i), s = load<C>(r.sin, t, pos * r.sin_ss + i);
    const int64_t i0 = r.interleaved ? 2 * i : i, i1 = r.interleaved ? 2 * i + 1 : i + half;
    const C x0 = load<C>(src, t, so + i0), x1 = load<C>(src, t, so + i1);
    store<C>(dst, t, dof + i0, x0 * c - x1 * s);
    store<C>(dst, t, dof + i1, x0 * s + x1 * c);
  }
  std::memcpy(static_cast<char*>(dst) + (dof + rd) * e, static_cast<const char*>(src) + (so + rd) * e,
              static_cast<size_t>((D - rd) * e));
}

template <class C>
void prepare(const KvcacheParams& kp, void* q_rot) {
  const ForwardParams& p = kp.fwd;
  const Shape& sh = p.shape;
  const DType t = p.num.dtype;
  const int64_t D = sh.head_dim;
  // The append: new row j of sequence b goes to relative cache row first_new[b] + j; a key is
  // rotated at its absolute position pos0[b] + j, a value copied.
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t j = 0; j < kp.s_new; ++j)
      for (int64_t h = 0; h < sh.heads_kv; ++h) {
        const int64_t row = kp.first_new[b] + j;
        rotate_row<C>(kp.rotary, t, kp.pos0[b] + j, kp.k_new.ptr, b * kp.k_new.sb + h * kp.k_new.sh + j * kp.k_new.ss,
                      kp.k_cache.ptr, kv_offset(p.kv, kp.k_cache, b, h, row), D);
        KvRotary none = kp.rotary;
        none.cos = nullptr;
        rotate_row<C>(none, t, 0, kp.v_new.ptr, b * kp.v_new.sb + h * kp.v_new.sh + j * kp.v_new.ss, kp.v_cache.ptr,
                      kv_offset(p.kv, kp.v_cache, b, h, row), D);
      }
  // q rotated into q_rot, contiguous [B, Hq, Sq, D].
  if (q_rot == nullptr) return;
  for (int64_t b = 0; b < sh.batch; ++b)
    for (int64_t h = 0; h < sh.heads_q; ++h)
      for (int64_t i = 0; i < sh.seq_q; ++i)
        rotate_row<C>(kp.rotary, t, kp.pos0[b] + (kp.rotary.q_advances ? i : 0), p.q.ptr,
                      b * p.q.sb + h * p.q.sh + i * p.q.ss, q_rot, ((b * sh.heads_q + h) * sh.seq_q + i) * D, D);
}

}  // namespace

In4 kvcache_prepare(const KvcacheParams& kp, void* q_rot) {
  if (kp.fwd.num.dtype == DType::Float64)
    prepare<double>(kp, q_rot);
  else
    prepare<float>(kp, q_rot);
  if (q_rot == nullptr) return kp.fwd.q;
  const Shape& sh = kp.fwd.shape;
  return In4{q_rot, sh.heads_q * sh.seq_q * sh.head_dim, sh.seq_q * sh.head_dim, sh.head_dim};
}

}  // namespace flashattn::cpu
