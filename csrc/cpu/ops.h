// The kernels' C++ interface, over plain memory: what abi.cpp exposes to Python and model_step.cpp
// chains. Every function checks its arguments' shapes and dtypes (a KernelError says what is wrong) and
// otherwise trusts that the pointers hold what the shapes say.
#pragma once

#include <cstdint>
#include <vector>

#include "dtypes.h"

namespace sluice::cpu {

// rows x cols elements of dtype, each row contiguous, rows `stride` elements apart.
struct Matrix {
  void* data;
  DType dtype;
  int64_t rows, cols, stride;

  template <typename T>
  T* row(int64_t r) const {
    return static_cast<T*>(data) + r * stride;
  }
};

// [tokens, heads, dim] of dtype, each head's dim contiguous.
struct Heads {
  void* data;
  DType dtype;
  int64_t tokens, heads, dim, token_stride, head_stride;
};

// One layer's paged KV cache: key and value [num_blocks, block_size, kv_heads, head_dim], contiguous; an
// int8 or fp8 cache [num_blocks, kv_heads, block_size, head_dim + 4] (kv_quant.h).
struct KvCache {
  void* key;
  void* value;
  DType dtype;
  int64_t num_blocks, block_size, kv_heads, head_dim;
};

// Per token, its cache slot (block * block_size + offset), int64 or int32; below zero: padding, skipped.
struct Slots {
  const void* data;
  bool wide;
  int64_t count;
};

// A step's sequences (worker/attention/backend.py, AttentionMetadata): sequence s owns query rows
// query_start_loc[s] .. query_start_loc[s + 1] and has seq_lens[s] tokens of context, in the blocks of
// block_table's row s.
struct Batch {
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t num_seqs;
  const int32_t* block_table;
  int64_t block_table_rows, block_table_stride;
};

// A packed weight (packed_weight.h) of `ints` words.
struct PackedRef {
  const int32_t* data;
  int64_t ints;
};

// A mixture-of-experts feed-forward (Qwen2-MoE, Qwen3-MoE, Mixtral). The router's logits (in x's dtype, as
// transformers rounds them) go through a float32 softmax; each token takes its top_k experts, with those
// probabilities as weights (divided by their sum where `renormalize`: norm_topk_prob, and always in
// Mixtral). Expert e is an MLP of gate_up[e] (packed gated, or plain [2 inner, hidden]) and down[e]. Qwen2-MoE
// adds a shared expert to every token, weighted by sigmoid(shared_gate x); its refs are null elsewhere.
struct MoeWeights {
  PackedRef router;  // plain [num_experts, hidden]
  const PackedRef* gate_up;
  const PackedRef* down;
  int64_t num_experts, top_k, inner, renormalize;
  PackedRef shared_gate_up, shared_down, shared_gate;  // shared_gate: plain [1, hidden]
  int64_t shared_inner;
};

// out = the MoE feed-forward of x [rows, hidden], in x's dtype. Each expert's weights are read once for all
// the tokens that chose it (one GEMM over its gathered rows); the weighted expert outputs are summed per
// token in float32, in ascending expert order as transformers adds them, then the shared expert's.
void moe(const Matrix& x, const MoeWeights& w, const Matrix& out);

// out = x @ W^T + bias for a packed weight (packed_weight.h) of packed_ints words: out [rows, N] in x's
// dtype or float32; for a gated weight out [rows, N / 2] = silu(gate) * up in x's dtype. bias (N entries
// of x's dtype) may be null.
void linear(const Matrix& x, const int32_t* packed, int64_t packed_ints, const void* bias, const Matrix& out);

// rms_norm(x) * weight for each row, as transformers computes it (statistics in float32).
void rms_norm(const Matrix& out, const Matrix& x, const void* weight, double eps);

// residual += delta in place, then out = rms_norm(residual) * weight: a layer's residual step.
void add_rms_norm(const Matrix& out, const Matrix& residual, const Matrix& delta, const void* weight, double eps);

// silu(gate) * up for gate_up [rows, 2 * width] holding the two halves side by side.
void silu_and_mul(const Matrix& out, const Matrix& gate_up);

// x = gelu(x) in place, with erf (not the tanh approximation), each element rounded once to x's dtype.
void gelu(const Matrix& x);

// Rotates qk in place by per-token cos and sign-folded sin tables [tokens, rotary_dim]: the first rotary_dim
// dimensions of each head (all of them, but for a partial rotary).
void rotary_embedding(const Heads& qk, const Matrix& cos, const Matrix& sin_signed);

// Qwen3's per-head norms, in place: rms_norm of each head's dim (no weight), times q_weight for the first
// q_heads heads and k_weight for the rest, each product rounded as transformers' two steps round it.
void qk_norm(const Heads& qk, int64_t q_heads, const void* q_weight, const void* k_weight, double eps);

// Each row's argmax of x (float32) as torch.argmax(dim=-1) gives it: the first of equal maxima, a NaN above all.
void argmax_rows(const Matrix& x, int64_t* out);

// Copies each token's key and value rows into its slot of the cache.
void write_kv_cache(const Heads& key, const Heads& value, const KvCache& cache, const Slots& slots);

// Causal attention of each sequence's new query rows over its context, read in place from the paged cache:
// all of it, or under a sliding window (window > 0) the last `window` keys up to each row's own position;
// softcap > 0 caps each scaled score s at softcap tanh(s / softcap) (Gemma 2).
// decode_path sends one-token sequences through their own kernel path (false runs them on
// the general tile path, so that its gain can be measured; KernelConfig.cpu_decode_attention); split_keys
// lets that path split a few sequences' keys among the threads (KernelConfig.cpu_decode_split_keys).
void paged_attention(const Heads& out, const Heads& query, const KvCache& cache, const Batch& batch, double scale,
                     int64_t window, double softcap, bool decode_path, bool split_keys);

// An encoder's attention: each query row of sequence s (rows query_start_loc[s] .. query_start_loc[s + 1]) to
// every key of its own sequence, before and after it, read in place from key and value (rows of the step,
// such as views into one fused QKV projection's output).
void attention_within_sequences(const Heads& out, const Heads& query, const Heads& key, const Heads& value,
                                const int32_t* query_start_loc, int64_t num_seqs, double scale);

// out[i] = weight row ids[i], for a table [rows, width] and ids int64.
void gather_rows(const Matrix& out, const Matrix& table, const int64_t* ids);

// Pins thread i of the calling thread's OpenMP pool to core cpu_ids[i]; per thread, the core it was
// pinned to, or -errno where the kernel refused.
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpu_ids);

}  // namespace sluice::cpu
