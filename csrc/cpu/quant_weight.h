// A linear weight W [N, K] kept quantized in blocks of 32 along K (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, and what
// converts to them exactly or nearly: worker/quantized_weights.py), multiplied by gemm_quant.cpp.
//
// It shares the SLPK header of packed_weight.h with format kFormatQuantBlocks: {magic, version, N, K,
// kPlainLayout, 0, kFormatQuantBlocks, dtype of the activations, 0, segments S, then per segment its end
// row and its kind}. A fused weight (q/k/v, gate/up) may mix kinds, since a GGUF file quantizes each of
// its parts on its own (a Q4_K_M file keeps v in Q6_K): segment s holds output rows [end of s - 1, end of
// s), each in one kind. A block of one row is:
//   - kQuantQ8: 32 signed bytes q, element j in byte j, and a float16 d: value = d * q;
//   - kQuantQ4: 16 bytes, element j in byte j's low nibble and element j + 16 in its high one (GGML's
//     order), q unsigned 0..15, and float16 d and m: value = d * q + m;
//   - kQuantQ4Sym: the same nibbles and a float16 d: value = d * (q - 8) (GGUF's Q4_0, 2 bytes a block
//     smaller, and no minimum to add).
// After the header come the segments, each on a 64-byte boundary, each its rows in tiles of kQuantTileRows
// (the last one padded with zero rows), each tile one run of bytes that the GEMM streams in order: block
// by block along K, a block being its 8 rows' values interleaved 4 bytes at a time (bytes 4 j .. 4 j + 3
// of row r at 32 j + 4 r: a 32-byte vector holds 4 bytes of every row), then the rows' d (8 float16),
// then for kQuantQ4 their m (8 float16). One tile being one stream keeps the hardware prefetcher ahead
// of a decode step, which reads every byte once.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace sluice::cpu {

constexpr int32_t kFormatQuantBlocks = 3;
constexpr int kQuantBlock = 32;
constexpr int kMaxQuantSegments = 3;
constexpr int32_t kQuantQ8 = 1;
constexpr int32_t kQuantQ4 = 2;
constexpr int32_t kQuantQ4Sym = 3;
constexpr int kQuantTileRows = 8;

constexpr int64_t quant_value_bytes(int32_t kind) { return kind == kQuantQ8 ? kQuantBlock : kQuantBlock / 2; }
constexpr int64_t quant_scale_planes(int32_t kind) { return kind == kQuantQ4 ? 2 : 1; }
// Bytes of one block of one row: its values and its float16 scales.
constexpr int64_t quant_block_bytes(int32_t kind) { return quant_value_bytes(kind) + 2 * quant_scale_planes(kind); }

struct QuantSegment {
  int64_t row0, row1;
  int32_t kind;
  // Bytes from the end of the header to the first tile, and from one tile to the next.
  int64_t offset, tile_bytes;

  int64_t tiles() const { return (row1 - row0 + kQuantTileRows - 1) / kQuantTileRows; }
};

struct QuantShape {
  int64_t n, k;
  DType dtype;  // of the activations and the output, as for a float packed weight
  int segment_count;
  QuantSegment segments[kMaxQuantSegments];
  int64_t total_ints;

  int64_t blocks() const { return k / kQuantBlock; }
};

// The layout of a weight of `count` segments, segment s ending at row row_ends[s] and of kinds[s].
QuantShape quant_packing_shape(DType dtype, int64_t n, int64_t k, int count, const int64_t* row_ends,
                               const int32_t* kinds);

// The header of a quantized weight of `ints` words, checked against its size.
QuantShape quant_shape(const int32_t* packed, int64_t ints);

// Writes the header and each segment's tiles into dst, from its values [rows][K / 32][value bytes] and its
// scales [rows][planes][K / 32] (d, then m for kQuantQ4), row-major as a GGUF file holds them.
void pack_quantized(const QuantShape& shape, const void* const* values, const void* const* scales, int32_t* dst);

}  // namespace sluice::cpu
