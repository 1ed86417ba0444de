// A linear weight W [N, K] re-laid once at load for the tier's GEMM.
//
// A packed weight is a 1-d int32 tensor, so it can never be mistaken for (or silently used as) a weight
// by F.linear: kHeaderInts header words, then column groups, each a run of rows of one k (or k pair):
//   {kPackedMagic, kPackedVersion, N, K, layout, k_blocks, format, dtype, lanes, 0...}
// Two formats, one per GEMM family; a tier packs with the one its GEMM reads (abi.cpp):
//   - kFormatBf16Pairs (the AVX512_BF16 tier, bf16 weights): ceil(N / 64) groups of ceil(K / 2) rows of
//     64 int32 words; word c of row j holds feature f's W[f][2 j] (low half) and W[f][2 j + 1] (high half),
//     so that vdpbf16ps multiplies a k pair of 16 features per vector (gemm_bf16.h).
//   - kFormatFmaLanes (every tier, any dtype; `lanes` L is the tier's float vector width): groups of 2 L
//     features, K rows each. A row holds the group's "low" L features and its "high" L features at one k,
//     in the weight's own dtype: fp32 and fp16 as low then high; bf16 as L 32-bit words, word i holding
//     low feature i (low half) and high feature i (high half), so that a shift and a mask widen each half
//     to floats (gemm_fma.h).
// Which features a group holds (f is the group's column c in 0 .. group width):
//   - kPlainLayout: group g holds features g * width + c;
//   - kGatedLayout, for W = [gate; up] of I = N / 2 features each (an MLP's fused gate_up): the group's
//     first half holds gate features g * width / 2 + c and its second half the up features of the same
//     index, so that the GEMM's epilogue holds both halves of width / 2 outputs of silu(gate) * up.
// k_blocks is 1 where the GEMM may take K in blocks (KernelConfig.gemm_k_blocks), 0 where it reads each
// column group whole: a property of the weight, so that two models in one process can differ on it.
// Features past the weight's and the k past an odd K are zeros. The header is 64 bytes.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace sluice::cpu {

constexpr int kHeaderInts = 16;
constexpr int32_t kPackedMagic = 0x4B504C53;  // "SLPK"
constexpr int32_t kPackedVersion = 2;
constexpr int32_t kPlainLayout = 0;
constexpr int32_t kGatedLayout = 1;
constexpr int32_t kFormatBf16Pairs = 1;
constexpr int32_t kFormatFmaLanes = 2;
// kFormatBf16Pairs: features per group.
constexpr int kPairGroupCols = 64;

struct PackedShape {
  int64_t n;
  int64_t k;
  bool gated;     // kGatedLayout: the GEMM writes silu(gate) * up, N / 2 features
  bool k_blocks;  // the GEMM may take K in blocks, prefetching the next block while it computes
  int32_t format;
  DType dtype;    // of the weights as packed
  int lanes;      // kFormatFmaLanes: the float vector width L (a group holds 2 L features)

  int64_t group_cols() const { return format == kFormatBf16Pairs ? kPairGroupCols : 2 * int64_t(lanes); }
  // Features of the output (N / 2 for a gated weight).
  int64_t out_features() const { return gated ? n / 2 : n; }
  int64_t groups() const {
    const int64_t per_group = gated ? group_cols() / 2 : group_cols();
    return (out_features() + per_group - 1) / per_group;
  }
  // Bytes of one row (one k, or one k pair) of a group.
  int64_t row_bytes() const {
    return format == kFormatBf16Pairs ? kPairGroupCols * 4 : group_cols() * dtype_size(dtype);
  }
  int64_t group_rows() const { return format == kFormatBf16Pairs ? (k + 1) / 2 : k; }
  int64_t group_bytes() const { return group_rows() * row_bytes(); }
  int64_t total_ints() const { return kHeaderInts + groups() * group_bytes() / 4; }
};

// The format word of a packed weight's header (kFormatBf16Pairs, kFormatFmaLanes or quant_weight.h's
// kFormatQuantBlocks), after checking that it is one.
int32_t packed_format(const int32_t* packed, int64_t ints);

// Checks the header of any packed weight, float or quantized (quant_weight.h), against its size; whether
// it is gated (a quantized weight never is).
bool packed_gated(const int32_t* packed, int64_t ints);

// The header of a float packed weight of `ints` words, checked against its size; a KernelError says what is wrong.
PackedShape packed_shape(const int32_t* packed, int64_t ints);

// The shape that packing W [n, k] of `dtype` in `layout` gives at this tier.
PackedShape packing_shape(DType dtype, int64_t n, int64_t k, int32_t layout, bool k_blocks);

// Packs W (element [f][j] at w + f * row_stride + j * col_stride) into dst, packing_shape's total_ints words.
void pack_weight(const void* w, DType dtype, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride,
                 int32_t layout, bool k_blocks, int32_t* dst);

// The float vector width of this tier's FMA GEMM (gemm_fma.h), and whether it has the bf16-pair GEMM.
int fma_lanes();
bool has_bf16_pairs();

}  // namespace sluice::cpu
