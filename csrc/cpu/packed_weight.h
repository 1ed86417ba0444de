// A bf16 linear weight W [N, K] re-laid once at load for the GEMM in gemm_bf16.h.
//
// The packed weight is a 1-d int32 tensor, so it can never be mistaken for (or silently used as) a
// weight by F.linear: kHeaderInts header words {kPackedMagic, kPackedVersion, N, K, 0...} and then
// ceil(N / 64) column groups. Group g holds output features 64 g .. 64 g + 63 as ceil(K / 2) rows of
// 64 int32 words; word c of row j packs W[64 g + c][2 j] (low half) and W[64 g + c][2 j + 1] (high
// half). Features past N and the k past an odd K are zeros. The header is 64 bytes, so every group
// row starts on a 64-byte boundary of torch's 64-byte-aligned allocation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace sluice::cpu {

constexpr int kGroupCols = 64;
constexpr int kGroupInts = kGroupCols;
constexpr int kHeaderInts = 16;
constexpr int32_t kPackedMagic = 0x4B504C53;  // "SLPK"
constexpr int32_t kPackedVersion = 1;

struct PackedShape {
  int64_t n;
  int64_t k;
};

// Whether w is a weight that pack_linear_weight produced.
bool is_packed_weight(const at::Tensor& w);

// The true [N, K] of a packed weight.
PackedShape packed_shape(const at::Tensor& w);

// W [N, K] (bf16, any strides) in the packed layout above.
at::Tensor pack_linear_weight(const at::Tensor& weight);

// Whether this build has the GEMM that reads packed weights (it needs AVX512_BF16).
bool packed_gemm_available();

// Whether the GEMM takes K in blocks at 7-64 rows, prefetching the next block while it computes
// (KernelConfig.gemm_k_blocks; on by default): process-wide, so that its gain can be measured.
void set_packed_gemm_k_blocks(bool enabled);

// out [M, N] (bf16 or float32, contiguous rows) = x [M, K] (bf16, contiguous rows) @ W^T + bias (bf16).
void packed_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                 at::Tensor& out);

}  // namespace sluice::cpu
