// x @ W^T + bias over a quantized weight (quant_weight.h), for any number of rows. Each row of x is
// quantized once per call to int8 in blocks of 32 with a float scale per block (llama.cpp's Q8_0
// activations), and its blocks' sums kept for kQuantQ4's minimum and kQuantQ4Sym's offset. A tile holds
// kQuantTileRows rows of W with each block's rows interleaved 4 bytes at a time, so one 32-byte vector
// is 4 values of each of the 8 rows: against x's 4 matching bytes splat to every lane, one integer
// multiply-add leaves each row's partial sum in its own lane (as llama.cpp's repacked 8x8 layouts do):
//   - AVX-512 tiers with VNNI: vpdpbusd (unsigned weights times signed activations, summed into int32);
//   - AVX2: vpmaddubsw, nibble products added as int16 over the block, then vpmaddwd by ones;
//   - elsewhere (aarch64's base tier): plain int32 loops, which the compiler vectorises.
// A kQuantQ8 block is signed, so its values go through the sign trick: |w| times x with w's sign. Each
// block's int32 sums are scaled by d_w * d_x into float accumulators, one lane per row, with no horizontal
// sums anywhere. A tile is computed for RN rows of x at once, so its weights are read and unpacked once
// for RN rows: a batch reads each weight once per tile of rows, not once per row.
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

// Rows of x per tile: RN float and RN integer accumulators and a block's unpacked values fit the vector
// registers (AVX2's 16, AVX-512's 32).
#if defined(__AVX512F__)
constexpr int kTileX = 8;
#else
constexpr int kTileX = 4;
#endif
// Work items wanted per call, and the fewest weight tiles in one.
constexpr int64_t kMinItems = 16;
constexpr int64_t kMinItemTiles = 2;
// Rows of x per work item: their int8 blocks stay in L2 while the item's weights pass.
constexpr int64_t kItemXRows = 64;
// A tile's rows of x lie in one panel of QuantizedX.
static_assert(kItemXRows % kTileX == 0);
// Below this many multiply-adds, waking the second thread costs more than it saves.
constexpr int64_t kSerialMacs = 1 << 17;

// How many blocks ahead of the one it computes a tile prefetches: a few hundred nanoseconds of work.
constexpr int64_t kPrefetchBlocks = 16;

inline void prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 3); }

// The rows of x quantized, in panels of P = min(kTileX, rows) rows: a panel is its blocks in order, a block its
// P rows' 32 values side by side (row r of block b at entry (r / P * blocks + b) * P + r % P), with
// each entry's scale d, 8 times the sum of its q (kQuantQ4Sym's offset) and d times that sum (kQuantQ4's)
// at the same index. A tile call then streams its rows of x in order, as it streams its weights: a
// block-major layout put the rows' consecutive blocks rows * 32 bytes apart, 64 KiB at a prefill chunk of
// 2,048 rows, every one of them in the same set of L1 and L2, and a prefill read x from L3. Fewer rows than
// kTileX make one panel, so that a decode step's row lies end to end as before.
struct QuantizedX {
  const int8_t* q;
  const float* d;
  const int32_t* qsum8;
  const float* s;
  int64_t rows, blocks, panel;

  // The entry of block b of row `row`.
  int64_t at(int64_t b, int64_t row) const { return (row / panel * blocks + b) * panel + row % panel; }
};

template <typename T>
QuantizedX quantize_rows(const Matrix& x) {
  static thread_local std::vector<int8_t> q;
  static thread_local std::vector<float> d, s;
  static thread_local std::vector<int32_t> qsum8;
  const int64_t k = x.cols, blocks = k / kQuantBlock;
  const int64_t panel = std::min<int64_t>(kTileX, x.rows);
  // Whole panels: a last partial one's missing rows are never read.
  const int64_t entries = (x.rows + panel - 1) / panel * panel * blocks;
  if (q.size() < size_t(entries * kQuantBlock)) q.resize(entries * kQuantBlock);
  if (d.size() < size_t(entries)) {
    d.resize(entries);
    s.resize(entries);
    qsum8.resize(entries);
  }
  int8_t* qd = q.data();
  float* dd = d.data();
  float* sd = s.data();
  int32_t* qd_sum8 = qsum8.data();
  const QuantizedX quantized{qd, dd, qd_sum8, sd, x.rows, blocks, panel};
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
        const int64_t at = quantized.at(b, r);
        int8_t* out = qd + at * kQuantBlock;
        int32_t sum = 0;
        for (int j = 0; j < kQuantBlock; ++j) {
          // Round half away from zero with one rounding of v * inverse +- 1/2 (an explicit fma, so that no
          // compiler's choice to contract or not changes a q), in a form the compiler vectorises.
          const int32_t n = int32_t(std::fma(v[j], inverse, v[j] >= 0.0f ? 0.5f : -0.5f));
          out[j] = int8_t(n);
          sum += n;
        }
        dd[at] = scale;
        qd_sum8[at] = 8 * sum;
        sd[at] = scale * float(sum);
      }
    }
  });
  return quantized;
}

