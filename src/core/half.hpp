// float16 / bfloat16 <-> float32 conversions on the host (round to nearest even), header-only so
// the CPU backend's inner loops can inline them. NaN stays NaN; overflow gives inf.
#pragma once

#include <cstdint>
#include <cstring>

namespace flashattn {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24
    float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (au >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u); // overflow -> inf
  if (au < 0x38800000u) {
    // subnormal or zero in half: round(|f| * 2^24) to nearest even
    float a = bits_to_float(au) * 16777216.0f;  // exact scaling
    uint32_t m = static_cast<uint32_t>(a);
    float rem = a - static_cast<float>(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t e = ((au >> 23) - 112u) << 10;
  uint32_t m = (au >> 13) & 0x3ffu;
  uint32_t r = au & 0x1fffu;
  uint32_t h = e | m;
  if (r > 0x1000u || (r == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

}  // namespace flashattn
