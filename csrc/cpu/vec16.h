// 16-lane float vectors through GCC vector extensions: AVX-512 where -march=native has it,
// pairs of AVX2 (or SSE) registers elsewhere, so the kernels build on any x86-64 or ARM machine.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <type_traits>
#include <utility>

namespace sluice::cpu {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
// Unaligned, aliasing views used only for loads and stores.
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2), may_alias));

inline v16 splat(float x) { return v16{} + x; }

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }

inline v16 load(const c10::BFloat16* p) {
#ifdef __AVX512F__
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  h16u h = *reinterpret_cast<const h16u*>(p);
  // A bf16 is the upper half of the float with the same bits.
  return reinterpret_cast<v16>(__builtin_convertvector(h, vu16) << 16);
#endif
}

inline v16 load(const c10::Half* p) {
#ifdef __AVX512F__
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  v16 r;
  for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(p[i]);
  return r;
#endif
}

inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// Round to nearest even on the upper half; NaNs become the canonical quiet NaN.
inline vu16 bf16_bits(v16 v) {
  const vu16 bits = reinterpret_cast<vu16>(v);
  const vu16 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  return v == v ? rounded : vu16{} + 0x7FC0u;
}

inline void store(c10::BFloat16* p, v16 v) {
  *reinterpret_cast<h16u*>(p) = __builtin_convertvector(bf16_bits(v), h16u);
}

// v rounded to T's precision and widened back, as torch rounds every op's result on T tensors.
template <typename T>
inline v16 round_to(v16 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return reinterpret_cast<v16>(bf16_bits(v) << 16);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    v16 r;
    for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(static_cast<c10::Half>(v[i]));
    return r;
  } else {
    return v;
  }
}

inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }

inline float hmax(v16 v) {
  v = vmax(v, __builtin_shuffle(v, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = vmax(v, __builtin_shuffle(v, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = vmax(v, __builtin_shuffle(v, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}

inline float hsum(v16 v) {
  v += __builtin_shuffle(v, vi16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi16{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi16{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi16{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// 2^x, relative error about 2e-7; lanes below -125 (including -inf) give exactly 0.
inline v16 exp2(v16 x) {
  const v16 lo = splat(-125.0f);
  v16 c = vmax(x, lo);
  c = c < splat(127.0f) ? c : splat(127.0f);
  // Adding and removing 1.5 * 2^23 rounds to the nearest integer without a rounding-mode change.
  const v16 magic = splat(12582912.0f);
  v16 n = (c + magic) - magic;
  v16 f = (c - n) * 0.69314718056f;
  v16 p = splat(1.0f / 720.0f);
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 r = p * reinterpret_cast<v16>(e);
  return x < lo ? v16{} : r;
}

// silu(gate) * up as torch computes it on T tensors: silu's result is rounded to T before the product
// (which the caller rounds). silu(g) = g / (1 + e^-g), with e^-g as 2^(-g log2 e).
template <typename T>
inline v16 silu_times(v16 gate, v16 up) {
  return round_to<T>(gate / (splat(1.0f) + exp2(gate * -1.4426950408889634f))) * up;
}

// In-place transpose of a 16x16 block held as 16 row vectors: swap off-diagonal sub-blocks of
// width 8, 4, 2, 1 in turn.
template <int S, bool Upper, int... J>
constexpr vi16 stage_mask(std::integer_sequence<int, J...>) {
  // Lower row keeps its own lanes and takes the partner's low lanes; upper row the reverse.
  if constexpr (Upper) {
    return vi16{((J & S) ? 16 + J : J + S)...};
  } else {
    return vi16{((J & S) ? 16 + J - S : J)...};
  }
}

template <int S>
inline void transpose_stage(v16* r) {
  constexpr vi16 lower = stage_mask<S, false>(std::make_integer_sequence<int, 16>{});
  constexpr vi16 upper = stage_mask<S, true>(std::make_integer_sequence<int, 16>{});
  for (int i = 0; i < 16; ++i) {
    if (i & S) continue;
    v16 a = r[i], b = r[i + S];
    r[i] = __builtin_shuffle(a, b, lower);
    r[i + S] = __builtin_shuffle(a, b, upper);
  }
}

inline void transpose16(v16* r) {
  transpose_stage<8>(r);
  transpose_stage<4>(r);
  transpose_stage<2>(r);
  transpose_stage<1>(r);
}

}  // namespace sluice::cpu
