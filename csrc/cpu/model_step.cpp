// Each stage runs the same kernels as the eager Python model on CPU (worker/layer_ops.py over
// worker/native_ops.py), in the same order and on the same dtypes, so its outputs are bitwise the eager
// ones; what it removes is the Python between them and the allocation of every intermediate.
#include "model_step.h"

#include <utility>

#include "check.h"
#include "packed_weight.h"

namespace sluice::cpu {

ModelStep::ModelStep(std::vector<LayerWeights> layers, ModelShape shape, const void* embedding,
                     const void* final_norm, double final_eps, const void* cos_table, const void* sin_table,
                     Workspace workspace, bool decode_attention, bool decode_split_keys)
    : layers_(std::move(layers)),
      shape_(shape),
      embedding_(embedding),
      final_norm_(final_norm),
      final_eps_(final_eps),
      cos_table_(cos_table),
      sin_table_(sin_table),
      ws_(workspace),
      decode_attention_(decode_attention),
      decode_split_keys_(decode_split_keys) {
  SK_CHECK(!layers_.empty(), "a model step needs at least one layer");
  SK_CHECK(shape_.max_tokens > 0, "max_tokens must be positive");
  head_dim_ = layers_.front().head_dim;
  SK_CHECK(shape_.rotary_dim > 0 && shape_.rotary_dim <= head_dim_ && shape_.rotary_dim % 2 == 0,
           "rotary_dim must be even and at most head_dim");
  for (const LayerWeights& w : layers_) {
    SK_CHECK(w.num_heads > 0 && w.num_kv_heads > 0 && w.num_heads % w.num_kv_heads == 0,
             "num_heads must be a positive multiple of num_kv_heads");
    SK_CHECK((w.q_norm == nullptr) == (w.k_norm == nullptr), "q_norm and k_norm come together");
    SK_CHECK(w.head_dim == head_dim_, "every layer must share head_dim");
    // Each weight's header is checked here, once, rather than found wanting in the middle of a step.
    for (const PackedRef* p : {&w.qkv, &w.o}) packed_gated(p->data, p->ints);
    if (w.moe == nullptr) {
      for (const PackedRef* p : {&w.gate_up, &w.down}) packed_gated(p->data, p->ints);
    } else {
      SK_CHECK(w.gate_up.data == nullptr && w.down.data == nullptr, "a MoE layer has no dense gate_up or down");
    }
  }
}

void ModelStep::set_kv_caches(std::vector<KvCache> caches) {
  SK_CHECK(caches.size() == layers_.size(), "one (key_cache, value_cache) pair per layer: expected ",
           layers_.size(), ", got ", caches.size());
  caches_ = std::move(caches);
}

const LayerWeights& ModelStep::layer(int64_t l, int64_t n) const {
  SK_CHECK(l >= 0 && l < num_layers(), "layer ", l, " of a model of ", num_layers());
  SK_CHECK(n >= 1 && n <= shape_.max_tokens, "a step of ", n, " tokens does not fit the workspace of ",
           shape_.max_tokens, " tokens");
  return layers_[l];
}

void ModelStep::attention_input(int64_t l, const Matrix* delta, const Matrix& residual, const Matrix& cos,
                                const Matrix& sin) const {
  const int64_t n = residual.rows;
  const LayerWeights& w = layer(l, n);
  const Matrix x = rows(ws_.normed, n, shape_.hidden);
  if (delta != nullptr) {
    add_rms_norm(x, residual, *delta, w.input_norm, w.eps);
  } else {
    rms_norm(x, residual, w.input_norm, w.eps);
  }
  const Matrix qkv = rows(ws_.qkv, n, w.qkv_width());
  linear(x, w.qkv.data, w.qkv.ints, w.qkv_bias, qkv);
  const Heads qk{qkv.data, shape_.dtype, n, w.num_heads + w.num_kv_heads, w.head_dim, qkv.stride, w.head_dim};
  if (w.q_norm != nullptr) qk_norm(qk, w.num_heads, w.q_norm, w.k_norm, w.eps);
  rotary_embedding(qk, cos, sin);
}

void ModelStep::attention_output(int64_t l, const Matrix& attn) const {
  const LayerWeights& w = layer(l, attn.rows);
  linear(attn, w.o.data, w.o.ints, w.o_bias, rows(ws_.attn_out, attn.rows, shape_.hidden));
}

void ModelStep::feed_forward(int64_t l, const Matrix& delta, const Matrix& residual) const {
  const int64_t n = residual.rows;
  const LayerWeights& w = layer(l, n);
  const Matrix x = rows(ws_.normed, n, shape_.hidden);
  add_rms_norm(x, residual, delta, w.post_norm, w.eps);
  if (w.moe != nullptr) {
    moe(x, *w.moe, rows(ws_.mlp_out, n, shape_.hidden));
    return;
  }
  const Matrix act = rows(ws_.act, n, w.intermediate_size);
  if (packed_gated(w.gate_up.data, w.gate_up.ints)) {
    linear(x, w.gate_up.data, w.gate_up.ints, w.gate_up_bias, act);
  } else {
    // gate_up is written only here, so where the weight is packed gated its pages stay untouched.
    const Matrix gate_up = rows(ws_.gate_up, n, 2 * w.intermediate_size);
    linear(x, w.gate_up.data, w.gate_up.ints, w.gate_up_bias, gate_up);
    silu_and_mul(act, gate_up);
  }
  linear(act, w.down.data, w.down.ints, w.down_bias, rows(ws_.mlp_out, n, shape_.hidden));
}

void ModelStep::forward(const int64_t* input_ids, const int64_t* positions, int64_t n, const Slots& slots,
                        const Batch& batch) {
  SK_CHECK(!caches_.empty(), "set_kv_caches must run before forward");
  layer(0, n);
  const DType dtype = shape_.dtype;
  const Matrix residual = rows(ws_.residual, n, shape_.hidden);
  const int64_t rotary = shape_.rotary_dim;
  const Matrix cos = rows(ws_.cos, n, rotary), sin = rows(ws_.sin, n, rotary);
  gather_rows(residual, {const_cast<void*>(embedding_), dtype, shape_.vocab, shape_.hidden, shape_.hidden},
              input_ids);
  gather_rows(cos, {const_cast<void*>(cos_table_), dtype, shape_.max_positions, rotary, rotary}, positions);
  gather_rows(sin, {const_cast<void*>(sin_table_), dtype, shape_.max_positions, rotary, rotary}, positions);
  const int64_t size = dtype_size(dtype);
  const Matrix delta = rows(ws_.mlp_out, n, shape_.hidden);
  for (int64_t l = 0; l < num_layers(); ++l) {
    const LayerWeights& w = layers_[l];
    attention_input(l, l == 0 ? nullptr : &delta, residual, cos, sin);
    char* qkv = static_cast<char*>(ws_.qkv);
    const int64_t stride = w.qkv_width(), dim = w.head_dim;
    const Heads q{qkv, dtype, n, w.num_heads, dim, stride, dim};
    const Heads k{qkv + w.num_heads * dim * size, dtype, n, w.num_kv_heads, dim, stride, dim};
    const Heads v{qkv + (w.num_heads + w.num_kv_heads) * dim * size, dtype, n, w.num_kv_heads, dim, stride, dim};
    write_kv_cache(k, v, caches_[l], slots);
    const Matrix attn = rows(ws_.attn, n, w.num_heads * dim);
    paged_attention({attn.data, dtype, n, w.num_heads, dim, attn.stride, dim}, q, caches_[l], batch, w.scale,
                    w.sliding_window, /*softcap=*/0.0, decode_attention_, decode_split_keys_);
    attention_output(l, attn);
    feed_forward(l, rows(ws_.attn_out, n, shape_.hidden), residual);
  }
  add_rms_norm(rows(ws_.hidden, n, shape_.hidden), residual, delta, final_norm_, final_eps_);
}

}  // namespace sluice::cpu
