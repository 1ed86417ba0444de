// Each stage runs the same kernels as the eager Python model, in the same order and on the same
// dtypes, so its outputs are bitwise the eager ones; what it removes is the Python between them
// and the allocation of every intermediate.
#include "model_step.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/rms_norm.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "ops.h"

namespace sluice::cpu {
namespace {

template <typename F>
int64_t widest(const std::vector<DecoderLayerWeights>& layers, F&& width) {
  int64_t most = 0;
  for (const DecoderLayerWeights& w : layers) most = std::max(most, width(w));
  return most;
}

void check_layer(const DecoderLayerWeights& w, const DecoderLayerWeights& first) {
  TORCH_CHECK(w.num_heads > 0 && w.num_kv_heads > 0 && w.num_heads % w.num_kv_heads == 0,
              "num_heads must be a positive multiple of num_kv_heads");
  TORCH_CHECK(w.q_norm.has_value() == w.k_norm.has_value(), "q_norm and k_norm come together");
  TORCH_CHECK(w.hidden_size() == first.hidden_size() && w.head_dim == first.head_dim,
              "every layer must share the hidden size and head_dim");
  TORCH_CHECK(w.input_norm.scalar_type() == first.input_norm.scalar_type() &&
                  w.post_norm.scalar_type() == first.input_norm.scalar_type(),
              "every layer's norms must be in the model dtype");
  // Weights are checked by linear_out itself: a packed one (packed_weight.h) is int32 with its own shape.
  for (const at::Tensor* t : {&w.input_norm, &w.post_norm, &w.qkv_weight, &w.o_weight, &w.gate_up_weight,
                              &w.down_weight}) {
    TORCH_CHECK(t->device().is_cpu(), "every layer tensor must be a CPU tensor");
  }
}

}  // namespace

StepWorkspace::StepWorkspace(const std::vector<DecoderLayerWeights>& layers, int64_t max_tokens)
    : max_tokens(max_tokens) {
  TORCH_CHECK(!layers.empty(), "a model step needs at least one layer");
  TORCH_CHECK(max_tokens > 0, "max_tokens must be positive");
  const DecoderLayerWeights& first = layers.front();
  for (const DecoderLayerWeights& w : layers) check_layer(w, first);
  const at::TensorOptions options = first.input_norm.options();
  // Flat buffers: a layer of any width views the first n * width elements as [n, width].
  auto buffer = [&](int64_t width) { return at::empty({max_tokens * width}, options); };
  const int64_t hidden = first.hidden_size();
  normed = buffer(hidden);
  qkv = buffer(widest(layers, [](const auto& w) { return w.qkv_width(); }));
  attn = buffer(widest(layers, [](const auto& w) { return w.num_heads * w.head_dim; }));
  attn_out = buffer(hidden);
  gate_up = buffer(widest(layers, [](const auto& w) { return 2 * w.intermediate_size; }));
  act = buffer(widest(layers, [](const auto& w) { return w.intermediate_size; }));
  mlp_out = buffer(hidden);
  residual = buffer(hidden);
  cos = buffer(first.head_dim);
  sin_signed = buffer(first.head_dim);
  this->hidden = buffer(hidden);
}

at::Tensor StepWorkspace::rows(const at::Tensor& buffer, int64_t n, int64_t width) const {
  TORCH_INTERNAL_ASSERT(n * width <= buffer.numel());
  return buffer.narrow(0, 0, n * width).view({n, width});
}

std::vector<at::Tensor> StepWorkspace::buffers() const {
  return {normed, qkv, attn, attn_out, gate_up, act, mlp_out, residual, cos, sin_signed, hidden};
}

DecoderStages::DecoderStages(DecoderLayerWeights weights, std::shared_ptr<StepWorkspace> workspace)
    : weights_(std::move(weights)), ws_(std::move(workspace)) {}

int64_t DecoderStages::checked_rows(const at::Tensor& t) const {
  const int64_t n = t.size(0);
  TORCH_CHECK(n >= 1 && n <= ws_->max_tokens, "a step of ", n, " tokens does not fit the workspace of ",
              ws_->max_tokens, " tokens");
  return n;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecoderStages::attention_input(
    const std::optional<at::Tensor>& delta, at::Tensor& residual, const at::Tensor& cos,
    const at::Tensor& sin_signed) const {
  c10::InferenceMode inference;
  const DecoderLayerWeights& w = weights_;
  const int64_t n = checked_rows(residual);
  const int64_t heads = w.num_heads, kv_heads = w.num_kv_heads, dim = w.head_dim;
  at::Tensor x = ws_->rows(ws_->normed, n, w.hidden_size());
  if (delta.has_value()) {
    add_rms_norm_into(x, residual, *delta, w.input_norm, w.eps);
  } else {
    rms_norm_into(x, residual, w.input_norm, w.eps);
  }
  at::Tensor qkv = ws_->rows(ws_->qkv, n, w.qkv_width());
  linear_out(qkv, x, w.qkv_weight, w.qkv_bias);
  at::Tensor heads_view = qkv.view({n, heads + 2 * kv_heads, dim});
  at::Tensor qk = heads_view.narrow(1, 0, heads + kv_heads);
  if (w.q_norm.has_value()) {
    // torch's own rms_norm and in-place muls, as llama.py runs them, so rounding matches; the
    // result goes back into the qkv rows, where q and k are read from.
    at::Tensor normed = at::rms_norm(qk, {dim}, std::nullopt, w.eps);
    normed.narrow(1, 0, heads).mul_(*w.q_norm);
    normed.narrow(1, heads, kv_heads).mul_(*w.k_norm);
    qk.copy_(normed);
  }
  rotary_embedding(qk, cos, sin_signed);
  return {qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads), heads_view.narrow(1, heads + kv_heads, kv_heads)};
}

at::Tensor DecoderStages::attention_output(const at::Tensor& attn) const {
  c10::InferenceMode inference;
  const DecoderLayerWeights& w = weights_;
  const int64_t n = checked_rows(attn);
  at::Tensor out = ws_->rows(ws_->attn_out, n, w.hidden_size());
  linear_out(out, attn.view({n, -1}), w.o_weight, w.o_bias);
  return out;
}

at::Tensor DecoderStages::feed_forward(const at::Tensor& delta, at::Tensor& residual) const {
  c10::InferenceMode inference;
  const DecoderLayerWeights& w = weights_;
  const int64_t n = checked_rows(residual);
  at::Tensor x = ws_->rows(ws_->normed, n, w.hidden_size());
  add_rms_norm_into(x, residual, delta, w.post_norm, w.eps);
  // gate_up is written only where the weight is not packed gated, so otherwise its pages stay untouched.
  at::Tensor gate_up = ws_->rows(ws_->gate_up, n, 2 * w.intermediate_size);
  at::Tensor act = ws_->rows(ws_->act, n, w.intermediate_size);
  gated_linear_out(act, gate_up, x, w.gate_up_weight, w.gate_up_bias);
  at::Tensor out = ws_->rows(ws_->mlp_out, n, w.hidden_size());
  linear_out(out, act, w.down_weight, w.down_bias);
  return out;
}

ModelStep::ModelStep(std::vector<DecoderLayerWeights> layers, at::Tensor embedding, at::Tensor final_norm,
                     double final_eps, at::Tensor cos_table, at::Tensor sin_table, int64_t max_tokens,
                     bool decode_attention, bool decode_split_keys)
    : ws_(std::make_shared<StepWorkspace>(layers, max_tokens)),
      embedding_(std::move(embedding)),
      final_norm_(std::move(final_norm)),
      cos_table_(std::move(cos_table)),
      sin_table_(std::move(sin_table)),
      final_eps_(final_eps),
      decode_attention_(decode_attention),
      decode_split_keys_(decode_split_keys) {
  const DecoderLayerWeights& first = layers.front();
  TORCH_CHECK(embedding_.dim() == 2 && embedding_.size(1) == first.hidden_size() &&
                  embedding_.scalar_type() == first.input_norm.scalar_type(),
              "embedding must be [vocab, hidden] in the model dtype");
  TORCH_CHECK(final_norm_.numel() == first.hidden_size(), "final_norm must be a [hidden] vector");
  for (const at::Tensor* t : {&cos_table_, &sin_table_}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == first.head_dim && t->scalar_type() == embedding_.scalar_type(),
                "cos and sin tables must be [max_positions, head_dim] in the model dtype");
  }
  layers_.reserve(layers.size());
  for (DecoderLayerWeights& w : layers) layers_.push_back(std::make_shared<DecoderStages>(std::move(w), ws_));
}

