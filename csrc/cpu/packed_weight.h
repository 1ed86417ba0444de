// A bf16 linear weight W [N, K] re-laid once at load for the GEMM in gemm_bf16.h.
//
// The packed weight is a 1-d int32 tensor, so it can never be mistaken for (or silently used as) a
// weight by F.linear: kHeaderInts header words {kPackedMagic, kPackedVersion, N, K, layout, k_blocks,
// 0...} and then ceil(N / 64) column groups of ceil(K / 2) rows of 64 int32 words each; word c of a group's row j
// packs feature f's W[f][2 j] (low half) and W[f][2 j + 1] (high half), where f is
//   - kPlainLayout: 64 g + c;
//   - kGatedLayout, for W = [gate; up] of I = N / 2 features each (an MLP's fused gate_up): gate
//     feature 32 g + c in columns c < 32, and the up feature of the same index in columns 32 + c, so
//     that the GEMM's epilogue holds both halves of 32 outputs of silu(gate) * up at once.
// k_blocks is 1 where the GEMM may take K in blocks (KernelConfig.gemm_k_blocks), 0 where it reads each
// column group whole: a property of the weight, so that two models in one process can differ on it.
// Features past the weight's and the k past an odd K are zeros. The header is 64 bytes, so every group
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
constexpr int32_t kPlainLayout = 0;
constexpr int32_t kGatedLayout = 1;

struct PackedShape {
  int64_t n;
  int64_t k;
  bool gated;     // kGatedLayout: the GEMM writes silu(gate) * up, N / 2 features
  bool k_blocks;  // the GEMM takes K in blocks at 7-64 rows, prefetching the next block while it computes
};

// Whether w is a weight that pack_linear_weight produced.
bool is_packed_weight(const at::Tensor& w);

// The true [N, K] of a packed weight.
PackedShape packed_shape(const at::Tensor& w);

// W [N, K] (bf16, any strides) in the packed layout above.
at::Tensor pack_linear_weight(const at::Tensor& weight, bool k_blocks = true);
// W = [gate; up] [2 I, K] (bf16, any strides) in the gated layout (KernelConfig.fused_gate_up).
at::Tensor pack_gated_linear_weight(const at::Tensor& weight, bool k_blocks = true);

// Whether this build has the GEMM that reads packed weights (it needs AVX512_BF16).
bool packed_gemm_available();

// out [M, N] (bf16 or float32, contiguous rows) = x [M, K] (bf16, contiguous rows) @ W^T + bias (bf16);
// for a gated weight, out [M, N / 2] (bf16) = silu(x @ gate^T + bias_gate) * (x @ up^T + bias_up), each
// half rounded to bf16 first, so that it equals silu_and_mul over the plain GEMM's output bit for bit.
void packed_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                 at::Tensor& out);

}  // namespace sluice::cpu
