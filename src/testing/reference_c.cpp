// The C ABI of libflashattn_reference (reference_c.h): strided float64 views gathered into the
// contiguous arrays of the C++ reference (reference.hpp), which does all the arithmetic, and its
// results scattered back.
#include "testing/reference_c.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "testing/reference.hpp"

namespace flashattn::testing {
namespace {

thread_local std::string g_error;

struct Invalid {
  std::string what;
};

// A logical view: sizes and strides in elements (contiguous when the caller gave none).
template <int N>
struct View {
  int64_t size[N];
  int64_t stride[N];
  int64_t count() const {
    int64_t n = 1;
    for (int i = 0; i < N; ++i) n *= size[i];
    return n;
  }
};

template <int N>
View<N> make_view(const char* name, const void* data, const int64_t (&size)[N],
                  const int64_t* strides) {
  View<N> v{};
  int64_t contiguous = 1;
  for (int i = N - 1; i >= 0; --i) {
    v.size[i] = size[i];
    v.stride[i] = strides ? strides[i] : contiguous;
    contiguous *= size[i];
  }
  if (data == nullptr) throw Invalid{std::string(name) + " is NULL"};
  return v;
}

// Calls f(logical_index, element_offset) for every element, in row-major logical order.
template <int N, typename F>
void for_each(const View<N>& v, F f) {
  const int64_t n = v.count();
  int64_t idx[N] = {};
  int64_t off = 0;
  for (int64_t e = 0; e < n; ++e) {
    f(e, off);
    for (int d = N - 1; d >= 0; --d) {
      off += v.stride[d];
      if (++idx[d] < v.size[d]) break;
      off -= v.stride[d] * v.size[d];
      idx[d] = 0;
    }
  }
}

template <int N>
std::vector<double> gather(const double* data, const View<N>& v) {
  std::vector<double> out(static_cast<size_t>(v.count()));
  for_each(v, [&](int64_t e, int64_t off) { out[e] = data[off]; });
  return out;
}

template <int N>
void scatter(const std::vector<double>& src, double* data, const View<N>& v) {
  for_each(v, [&](int64_t e, int64_t off) { data[off] = src[e]; });
}

RefShape check_shape(const flashattn_ref_shape* s, int32_t mask) {
  if (s == nullptr) throw Invalid{"shape is NULL"};
  const int64_t dims[] = {s->batch, s->heads_q, s->heads_kv, s->seq_q, s->seq_kv, s->head_dim};
  const char* names[] = {"batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim"};
  for (int i = 0; i < 6; ++i)
    if (dims[i] < 1) throw Invalid{std::string(names[i]) + " = " + std::to_string(dims[i]) +
                               ": every size must be at least 1"};
  if (s->heads_q % s->heads_kv != 0) throw Invalid{"heads_kv does not divide heads_q"};
  if (mask < 0 || mask > 2)
    throw Invalid{"mask " + std::to_string(mask) + " is none of 0 (none), 1 (causal top-left), "
                                                   "2 (causal bottom-right)"};
  return RefShape{s->batch, s->heads_q, s->heads_kv, s->seq_q, s->seq_kv, s->head_dim};
}

RefMods mods_of(const flashattn_ref_mods* m, const RefShape& s) {
  RefMods r;
  if (m == nullptr) return r;
  if (m->window_left < -1 || m->window_right < -1) throw Invalid{"window sizes must be >= -1"};
  if (!(m->softcap >= 0)) throw Invalid{"softcap must be >= 0"};
  r.window_left = m->window_left;
  r.window_right = m->window_right;
  r.softcap = m->softcap;
  if (m->alibi != nullptr) r.alibi.assign(m->alibi, m->alibi + s.batch * s.heads_q);
  return r;
}

template <typename F>
int guarded(F f) {
  try {
    f();
    return FLASHATTN_REF_OK;
  } catch (const Invalid& e) {
    g_error = e.what;
    return FLASHATTN_REF_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return FLASHATTN_REF_FAILED;
  } catch (const std::exception& e) {
    g_error = e.what();
    return FLASHATTN_REF_FAILED;
  } catch (...) {
    g_error = "unknown exception";
    return FLASHATTN_REF_FAILED;
  }
}

}  // namespace
}  // namespace flashattn::testing

