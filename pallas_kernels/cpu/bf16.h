// bfloat16 as the kernels hold it: its 16 bits, the top half of a float32.
#pragma once

#include <cstdint>
#include <cstring>

namespace metrale {

using Bf16 = uint16_t;

inline float ToFloat(float x) { return x; }
inline float ToFloat(Bf16 x) {
  const uint32_t bits = uint32_t{x} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 -> bfloat16, rounded to nearest even (as XLA converts); NaN stays a (quiet) NaN.
inline Bf16 ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<Bf16>((bits >> 16) | 0x40u);
  return static_cast<Bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <typename T>
inline T FromFloat(float f) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return f;
  } else {
    return ToBf16(f);
  }
}

}  // namespace metrale
