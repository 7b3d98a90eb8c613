// bfloat16 as the kernels hold it: its 16 bits, the top half of a float32.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// bf16 read in pairs: each 32-bit lane of a load holds elements (2i, 2i + 1), low half
// first, so the even one widened to float32 is the lane shifted up 16 bits and the odd one
// the lane with its low half cleared: two integer ops, no shuffle.
#ifdef __AVX512F__
inline void WidenPairs(const Bf16* p, __m512& even, __m512& odd) {
  const __m512i lanes = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(int32_t(0xffff0000u))));
}
#endif
#ifdef __AVX2__
inline void WidenPairs(const Bf16* p, __m256& even, __m256& odd) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  odd = _mm256_castsi256_ps(
      _mm256_and_si256(lanes, _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u))));
}
#endif

}  // namespace metrale