void ModelStep::set_kv_caches(std::vector<std::pair<at::Tensor, at::Tensor>> kv_caches) {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one (key_cache, value_cache) pair per layer: expected ",
              layers_.size(), ", got ", kv_caches.size());
  kv_caches_ = std::move(kv_caches);
}

at::Tensor ModelStep::forward(const at::Tensor& input_ids, const at::Tensor& positions,
                              const at::Tensor& slot_mapping, const at::Tensor& block_table,
                              const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
  c10::InferenceMode inference;
  TORCH_CHECK(!kv_caches_.empty(), "set_kv_caches must run before forward");
  TORCH_CHECK(input_ids.dim() == 1 && positions.sizes() == input_ids.sizes(),
              "input_ids and positions must be [num_tokens] each");
  const int64_t n = input_ids.size(0);
  TORCH_CHECK(n >= 1 && n <= ws_->max_tokens, "a step of ", n, " tokens does not fit the workspace of ",
              ws_->max_tokens, " tokens");
  const DecoderLayerWeights& first = layers_.front()->weights();
  const int64_t hidden = first.hidden_size();
  at::Tensor residual = ws_->rows(ws_->residual, n, hidden);
  at::Tensor cos = ws_->rows(ws_->cos, n, first.head_dim);
  at::Tensor sin = ws_->rows(ws_->sin_signed, n, first.head_dim);
  at::index_select_out(residual, embedding_, 0, input_ids);
  at::index_select_out(cos, cos_table_, 0, positions);
  at::index_select_out(sin, sin_table_, 0, positions);
  std::optional<at::Tensor> delta;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const DecoderStages& stages = *layers_[l];
    const DecoderLayerWeights& w = stages.weights();
    auto& [key_cache, value_cache] = kv_caches_[l];
    auto [q, k, v] = stages.attention_input(delta, residual, cos, sin);
    write_kv_cache(k, v, key_cache, value_cache, slot_mapping);
    at::Tensor attn = ws_->rows(ws_->attn, n, w.num_heads * w.head_dim).view({n, w.num_heads, w.head_dim});
    paged_attention(attn, q, key_cache, value_cache, block_table, query_start_loc, seq_lens, w.scale,
                    decode_attention_, decode_split_keys_);
    delta = stages.feed_forward(stages.attention_output(attn), residual);
  }
  at::Tensor out = ws_->rows(ws_->hidden, n, hidden);
  add_rms_norm_into(out, residual, *delta, final_norm_, final_eps_);
  return out;
}

}  // namespace sluice::cpu
