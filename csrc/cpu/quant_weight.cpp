// The layout of a quantized linear weight (quant_weight.h): its header, checked, and its packing.
#include "quant_weight.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "check.h"
#include "packed_weight.h"
#include "parallel.h"

namespace sluice::cpu {
namespace {

constexpr int64_t kRegionAlign = 64;

int64_t aligned(int64_t bytes) { return (bytes + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

// Fills in each segment's offsets and the total size from n, k, the end rows and the kinds.
QuantShape laid_out(DType dtype, int64_t n, int64_t k, int count, const int64_t* row_ends, const int32_t* kinds) {
  SK_CHECK(n > 0 && k > 0 && n <= std::numeric_limits<int32_t>::max() && k <= std::numeric_limits<int32_t>::max(),
           "cannot pack a quantized weight of shape [", n, ", ", k, "]");
  SK_CHECK(k % kQuantBlock == 0, "a quantized weight's K must be a multiple of ", kQuantBlock, ", got ", k);
  SK_CHECK(count >= 1 && count <= kMaxQuantSegments, "a quantized weight has 1 to ", kMaxQuantSegments,
           " segments, got ", count);
  QuantShape s{};
  s.n = n;
  s.k = k;
  s.dtype = dtype;
  s.segment_count = count;
  int64_t row0 = 0, offset = 0;
  for (int i = 0; i < count; ++i) {
    SK_CHECK(kinds[i] == kQuantQ8 || kinds[i] == kQuantQ4 || kinds[i] == kQuantQ4Sym, "unknown quantized block kind ",
             kinds[i]);
    SK_CHECK(row_ends[i] > row0 && row_ends[i] <= n, "quantized segment ", i, " ends at row ", row_ends[i],
             ", not past row ", row0, " and within ", n);
    QuantSegment& seg = s.segments[i];
    seg = {row0, row_ends[i], kinds[i], offset, s.blocks() * kQuantTileRows * quant_block_bytes(kinds[i])};
    offset += aligned(seg.tiles() * seg.tile_bytes);
    row0 = row_ends[i];
  }
  SK_CHECK(row0 == n, "the quantized segments cover rows 0 to ", row0, " of ", n);
  s.total_ints = kHeaderInts + offset / 4;
  return s;
}

// One segment's rows, row-major as quant_weight.h's pack_quantized takes them, laid out in its tiles.
void tile_segment(const QuantShape& s, const QuantSegment& seg, const uint8_t* values, const uint16_t* scales,
                  uint8_t* dst) {
  const int64_t blocks = s.blocks(), rows = seg.row1 - seg.row0;
  const int64_t value_bytes = quant_value_bytes(seg.kind), planes = quant_scale_planes(seg.kind);
  const int64_t block_bytes = kQuantTileRows * quant_block_bytes(seg.kind);
  parallel_for(0, seg.tiles(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* out = dst + t * seg.tile_bytes + b * block_bytes;
        // Zero rows past the segment's end: their values and scales stay the memset's zeros.
        for (int r = 0; r < kQuantTileRows && t * kQuantTileRows + r < rows; ++r) {
          const int64_t row = t * kQuantTileRows + r;
          const uint8_t* v = values + (row * blocks + b) * value_bytes;
          for (int64_t i = 0; i < value_bytes; i += 4) std::memcpy(out + i * kQuantTileRows + r * 4, v + i, 4);
          for (int64_t p = 0; p < planes; ++p) {
            std::memcpy(out + kQuantTileRows * (value_bytes + 2 * p) + r * 2, scales + (row * planes + p) * blocks + b, 2);
          }
        }
      }
    }
  });
}

}  // namespace

QuantShape quant_packing_shape(DType dtype, int64_t n, int64_t k, int count, const int64_t* row_ends,
                               const int32_t* kinds) {
  return laid_out(dtype, n, k, count, row_ends, kinds);
}

QuantShape quant_shape(const int32_t* h, int64_t ints) {
  SK_CHECK(ints >= kHeaderInts && h[0] == kPackedMagic, "not a packed weight (no SLPK header)");
  SK_CHECK(h[1] == kPackedVersion, "packed weight has version ", h[1], ", expected ", kPackedVersion);
  SK_CHECK(h[6] == kFormatQuantBlocks, "not a quantized weight (format ", h[6], ")");
  SK_CHECK(h[4] == kPlainLayout && h[5] == 0, "a quantized weight has a plain layout and no k blocks");
  SK_CHECK(h[7] >= 0 && h[7] <= 2, "packed weight has unknown dtype ", h[7]);
  const int count = h[9];
  SK_CHECK(count >= 1 && count <= kMaxQuantSegments, "quantized weight has ", count, " segments");
  int64_t row_ends[kMaxQuantSegments];
  int32_t kinds[kMaxQuantSegments];
  for (int i = 0; i < count; ++i) {
    row_ends[i] = h[10 + 2 * i];
    kinds[i] = h[11 + 2 * i];
  }
  const QuantShape s = laid_out(DType(h[7]), h[2], h[3], count, row_ends, kinds);
  SK_CHECK(ints == s.total_ints, "quantized weight's size does not match its header's [N, K] = [", s.n, ", ", s.k,
           "]");
  return s;
}

void pack_quantized(const QuantShape& s, const void* const* values, const void* const* scales, int32_t* dst) {
  std::memset(dst, 0, s.total_ints * sizeof(int32_t));
  dst[0] = kPackedMagic;
  dst[1] = kPackedVersion;
  dst[2] = int32_t(s.n);
  dst[3] = int32_t(s.k);
  dst[4] = kPlainLayout;
  dst[6] = kFormatQuantBlocks;
  dst[7] = int32_t(s.dtype);
  dst[9] = s.segment_count;
  char* data = reinterpret_cast<char*>(dst + kHeaderInts);
  for (int i = 0; i < s.segment_count; ++i) {
    const QuantSegment& seg = s.segments[i];
    dst[10 + 2 * i] = int32_t(seg.row1);
    dst[11 + 2 * i] = seg.kind;
    tile_segment(s, seg, static_cast<const uint8_t*>(values[i]), static_cast<const uint16_t*>(scales[i]),
                 reinterpret_cast<uint8_t*>(data + seg.offset));
  }
}

}  // namespace sluice::cpu
