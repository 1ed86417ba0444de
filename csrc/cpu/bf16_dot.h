// bf16 x bf16 -> fp32 pair dot products (AVX512_BF16) for bf16 queries and caches: half the
// multiply-adds of widening to float, and K needs only half as many transposes. Operands are
// 32-bit lanes holding two bf16 values, so keys are transposed as pairs of dims and values are
// interleaved as pairs of keys.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SLUICE_BF16_DOT 1

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

#include "vec16.h"

namespace sluice::cpu::bf16dot {

constexpr int kMaxDim = 1024;
// Stands in for rows past the end of the context so that 0 * garbage never reaches an accumulator.
alignas(64) inline const uint16_t kZeroRow[kMaxDim] = {};

inline __m512 as_ps(__m512i v) { return _mm512_castsi512_ps(v); }
inline __m512i as_si(__m512 v) { return _mm512_castps_si512(v); }

// kp[dp * 16 + key] holds dims (2 dp, 2 dp + 1) of each of the 16 keys.
inline void pack_keys(const uint16_t* const* rows, int dim, uint32_t* kp) {
  for (int d0 = 0; d0 < dim; d0 += 32) {
    v16 r[16];
    for (int i = 0; i < 16; ++i) r[i] = reinterpret_cast<v16>(as_ps(_mm512_loadu_si512(rows[i] + d0)));
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(kp + (d0 / 2 + j) * 16, as_si(r[j]));
  }
}

template <int R>
void qk_rows(const uint32_t* q, int dim, const uint32_t* kp, float* s) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int half = dim / 2;
  for (int dp = 0; dp < half; ++dp) {
    const __m512bh k = (__m512bh)_mm512_loadu_si512(kp + dp * 16);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(int(q[r * half + dp])), k);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * 16, acc[r]);
}

template <int... I>
constexpr auto make_qk_table(std::integer_sequence<int, I...>) {
  return std::array<void (*)(const uint32_t*, int, const uint32_t*, float*), sizeof...(I)>{&qk_rows<I + 1>...};
}

inline void qk(const uint32_t* q, int dim, const uint32_t* kp, int rows, float* s) {
  constexpr int kRows = 12;
  static constexpr auto table = make_qk_table(std::make_integer_sequence<int, kRows>{});
  int r = 0;
  for (; r + kRows <= rows; r += kRows) qk_rows<kRows>(q + r * dim / 2, dim, kp, s + r * 16);
  if (r < rows) table[rows - r - 1](q + r * dim / 2, dim, kp, s + r * 16);
}

// Probabilities of 16 keys as 8 bf16 pairs, rounded to nearest even.
inline void store_probs(v16 p, uint32_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(reinterpret_cast<__m512>(p)));
}

// acc[r] = acc[r] * alpha[r] + sum over key pairs of probs x interleaved values, for Z vectors of 16
// dims starting at `off`. `pairs` key pairs are read; rows past the context are kZeroRow.
template <int R, int Z>
void pv_rows(float* acc, int dim, const uint32_t* probs, const float* alpha, const uint16_t* const* v, int pairs,
             int off) {
  static_assert(Z % 2 == 0, "values are interleaved 32 dims at a time");
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  __m512 a[R][Z];
  for (int r = 0; r < R; ++r)
    for (int z = 0; z < Z; ++z)
      a[r][z] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * dim + off + z * 16), _mm512_set1_ps(alpha[r]));
  for (int i = 0; i < pairs; ++i) {
    __m512bh vv[Z];
    for (int z = 0; z < Z; z += 2) {
      const __m512i x = _mm512_loadu_si512(v[2 * i] + off + z * 16);
      const __m512i y = _mm512_loadu_si512(v[2 * i + 1] + off + z * 16);
      vv[z] = (__m512bh)_mm512_permutex2var_epi16(x, lo_idx, y);
      vv[z + 1] = (__m512bh)_mm512_permutex2var_epi16(x, hi_idx, y);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(probs[r * 8 + i]));
      for (int z = 0; z < Z; ++z) a[r][z] = _mm512_dpbf16_ps(a[r][z], w, vv[z]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int z = 0; z < Z; ++z) _mm512_storeu_ps(acc + r * dim + off + z * 16, a[r][z]);
}

template <int R>
void pv_row_group(float* acc, int dim, const uint32_t* probs, const float* alpha, const uint16_t* const* v,
                  int pairs) {
  int off = 0;
  for (; off + 64 <= dim; off += 64) pv_rows<R, 4>(acc, dim, probs, alpha, v, pairs, off);
  if (off < dim) pv_rows<R, 2>(acc, dim, probs, alpha, v, pairs, off);
}

template <int... I>
constexpr auto make_pv_table(std::integer_sequence<int, I...>) {
  using Fn = void (*)(float*, int, const uint32_t*, const float*, const uint16_t* const*, int);
  return std::array<Fn, sizeof...(I)>{&pv_row_group<I + 1>...};
}

inline void pv(float* acc, int dim, const uint32_t* probs, const float* alpha, const uint16_t* const* v, int nk,
               int rows) {
  constexpr int kRows = 6;
  static constexpr auto table = make_pv_table(std::make_integer_sequence<int, kRows>{});
  const int pairs = (nk + 1) / 2;
  int r = 0;
  for (; r + kRows <= rows; r += kRows) pv_row_group<kRows>(acc + r * dim, dim, probs + r * 8, alpha + r, v, pairs);
  if (r < rows) table[rows - r - 1](acc + r * dim, dim, probs + r * 8, alpha + r, v, pairs);
}

}  // namespace sluice::cpu::bf16dot

#endif
