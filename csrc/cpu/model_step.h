// The CPU's own "graph": a decoder's dense stages, and its whole forward pass, as C++ calls over
// activation buffers allocated once. Python pays one call per stage (PIECEWISE) or one per step
// (FULL) instead of a dozen dispatches per layer, and a step allocates no activations.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace sluice::cpu {

// One decoder layer's tensors as the Python model holds them (worker/models/llama.py, _LayerTensors).
// With tensor parallelism they are this rank's shards and the head counts are this rank's.
struct DecoderLayerWeights {
  at::Tensor input_norm;
  at::Tensor post_norm;
  double eps;
  at::Tensor qkv_weight;
  std::optional<at::Tensor> qkv_bias;
  at::Tensor o_weight;
  std::optional<at::Tensor> o_bias;
  at::Tensor gate_up_weight;
  std::optional<at::Tensor> gate_up_bias;
  at::Tensor down_weight;
  std::optional<at::Tensor> down_bias;
  // Qwen3 normalises each head of q and k before the rotation.
  std::optional<at::Tensor> q_norm;
  std::optional<at::Tensor> k_norm;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t intermediate_size;
  double scale;

  int64_t hidden_size() const { return input_norm.numel(); }
  int64_t qkv_width() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
};

// Activation buffers shared by every layer, each sized for max_tokens rows of its widest use; a step
// of n tokens works in the first n rows, so any batch up to max_tokens runs without padding.
class StepWorkspace {
 public:
  StepWorkspace(const std::vector<DecoderLayerWeights>& layers, int64_t max_tokens);

  // The first n rows of `buffer` as a contiguous [n, width] tensor.
  at::Tensor rows(const at::Tensor& buffer, int64_t n, int64_t width) const;
  std::vector<at::Tensor> buffers() const;

  int64_t max_tokens;
  at::Tensor normed, qkv, attn, attn_out, gate_up, act, mlp_out, residual, cos, sin_signed, hidden;
};

// A decoder layer's three dense stages, each mirroring the method of the same name on llama.py's
// DecoderLayer op for op. The tensors returned are views of the shared workspace, valid until the
// same stage of any layer runs again. attention_output and feed_forward return this rank's partial
// sums under tensor parallelism; the caller all-reduces them.
class DecoderStages {
 public:
  DecoderStages(DecoderLayerWeights weights, std::shared_ptr<StepWorkspace> workspace);

  // Adds `delta` (the previous layer's output, none for the first layer) into `residual` in place;
  // returns rotated q, k and v as views of the workspace's qkv rows.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_input(const std::optional<at::Tensor>& delta,
                                                                  at::Tensor& residual, const at::Tensor& cos,
                                                                  const at::Tensor& sin_signed) const;
  // o_proj of the attention output [num_tokens, heads, head_dim].
  at::Tensor attention_output(const at::Tensor& attn) const;
  // Adds the attention's `delta` into `residual` in place; returns the MLP's output.
  at::Tensor feed_forward(const at::Tensor& delta, at::Tensor& residual) const;

  const DecoderLayerWeights& weights() const { return weights_; }

 private:
  int64_t checked_rows(const at::Tensor& t) const;

  DecoderLayerWeights weights_;
  std::shared_ptr<StepWorkspace> ws_;
};

// The whole forward pass of a single-rank model in one call (FULL): embedding, every layer with its
// KV-cache write and paged attention, and the final norm, over the workspace. decode_attention and
// decode_split_keys are paged_attention's decode_path and split_keys.
class ModelStep {
 public:
  ModelStep(std::vector<DecoderLayerWeights> layers, at::Tensor embedding, at::Tensor final_norm,
            double final_eps, at::Tensor cos_table, at::Tensor sin_table, int64_t max_tokens,
            bool decode_attention, bool decode_split_keys);

  // The per-layer (key_cache, value_cache) pairs that forward writes and reads; set once they exist.
  void set_kv_caches(std::vector<std::pair<at::Tensor, at::Tensor>> kv_caches);

  // Final-normed hidden states [num_tokens, hidden], a view of the workspace valid until the next call.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc,
                     const at::Tensor& seq_lens);

  const std::vector<std::shared_ptr<DecoderStages>>& layers() const { return layers_; }
  std::vector<at::Tensor> workspace_buffers() const { return ws_->buffers(); }
  int64_t max_tokens() const { return ws_->max_tokens; }

 private:
  std::shared_ptr<StepWorkspace> ws_;
  std::vector<std::shared_ptr<DecoderStages>> layers_;
  std::vector<std::pair<at::Tensor, at::Tensor>> kv_caches_;
  at::Tensor embedding_, final_norm_, cos_table_, sin_table_;
  double final_eps_;
  bool decode_attention_;
  bool decode_split_keys_;
};

}  // namespace sluice::cpu
