// Scalar conversions between the model dtypes and float, written branch-free so that the
// compiler vectorises the loops that use them.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace sluice::cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    // Round to nearest even on the upper half; a NaN becomes the canonical quiet NaN.
    const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    return c10::BFloat16(static_cast<uint16_t>(f != f ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(f);
  }
}

// f rounded to T's precision, as torch rounds the result of every op on T tensors.
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

}  // namespace sluice::cpu
