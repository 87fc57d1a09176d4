// The C ABI: a thin, exception-proof shell over the C++ API. Nothing escapes as an exception;
// every failure becomes a status code plus a thread-local message.
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"
#include "core/backend.hpp"
#include "core/c_options.hpp"

namespace {

thread_local std::string g_last_error;

int set_error(int status, const std::string& msg) {
  try {
    g_last_error = msg;
  } catch (...) {
    // Out of memory while storing the message: keep the status, lose the text.
  }
  return status;
}

template <class F>
int guarded(F&& f) {
  try {
    f();
    g_last_error.clear();
    return FLASHATTN_OK;
  } catch (const flashattn::Error& e) {
    return set_error(static_cast<int>(e.status()), e.what());
  } catch (const std::bad_alloc&) {
    return set_error(FLASHATTN_ERROR_OUT_OF_MEMORY, "out of host memory");
  } catch (const std::exception& e) {
    return set_error(FLASHATTN_ERROR_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return set_error(FLASHATTN_ERROR_INTERNAL, "internal error: unknown exception");
  }
}

flashattn::Tensor to_tensor(const flashattn_tensor* t, const char* name) {
  if (t == nullptr)
    throw flashattn::Error(flashattn::Status::InvalidArgument,
                           std::string(name) + " is NULL (a flashattn_tensor pointer is required)");
  flashattn::Tensor r;
  r.data = t->data;
  r.dtype = static_cast<flashattn::DType>(t->dtype);
  r.device = t->device;
  r.ndim = t->ndim;
  if (t->ndim < 0 || t->ndim > 4)
    throw flashattn::Error(flashattn::Status::InvalidArgument,
                           std::string(name) + ".ndim = " + std::to_string(t->ndim) +
                               ", expected " + (std::strcmp(name, "lse") == 0 ? "3" : "4"));
  for (int i = 0; i < 4; ++i) {
    r.shape[i] = i < t->ndim ? t->shape[i] : 0;
    r.stride[i] = i < t->ndim ? t->stride[i] : 0;
  }
  return r;
}

// The packed-batch description; the index tensors' views go to *store (cu_q, cu_k, used_k).
flashattn::Varlen varlen_from_c(const flashattn_varlen* vl, flashattn::Tensor (&store)[3]) {
  using flashattn::Error;
  using flashattn::Status;
  if (vl == nullptr) throw Error(Status::InvalidArgument, "varlen is NULL (a flashattn_varlen is required)");
  if (vl->struct_size < sizeof(flashattn_varlen))
    throw Error(Status::InvalidArgument, "varlen->struct_size = " + std::to_string(vl->struct_size) +
                                             " is too small (set it to sizeof(flashattn_varlen) = " +
                                             std::to_string(sizeof(flashattn_varlen)) + ")");
  flashattn::Varlen r;
  if (vl->cu_seqlens_q != nullptr) store[0] = to_tensor(vl->cu_seqlens_q, "cu_seqlens_q"), r.cu_seqlens_q = &store[0];
  if (vl->cu_seqlens_k != nullptr) store[1] = to_tensor(vl->cu_seqlens_k, "cu_seqlens_k"), r.cu_seqlens_k = &store[1];
  if (vl->seqused_k != nullptr) store[2] = to_tensor(vl->seqused_k, "seqused_k"), r.seqused_k = &store[2];
  r.max_seqlen_q = vl->max_seqlen_q;
  r.max_seqlen_k = vl->max_seqlen_k;
  return r;
}

// The KV-cache description; its tensors' views go to *store.
flashattn::KvCache kvcache_from_c(const flashattn_kvcache* kv, flashattn::Tensor (&store)[8]) {
  using flashattn::Error;
  using flashattn::Status;
  if (kv == nullptr) throw Error(Status::InvalidArgument, "kv is NULL (a flashattn_kvcache is required)");
  if (kv->struct_size < sizeof(flashattn_kvcache))
    throw Error(Status::InvalidArgument, "kv->struct_size = " + std::to_string(kv->struct_size) +
                                             " is too small (set it to sizeof(flashattn_kvcache) = " +
                                             std::to_string(sizeof(flashattn_kvcache)) +
                                             " or call flashattn_kvcache_init)");
  flashattn::KvCache r;
  const std::pair<const flashattn_tensor*, const char*> in[8] = {
      {kv->k_new, "k_new"},         {kv->v_new, "v_new"},         {kv->cache_seqlens, "cache_seqlens"},
      {kv->cache_batch_idx, "cache_batch_idx"}, {kv->cache_leftpad, "cache_leftpad"}, {kv->block_table, "block_table"},
      {kv->rotary_cos, "rotary_cos"}, {kv->rotary_sin, "rotary_sin"}};
  const flashattn::Tensor** out[8] = {&r.k_new,         &r.v_new,       &r.cache_seqlens, &r.cache_batch_idx,
                                      &r.cache_leftpad, &r.block_table, &r.rotary_cos,    &r.rotary_sin};
  for (int i = 0; i < 8; ++i)
    if (in[i].first != nullptr) store[i] = to_tensor(in[i].first, in[i].second), *out[i] = &store[i];
  r.rotary_interleaved = kv->rotary_interleaved != 0;
  r.num_splits = kv->num_splits;
  return r;
}

}  // namespace

extern "C" {

void flashattn_kvcache_init(flashattn_kvcache* kv) {
  if (kv == nullptr) return;
  std::memset(kv, 0, sizeof(*kv));
  kv->struct_size = sizeof(flashattn_kvcache);
  kv->rotary_interleaved = 1;
}

int flashattn_forward_kvcache(const flashattn_tensor* q, const flashattn_tensor* k_cache, const flashattn_tensor* v_cache,
                              const flashattn_tensor* out, const flashattn_tensor* lse, const flashattn_kvcache* kv,
                              const flashattn_options* opts) {
  return guarded([&] {
    flashattn::Tensor alibi, idx[8];
    const flashattn::Options o = flashattn::detail::options_from_c(opts, &alibi);
    const flashattn::KvCache k = kvcache_from_c(kv, idx);
    flashattn::forward_kvcache(to_tensor(q, "q"), to_tensor(k_cache, "k_cache"), to_tensor(v_cache, "v_cache"),
                               to_tensor(out, "out"), to_tensor(lse, "lse"), k, o);
  });
}

void flashattn_options_init(flashattn_options* opts) {
  if (opts == nullptr) return;
  std::memset(opts, 0, sizeof(*opts));
  opts->struct_size = sizeof(flashattn_options);
}

int flashattn_forward(const flashattn_tensor* q, const flashattn_tensor* k,
                      const flashattn_tensor* v, const flashattn_tensor* out,
                      const flashattn_tensor* lse, const flashattn_options* opts) {
  return guarded([&] {
    flashattn::Tensor alibi;
    const flashattn::Options o = flashattn::detail::options_from_c(opts, &alibi);
    flashattn::forward(to_tensor(q, "q"), to_tensor(k, "k"), to_tensor(v, "v"),
                       to_tensor(out, "out"), to_tensor(lse, "lse"), o);
  });
}

int flashattn_backward(const flashattn_tensor* q, const flashattn_tensor* k,
                       const flashattn_tensor* v, const flashattn_tensor* out,
                       const flashattn_tensor* dout, const flashattn_tensor* lse,
                       const flashattn_tensor* dq, const flashattn_tensor* dk,
                       const flashattn_tensor* dv, const flashattn_options* opts) {
  return guarded([&] {
    flashattn::Tensor alibi;
    const flashattn::Options o = flashattn::detail::options_from_c(opts, &alibi);
    flashattn::backward(to_tensor(q, "q"), to_tensor(k, "k"), to_tensor(v, "v"),
                        to_tensor(out, "out"), to_tensor(dout, "dout"), to_tensor(lse, "lse"),
                        to_tensor(dq, "dq"), to_tensor(dk, "dk"), to_tensor(dv, "dv"), o);
  });
}

int flashattn_forward_varlen(const flashattn_tensor* q, const flashattn_tensor* k, const flashattn_tensor* v,
                             const flashattn_tensor* out, const flashattn_tensor* lse, const flashattn_varlen* varlen,
                             const flashattn_options* opts) {
  return guarded([&] {
    flashattn::Tensor alibi, idx[3];
    const flashattn::Options o = flashattn::detail::options_from_c(opts, &alibi);
    const flashattn::Varlen vl = varlen_from_c(varlen, idx);
    flashattn::forward_varlen(to_tensor(q, "q"), to_tensor(k, "k"), to_tensor(v, "v"), to_tensor(out, "out"),
                              to_tensor(lse, "lse"), vl, o);
  });
}

int flashattn_backward_varlen(const flashattn_tensor* q, const flashattn_tensor* k, const flashattn_tensor* v,
                              const flashattn_tensor* out, const flashattn_tensor* dout, const flashattn_tensor* lse,
                              const flashattn_tensor* dq, const flashattn_tensor* dk, const flashattn_tensor* dv,
                              const flashattn_varlen* varlen, const flashattn_options* opts) {
  return guarded([&] {
    flashattn::Tensor alibi, idx[3];
    const flashattn::Options o = flashattn::detail::options_from_c(opts, &alibi);
    const flashattn::Varlen vl = varlen_from_c(varlen, idx);
    flashattn::backward_varlen(to_tensor(q, "q"), to_tensor(k, "k"), to_tensor(v, "v"), to_tensor(out, "out"),
                               to_tensor(dout, "dout"), to_tensor(lse, "lse"), to_tensor(dq, "dq"), to_tensor(dk, "dk"),
                               to_tensor(dv, "dv"), vl, o);
  });
}

const char* flashattn_last_error(void) { return g_last_error.c_str(); }

const char* flashattn_status_string(int status) {
  switch (status) {
    case FLASHATTN_OK: return "ok";
    case FLASHATTN_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case FLASHATTN_ERROR_UNSUPPORTED: return "unsupported";
    case FLASHATTN_ERROR_BACKEND: return "backend error";
    case FLASHATTN_ERROR_OUT_OF_MEMORY: return "out of memory";
    case FLASHATTN_ERROR_INTERNAL: return "internal error";
    case FLASHATTN_ERROR_CANCELLED: return "cancelled";
    default: return "unknown status";
  }
}

const char* flashattn_version(void) { return "0.1.0"; }

#if defined(FLASHATTN_DEV_OVERRIDES)
// Kernel-selection overrides for tests and benchmarks in other languages (cuda/host/overrides.hpp):
// exported only by builds with FLASHATTN_DEV_OVERRIDES, and not part of the stable C ABI (no
// declaration in flashattn.h). value NULL or "": back to the library's choice.
__attribute__((visibility("default"))) int flashattn_dev_set_override(const char* name, const char* value) {
  return guarded([&] { flashattn::cuda::set_override(name, value); });
}
#endif

int flashattn_set_cpu_team_runner(flashattn_cpu_team_runner run, void* ctx) {
  return guarded([&] { flashattn::cpu::set_team_runner(run, ctx); });
}

int flashattn_cuda_take_check_failures(int32_t device, int64_t* failures) {
  return guarded([&] {
    if (failures == nullptr) throw flashattn::Error(flashattn::Status::InvalidArgument, "failures is NULL");
    *failures = flashattn::cuda_take_check_failures(device);
  });
}

int flashattn_cuda_available(void) {
  try {
    return flashattn::cuda_available() ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
