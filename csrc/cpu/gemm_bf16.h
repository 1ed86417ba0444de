// The bf16 GEMM micro-kernel: out[R rows, V x 16 columns] = x . W^T (+ bias), fp32 accumulation,
// reading one column group of a packed weight (see packed_weight.h). Each step over K takes one pair
// of k: a 32-bit broadcast of the row's two activations against one 64-byte vector holding that
// pair for 16 output features, so vdpbf16ps reads every weight byte exactly once per row tile.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SLUICE_PACKED_GEMM 1

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "packed_weight.h"

namespace sluice::cpu::gemm {

// What one linear call reads and writes; rows of x and out may be strided, columns are contiguous.
struct Problem {
  const uint16_t* x;
  int64_t x_stride;
  const int32_t* weight;  // the packed groups
  int64_t pairs;          // k pairs per group row count: ceil(K / 2)
  int64_t k;
  int64_t n;
  const uint16_t* bias;  // bf16, or null
  void* out;
  int64_t out_stride;
};

inline __m512bh pair_broadcast(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

inline __mmask16 column_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1);
}

// The k pairs [j0, j1) of one tile's work, and what it does around them. A tile over all of K starts
// from zero and writes out; a tile over one block of K (several tiles sharing a block that stays in
// cache) carries its sums in `partial` from block to block, and meanwhile prefetches the lines
// [prefetch, prefetch_stop), `prefetch_per_pair` per pair, so that memory streams while it computes.
struct KRange {
  int64_t j0, j1;
  float* partial;  // [R][kGroupCols] fp32 sums between blocks; null when the tile covers all of K
  const char* prefetch;
  const char* prefetch_stop;
  int prefetch_per_pair;
};

// Rows row0..row0+R of the first V vectors of column group `group`; Out is float or uint16_t (bf16 bits).
template <int R, int V, typename Out>
void tile(const Problem& p, int64_t row0, int64_t group, const KRange& range) {
  static_assert(R * V + V <= 32, "accumulators and weight vectors must fit the 32 registers");
  const int32_t* w = p.weight + group * p.pairs * kGroupInts;
  const uint16_t* x = p.x + row0 * p.x_stride;
  const int64_t full_pairs = p.k / 2;
  const bool first = range.j0 == 0, last = range.j1 >= full_pairs;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(range.partial + r * kGroupCols + v * 16);
  const char* prefetch = range.prefetch;
  for (int64_t j = range.j0; j < range.j1; ++j) {
    for (int i = 0; i < range.prefetch_per_pair; ++i) {
      if (prefetch < range.prefetch_stop) {
        // Into L2: a prefetch into L1 holds one of its few miss buffers, which caps how much a core
        // reads at once (paged_attention.cpp). A register operand: with a memory operand GCC kept the
        // accumulators in memory across it.
        asm volatile("prefetcht2 (%0)" : : "r"(prefetch));
        prefetch += 64;
      }
    }
    const int32_t* row = w + j * kGroupInts;
    __m512bh b[V];
    for (int v = 0; v < V; ++v) b[v] = (__m512bh)_mm512_load_si512(row + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_broadcast(x + r * p.x_stride + 2 * j);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], a);
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) _mm512_store_ps(range.partial + r * kGroupCols + v * 16, acc[r][v]);
    return;
  }
  if (p.k % 2) {
    // The last k has no partner in x: its pair's high half is zero, as the packed weight's is.
    const int32_t* row = w + full_pairs * kGroupInts;
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * p.x_stride + p.k - 1]));
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)_mm512_load_si512(row + v * 16), a);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = group * kGroupCols + v * 16;
    if (col >= p.n) break;
    const __mmask16 mask = column_mask(p.n - col);
    __m512 bias = _mm512_setzero_ps();
    if (p.bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, p.bias + col);
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_add_ps(acc[r][v], bias);
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(static_cast<float*>(p.out) + (row0 + r) * p.out_stride + col, mask, y);
      } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + (row0 + r) * p.out_stride + col, mask,
                                 (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, const KRange&);

template <int V, typename Out, int... I>
constexpr auto make_tile_table(std::integer_sequence<int, I...>) {
  return std::array<TileFn, sizeof...(I)>{&tile<I + 1, V, Out>...};
}

}  // namespace sluice::cpu::gemm

#endif