inline float half_to_float(uint16_t bits) { return to_float(fp16{bits}); }

inline const uint16_t* halves(const uint8_t* p) { return reinterpret_cast<const uint16_t*>(p); }

#if defined(__AVX2__)

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Four bytes of x (elements 4 j .. 4 j + 3 of a block) in every 32-bit lane: one per row of the tile.
inline __m256i splat4(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return _mm256_set1_epi32(word);
}

// acc + the sums of u8 x s8 products, four adjacent bytes to each of 8 int32 lanes (lane r: row r).
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// A block's nibble products summed per row. Without VNNI they add up as int16 pairs (each vpmaddubsw
// lane at most 2 * 15 * 127, and a block's 8 of them below 2^15) and widen once at the block's end.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
inline __m256i nibble_dot(__m256i acc, __m256i low, __m256i x_low, __m256i high, __m256i x_high) {
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, low, x_low), high, x_high);
}
inline __m256i nibble_sums(__m256i acc) { return acc; }
#else
inline __m256i nibble_dot(__m256i acc, __m256i low, __m256i x_low, __m256i high, __m256i x_high) {
  return _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high)));
}
inline __m256i nibble_sums(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif

// An empty asm that takes and gives back each of v's registers: integer sums cannot be reassociated
// across it, so GCC adds each vector's products into its accumulator as it goes, rather than computing a
// whole block's products first as one sum tree (which spilled most of them to the stack).
template <int RN>
inline void sum_so_far(__m256i (&v)[RN]) {
  for (int c = 0; c < RN; ++c) asm("" : "+x"(v[c]));
}

// sums[t * RN + c][r] = row xrow + c of x times row r of tile t (tiles[0] + t * tile_bytes), over all of K,
// for NT tiles side by side. Lane r of every vector is row r of a tile, so a block's products never meet
// across lanes: no horizontal sums. NT > 1 serves few rows of x, whose tiles stream from memory: NT runs of
// weights in flight at once, each behind its own chain of sums, keep memory busier than one (one tile at a
// time, a decode row read Q8_0 weights at 1/1.4 the bytes per second of the bf16 GEMM, which streams several
// column groups at once).
template <int32_t Kind, int RN, int NT>
void tile(const uint8_t* tiles, int64_t tile_bytes, const QuantizedX& x, int64_t xrow,
          float (&sums)[kTileX][kQuantTileRows]) {
  static_assert(kQuantTileRows == 8 && RN * NT <= kTileX);
  // A block of a tile: its rows' values, then their d (and m).
  constexpr int64_t block_bytes = kQuantTileRows * quant_block_bytes(Kind);
  constexpr int64_t values = kQuantTileRows * quant_value_bytes(Kind);
  constexpr int N = RN * NT;
  __m256 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm256_setzero_ps();
  const uint8_t* block = tiles;
  // Block b's RN rows of x: their values from xq on (row xrow + c at c * 32 bytes), their scales and sums
  // from entry xb on; the next block's are a panel further.
  int64_t xb = x.at(0, xrow);
  const int8_t* xq = x.q + xb * kQuantBlock;
  for (int64_t b = 0; b < x.blocks; ++b, block += block_bytes, xq += x.panel * kQuantBlock, xb += x.panel) {
    // Each tile's bytes lie end to end, the tiles of a chunk too: ask for the bytes a few blocks ahead
    // (past the tile's end too), since one thread's computing leaves the hardware prefetcher too few
    // misses in flight.
    for (int t = 0; t < NT; ++t)
      for (int64_t line = 0; line < block_bytes; line += 64)
        prefetch(block + t * tile_bytes + kPrefetchBlocks * block_bytes + line);
    // dots[t * RN + c]: tile t's sums with row xrow + c.
    __m256i dots[N];
    for (int i = 0; i < N; ++i) dots[i] = _mm256_setzero_si256();
    if constexpr (Kind == kQuantQ8) {
      // Signed weights through the sign trick: |w| times x with w's sign (a pair's sum then fits int16).
      for (int j = 0; j < kQuantBlock / 4; ++j) {
        for (int t = 0; t < NT; ++t) {
          const __m256i w = load256(block + t * tile_bytes + j * 32), magnitude = _mm256_abs_epi8(w);
          for (int c = 0; c < RN; ++c)
            dots[t * RN + c] =
                dot_u8s8(dots[t * RN + c], magnitude, _mm256_sign_epi8(splat4(xq + c * kQuantBlock + 4 * j), w));
        }
        sum_so_far(dots);
      }
    } else {
      const __m256i mask = _mm256_set1_epi8(0x0F);
      for (int j = 0; j < kQuantBlock / 8; ++j) {
        for (int t = 0; t < NT; ++t) {
          const __m256i nibbles = load256(block + t * tile_bytes + j * 32);
          const __m256i low = _mm256_and_si256(nibbles, mask);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(nibbles, 4), mask);
          for (int c = 0; c < RN; ++c) {
            const int8_t* xc = xq + c * kQuantBlock + 4 * j;
            dots[t * RN + c] = nibble_dot(dots[t * RN + c], low, splat4(xc), high, splat4(xc + kQuantBlock / 2));
          }
        }
        sum_so_far(dots);
      }
      for (int i = 0; i < N; ++i) dots[i] = nibble_sums(dots[i]);
      // sum (q - 8) x = sum q x - 8 sum x.
      if constexpr (Kind == kQuantQ4Sym) {
        for (int i = 0; i < N; ++i) dots[i] = _mm256_sub_epi32(dots[i], _mm256_set1_epi32(x.qsum8[xb + i % RN]));
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* scales = block + t * tile_bytes + values;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
      for (int c = 0; c < RN; ++c)
        acc[t * RN + c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t * RN + c]),
                                          _mm256_mul_ps(dw, _mm256_set1_ps(x.d[xb + c])), acc[t * RN + c]);
      if constexpr (Kind == kQuantQ4) {
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16)));
        for (int c = 0; c < RN; ++c)
          acc[t * RN + c] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[xb + c]), acc[t * RN + c]);
      }
    }
  }
  for (int i = 0; i < N; ++i) _mm256_storeu_ps(sums[i], acc[i]);
}