using namespace flashattn::testing;

extern "C" int flashattn_ref_forward(const flashattn_ref_shape* shape, const double* q,
                                     const int64_t* q_strides, const double* k,
                                     const int64_t* k_strides, const double* v,
                                     const int64_t* v_strides, double softmax_scale, int32_t mask,
                                     double* out, const int64_t* out_strides, double* lse,
                                     const int64_t* lse_strides) {
  return flashattn_ref_forward_ex(shape, q, q_strides, k, k_strides, v, v_strides, softmax_scale, mask, nullptr,
                                  out, out_strides, lse, lse_strides);
}

extern "C" int flashattn_ref_forward_ex(const flashattn_ref_shape* shape, const double* q,
                                        const int64_t* q_strides, const double* k,
                                        const int64_t* k_strides, const double* v,
                                        const int64_t* v_strides, double softmax_scale, int32_t mask,
                                        const flashattn_ref_mods* mods, double* out,
                                        const int64_t* out_strides, double* lse,
                                        const int64_t* lse_strides) {
  return guarded([&] {
    const RefShape s = check_shape(shape, mask);
    const int64_t qd[4] = {s.batch, s.heads_q, s.seq_q, s.head_dim};
    const int64_t kd[4] = {s.batch, s.heads_kv, s.seq_kv, s.head_dim};
    const int64_t ld[3] = {s.batch, s.heads_q, s.seq_q};
    const auto qv = make_view("q", q, qd, q_strides);
    const auto kv = make_view("k", k, kd, k_strides);
    const auto vv = make_view("v", v, kd, v_strides);
    const auto ov = make_view("out", out, qd, out_strides);
    const auto lv = make_view("lse", lse, ld, lse_strides);
    const RefForward r = reference_forward(s, gather(q, qv), gather(k, kv), gather(v, vv),
                                           softmax_scale, static_cast<flashattn::Mask>(mask),
                                           mods_of(mods, s));
    scatter(r.out, out, ov);
    scatter(r.lse, lse, lv);
  });
}

extern "C" int flashattn_ref_backward(const flashattn_ref_shape* shape, const double* q,
                                      const int64_t* q_strides, const double* k,
                                      const int64_t* k_strides, const double* v,
                                      const int64_t* v_strides, const double* dout,
                                      const int64_t* dout_strides, double softmax_scale,
                                      int32_t mask, double* dq, const int64_t* dq_strides,
                                      double* dk, const int64_t* dk_strides, double* dv,
                                      const int64_t* dv_strides) {
  return flashattn_ref_backward_ex(shape, q, q_strides, k, k_strides, v, v_strides, dout, dout_strides,
                                   softmax_scale, mask, nullptr, dq, dq_strides, dk, dk_strides, dv, dv_strides);
}

extern "C" int flashattn_ref_backward_ex(const flashattn_ref_shape* shape, const double* q,
                                         const int64_t* q_strides, const double* k,
                                         const int64_t* k_strides, const double* v,
                                         const int64_t* v_strides, const double* dout,
                                         const int64_t* dout_strides, double softmax_scale,
                                         int32_t mask, const flashattn_ref_mods* mods, double* dq,
                                         const int64_t* dq_strides, double* dk,
                                         const int64_t* dk_strides, double* dv,
                                         const int64_t* dv_strides) {
  return guarded([&] {
    const RefShape s = check_shape(shape, mask);
    const int64_t qd[4] = {s.batch, s.heads_q, s.seq_q, s.head_dim};
    const int64_t kd[4] = {s.batch, s.heads_kv, s.seq_kv, s.head_dim};
    const auto qv = make_view("q", q, qd, q_strides);
    const auto kv = make_view("k", k, kd, k_strides);
    const auto vv = make_view("v", v, kd, v_strides);
    const auto dov = make_view("dout", dout, qd, dout_strides);
    const auto dqv = make_view("dq", dq, qd, dq_strides);
    const auto dkv = make_view("dk", dk, kd, dk_strides);
    const auto dvv = make_view("dv", dv, kd, dv_strides);
    const RefBackward r =
        reference_backward(s, gather(q, qv), gather(k, kv), gather(v, vv), gather(dout, dov),
                           softmax_scale, static_cast<flashattn::Mask>(mask), mods_of(mods, s));
    scatter(r.dq, dq, dqv);
    scatter(r.dk, dk, dkv);
    scatter(r.dv, dv, dvv);
  });
}

