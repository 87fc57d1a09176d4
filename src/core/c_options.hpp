// flashattn_options (C) -> flashattn::Options (C++), honouring struct_size. In a header of its own
// so that tests/test_c_api.cpp can check, field by field, which fields an older caller's smaller
// struct yields: defaults such as deterministic = false leave no trace in CPU results.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashattn/flashattn.h"
#include "flashattn/flashattn.hpp"

namespace flashattn::detail {

static_assert(sizeof(void*) != 8 || offsetof(flashattn_options, max_flops) == FLASHATTN_OPTIONS_V3_SIZE,
              "version 3 of flashattn_options ends where max_flops starts (64-bit pointers)");
static_assert(sizeof(void*) != 8 || offsetof(flashattn_options, workspace) == FLASHATTN_OPTIONS_V4_SIZE,
              "version 4 of flashattn_options ends where workspace starts (64-bit pointers)");

// nullptr means all defaults. Throws Error(InvalidArgument) when struct_size is below version 1.
// The ALiBi slopes' view is copied into *alibi_storage (which must outlive the Options).
inline Options options_from_c(const flashattn_options* o, Tensor* alibi_storage = nullptr) {
  Options r;
  if (o == nullptr) return r;
  if (o->struct_size < FLASHATTN_OPTIONS_V1_SIZE)
    throw Error(Status::InvalidArgument,
                "opts->struct_size = " + std::to_string(o->struct_size) +
                    " is too small (at least " + std::to_string(FLASHATTN_OPTIONS_V1_SIZE) +
                    "; set it to sizeof(flashattn_options) or call flashattn_options_init)");
  // Read only the fields the caller's struct has: newer fields keep their defaults. A field past
  // struct_size may lie past the caller's allocation, so it must not even be loaded.
  auto has = [&](size_t offset, size_t size) { return o->struct_size >= offset + size; };
  r.softmax_scale = o->softmax_scale;
  r.mask = static_cast<Mask>(o->mask);
  r.stream = o->stream;
  if (has(offsetof(flashattn_options, num_threads), sizeof(int32_t))) r.num_threads = o->num_threads;
  if (has(offsetof(flashattn_options, precision), sizeof(int32_t)))
    r.precision = static_cast<Precision>(o->precision);
  if (has(offsetof(flashattn_options, deterministic), sizeof(int32_t)))
    r.deterministic = o->deterministic != 0;
  if (has(offsetof(flashattn_options, sliding_window), sizeof(int32_t)) && o->sliding_window != 0) {
    r.window_left = o->window_left;
    r.window_right = o->window_right;
  }
  if (has(offsetof(flashattn_options, softcap), sizeof(float))) r.softcap = o->softcap;
  if (has(offsetof(flashattn_options, max_flops), sizeof(double))) r.max_flops = o->max_flops;
  if (has(offsetof(flashattn_options, cancel_arg), sizeof(void*))) {
    r.cancel = o->cancel;
    r.cancel_arg = o->cancel_arg;
  }
  if (has(offsetof(flashattn_options, workspace_query), sizeof(void*))) {
    r.workspace = o->workspace;
    r.workspace_bytes = o->workspace_bytes;
    r.workspace_query = o->workspace_query;
  }
  if (has(offsetof(flashattn_options, alibi_slopes), sizeof(void*)) && o->alibi_slopes != nullptr)
  {
    const flashattn_tensor* t = o->alibi_slopes;
    if (t->ndim < 1 || t->ndim > 2)
      throw Error(Status::InvalidArgument, "opts->alibi_slopes->ndim = " + std::to_string(t->ndim) +
                                               ", expected 1 ([Hq]) or 2 ([B, Hq])");
    Tensor a;
    a.data = t->data;
    a.dtype = static_cast<DType>(t->dtype);
    a.device = t->device;
    a.ndim = t->ndim;
    for (int i = 0; i < t->ndim; ++i) {
      a.shape[i] = t->shape[i];
      a.stride[i] = t->stride[i];
    }
    if (alibi_storage == nullptr) throw Error(Status::Internal, "options_from_c: no storage for alibi_slopes");
    *alibi_storage = a;
    r.alibi_slopes = alibi_storage;
  }
  return r;
}

}  // namespace flashattn::detail
