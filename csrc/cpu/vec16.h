// Float vectors through GCC vector extensions: 16 lanes (v16) are one AVX-512 register, two AVX2
// registers or four NEON ones, so the same kernel source builds at every tier; loads, stores and the
// roundings for each model dtype.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "dtypes.h"

namespace sluice::cpu {

// Float, int and half-width vectors of N lanes (GCC vector extensions), for the kernels that pick their
// width per tier (gemm_fma.h) and for v16 below.
template <int N>
struct Vec {
  typedef float f __attribute__((vector_size(N * 4)));
  typedef int32_t i __attribute__((vector_size(N * 4)));
  typedef uint32_t u __attribute__((vector_size(N * 4)));
  // Unaligned, aliasing views used only for loads and stores.
  typedef float fu __attribute__((vector_size(N * 4), aligned(4), may_alias));
  typedef uint32_t uu __attribute__((vector_size(N * 4), aligned(4), may_alias));
  typedef uint16_t hu __attribute__((vector_size(N * 2), aligned(2), may_alias));
};

template <typename V>
constexpr int lanes_of() {
  return int(sizeof(V) / sizeof(float));
}

typedef Vec<16>::f v16;
typedef Vec<16>::i vi16;
typedef Vec<16>::u vu16;

// The widest vector that is one register of this CPU: the type for values kept in registers across a loop
// (a v16 spans two AVX2 registers, and GCC keeps arrays of such in memory).
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#else
constexpr int kNativeLanes = 8;
#endif
typedef Vec<kNativeLanes>::f vn;
typedef Vec<kNativeLanes>::i vin;

// A vector's two halves, and one joined from two: compares, selects and conversions of a vector wider than
// a register are done half by half (GCC does them a lane at a time otherwise).
template <typename H, typename V>
inline H lower_half(V v) {
  static_assert(2 * sizeof(H) == sizeof(V));
  H h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}

template <typename H, typename V>
inline H upper_half(V v) {
  H h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + sizeof h, sizeof h);
  return h;
}

template <typename V, typename H>
inline V joined(H low, H high) {
  static_assert(2 * sizeof(H) == sizeof(V));
  V v;
  std::memcpy(&v, &low, sizeof low);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof low, &high, sizeof high);
  return v;
}

template <typename V>
constexpr bool wider_than_a_register() {
  return lanes_of<V>() > kNativeLanes;
}

template <typename V, size_t... I>
inline V splat_lanes(float x, std::index_sequence<I...>) {
  return V{(static_cast<void>(I), x)...};
}

// x in every lane: a broadcast (from memory where x is loaded), not V{} + x, which costs an add and a
// shuffle per splat.
template <typename V>
inline V splat_as(float x) {
  if constexpr (wider_than_a_register<V>()) {
    using H = typename Vec<lanes_of<V>() / 2>::f;
    return joined<V>(splat_as<H>(x), splat_as<H>(x));
  } else {
    return splat_lanes<V>(x, std::make_index_sequence<lanes_of<V>()>{});
  }
}

inline v16 splat(float x) { return splat_as<v16>(x); }

template <typename V>
inline V load_as(const float* p) {
  return *reinterpret_cast<const typename Vec<lanes_of<V>()>::fu*>(p);
}

template <typename V>
inline void store_as(float* p, V v) {
  *reinterpret_cast<typename Vec<lanes_of<V>()>::fu*>(p) = v;
}

// Widens N bf16: a bf16 is the upper half of the float with the same bits.
template <typename V>
inline V load_as(const bf16* p) {
  constexpr int n = lanes_of<V>();
  if constexpr (wider_than_a_register<V>()) {
    using H = typename Vec<n / 2>::f;
    return joined<V>(load_as<H>(p), load_as<H>(p + n / 2));
#if defined(__AVX2__) && !defined(__AVX512F__)
  } else if constexpr (n == 8) {
    // One zero-extension of 8 halves (GCC's own widening of the vector took four instructions).
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<V>(_mm256_slli_epi32(wide, 16));
#endif
  } else {
    const typename Vec<n>::hu h = *reinterpret_cast<const typename Vec<n>::hu*>(p);
    return reinterpret_cast<V>(__builtin_convertvector(h, typename Vec<n>::u) << 16);
  }
}

