// The fp32 FMA GEMM micro-kernel of every tier: out[R rows, G column groups] = x . W^T (+ bias), where a
// group of a kFormatFmaLanes weight (packed_weight.h) is 2 L features and each row of it one k. The
// weights are widened to float in registers (bf16: a shift and a mask; fp16: the hardware's conversion;
// fp32 as is) and multiplied with broadcast fp32 activations, so each weight byte is read once per row
// tile. Every output element is one fp32 accumulator summed over k in order, whatever the tile's shape,
// so a row's result does not depend on how many rows share its batch (batch invariance).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "dtypes.h"
#include "vec16.h"

namespace sluice::cpu::fma {

// The float vector width L of this tier: one AVX-512 register, one AVX2 register, or two NEON ones.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
// Accumulators a tile may hold: 24 of the 32 vector registers (the rest for weights and x).
constexpr int kAccumulators = 24;
#elif defined(__x86_64__)
constexpr int kLanes = 8;
// 12 of AVX2's 16 registers.
constexpr int kAccumulators = 12;
#else
constexpr int kLanes = 8;
// 12 pairs of NEON's 32 registers.
constexpr int kAccumulators = 12;
#endif
// Rows of the tallest tile (one group): two accumulators per row.
constexpr int kTileRows = kAccumulators / 2;

using V = Vec<kLanes>::f;
using U = Vec<kLanes>::u;

// Groups a tile of R rows spans: as many as fill the accumulators, at most 4 (weight streams at once).
constexpr int groups_for_rows(int rows) {
  const int g = kAccumulators / (2 * rows);
  return g < 1 ? 1 : (g > 4 ? 4 : g);
}

// The Out of a gated weight's tile (packed_weight.h, kGatedLayout): silu(gate) * up in T.
template <typename T>
struct SiluGated {};

template <typename Out>
struct Gated : std::false_type {};
template <typename T>
struct Gated<SiluGated<T>> : std::true_type {
  using Type = T;
};

// What one linear call reads and writes; rows of x and out may be strided, columns are contiguous.
struct Problem {
  const float* x;  // fp32 activations
  int64_t x_stride;
  const char* weight;  // the first group
  int64_t group_bytes;
  int64_t row_bytes;
  int64_t k;
  int64_t features;  // of the output (N / 2 for a gated weight)
  const void* bias;  // in the weight's dtype, N entries, or null
  void* out;
  int64_t out_stride;
};

// One row of a group (one k): its low and high L features widened to float.
template <typename WT>
inline void widen(const char* row, V& lo, V& hi) {
  if constexpr (std::is_same_v<WT, bf16>) {
    U word;
    std::memcpy(&word, row, sizeof word);
    lo = reinterpret_cast<V>(word << 16);
    hi = reinterpret_cast<V>(word & 0xFFFF0000u);
  } else {
    lo = load_as<V>(reinterpret_cast<const WT*>(row));
    hi = load_as<V>(reinterpret_cast<const WT*>(row) + kLanes);
  }
}

// `count` (< L) lanes of p, the rest zero; and the reverse for stores.
template <typename T>
inline V load_partial(const T* p, int64_t count) {
  T lanes[kLanes] = {};
  std::memcpy(lanes, p, count * sizeof(T));
  return load_as<V>(lanes);
}

template <typename T>
inline void store_partial(T* p, V v, int64_t count) {
  T lanes[kLanes];
  store_as(lanes, v);
  std::memcpy(p, lanes, count * sizeof(T));
}

template <typename T>
inline V bias_lanes(const Problem& p, int64_t col, int64_t count) {
  if (p.bias == nullptr) return V{};
  const T* b = static_cast<const T*>(p.bias) + col;
  return count == kLanes ? load_as<V>(b) : load_partial(b, count);
}

template <typename T>
inline void store_lanes(const Problem& p, int64_t row, int64_t col, int64_t count, V y) {
  T* dst = static_cast<T*>(p.out) + row * p.out_stride + col;
  if (count == kLanes) {
    store_as(dst, y);
  } else {
    store_partial(dst, y, count);
  }
}

// k per line prefetched: a tile that prefetches reads K * 64 / kPrefetchEvery bytes ahead for the call after.
constexpr int64_t kPrefetchEvery = 16;

// Rows row0 .. row0 + R of groups group0 .. group0 + G over all of K; WT is the weight's dtype, Out the
// output's (float, bf16, fp16) or SiluGated<T>. With Prefetch, one line from `prefetch` on is fetched into
// L2 every kPrefetchEvery k (K * 64 / kPrefetchEvery bytes in all, rounded down): weights a later tile reads,
// streaming in while this one computes.
template <typename WT, typename Out, int R, int G, bool Prefetch>
void tile(const Problem& p, int64_t row0, int64_t group0, const char* prefetch) {
  V acc[R][G][2];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g][0] = acc[r][g][1] = V{};
  const char* w = p.weight + group0 * p.group_bytes;
  const float* x = p.x + row0 * p.x_stride;
  auto step = [&](int64_t kk) {
    V lo[G], hi[G];
    for (int g = 0; g < G; ++g) widen<WT>(w + g * p.group_bytes + kk * p.row_bytes, lo[g], hi[g]);
    for (int r = 0; r < R; ++r) {
      const V xb = splat_as<V>(x[r * p.x_stride + kk]);
      for (int g = 0; g < G; ++g) {
        acc[r][g][0] += xb * lo[g];
        acc[r][g][1] += xb * hi[g];
      }
    }
  };
  int64_t kk = 0;
  if constexpr (Prefetch) {
    for (; kk + kPrefetchEvery <= p.k; kk += kPrefetchEvery) {
#if defined(__x86_64__)
      // Into L2, by a register operand (with a memory operand GCC kept the accumulators in memory).
      asm volatile("prefetcht2 (%0)" : : "r"(prefetch));
#else
      __builtin_prefetch(prefetch, 0, 1);
#endif
      prefetch += 64;
#pragma GCC unroll 16
      for (int64_t j = 0; j < kPrefetchEvery; ++j) step(kk + j);
    }
  }
#pragma GCC unroll 4
  for (; kk < p.k; ++kk) step(kk);
  for (int g = 0; g < G; ++g) {
    if constexpr (Gated<Out>::value) {
      using T = typename Gated<Out>::Type;
      // Each half is rounded to T first, as the plain GEMM's output would be, so that this equals
      // silu_and_mul over it.
      const int64_t col = (group0 + g) * kLanes;
      if (col >= p.features) break;
      const int64_t count = p.features - col < kLanes ? p.features - col : kLanes;
      const V gate_bias = bias_lanes<T>(p, col, count), up_bias = bias_lanes<T>(p, p.features + col, count);
      for (int r = 0; r < R; ++r) {
        const V gate = round_to<T>(acc[r][g][0] + gate_bias), up = round_to<T>(acc[r][g][1] + up_bias);
        store_lanes<T>(p, row0 + r, col, count, silu_times<T>(gate, up));
      }
    } else {
      for (int half = 0; half < 2; ++half) {
        const int64_t col = (group0 + g) * 2 * kLanes + half * kLanes;
        if (col >= p.features) break;
        const int64_t count = p.features - col < kLanes ? p.features - col : kLanes;
        const V bias = bias_lanes<WT>(p, col, count);
        for (int r = 0; r < R; ++r) store_lanes<Out>(p, row0 + r, col, count, acc[r][g][half] + bias);
      }
    }
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, const char*);

// Per row count R (index R - 1): the tile over groups_for_rows(R) groups, and the one-group tile.
template <typename WT, typename Out, int... I>
constexpr auto make_wide_tiles(std::integer_sequence<int, I...>) {
  return std::array<TileFn, sizeof...(I)>{&tile<WT, Out, I + 1, groups_for_rows(I + 1), false>...};
}

template <typename WT, typename Out, bool Prefetch, int... I>
constexpr auto make_narrow_tiles(std::integer_sequence<int, I...>) {
  return std::array<TileFn, sizeof...(I)>{&tile<WT, Out, I + 1, 1, Prefetch>...};
}

}  // namespace sluice::cpu::fma
