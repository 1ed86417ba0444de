// The model dtypes as the kernels store them (bf16 and fp16 as their 16-bit patterns), and exact
// conversions to and from float: round to nearest even, as torch rounds every op's result.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "check.h"

#if defined(__x86_64__)
#include <immintrin.h>
#elif !defined(__aarch64__)
#error "Sluice's CPU kernels are built for x86-64 and aarch64; other CPUs run on torch's own ops (--cpu-isa none)"
#endif

namespace sluice::cpu {

// The codes that cross the C ABI (abi.h); Python's worker/native_ops.py uses the same numbers. kInt8 and
// kFp8E4M3 are KV cache formats only (kv_quant.h): rows of one-byte values, each row followed by its scale.
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3, kFp8E4M3 = 4 };

struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, bf16>) return DType::kBFloat16;
  return DType::kFloat16;
}

inline int dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kBFloat16:
    case DType::kFloat16: return 2;
    case DType::kInt8:
    case DType::kFp8E4M3: return 1;
  }
  fail("unknown dtype code ", int32_t(t));
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kInt8: return "int8";
    case DType::kFp8E4M3: return "fp8_e4m3";
  }
  return "an unknown dtype";
}

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  // A bf16 is the upper half of the float with the same bits.
  const uint32_t bits = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Every x86 tier has F16C and every aarch64 CPU converts halves in hardware: no software path.
inline float to_float(fp16 x) {
#if defined(__x86_64__)
  return _cvtsh_ss(x.bits);
#else
  __fp16 h;
  std::memcpy(&h, &x.bits, sizeof h);
  return float(h);
#endif
}

inline uint16_t bf16_bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  // Round to nearest even on the upper half; a NaN becomes the canonical quiet NaN.
  const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return uint16_t(f != f ? 0x7FC0u : rounded);
}

inline uint16_t fp16_bits_of(float f) {
#if defined(__x86_64__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  const __fp16 h = __fp16(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
#endif
}

template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, bf16>) {
    return bf16{bf16_bits_of(f)};
  } else if constexpr (std::is_same_v<T, fp16>) {
    return fp16{fp16_bits_of(f)};
  } else {
    return f;
  }
}

// f rounded to T's precision, as torch rounds the result of every op on T tensors.
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

// Calls body(T{}) with T the C++ type of `type`, one of the activation dtypes.
template <typename F>
void dispatch_dtype(DType type, F&& body) {
  switch (type) {
    case DType::kFloat32: body(float{}); return;
    case DType::kBFloat16: body(bf16{}); return;
    case DType::kFloat16: body(fp16{}); return;
    case DType::kInt8:
    case DType::kFp8E4M3: break;
  }
  fail("activations are float32, bfloat16 or float16, not ", dtype_name(type));
}

}  // namespace sluice::cpu
