// x @ W^T + bias over a quantized weight (quant_weight.h), for any number of rows. Each row of x is
// quantized once per call to int8 in blocks of 32 with a float scale per block (llama.cpp's Q8_0
// activations), and its blocks' sums kept for kQuantQ4's minimum and kQuantQ4Sym's offset. Then each block of W meets the matching
// block of every row of x in one integer dot product of 32 pairs, scaled by d_w * d_x into a float sum:
//   - AVX-512 tiers: VNNI's vpdpbusd (unsigned weights times signed activations, summed into int32);
//   - AVX2: vpmaddubsw then vpmaddwd by ones (the pair sums fit int16: at most 2 * 128 * 127);
//   - elsewhere (aarch64's base tier): plain int32 loops, which the compiler vectorises.
// A kQuantQ8 block is signed, so its pairs go through the sign trick: |w| times x with w's sign.
// A tile is kQuantTileRows rows of W times RN rows of x, so a weight block is read and unpacked once for
// RN rows: a batch reads each weight once per tile of rows, not once per row.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "check.h"
#include "gemm.h"
#include "parallel.h"
#include "quant_weight.h"

namespace sluice::cpu {
namespace {

// Rows of x per tile: kQuantTileRows * kTileX float accumulators must fit the registers with room to spare.
#if defined(__AVX512F__)
constexpr int kTileX = 4;
#else
constexpr int kTileX = 2;
#endif
// Work items wanted per call, and the fewest weight tiles in one.
constexpr int64_t kMinItems = 16;
constexpr int64_t kMinItemTiles = 2;
// Rows of x per work item: their int8 blocks stay in L2 while the item's weights pass.
constexpr int64_t kItemXRows = 64;
// Below this many multiply-adds, waking the second thread costs more than it saves.
constexpr int64_t kSerialMacs = 1 << 17;

// How many groups ahead of the one it computes a tile prefetches: a few hundred nanoseconds of work.
constexpr int64_t kPrefetchGroups = 4;

inline void prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 3); }

// The rows of x quantized: per row K int8 values, and per block its scale d, the sum of its q and d times
// that sum.
// `pairs` holds the same values again with each pair of blocks interleaved by halves, [first block's
// values 0..15, second's 0..15, first's 16..31, second's 16..31], the order in which one 32-byte load
// of a kQuantQ4 weight's two blocks unpacks (low nibbles, then high).
struct QuantizedX {
  const int8_t* q;
  const int8_t* pairs;
  const float* d;
  const int32_t* qsum;
  const float* s;
  int64_t k, blocks;
};

template <typename T>
QuantizedX quantize_rows(const Matrix& x) {
  static thread_local std::vector<int8_t> q, pairs;
  static thread_local std::vector<float> d, s;
  static thread_local std::vector<int32_t> qsum;
  const int64_t k = x.cols, blocks = k / kQuantBlock;
  if (q.size() < size_t(x.rows * k)) {
    q.resize(x.rows * k);
    pairs.resize(x.rows * k);
  }
  if (d.size() < size_t(x.rows * blocks)) {
    d.resize(x.rows * blocks);
    s.resize(x.rows * blocks);
    qsum.resize(x.rows * blocks);
  }
  int8_t* qd = q.data();
  int8_t* pd = pairs.data();
  float* dd = d.data();
  float* sd = s.data();
  int32_t* qd_sum = qsum.data();
  constexpr int half = kQuantBlock / 2;
  parallel_for(0, x.rows, std::max<int64_t>(1, (1 << 15) / k), [&](int64_t begin, int64_t end) {
    float v[kQuantBlock];
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x.row<T>(r);
      for (int64_t b = 0; b < blocks; ++b) {
        float amax = 0.0f;
        for (int j = 0; j < kQuantBlock; ++j) {
          v[j] = to_float(src[b * kQuantBlock + j]);
          amax = std::max(amax, std::fabs(v[j]));
        }
        const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t* out = qd + r * k + b * kQuantBlock;
        int32_t sum = 0;
        for (int j = 0; j < kQuantBlock; ++j) {
          // Round half away from zero with one rounding of v * inverse +- 1/2 (an explicit fma, so that no
          // compiler's choice to contract or not changes a q), in a form the compiler vectorises.
          const int32_t n = int32_t(std::fma(v[j], inverse, v[j] >= 0.0f ? 0.5f : -0.5f));
          out[j] = int8_t(n);
          sum += n;
        }
        dd[r * blocks + b] = scale;
        qd_sum[r * blocks + b] = sum;
        sd[r * blocks + b] = scale * float(sum);
        // Block b is the first (b even) or second of its pair; a last block without a partner has none.
        if ((b | 1) < blocks) {
          int8_t* pair = pd + r * k + (b & ~int64_t(1)) * kQuantBlock + (b & 1) * half;
          std::memcpy(pair, out, half);
          std::memcpy(pair + kQuantBlock, out + half, half);
        }
      }
    }
  });
  return {qd, pd, dd, qd_sum, sd, k, blocks};
}

