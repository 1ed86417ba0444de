// bf16 x bf16 -> fp32 pair dot products (AVX512_BF16) for bf16 queries and caches: half the
// multiply-adds of widening to float, and K needs only half as many transposes. Operands are
// 32-bit lanes holding two bf16 values, so keys are transposed as pairs of dims and values are
// interleaved as pairs of keys.
#pragma once

#include "vec16.h"

namespace sluice::cpu {

// Regroups 4 vectors of 4 128-bit lanes so that x[j] holds lane j of a, b, c and d in that order.
inline void key_quads(v16 a, v16 b, v16 c, v16 d, v16* x) {
  const vi16 low = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi16 high = low + 8;
  const vi16 even = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi16 odd = even + 4;
  const v16 ab0 = __builtin_shuffle(a, b, low), cd0 = __builtin_shuffle(c, d, low);
  const v16 ab1 = __builtin_shuffle(a, b, high), cd1 = __builtin_shuffle(c, d, high);
  x[0] = __builtin_shuffle(ab0, cd0, even);
  x[1] = __builtin_shuffle(ab0, cd0, odd);
  x[2] = __builtin_shuffle(ab1, cd1, even);
  x[3] = __builtin_shuffle(ab1, cd1, odd);
}

// Lane 4 L + j of the result is the sum of the four lanes in 128-bit lane L of a[j].
inline v16 sum_quads(const v16* a) {
  const vi16 lo = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
  const vi16 hi = lo + 2;
  const vi16 first = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi16 second = first + 2;
  const v16 ab = __builtin_shuffle(a[0], a[1], lo) + __builtin_shuffle(a[0], a[1], hi);
  const v16 cd = __builtin_shuffle(a[2], a[3], lo) + __builtin_shuffle(a[2], a[3], hi);
  return __builtin_shuffle(ab, cd, first) + __builtin_shuffle(ab, cd, second);
}

}  // namespace sluice::cpu

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

// Decode rows: too few to pay for transposing K. Each 128-bit lane of an operand holds 8 dims of one
// key and the query's matching 8 dims sit broadcast in every lane, so 4 keys share one dot product;
// each key's 4 partial sums are added once per 16 keys. q holds dim / 8 such vectors per row.
template <int R>
void decode_qk(const void* query, int dim, const uint16_t* const* k, float* s, int s_stride) {
  const __m512i* q = static_cast<const __m512i*>(query);
  const int q_stride = dim / 8;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int d0 = 0; d0 < dim; d0 += 32) {
    for (int g = 0; g < 4; ++g) {
      v16 x[4];
      key_quads(reinterpret_cast<v16>(as_ps(_mm512_loadu_si512(k[g] + d0))),
                reinterpret_cast<v16>(as_ps(_mm512_loadu_si512(k[g + 4] + d0))),
                reinterpret_cast<v16>(as_ps(_mm512_loadu_si512(k[g + 8] + d0))),
                reinterpret_cast<v16>(as_ps(_mm512_loadu_si512(k[g + 12] + d0))), x);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j)
          acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)as_si(reinterpret_cast<__m512>(x[j])),
                                       (__m512bh)_mm512_loadu_si512(q + r * q_stride + d0 / 8 + j));
    }
  }
  for (int r = 0; r < R; ++r) {
    v16 a[4];
    for (int g = 0; g < 4; ++g) a[g] = reinterpret_cast<v16>(acc[r][g]);
    _mm512_storeu_ps(s + r * s_stride, reinterpret_cast<__m512>(sum_quads(a)));
  }
}

// acc[r] += sum over key pairs of probs x values for R rows and 32 * H dims from `off`. Pairs of keys
// are interleaved with in-lane unpacks, which are cheaper than a cross-lane permute but leave the
// dims of each 32-dim block in unpack order: the block is stored as lo then hi, where lo lane
// 4 L + j is dim 8 L + j and hi lane 4 L + j is dim 8 L + 4 + j.
template <int R, int H>
void decode_pv(float* acc, int dim, const uint32_t* probs, int p_stride, const uint16_t* const* v, int pairs,
               int off) {
  __m512 a[R][2 * H];
  for (int r = 0; r < R; ++r)
    for (int z = 0; z < 2 * H; ++z) a[r][z] = _mm512_loadu_ps(acc + r * dim + off + z * 16);
  for (int i = 0; i < pairs; ++i) {
    __m512bh vv[2 * H];
    for (int h = 0; h < H; ++h) {
      const __m512i x = _mm512_loadu_si512(v[2 * i] + off + h * 32);
      const __m512i y = _mm512_loadu_si512(v[2 * i + 1] + off + h * 32);
      vv[2 * h] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      vv[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(int(probs[r * p_stride + i]));
      for (int z = 0; z < 2 * H; ++z) a[r][z] = _mm512_dpbf16_ps(a[r][z], w, vv[z]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int z = 0; z < 2 * H; ++z) _mm512_storeu_ps(acc + r * dim + off + z * 16, a[r][z]);
}

// A decode query row as decode_qk reads it: each 8 dims (bf16 pairs) broadcast to all four 128-bit lanes.
inline void broadcast_query(float* dst, const uint16_t* src, int dim) {
  for (int j = 0; j < dim / 8; ++j)
    _mm512_storeu_si512(dst + j * 16,
                        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * 8))));
}

// Undoes decode_pv's dim order for one 32-dim block.
inline void unpack_order(const float* src, float* dst) {
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const __m512i first = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo, second, hi));
}

}  // namespace sluice::cpu::bf16dot

#else

#include <cstdint>

#include "vec16.h"

// Declarations only, so that the attention kernel's bf16-dot branches, discarded by `if constexpr` where this
// CPU lacks AVX512_BF16, still parse; nothing calls them, so nothing needs their definitions.
namespace sluice::cpu::bf16dot {
constexpr int kMaxDim = 1024;
extern const uint16_t kZeroRow[kMaxDim];
void pack_keys(const uint16_t* const* rows, int dim, uint32_t* kp);
void qk(const uint32_t* q, int dim, const uint32_t* kp, int rows, float* s);
void store_probs(v16 p, uint32_t* dst);
void pv(float* acc, int dim, const uint32_t* probs, const float* alpha, const uint16_t* const* v, int nk, int rows);
template <int R>
void decode_qk(const void* query, int dim, const uint16_t* const* k, float* s, int s_stride);
template <int R, int H>
void decode_pv(float* acc, int dim, const uint32_t* probs, int p_stride, const uint16_t* const* v, int pairs, int off);
void broadcast_query(float* dst, const uint16_t* src, int dim);
void unpack_order(const float* src, float* dst);
}  // namespace sluice::cpu::bf16dot

#endif
