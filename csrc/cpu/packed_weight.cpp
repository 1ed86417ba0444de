// Packing a linear weight into its GEMM's column-group layout (see packed_weight.h).
#include "packed_weight.h"

#include <cstring>
#include <limits>

#include "check.h"
#include "parallel.h"
#include "quant_weight.h"

namespace sluice::cpu {

int32_t packed_format(const int32_t* packed, int64_t ints) {
  SK_CHECK(ints >= kHeaderInts && packed[0] == kPackedMagic, "not a packed weight (no SLPK header)");
  return packed[6];
}

bool packed_gated(const int32_t* packed, int64_t ints) {
  if (packed_format(packed, ints) == kFormatQuantBlocks) {
    quant_shape(packed, ints);
    return false;
  }
  return packed_shape(packed, ints).gated;
}

PackedShape packed_shape(const int32_t* packed, int64_t ints) {
  SK_CHECK(ints >= kHeaderInts && packed[0] == kPackedMagic, "not a packed weight (no SLPK header)");
  const int32_t* h = packed;
  SK_CHECK(h[1] == kPackedVersion, "packed weight has version ", h[1], ", expected ", kPackedVersion);
  SK_CHECK(h[4] == kPlainLayout || h[4] == kGatedLayout, "packed weight has unknown layout ", h[4]);
  SK_CHECK(h[5] == 0 || h[5] == 1, "packed weight has a k_blocks word of ", h[5]);
  SK_CHECK(h[6] == kFormatBf16Pairs || h[6] == kFormatFmaLanes, "packed weight has unknown format ", h[6]);
  SK_CHECK(h[7] >= 0 && h[7] <= 2, "packed weight has unknown dtype ", h[7]);
  SK_CHECK(h[8] == 8 || h[8] == 16, "packed weight has a lanes word of ", h[8]);
  SK_CHECK(h[2] > 0 && h[3] > 0 && (h[4] == kPlainLayout || h[2] % 2 == 0), "packed weight has a bad [N, K] = [",
           h[2], ", ", h[3], "]");
  const PackedShape shape{h[2], h[3], h[4] == kGatedLayout, h[5] == 1, h[6], DType(h[7]), h[8]};
  SK_CHECK(shape.format == kFormatFmaLanes || shape.dtype == DType::kBFloat16,
           "a bf16-pair packed weight must hold bfloat16");
  SK_CHECK(ints == shape.total_ints(), "packed weight's size does not match its header's [N, K] = [", shape.n,
           ", ", shape.k, "]");
  return shape;
}

PackedShape packing_shape(DType dtype, int64_t n, int64_t k, int32_t layout, bool k_blocks) {
  SK_CHECK(n > 0 && k > 0 && n <= std::numeric_limits<int32_t>::max() && k <= std::numeric_limits<int32_t>::max(),
           "cannot pack a weight of shape [", n, ", ", k, "]");
  SK_CHECK(layout == kPlainLayout || layout == kGatedLayout, "unknown packed layout ", layout);
  SK_CHECK(layout == kPlainLayout || n % 2 == 0,
           "a gated weight must stack gate and up halves of equal height, got [", n, ", ", k, "]");
  const bool pairs = has_bf16_pairs() && dtype == DType::kBFloat16;
  const int lanes = pairs ? 16 : fma_lanes();
  return {n, k, layout == kGatedLayout, k_blocks, pairs ? kFormatBf16Pairs : kFormatFmaLanes, dtype, lanes};
}

namespace {

// Where element (k, c) of a group goes, in units of the element size, from the group's start.
int64_t element_index(const PackedShape& s, int64_t k, int64_t c) {
  if (s.format == kFormatBf16Pairs) return (k / 2) * (2 * kPairGroupCols) + c * 2 + k % 2;
  const int64_t width = s.group_cols(), lanes = s.lanes;
  if (s.dtype == DType::kBFloat16) return k * width + (c < lanes ? 2 * c : 2 * (c - lanes) + 1);
  return k * width + c;
}

// The weight row that column c of group g holds, or -1 for a zero column.
int64_t source_row(const PackedShape& s, int64_t g, int64_t c) {
  const int64_t width = s.group_cols();
  if (!s.gated) {
    const int64_t row = g * width + c;
    return row < s.n ? row : -1;
  }
  const int64_t half = width / 2, features = s.n / 2, feature = g * half + c % half;
  if (feature >= features) return -1;
  return c < half ? feature : features + feature;
}

}  // namespace

void pack_weight(const void* w, DType dtype, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride,
                 int32_t layout, bool k_blocks, int32_t* dst) {
  const PackedShape s = packing_shape(dtype, n, k, layout, k_blocks);
  std::memset(dst, 0, kHeaderInts * sizeof(int32_t));
  dst[0] = kPackedMagic;
  dst[1] = kPackedVersion;
  dst[2] = int32_t(n);
  dst[3] = int32_t(k);
  dst[4] = layout;
  dst[5] = k_blocks ? 1 : 0;
  dst[6] = s.format;
  dst[7] = int32_t(dtype);
  dst[8] = s.lanes;
  const int size = dtype_size(dtype);
  const char* src = static_cast<const char*>(w);
  char* groups = reinterpret_cast<char*>(dst + kHeaderInts);
  const int64_t group_bytes = s.group_bytes();
  parallel_for(0, s.groups(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      char* group = groups + g * group_bytes;
      std::memset(group, 0, group_bytes);
      for (int64_t c = 0; c < s.group_cols(); ++c) {
        const int64_t row = source_row(s, g, c);
        if (row < 0) continue;
        for (int64_t kk = 0; kk < k; ++kk)
          std::memcpy(group + element_index(s, kk, c) * size, src + (row * row_stride + kk * col_stride) * size,
                      size);
      }
    }
  });
}

}  // namespace sluice::cpu