inline float half_to_float(uint16_t bits) { return to_float(fp16{bits}); }

inline const uint16_t* halves(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }

#if defined(__AVX2__)

using Acc = __m256;

inline Acc acc_zero() { return _mm256_setzero_ps(); }

inline float acc_sum(Acc a) {
  __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// acc + the sums of u8 x s8 products, four adjacent pairs to each of 8 int32 lanes.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// One signed kQuantQ8 block against x's: |w| times x with w's sign (the pairs' sums then fit int16).
inline __m256i dot_q8(__m256i w, const int8_t* x) {
  return dot_u8s8(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(load256(x), w));
}

// Two kQuantQ4 blocks (32 bytes of nibbles) against x's pair layout: block 2p in the low 128-bit lane of
// the result, 2p + 1 in the high one.
inline __m256i dot_q4_pair(__m256i nibbles, const int8_t* pair) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i low = _mm256_and_si256(nibbles, mask);
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), mask);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return dot_u8s8(dot_u8s8(_mm256_setzero_si256(), low, load256(pair)), high, load256(pair + kQuantBlock));
#else
  // 4-bit weights leave room: both halves' int16 pair sums (at most 4 * 15 * 128) add before one widening.
  const __m256i sums16 = _mm256_add_epi16(_mm256_maddubs_epi16(low, load256(pair)),
                                          _mm256_maddubs_epi16(high, load256(pair + kQuantBlock)));
  return _mm256_madd_epi16(sums16, _mm256_set1_epi16(1));
#endif
}

// Eight blocks' int32 sums, block j in lane j, from 4 vectors of one pair of blocks each (the first block's
// sums in the low lane).
inline __m256i reduce_pairs(const __m256i (&v)[4]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  // h holds blocks 0, 2, 4, 6 in its low lane and 1, 3, 5, 7 in its high one.
  return _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A full group of kQuantGroup blocks (quant_weight.h), starting at block b, of a tile's kQuantTileRows rows
// against each of RN rows of x, into the accumulators (lane j of acc[r][c] gathers block b + j's products).
template <int32_t Kind, int RN>
inline void group8(const uint8_t* group, const QuantizedX& x, int64_t xrow, int64_t b,
                   Acc (&acc)[kQuantTileRows][RN]) {
  static_assert(kQuantGroup == 8);
  constexpr int64_t value_bytes = Kind == kQuantQ8 ? kQuantBlock : kQuantBlock / 2;
  const uint8_t* d_plane = group + kQuantTileRows * kQuantGroup * value_bytes;
  for (int r = 0; r < kQuantTileRows; ++r) {
    const uint8_t* values = group + r * kQuantGroup * value_bytes;
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_plane + r * 16)));
    __m256i sums[RN];
    if constexpr (Kind == kQuantQ8) {
      // Pairs of blocks interleaved by halves (quant_weight.h), as x's pairs are: each vector's two lanes
      // hold a half of each block of the pair.
      for (int c = 0; c < RN; ++c) {
        __m256i v[4];
        const int8_t* xp = x.pairs + (xrow + c) * x.k + b * kQuantBlock;
        for (int p = 0; p < 4; ++p) {
          const uint8_t* pair = values + p * 2 * kQuantBlock;
          const int8_t* xpair = xp + p * 2 * kQuantBlock;
          v[p] = _mm256_add_epi32(dot_q8(load256(pair), xpair), dot_q8(load256(pair + kQuantBlock), xpair + kQuantBlock));
        }
        sums[c] = reduce_pairs(v);
      }
    } else {
      __m256i nibbles[4];
      for (int p = 0; p < 4; ++p) nibbles[p] = load256(values + p * kQuantBlock);
      for (int c = 0; c < RN; ++c) {
        __m256i v[4];
        const int8_t* xp = x.pairs + (xrow + c) * x.k + b * kQuantBlock;
        for (int p = 0; p < 4; ++p) v[p] = dot_q4_pair(nibbles[p], xp + p * 2 * kQuantBlock);
        sums[c] = reduce_pairs(v);
        if constexpr (Kind == kQuantQ4Sym) {
          // sum (q - 8) x = sum q x - 8 sum x.
          const __m256i x_sums = load256(x.qsum + (xrow + c) * x.blocks + b);
          sums[c] = _mm256_sub_epi32(sums[c], _mm256_slli_epi32(x_sums, 3));
        }
      }
    }
    for (int c = 0; c < RN; ++c) {
      const __m256 dx = _mm256_loadu_ps(x.d + (xrow + c) * x.blocks + b);
      acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[c]), _mm256_mul_ps(dw, dx), acc[r][c]);
    }
    if constexpr (Kind == kQuantQ4) {
      const uint8_t* m_plane = d_plane + kQuantTileRows * 16;
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m_plane + r * 16)));
      for (int c = 0; c < RN; ++c)
        acc[r][c] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s + (xrow + c) * x.blocks + b), acc[r][c]);
    }
  }
}

