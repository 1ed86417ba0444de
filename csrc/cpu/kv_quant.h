// The quantized KV cache formats (--kv-cache-dtype int8 | fp8_e4m3): each cached row (one token's key or
// value for one KV head) is head_dim one-byte values followed by a float32 scale, so a row is read with
// one stream and a value is `widened byte * scale`. One scale per row keeps the error of a row bounded by
// its own largest element, whatever the other heads and tokens hold. A quantized cache is head-major
// within a block, [num_blocks, kv_heads, block_size, row]: a work item reads one head, and its 16 rows of
// 68 bytes (head_dim 64) then span 17 cache lines, where token-major they would span 32, as many as bf16.
//   int8:     q = round(x * 127 / amax), scale = amax / 127.
//   fp8_e4m3: q = e4m3(x * 448 / amax) (round to nearest even), scale = amax / 448 * 256: the bits are
//             widened as float16 patterns (an e4m3 shifted into a half is the value / 256; subnormals stay
//             subnormal), so the 256 lives in the scale and the read is one F16C conversion.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "ops.h"
#include "vec16.h"

namespace sluice::cpu {

struct q8 {
  int8_t bits;
};
struct e4m3 {
  uint8_t bits;
};

constexpr int kKvScaleBytes = int(sizeof(float));
// The widest row a quantized cache takes (a write widens one row to floats on the stack).
constexpr int kMaxKvHeadDim = 1024;

inline bool is_quantized_cache(DType t) { return t == DType::kInt8 || t == DType::kFp8E4M3; }

// Elements (of the cache's dtype) from one row of the cache to the next.
inline int64_t cache_row_elems(DType t, int64_t head_dim) {
  return is_quantized_cache(t) ? head_dim + kKvScaleBytes : head_dim;
}

// Where a cache row lives, in elements of the cache's dtype: block * block + head * head + offset * token.
struct RowStrides {
  int64_t block, head, token;
};

inline RowStrides cache_row_strides(const KvCache& cache) {
  const int64_t row = cache_row_elems(cache.dtype, cache.head_dim);
  if (is_quantized_cache(cache.dtype)) return {cache.kv_heads * cache.block_size * row, cache.block_size * row, row};
  return {cache.block_size * cache.kv_heads * row, row, cache.kv_heads * row};
}

template <typename C>
constexpr bool kQuantizedRows = std::is_same_v<C, q8> || std::is_same_v<C, e4m3>;

template <typename C>
constexpr int cache_row_bytes(int head_dim) {
  return kQuantizedRows<C> ? head_dim + kKvScaleBytes : head_dim * int(sizeof(C));
}

// What a row's widened values are multiplied by: its stored scale, or 1 for float rows.
template <typename C>
inline float row_scale(const C* row, int head_dim) {
  if constexpr (kQuantizedRows<C>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof s);
    return s;
  } else {
    return 1.0f;
  }
}

// Byte vectors of N lanes (unaligned, aliasing loads), and the halves they widen to.
template <int N>
struct ByteVec {
  typedef int8_t s __attribute__((vector_size(N), aligned(1), may_alias));
  typedef uint8_t u __attribute__((vector_size(N), aligned(1), may_alias));
  typedef uint16_t h __attribute__((vector_size(N * 2)));
};

// Widens N int8 values to float.
template <typename V>
inline V load_as(const q8* p) {
  constexpr int n = lanes_of<V>();
  if constexpr (wider_than_a_register<V>()) {
    using H = typename Vec<n / 2>::f;
    return joined<V>(load_as<H>(p), load_as<H>(p + n / 2));
#if defined(__AVX512F__)
  } else if constexpr (n == 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<V>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
#endif
#if defined(__AVX2__)
  } else if constexpr (n == 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<V>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#endif
  } else {
    return __builtin_convertvector(*reinterpret_cast<const typename ByteVec<n>::s*>(p), V);
  }
}

// Widens N e4m3 values to float / 256 (see the top of this file): sign to bit 15, the rest to bits 7..14.
template <typename V>
inline V load_as(const e4m3* p) {
  constexpr int n = lanes_of<V>();
#if defined(__x86_64__)
  if constexpr (wider_than_a_register<V>()) {
    using Half = typename Vec<n / 2>::f;
    return joined<V>(load_as<Half>(p), load_as<Half>(p + n / 2));
  } else if constexpr (n == 8) {
    const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                                      _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
    return reinterpret_cast<V>(_mm256_cvtph_ps(half));
#if defined(__AVX512F__)
  } else if constexpr (n == 16) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
    return reinterpret_cast<V>(_mm512_cvtph_ps(half));
#endif
  }
#endif
  using H = typename ByteVec<n>::h;
  const H b = __builtin_convertvector(*reinterpret_cast<const typename ByteVec<n>::u*>(p), H);
  const H half = ((b & 0x80) << 8) | ((b & 0x7F) << 7);
  uint16_t bits[n];
  std::memcpy(bits, &half, sizeof bits);
  return load_as<V>(reinterpret_cast<const fp16*>(bits));
}

inline v16 load(const q8* p) { return load_as<v16>(p); }
inline v16 load(const e4m3* p) { return load_as<v16>(p); }

// e4m3 (no infinities, 0x7F the NaN) nearest to f, ties to even, saturated at +-448.
inline uint8_t e4m3_bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const float a = std::fabs(f);
  if (!(a < 448.0f)) return sign | 0x7E;
  // Below the smallest normal (2^-6) the values are multiples of 2^-9; 8 of them is 2^-6 itself.
  if (a < 0.015625f) return sign | uint8_t(std::nearbyint(a * 512.0f));
  const uint32_t m = u & 0x7FFFFFFFu;
  const uint32_t r = (m + 0x7FFFFu + ((m >> 20) & 1u)) >> 20;  // 8 exponent bits, 3 mantissa bits
  const uint32_t bits = r - ((127u - 7u) << 3);
  return sign | uint8_t(bits > 0x7Eu ? 0x7Eu : bits);
}

// Writes one row: dim quantized values of x, then the scale.
template <typename C>
void quantize_row(const float* x, int dim, C* row) {
  float amax = 0.0f;
  for (int d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  float scale;
  if constexpr (std::is_same_v<C, q8>) {
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int d = 0; d < dim; ++d) row[d].bits = int8_t(std::nearbyint(x[d] * inv));
    scale = amax / 127.0f;
  } else {
    static_assert(std::is_same_v<C, e4m3>);
    const float inv = amax > 0.0f ? 448.0f / amax : 0.0f;
    for (int d = 0; d < dim; ++d) row[d].bits = e4m3_bits_of(x[d] * inv);
    scale = amax / 448.0f * 256.0f;
  }
  std::memcpy(row + dim, &scale, sizeof scale);
}

}  // namespace sluice::cpu
