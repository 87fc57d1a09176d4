// Developer overrides of kernel selection (overrides.hpp). Host code only.
#include "cuda/host/overrides.hpp"

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <string>

#include "flashattn/flashattn.hpp"

namespace flashattn::cuda {
namespace {

// The index of `value` in `names`, or -1 when unset; anything else names the variable and choices.
int choice(const char* var, const char* value, std::initializer_list<const char*> names) {
  if (value == nullptr || *value == '\0') return -1;
  int i = 0;
  std::string list;
  for (const char* n : names) {
    if (std::strcmp(value, n) == 0) return i;
    list += (i == 0 ? "" : i + 1 == static_cast<int>(names.size()) ? " or " : ", ") + std::string(n);
    ++i;
  }
  throw Error(Status::InvalidArgument, std::string(var) + " = '" + value + "' is unknown (" + list + ")");
}

// A count in [0, max] (or, with allow_sms, "sms" -> -2); -1 when unset.
long count(const char* var, const char* value, long max, bool allow_sms, const char* meaning) {
  if (value == nullptr || *value == '\0') return -1;
  if (allow_sms && std::strcmp(value, "sms") == 0) return -2;
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (*end != '\0' || v < 0 || v > max)
    throw Error(Status::InvalidArgument, std::string(var) + " = '" + value + "' is not " + meaning);
  return v;
}

// Applies one variable to `o`; false when `var` is not a knob.
bool apply(Overrides& o, const char* var, const char* v) {
  auto is = [&](const char* n) { return std::strcmp(var, n) == 0; };
  if (is("FLASHATTN_CUDA_ARCH")) o.arch = choice(var, v, {"sm80", "sm90"});
  else if (is("FLASHATTN_CUDA_MATH")) o.math = choice(var, v, {"fma", "tf32", "3xtf32"});
  else if (is("FLASHATTN_CUDA_BWD")) o.bwd = choice(var, v, {"split", "atomic", "ordered"});
  else if (is("FLASHATTN_CUDA_SM90_VARIANT")) o.sm90_variant = choice(var, v, {"0", "1"});
  else if (is("FLASHATTN_CUDA_PINGPONG")) o.pingpong = choice(var, v, {"0", "1"});
  else if (is("FLASHATTN_CUDA_TF32_FWD_COPIES")) o.tf32_fwd_copies = choice(var, v, {"none", "v", "kv"});
  else if (is("FLASHATTN_CUDA_FP32_FWD")) o.fp32_fwd = choice(var, v, {"mma", "wgmma"});
  else if (is("FLASHATTN_CUDA_TF32_BWD")) o.tf32_bwd = choice(var, v, {"mma", "wgmma-dq", "wgmma", "pair"});
  else if (is("FLASHATTN_CUDA_FP32_BWD")) o.fp32_bwd = choice(var, v, {"mma", "wgmma"});
  else if (is("FLASHATTN_CUDA_PERSISTENT_CTAS"))
    o.persistent_ctas = count(var, v, 1000000, true, "a count or 'sms' (0: one CTA per block)");
  else if (is("FLASHATTN_CUDA_FWD_CTAS"))
    o.fwd_ctas = count(var, v, 1000000, true, "a count or 'sms' (0: one CTA per block)");
  else if (is("FLASHATTN_CUDA_CONVERT_CTAS")) o.convert_ctas = count(var, v, 100000, false, "a count (0: no side stream)");
  else if (is("FLASHATTN_CUDA_PACKED_GRID")) o.packed_grid = choice(var, v, {"dense", "compact"});
  else if (is("FLASHATTN_CUDA_DECODE_LOADER")) o.decode_loader = choice(var, v, {"bulk", "rows", "generic"});
  else if (is("FLASHATTN_CUDA_DECODE_STAGES")) o.decode_stages = choice(var, v, {"2", "3", "4"});
  else if (is("FLASHATTN_CUDA_KV_CHECK")) o.kv_check = choice(var, v, {"host", "device"});
  else if (is("FLASHATTN_CUDA_DECODE_STREAMS")) o.decode_streams = 1 + choice(var, v, {"1", "2", "3", "4"});
  else if (is("FLASHATTN_CUDA_ORD_HEADS")) o.ord_heads = choice(var, v, {"0", "1"});
  else if (is("FLASHATTN_CUDA_ATOMIC_HEADS")) o.atomic_heads = choice(var, v, {"0", "1"});
  else if (is("FLASHATTN_CUDA_KEY_CHUNK")) {
    o.key_chunk = count(var, v, long{1} << 30, false, "a count of keys (a multiple of 128; 0: no chunks)");
    if (o.key_chunk > 0 && o.key_chunk % 128 != 0)
      throw Error(Status::InvalidArgument, std::string(var) + " = '" + v + "' is not a multiple of 128");
  } else return false;
  return true;
}

constexpr const char* kVars[] = {
    "FLASHATTN_CUDA_ARCH",    "FLASHATTN_CUDA_MATH",     "FLASHATTN_CUDA_BWD",
    "FLASHATTN_CUDA_SM90_VARIANT", "FLASHATTN_CUDA_PINGPONG", "FLASHATTN_CUDA_TF32_FWD_COPIES",
    "FLASHATTN_CUDA_FP32_FWD", "FLASHATTN_CUDA_TF32_BWD", "FLASHATTN_CUDA_FP32_BWD",
    "FLASHATTN_CUDA_PERSISTENT_CTAS", "FLASHATTN_CUDA_CONVERT_CTAS", "FLASHATTN_CUDA_FWD_CTAS", "FLASHATTN_CUDA_PACKED_GRID",
    "FLASHATTN_CUDA_KEY_CHUNK", "FLASHATTN_CUDA_DECODE_LOADER", "FLASHATTN_CUDA_DECODE_STAGES", "FLASHATTN_CUDA_KV_CHECK",
    "FLASHATTN_CUDA_DECODE_STREAMS", "FLASHATTN_CUDA_ORD_HEADS", "FLASHATTN_CUDA_ATOMIC_HEADS"};

#if defined(FLASHATTN_DEV_OVERRIDES)
std::mutex& mutex() {
  static std::mutex m;
  return m;
}
// The process's overrides, read from the environment on first use (callers hold mutex()). A bad
// value throws once, from that first call; the environment is then not read again and every knob
// stays at the library's choice.
Overrides& current() {
  static Overrides o;
  static bool read = false;
  if (!read) {
    read = true;
    o = parse_overrides([](const char* n, void*) -> const char* { return std::getenv(n); }, nullptr);
  }
  return o;
}
#endif

}  // namespace

Overrides parse_overrides(const char* (*lookup)(const char* name, void* ctx), void* ctx) {
  Overrides o;
  for (const char* var : kVars) apply(o, var, lookup(var, ctx));
  return o;
}

#if defined(FLASHATTN_DEV_OVERRIDES)
bool overrides_enabled() { return true; }
Overrides overrides() {
  const std::lock_guard<std::mutex> lock(mutex());
  return current();
}
void set_override(const char* name, const char* value) {
  const std::lock_guard<std::mutex> lock(mutex());
  Overrides o = current();
  if (name == nullptr || !apply(o, name, value))
    throw Error(Status::InvalidArgument, std::string("set_override: '") + (name ? name : "(null)") +
                                             "' is not a FLASHATTN_CUDA_* override");
  current() = o;
}
#else
bool overrides_enabled() { return false; }
Overrides overrides() { return Overrides{}; }
void set_override(const char*, const char*) {
  throw Error(Status::Unsupported, "this build has no kernel-selection overrides (FLASHATTN_DEV_OVERRIDES=OFF)");
}
#endif

}  // namespace flashattn::cuda