extern "C" int flashattn_ref_kvcache(const flashattn_ref_kvcache_seq* seq, const double* q,
                                     const double* k_old, const double* v_old, const double* k_new,
                                     const double* v_new, const double* rotary_cos,
                                     const double* rotary_sin, double softmax_scale, int32_t mask,
                                     const flashattn_ref_mods* mods, double* out, double* lse,
                                     double* k_appended) {
  return guarded([&] {
    if (seq == nullptr) throw Invalid{"seq is NULL"};
    const flashattn_ref_kvcache_seq& s = *seq;
    const int64_t Sk = s.len_old + s.seq_new;
    // The shape check of the dense calls (Skv at least 1 for it; an empty sequence is allowed).
    const flashattn_ref_shape shape{1, s.heads_q, s.heads_kv, s.seq_q, Sk > 0 ? Sk : 1, s.head_dim};
    const RefShape rs = check_shape(&shape, mask);
    if (s.len_old < 0 || s.seq_new < 0 || s.pos0 < 0) throw Invalid{"len_old, seq_new and pos0 must be >= 0"};
    const int64_t half = s.rotary_dim / 2;
    if (s.rotary_dim < 0 || s.rotary_dim % 2 != 0 || s.rotary_dim > s.head_dim)
      throw Invalid{"rotary_dim must be even and in [0, head_dim]"};
    if (s.rotary_dim > 0 && s.pos0 + std::max(s.seq_new, s.q_advances ? s.seq_q : 1) > s.rotary_rows)
      throw Invalid{"rotary_rows is too short for the positions used"};
    if (s.round_to < 0 || s.round_to > 3)  // FLASHATTN_FLOAT32 .. FLASHATTN_FLOAT64
      throw Invalid{"round_to must be a float dtype code of flashattn.h (0..3)"};
    auto arr = [](const char* name, const double* p, int64_t n) {
      if (n == 0) return std::vector<double>();
      if (p == nullptr) throw Invalid{std::string(name) + " is NULL"};
      return std::vector<double>(p, p + n);
    };
    const int64_t D = s.head_dim, kv_old = s.heads_kv * s.len_old * D, kv_new = s.heads_kv * s.seq_new * D;
    RefKvcacheSeq r;
    r.heads_q = s.heads_q, r.heads_kv = s.heads_kv, r.seq_q = s.seq_q, r.head_dim = D;
    r.q = arr("q", q, s.heads_q * s.seq_q * D);
    r.len_old = s.len_old, r.k_old = arr("k_old", k_old, kv_old), r.v_old = arr("v_old", v_old, kv_old);
    r.seq_new = s.seq_new, r.k_new = arr("k_new", k_new, kv_new), r.v_new = arr("v_new", v_new, kv_new);
    r.pos0 = s.pos0;
    r.q_advances = s.q_advances != 0;
    RefRotary rot;
    if (s.rotary_dim > 0) {
      rot.cos = arr("rotary_cos", rotary_cos, s.rotary_rows * half);
      rot.sin = arr("rotary_sin", rotary_sin, s.rotary_rows * half);
      rot.rotary_dim = s.rotary_dim;
      rot.interleaved = s.rotary_interleaved != 0;
      rot.round_to = static_cast<flashattn::DType>(s.round_to);
    }
    if (out == nullptr || lse == nullptr || (s.seq_new > 0 && k_appended == nullptr))
      throw Invalid{"out, lse and (when seq_new > 0) k_appended must not be NULL"};
    const RefKvcache res = reference_kvcache(r, rot, softmax_scale, static_cast<flashattn::Mask>(mask),
                                             mods_of(mods, rs));
    std::copy(res.fwd.out.begin(), res.fwd.out.end(), out);
    std::copy(res.fwd.lse.begin(), res.fwd.lse.end(), lse);
    std::copy(res.k_appended.begin(), res.k_appended.end(), k_appended);
  });
}

extern "C" const char* flashattn_ref_last_error(void) { return g_error.c_str(); }