// Round to nearest even on the upper half; NaNs become the canonical quiet NaN.
template <typename V>
inline typename Vec<lanes_of<V>()>::u bf16_bits(V v) {
  using U = typename Vec<lanes_of<V>()>::u;
  if constexpr (wider_than_a_register<V>()) {
    using H = typename Vec<lanes_of<V>() / 2>::f;
    return joined<U>(bf16_bits(lower_half<H>(v)), bf16_bits(upper_half<H>(v)));
  } else {
    const U bits = reinterpret_cast<U>(v);
    const U rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
    return v == v ? rounded : U{} + 0x7FC0u;
  }
}

template <typename V>
inline void store_as(bf16* p, V v) {
  constexpr int n = lanes_of<V>();
  *reinterpret_cast<typename Vec<n>::hu*>(p) = __builtin_convertvector(bf16_bits(v), typename Vec<n>::hu);
}

// Halves through the hardware's conversions: F16C on x86 (8 lanes at a time), FCVT on aarch64.
template <typename V>
inline V load_as(const fp16* p) {
  constexpr int n = lanes_of<V>();
#if defined(__x86_64__)
  static_assert(n % 8 == 0, "F16C converts 8 halves at a time");
  V r;
  for (int i = 0; i < n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    std::memcpy(reinterpret_cast<float*>(&r) + i, &x, sizeof x);
  }
  return r;
#else
  typedef __fp16 vh __attribute__((vector_size(n * 2), aligned(2), may_alias));
  return __builtin_convertvector(*reinterpret_cast<const vh*>(p), V);
#endif
}

template <typename V>
inline void store_as(fp16* p, V v) {
  constexpr int n = lanes_of<V>();
#if defined(__x86_64__)
  static_assert(n % 8 == 0, "F16C converts 8 halves at a time");
  for (int i = 0; i < n; i += 8) {
    __m256 x;
    std::memcpy(&x, reinterpret_cast<const float*>(&v) + i, sizeof x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
#else
  typedef __fp16 vh __attribute__((vector_size(n * 2), aligned(2), may_alias));
  *reinterpret_cast<vh*>(p) = __builtin_convertvector(v, vh);
#endif
}

inline v16 load(const float* p) { return load_as<v16>(p); }

inline v16 load(const bf16* p) {
#ifdef __AVX512F__
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  return load_as<v16>(p);
#endif
}

inline v16 load(const fp16* p) { return load_as<v16>(p); }

template <typename T>
inline void store(T* p, v16 v) {
  store_as(p, v);
}

// v rounded to T's precision and widened back, as torch rounds every op's result on T tensors
// (dtypes.h has the scalar round_to).
template <typename T, typename V, typename = std::enable_if_t<!std::is_same_v<V, float>>>
inline V round_to(V v) {
  constexpr int n = lanes_of<V>();
  if constexpr (std::is_same_v<T, bf16>) {
    return reinterpret_cast<V>(bf16_bits(v) << 16);
  } else if constexpr (std::is_same_v<T, fp16>) {
    uint16_t h[n];
    store_as(reinterpret_cast<fp16*>(h), v);
    return load_as<V>(reinterpret_cast<const fp16*>(h));
  } else {
    return v;
  }
}

// 2^x, relative error about 2e-7; lanes below -125 (including -inf) give exactly 0.
template <typename V>
inline V exp2(V x) {
  if constexpr (wider_than_a_register<V>()) {
    using H = typename Vec<lanes_of<V>() / 2>::f;
    return joined<V>(exp2(lower_half<H>(x)), exp2(upper_half<H>(x)));
  } else {
    using I = typename Vec<lanes_of<V>()>::i;
    const V lo = splat_as<V>(-125.0f);
    V c = x > lo ? x : lo;
    c = c < splat_as<V>(127.0f) ? c : splat_as<V>(127.0f);
    // Adding and removing 1.5 * 2^23 rounds to the nearest integer without a rounding-mode change.
    const V magic = splat_as<V>(12582912.0f);
    V n = (c + magic) - magic;
    V f = (c - n) * 0.69314718056f;
    V p = splat_as<V>(1.0f / 720.0f);
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    I e = (__builtin_convertvector(n, I) + 127) << 23;
    V r = p * reinterpret_cast<V>(e);
    return x < lo ? V{} : r;
  }
}

// c tanh(x / c): attention scores soft-capped at c (Gemma 2), as c (1 - 2 / (e^(2x / c) + 1)), whose
// absolute error is about 1e-7 c; lanes far past c give exactly +-c.
template <typename V>
inline V soft_cap(V x, float c) {
  const V e = exp2(x * (2.0f * 1.4426950408889634f / c));
  return (splat_as<V>(1.0f) - splat_as<V>(2.0f) / (e + 1.0f)) * c;
}

// silu(gate) * up as torch computes it on T tensors: silu's result is rounded to T before the product
// (which the caller rounds). silu(g) = g / (1 + e^-g), with e^-g as 2^(-g log2 e).
template <typename T, typename V>
inline V silu_times(V gate, V up) {
  return round_to<T>(gate / (splat_as<V>(1.0f) + exp2(gate * -1.4426950408889634f))) * up;
}

template <typename V, typename = std::enable_if_t<!std::is_same_v<V, v16>>>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}

inline v16 vmax(v16 a, v16 b) {
  if constexpr (wider_than_a_register<v16>()) {
    return joined<v16>(vmax(lower_half<vn>(a), lower_half<vn>(b)), vmax(upper_half<vn>(a), upper_half<vn>(b)));
  } else {
    return a > b ? a : b;
  }
}

// The horizontal max and sum of 16 lanes, and a 16x16 transpose. On AVX-512 they are shuffles of one
// register; elsewhere a v16 spans registers, and GCC turns shuffles across them into one move per lane,
// so they are written over 8-lane halves (AVX2 intrinsics; plain per-lane code on other CPUs).
#if defined(__AVX512F__)

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

#else

typedef Vec<8>::f v8;

inline v8 low_half(v16 v) {
  v8 h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}

inline v8 high_half(v16 v) {
  v8 h;
  std::memcpy(&h, reinterpret_cast<const char*>(&v) + sizeof h, sizeof h);
  return h;
}

inline v16 join_halves(v8 low, v8 high) {
  v16 v;
  std::memcpy(&v, &low, sizeof low);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof low, &high, sizeof high);
  return v;
}

