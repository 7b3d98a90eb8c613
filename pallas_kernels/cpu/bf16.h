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

}  // namespace metrale
