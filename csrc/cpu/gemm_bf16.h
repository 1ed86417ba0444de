// The bf16 GEMM micro-kernel: out[R rows, V x 16 columns] = x . W^T (+ bias), fp32 accumulation,
// reading one column group of a kFormatBf16Pairs weight (see packed_weight.h). Each step over K takes one pair
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
#include "vec16.h"

namespace sluice::cpu::gemm {

// The Out of a gated weight's tile (packed_weight.h, kGatedLayout): bf16 silu(gate) * up, 32 features
// per column group.
struct SiluGated {};

// What one linear call reads and writes; rows of x and out may be strided, columns are contiguous.
// For a gated weight, n counts both halves and out holds n / 2 features.
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

// The bias's 16 features from col (those the mask leaves; zero without a bias) in fp32.
inline __m512 bias_vector(const uint16_t* bias, int64_t col, __mmask16 mask) {
  if (bias == nullptr) return _mm512_setzero_ps();
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store_bf16(uint16_t* dst, __mmask16 mask, __m512 y) {
  _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(y));
}

// Vectors v and v + V / 2 of a gated tile's sums are 16 gate and the 16 matching up features: writes
// silu(gate) * up for the group's features from group * 32 + v * 16, each half rounded to bf16 first as
// the plain GEMM's output would be, so that this equals silu_and_mul over it.
template <int R, int V>
void store_silu_gated(const Problem& p, int64_t row0, int64_t group, const __m512 (&acc)[R][V]) {
  static_assert(V % 2 == 0, "a gated tile holds gate and up vectors in equal numbers");
  const int64_t width = p.n / 2;
  for (int v = 0; v < V / 2; ++v) {
    const int64_t col = group * (kPairGroupCols / 2) + v * 16;
    if (col >= width) break;
    const __mmask16 mask = column_mask(width - col);
    const __m512 gate_bias = bias_vector(p.bias, col, mask), up_bias = bias_vector(p.bias, width + col, mask);
    for (int r = 0; r < R; ++r) {
      const v16 gate = round_to<bf16>(v16(_mm512_add_ps(acc[r][v], gate_bias)));
      const v16 up = round_to<bf16>(v16(_mm512_add_ps(acc[r][v + V / 2], up_bias)));
      store_bf16(static_cast<uint16_t*>(p.out) + (row0 + r) * p.out_stride + col, mask,
                 __m512(silu_times<bf16>(gate, up)));
    }
  }
}

// The k pairs [j0, j1) of one tile's work, and what it does around them. A tile over all of K starts
// from zero and writes out; a tile over one block of K (several tiles sharing a block that stays in
// cache) carries its sums in `partial` from block to block, and meanwhile prefetches the lines
// [prefetch, prefetch_stop), `prefetch_per_pair` per pair, so that memory streams while it computes.
struct KRange {
  int64_t j0, j1;
  float* partial;  // [R][kPairGroupCols] fp32 sums between blocks; null when the tile covers all of K
  const char* prefetch;
  const char* prefetch_stop;
  int prefetch_per_pair;
};

// Rows row0..row0+R of the first V vectors of column group `group`; Out is float, uint16_t (bf16 bits)
// or SiluGated.
template <int R, int V, typename Out>
void tile(const Problem& p, int64_t row0, int64_t group, const KRange& range) {
  static_assert(R * V + V <= 32, "accumulators and weight vectors must fit the 32 registers");
  const int32_t* w = p.weight + group * p.pairs * kPairGroupCols;
  const uint16_t* x = p.x + row0 * p.x_stride;
  const int64_t full_pairs = p.k / 2;
  const bool first = range.j0 == 0, last = range.j1 >= full_pairs;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      acc[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(range.partial + r * kPairGroupCols + v * 16);
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
    const int32_t* row = w + j * kPairGroupCols;
    __m512bh b[V];
    for (int v = 0; v < V; ++v) b[v] = (__m512bh)_mm512_load_si512(row + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_broadcast(x + r * p.x_stride + 2 * j);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], b[v], a);
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) _mm512_store_ps(range.partial + r * kPairGroupCols + v * 16, acc[r][v]);
    return;
  }
  if (p.k % 2) {
    // The last k has no partner in x: its pair's high half is zero, as the packed weight's is.
    const int32_t* row = w + full_pairs * kPairGroupCols;
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(x[r * p.x_stride + p.k - 1]));
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)_mm512_load_si512(row + v * 16), a);
    }
  }
  if constexpr (std::is_same_v<Out, SiluGated>) {
    store_silu_gated(p, row0, group, acc);
    return;
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = group * kPairGroupCols + v * 16;
    if (col >= p.n) break;
    const __mmask16 mask = column_mask(p.n - col);
    const __m512 bias = bias_vector(p.bias, col, mask);
    for (int r = 0; r < R; ++r) {
      const __m512 y = _mm512_add_ps(acc[r][v], bias);
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_mask_storeu_ps(static_cast<float*>(p.out) + (row0 + r) * p.out_stride + col, mask, y);
      } else {
        store_bf16(static_cast<uint16_t*>(p.out) + (row0 + r) * p.out_stride + col, mask, y);
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