#else

// The same sums one value at a time (aarch64's base tier, where the compiler vectorises the loops).
template <int32_t Kind, int RN, int NT>
void tile(const uint8_t* tiles, int64_t tile_bytes, const QuantizedX& x, int64_t xrow,
          float (&sums)[kTileX][kQuantTileRows]) {
  static_assert(RN * NT <= kTileX);
  // A block of a tile: its rows' values, then their d (and m).
  constexpr int64_t block_bytes = kQuantTileRows * quant_block_bytes(Kind);
  constexpr int64_t values = kQuantTileRows * quant_value_bytes(Kind);
  for (int t = 0; t < NT; ++t) {
    float acc[RN][kQuantTileRows] = {};
    const uint8_t* block = tiles + t * tile_bytes;
    // Block b's entries of the RN rows of x: xb0 + c, the next block's a panel further (as in the AVX2 tile).
    for (int64_t b = 0, xb0 = x.at(0, xrow); b < x.blocks; ++b, block += block_bytes, xb0 += x.panel) {
      const uint16_t* d = halves(block + values);
      for (int c = 0; c < RN; ++c) {
        const int64_t xb = xb0 + c;
        const int8_t* xq = x.q + xb * kQuantBlock;
        for (int r = 0; r < kQuantTileRows; ++r) {
          int32_t dot = 0;
          // Byte i of row r's values sits at (i / 4) * 32 + r * 4 + i % 4 (quant_weight.h).
          for (int i = 0; i < quant_value_bytes(Kind); ++i) {
            const uint8_t byte = block[(i / 4) * 32 + r * 4 + i % 4];
            if constexpr (Kind == kQuantQ8) {
              dot += int32_t(int8_t(byte)) * int32_t(xq[i]);
            } else {
              dot += int32_t(byte & 0x0F) * int32_t(xq[i]) + int32_t(byte >> 4) * int32_t(xq[i + kQuantBlock / 2]);
            }
          }
          if constexpr (Kind == kQuantQ4Sym) dot -= x.qsum8[xb];
          acc[c][r] += float(dot) * (half_to_float(d[r]) * x.d[xb]);
          if constexpr (Kind == kQuantQ4) acc[c][r] += half_to_float(d[kQuantTileRows + r]) * x.s[xb];
        }
      }
    }
    for (int c = 0; c < RN; ++c)
      for (int r = 0; r < kQuantTileRows; ++r) sums[t * RN + c][r] = acc[c][r];
  }
}

