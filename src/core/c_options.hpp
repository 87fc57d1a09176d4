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

// nullptr means all defaults. Throws Error(InvalidArgument) when struct_size is below version 1.
inline Options options_from_c(const flashattn_options* o) {
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
  return r;
}

}  // namespace flashattn::detail
