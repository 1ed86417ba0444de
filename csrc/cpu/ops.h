#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace sluice::cpu {

// Causal attention of each sequence's new query rows over its whole context, read in place from the
// paged cache through the block table. Writes out [num_tokens, num_heads, head_dim]. decode_path sends
// one-token sequences through their own kernel path; false runs them on the general tile path, so that
// the decode path's gain can be measured (KernelConfig.cpu_decode_attention). split_keys lets the decode
// path split each one-token sequence's keys among the threads where the batch has too few such
// sequences to keep them all busy (KernelConfig.cpu_decode_split_keys).
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     bool decode_path, bool split_keys);

// Copies each new token's key/value row to its slot; slots below zero (padding) are skipped.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping);

// rms_norm(x) * weight for each row of x [rows, width].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);

// residual += delta in place, then returns rms_norm(residual) * weight: a layer's residual step.
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
void add_rms_norm_into(at::Tensor& out, at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                       double eps);

// silu(gate) * up for gate_up [rows, 2 * width] holding the two halves side by side.
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void silu_and_mul_into(at::Tensor& out, const at::Tensor& gate_up);

// x @ weight.T + bias, as F.linear computes it; weight is as loaded or as prepare_linear_weight left it.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// linear written into out, a preallocated contiguous [rows, out_features] buffer; bitwise the same product.
void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias);

// silu(x @ gate^T + b_gate) * (x @ up^T + b_up) for weight = [gate; up] [2 I, K], as silu_and_mul over
// linear's output computes it (bit for bit): in the GEMM's epilogue where weight was packed gated
// (prepare_gated_linear_weight), else as those two ops.
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// gated_linear into out [rows, I]; gate_up [rows, 2 I] holds linear's output where weight is not gated.
void gated_linear_out(at::Tensor& out, at::Tensor& gate_up, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);

// linear's result in float32: a packed weight's fp32 accumulators are stored without a bf16 rounding,
// any other weight's result is F.linear's then widened (as .float() would).
at::Tensor linear_float32(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// The weight as linear reads it fastest: a 2-d bfloat16 weight packed (packed_weight.h) where this
// CPU has AVX512_BF16; any other weight unchanged. (KernelConfig.packed_linear decides whether it is called,
// and KernelConfig.gemm_k_blocks gives k_blocks: whether its GEMM may take K in blocks.)
at::Tensor prepare_linear_weight(const at::Tensor& weight, bool k_blocks);
// An MLP's [gate; up] weight as gated_linear reads it fastest: packed gated (packed_weight.h) where
// prepare_linear_weight would pack it, else unchanged (KernelConfig.fused_gate_up decides whether it is called).
at::Tensor prepare_gated_linear_weight(const at::Tensor& weight, bool k_blocks);

// Each row's argmax as torch.argmax(dim=-1) gives it (first of equal maxima, a NaN above all), in one
// pass over x [rows, n] float32 on every thread: the greedy pick (KernelConfig.native_argmax).
at::Tensor argmax_rows(const at::Tensor& x);

// Rotates qk [num_tokens, heads, head_dim] in place by per-token cos and sign-folded sin tables.
void rotary_embedding(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin_signed);

// Pins thread i of the calling thread's OpenMP pool (torch's intra-op pool) to core cpu_ids[i]; returns,
// per thread, the core it was pinned to, or -errno where the kernel refused.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpu_ids);

}  // namespace sluice::cpu