#if defined(__AVX2__)

inline float hmax(v8 m) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(__m256(m)), _mm256_extractf128_ps(__m256(m), 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
}

inline float hsum(v8 s) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(__m256(s)), _mm256_extractf128_ps(__m256(s), 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

inline float hmax(v16 v) { return hmax(v8(_mm256_max_ps(__m256(low_half(v)), __m256(high_half(v))))); }

inline float hsum(v16 v) { return hsum(low_half(v) + high_half(v)); }

// The 8x8 transpose of eight rows: unpack pairs of rows, shuffle pairs of pairs, swap 128-bit halves.
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// The four 8x8 blocks of the 16x16 block, each transposed, and the off-diagonal ones swapped.
inline void transpose16(v16* r) {
  __m256 top_left[8], top_right[8], bottom_left[8], bottom_right[8];
  for (int i = 0; i < 8; ++i) {
    top_left[i] = __m256(low_half(r[i]));
    top_right[i] = __m256(high_half(r[i]));
    bottom_left[i] = __m256(low_half(r[i + 8]));
    bottom_right[i] = __m256(high_half(r[i + 8]));
  }
  transpose8(top_left);
  transpose8(top_right);
  transpose8(bottom_left);
  transpose8(bottom_right);
  for (int i = 0; i < 8; ++i) {
    r[i] = join_halves(v8(top_left[i]), v8(bottom_left[i]));
    r[i + 8] = join_halves(v8(top_right[i]), v8(bottom_right[i]));
  }
}

// Lane i of the result is the sum of a[i]'s 8 lanes, for four vectors at once.
inline void sum4(const v8* a, float* out) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(__m256(a[0]), __m256(a[1])),
                                  _mm256_hadd_ps(__m256(a[2]), __m256(a[3])));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

#else

inline float hmax(v8 v) {
  float top = v[0];
  for (int i = 1; i < 8; ++i) top = v[i] > top ? v[i] : top;
  return top;
}

inline float hsum(v8 v) {
  float sum = 0.0f;
  for (int i = 0; i < 8; ++i) sum += v[i];
  return sum;
}

inline float hmax(v16 v) {
  const v8 low = low_half(v), high = high_half(v);
  return hmax(v8(low > high ? low : high));
}

inline float hsum(v16 v) { return hsum(low_half(v) + high_half(v)); }

inline void transpose16(v16* r) {
  float block[16][16];
  std::memcpy(block, r, sizeof block);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) r[i][j] = block[j][i];
}

inline void sum4(const v8* a, float* out) {
  for (int i = 0; i < 4; ++i) {
    float sum = 0.0f;
    for (int l = 0; l < 8; ++l) sum += a[i][l];
    out[i] = sum;
  }
}

#endif
#endif

}  // namespace sluice::cpu
