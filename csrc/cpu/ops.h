#pragma once

#include <ATen/core/Tensor.h>

namespace sluice::cpu {

// Causal attention of each sequence's new query rows over its whole context, read in place from the
// paged cache through the block table. Writes out [num_tokens, num_heads, head_dim].
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_table,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale);

// Copies each new token's key/value row to its slot; slots below zero (padding) are skipped.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping);

}  // namespace sluice::cpu