// One block's integer dot product with x's block, 8 lanes of partial sums; a kQuantQ8 block's values
// 0..15 at w and 16..31 at high (16 bytes on, or elsewhere where its group interleaves pairs).
template <int32_t Kind>
inline __m256i block_sums(const uint8_t* w, const uint8_t* high, const int8_t* x) {
  if constexpr (Kind == kQuantQ8) {
    const __m128i low_half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return dot_q8(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high)), low_half), x);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return dot_u8s8(_mm256_setzero_si256(), _mm256_and_si256(both, _mm256_set1_epi8(0x0F)), load256(x));
  }
}

// A kQuantQ4Sym block's sums from its plain nibbles' (lanes of block_sums): less 8 times x's sum, taken
// from one lane.
inline __m256i offset_sums(__m256i sums, int32_t x_sum) {
  return _mm256_sub_epi32(sums, _mm256_setr_epi32(8 * x_sum, 0, 0, 0, 0, 0, 0, 0));
}

inline Acc add_scaled(Acc acc, __m256i sums, float scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
}

#else

using Acc = float;

inline Acc acc_zero() { return 0.0f; }
inline float acc_sum(Acc a) { return a; }

// No group8 here: every block goes through block_sums.

template <int32_t Kind>
inline int32_t block_sums(const uint8_t* w, const uint8_t* high, const int8_t* x) {
  int32_t sum = 0;
  if constexpr (Kind == kQuantQ8) {
    const int8_t* low_half = reinterpret_cast<const int8_t*>(w);
    const int8_t* high_half = reinterpret_cast<const int8_t*>(high);
    for (int j = 0; j < kQuantBlock / 2; ++j)
      sum += int32_t(low_half[j]) * int32_t(x[j]) + int32_t(high_half[j]) * int32_t(x[j + kQuantBlock / 2]);
  } else {
    for (int j = 0; j < kQuantBlock / 2; ++j)
      sum += int32_t(w[j] & 0x0F) * int32_t(x[j]) + int32_t(w[j] >> 4) * int32_t(x[j + kQuantBlock / 2]);
  }
  return sum;
}

inline int32_t offset_sums(int32_t sums, int32_t x_sum) { return sums - 8 * x_sum; }

inline Acc add_scaled(Acc acc, int32_t sums, float scale) { return acc + float(sums) * scale; }

#endif

// A group of g blocks starting at block b, one block at a time (a tail group, or every group where the tier
// has no group8).
template <int32_t Kind, int RN>
inline void group_blocks(const uint8_t* group, int64_t g, const QuantizedX& x, int64_t xrow, int64_t b,
                         Acc (&acc)[kQuantTileRows][RN], float (&minimum)[kQuantTileRows][RN]) {
  constexpr int64_t value_bytes = Kind == kQuantQ8 ? kQuantBlock : kQuantBlock / 2;
  constexpr int64_t half = kQuantBlock / 2;
  const uint16_t* d_plane = halves(group + kQuantTileRows * g * value_bytes);
  // A whole group of kQuantQ8 interleaves each pair of blocks by halves (quant_weight.h).
  const bool pairs = Kind == kQuantQ8 && g == kQuantGroup;
  for (int r = 0; r < kQuantTileRows; ++r) {
    for (int64_t j = 0; j < g; ++j) {
      const uint8_t* row = group + r * g * value_bytes;
      const uint8_t* values = pairs ? row + (j & ~int64_t(1)) * kQuantBlock + (j & 1) * half : row + j * value_bytes;
      const uint8_t* high = pairs ? values + kQuantBlock : values + half;
      const float dw = half_to_float(d_plane[r * g + j]);
      for (int c = 0; c < RN; ++c) {
        const int64_t xb = (xrow + c) * x.blocks + b + j;
        auto sums = block_sums<Kind>(values, high, x.q + xb * kQuantBlock);
        if constexpr (Kind == kQuantQ4Sym) sums = offset_sums(sums, x.qsum[xb]);
        acc[r][c] = add_scaled(acc[r][c], sums, dw * x.d[xb]);
        if constexpr (Kind == kQuantQ4) minimum[r][c] += half_to_float(d_plane[(kQuantTileRows + r) * g + j]) * x.s[xb];
      }
    }
  }
}

