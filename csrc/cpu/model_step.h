// The CPU's own "graph": a decoder's dense stages, and its whole forward pass, as calls over activation
// buffers allocated once. Python pays one call per stage (PIECEWISE) or one per step (FULL) instead of a
// dozen dispatches per layer, and a step allocates no activations. The buffers, the weights and the KV
// caches are the worker's torch tensors (worker/cpu_model_step.py), which outlive the step.
#pragma once

#include <cstdint>
#include <vector>

#include "ops.h"

namespace sluice::cpu {

// One decoder layer's tensors as the Python model holds them (worker/models/llama.py, _LayerTensors); with
// tensor parallelism they are this rank's shards and the head counts are this rank's. Norms and biases
// are in the model dtype; a null bias or q/k norm is absent.
struct LayerWeights {
  const void* input_norm;
  const void* post_norm;
  double eps;
  PackedRef qkv;
  const void* qkv_bias;
  PackedRef o;
  const void* o_bias;
  PackedRef gate_up;  // packed gated, or plain (then silu_and_mul runs after it)
  const void* gate_up_bias;
  PackedRef down;
  const void* down_bias;
  // A mixture-of-experts layer's feed-forward, in place of gate_up and down (then null); null for a dense one.
  const MoeWeights* moe;
  // Qwen3 normalises each head of q and k before the rotation.
  const void* q_norm;
  const void* k_norm;
  int64_t num_heads, num_kv_heads, head_dim, intermediate_size;
  // The layer's sliding window (paged_attention's), or 0 where it attends to the whole context. (No layer
  // the step runs soft-caps its scores: Gemma's layers run eagerly.)
  int64_t sliding_window;
  double scale;

  int64_t qkv_width() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
};

// Activation buffers shared by every layer, each of max_tokens rows of its widest use (a step of n tokens
// works in the first n rows), in the model dtype.
struct Workspace {
  void* normed;    // hidden
  void* qkv;       // widest qkv_width
  void* attn;      // widest num_heads * head_dim
  void* attn_out;  // hidden
  void* gate_up;   // widest 2 * intermediate_size
  void* act;       // widest intermediate_size
  void* mlp_out;   // hidden
  void* residual;  // hidden
  void* cos;       // rotary_dim
  void* sin;       // rotary_dim
  void* hidden;    // hidden: the final-normed output
};

struct ModelShape {
  DType dtype;
  // rotary_dim: the cos and sin tables' width (head_dim, or less for a partial rotary).
  int64_t hidden, vocab, max_tokens, max_positions, rotary_dim;
};

class ModelStep {
 public:
  // embedding [vocab, hidden], cos and sin tables [max_positions, rotary_dim], final_norm [hidden].
  ModelStep(std::vector<LayerWeights> layers, ModelShape shape, const void* embedding, const void* final_norm,
            double final_eps, const void* cos_table, const void* sin_table, Workspace workspace,
            bool decode_attention, bool decode_split_keys);

  // The per-layer caches that forward writes and reads; set once they exist.
  void set_kv_caches(std::vector<KvCache> caches);

  // FULL: embedding, every layer with its KV-cache write and paged attention, and the final norm, into the
  // workspace's first n rows of `hidden`. decode_attention and decode_split_keys are paged_attention's.
  void forward(const int64_t* input_ids, const int64_t* positions, int64_t n, const Slots& slots,
               const Batch& batch);

  // PIECEWISE: layer `l`'s three dense stages, each mirroring the method of the same name on llama.py's
  // DecoderLayer op for op. attention_input adds `delta` (none for the first layer) into `residual` in
  // place and leaves rotated q and k, and v, in the workspace's qkv rows; attention_output writes o_proj
  // of `attn` to attn_out; feed_forward adds `delta` into `residual` and writes the MLP's output to
  // mlp_out. Under tensor parallelism those outputs are partial sums that the caller all-reduces.
  void attention_input(int64_t l, const Matrix* delta, const Matrix& residual, const Matrix& cos,
                       const Matrix& sin) const;
  void attention_output(int64_t l, const Matrix& attn) const;
  void feed_forward(int64_t l, const Matrix& delta, const Matrix& residual) const;

  int64_t num_layers() const { return int64_t(layers_.size()); }

 private:
  const LayerWeights& layer(int64_t l, int64_t n) const;
  Matrix rows(void* buffer, int64_t n, int64_t width) const { return {buffer, shape_.dtype, n, width, width}; }

  std::vector<LayerWeights> layers_;
  ModelShape shape_;
  const void* embedding_;
  const void* final_norm_;
  double final_eps_;
  const void* cos_table_;
  const void* sin_table_;
  Workspace ws_;
  bool decode_attention_;
  bool decode_split_keys_;
  int64_t head_dim_;
  std::vector<KvCache> caches_;
};

}  // namespace sluice::cpu