#endif

// Tiles side by side for RN rows of x (tile's NT): kQuantQ8's, as many as RN * NT accumulators allow, at most
// kMaxStreams. Only a call's last panel of rows, when it is its only one, takes them: with more rows a tile's
// weights are reused by every panel from L1 instead. The nibble kinds stay one tile at a time: their
// unpacking makes a block's bytes take twice the instructions, and side by side they read no faster (a
// decode row's Q8_0 linears of the 1.1B model 1.29x faster with 4 tiles in bench/kernel_ab.py --cases
// quantized; Q4_0's 0.95-1.02x with 2 or 4 in A/Bs of the two builds).
constexpr int kMaxStreams = 4;
constexpr int streams(int32_t kind, int rn) { return kind == kQuantQ8 ? std::min(kMaxStreams, kTileX / rn) : 1; }

using TileFn = void (*)(const uint8_t*, int64_t, const QuantizedX&, int64_t, float (&)[kTileX][kQuantTileRows]);

template <int32_t Kind, bool Wide, int... I>
constexpr std::array<TileFn, sizeof...(I)> make_tiles(std::integer_sequence<int, I...>) {
  return {&tile<Kind, I + 1, Wide ? streams(Kind, I + 1) : 1>...};
}

// Index RN - 1: one tile at a time, and streams(Kind, RN) at a time.
template <int32_t Kind>
constexpr auto kTiles = make_tiles<Kind, false>(std::make_integer_sequence<int, kTileX>{});
template <int32_t Kind>
constexpr auto kWideTiles = make_tiles<Kind, true>(std::make_integer_sequence<int, kTileX>{});

template <typename Out, typename T>
void run_segment(const QuantShape& shape, const QuantSegment& seg, const char* data, const QuantizedX& x,
                 const T* bias, const Matrix& out) {
  const uint8_t* tiles_data = reinterpret_cast<const uint8_t*>(data + seg.offset);
  const bool q8 = seg.kind == kQuantQ8, q4 = seg.kind == kQuantQ4;
  const auto& tiles = q8 ? kTiles<kQuantQ8> : q4 ? kTiles<kQuantQ4> : kTiles<kQuantQ4Sym>;
  const auto& wide_tiles = q8 ? kWideTiles<kQuantQ8> : q4 ? kWideTiles<kQuantQ4> : kWideTiles<kQuantQ4Sym>;
  const int64_t rows = seg.row1 - seg.row0, tile_count = seg.tiles(), m = out.rows;
  const int64_t x_blocks = (m + kItemXRows - 1) / kItemXRows;
  const int64_t wanted = std::max<int64_t>(1, (kMinItems + x_blocks - 1) / x_blocks);
  const int64_t chunk = std::max<int64_t>(kMinItemTiles, (tile_count + wanted - 1) / wanted);
  const int64_t chunks = (tile_count + chunk - 1) / chunk;
  const bool serial = m * rows * shape.k < kSerialMacs;
  run_items(chunks * x_blocks, serial, [&](int64_t item) {
    const int64_t t0 = item / x_blocks * chunk, t1 = std::min(tile_count, t0 + chunk);
    const int64_t x0 = item % x_blocks * kItemXRows, x1 = std::min(m, x0 + kItemXRows);
    const int wide = x1 - x0 <= kTileX ? streams(seg.kind, int(x1 - x0)) : 1;
    float sums[kTileX][kQuantTileRows];
    for (int64_t t = t0, nt = 1; t < t1; t += nt) {
      nt = t + wide <= t1 ? wide : 1;
      for (int64_t xr = x0; xr < x1; xr += kTileX) {
        const int rn = int(std::min<int64_t>(kTileX, x1 - xr));
        (nt > 1 ? wide_tiles : tiles)[rn - 1](tiles_data + t * seg.tile_bytes, seg.tile_bytes, x, xr, sums);
        for (int64_t s = 0; s < nt; ++s) {
          const int64_t row0 = (t + s) * kQuantTileRows;
          const int rm = int(std::min<int64_t>(kQuantTileRows, rows - row0));
          for (int c = 0; c < rn; ++c) {
            Out* dst = out.row<Out>(xr + c) + seg.row0 + row0;
            for (int r = 0; r < rm; ++r) {
              const float b = bias == nullptr ? 0.0f : to_float(bias[seg.row0 + row0 + r]);
              dst[r] = from_float<Out>(sums[s * rn + c][r] + b);
            }
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