// sums[c][r] = row xrow + c of x times row r of the tile, over all of K.
template <int32_t Kind, int RN>
void tile(const uint8_t* tile, const QuantizedX& x, int64_t xrow, float (&sums)[kTileX][kQuantTileRows]) {
  const int64_t group_bytes = kQuantTileRows * kQuantGroup * quant_block_bytes(Kind);
  Acc acc[kQuantTileRows][RN];
  float minimum[kQuantTileRows][RN] = {};
  for (int r = 0; r < kQuantTileRows; ++r)
    for (int c = 0; c < RN; ++c) acc[r][c] = acc_zero();
  int64_t b = 0;
  const uint8_t* group = tile;
  for (; b + kQuantGroup <= x.blocks; b += kQuantGroup, group += group_bytes) {
    // The tiles of a chunk lie end to end: ask for the bytes a few groups ahead (past the tile's end
    // too), since one thread's computing leaves the hardware prefetcher too few misses in flight.
    for (int64_t line = 0; line < group_bytes; line += 64) prefetch(group + kPrefetchGroups * group_bytes + line);
#if defined(__AVX2__)
    group8<Kind, RN>(group, x, xrow, b, acc);
#else
    group_blocks<Kind, RN>(group, kQuantGroup, x, xrow, b, acc, minimum);
#endif
  }
  if (b < x.blocks) group_blocks<Kind, RN>(group, x.blocks - b, x, xrow, b, acc, minimum);
  for (int r = 0; r < kQuantTileRows; ++r)
    for (int c = 0; c < RN; ++c) sums[c][r] = acc_sum(acc[r][c]) + minimum[r][c];
}

using TileFn = void (*)(const uint8_t*, const QuantizedX&, int64_t, float (&)[kTileX][kQuantTileRows]);

template <int32_t Kind, int... I>
constexpr std::array<TileFn, sizeof...(I)> make_tiles(std::integer_sequence<int, I...>) {
  return {&tile<Kind, I + 1>...};
}

// Index RN - 1.
template <int32_t Kind>
constexpr auto kTiles = make_tiles<Kind>(std::make_integer_sequence<int, kTileX>{});

template <typename Out, typename T>
void run_segment(const QuantShape& shape, const QuantSegment& seg, const char* data, const QuantizedX& x,
                 const T* bias, const Matrix& out) {
  const uint8_t* tiles_data = reinterpret_cast<const uint8_t*>(data + seg.offset);
  const auto& tiles = seg.kind == kQuantQ8 ? kTiles<kQuantQ8> : seg.kind == kQuantQ4 ? kTiles<kQuantQ4> : kTiles<kQuantQ4Sym>;
  const int64_t rows = seg.row1 - seg.row0, tile_count = seg.tiles(), m = out.rows;
  const int64_t x_blocks = (m + kItemXRows - 1) / kItemXRows;
  const int64_t wanted = std::max<int64_t>(1, (kMinItems + x_blocks - 1) / x_blocks);
  const int64_t chunk = std::max<int64_t>(kMinItemTiles, (tile_count + wanted - 1) / wanted);
  const int64_t chunks = (tile_count + chunk - 1) / chunk;
  const bool serial = m * rows * shape.k < kSerialMacs;
  run_items(chunks * x_blocks, serial, [&](int64_t item) {
    const int64_t t0 = item / x_blocks * chunk, t1 = std::min(tile_count, t0 + chunk);
    const int64_t x0 = item % x_blocks * kItemXRows, x1 = std::min(m, x0 + kItemXRows);
    float sums[kTileX][kQuantTileRows];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t row0 = t * kQuantTileRows;
      const int rm = int(std::min<int64_t>(kQuantTileRows, rows - row0));
      for (int64_t xr = x0; xr < x1; xr += kTileX) {
        const int rn = int(std::min<int64_t>(kTileX, x1 - xr));
        tiles[rn - 1](tiles_data + t * seg.tile_bytes, x, xr, sums);
        for (int c = 0; c < rn; ++c) {
          Out* dst = out.row<Out>(xr + c) + seg.row0 + row0;
          for (int r = 0; r < rm; ++r) {
            const float b = bias == nullptr ? 0.0f : to_float(bias[seg.row0 + row0 + r]);
            dst[r] = from_float<Out>(sums[c][r] + b);
          }
        }
      }
    }
  });
}

}  // namespace

void quant_gemm(const Matrix& x, const QuantShape& shape, const int32_t* packed, const void* bias,
                const Matrix& out) {
  const char* data = reinterpret_cast<const char*>(packed + kHeaderInts);
  dispatch_dtype(shape.dtype, [&](auto tag) {
    using T = decltype(tag);
    const QuantizedX qx = quantize_rows<T>(x);
    const T* b = static_cast<const T*>(bias);
    for (int i = 0; i < shape.segment_count; ++i) {
      if (out.dtype == DType::kFloat32) {
        run_segment<float>(shape, shape.segments[i], data, qx, b, out);
      } else {
        run_segment<T>(shape, shape.segments[i], data, qx, b, out);
      }
    }
  });
}

}  // namespace sluice::cpu
