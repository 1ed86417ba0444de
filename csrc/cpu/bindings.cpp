#include <torch/extension.h>

#include "model_step.h"
#include "ops.h"
#include "packed_weight.h"

namespace {

using sluice::cpu::DecoderLayerWeights;
using sluice::cpu::DecoderStages;
using sluice::cpu::ModelStep;
using OptionalTensor = std::optional<at::Tensor>;
// The stages and the model step run matmuls and attention: other Python threads may run meanwhile.
using ReleaseGil = py::call_guard<py::gil_scoped_release>;

void bind_model_step(py::module_& m) {
  py::class_<DecoderLayerWeights>(m, "DecoderLayerWeights", "one decoder layer's tensors (llama.py _LayerTensors)")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_norm, double eps, at::Tensor qkv_weight,
                       OptionalTensor qkv_bias, at::Tensor o_weight, OptionalTensor o_bias,
                       at::Tensor gate_up_weight, OptionalTensor gate_up_bias, at::Tensor down_weight,
                       OptionalTensor down_bias, OptionalTensor q_norm, OptionalTensor k_norm, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale) {
             return DecoderLayerWeights{input_norm,   post_norm,      eps,       qkv_weight,   qkv_bias,
                                        o_weight,     o_bias,         gate_up_weight, gate_up_bias, down_weight,
                                        down_bias,    q_norm,         k_norm,    num_heads,    num_kv_heads,
                                        head_dim,     intermediate_size, scale};
           }),
           py::kw_only(), py::arg("input_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_weight"),
           py::arg("qkv_bias"), py::arg("o_weight"), py::arg("o_bias"), py::arg("gate_up_weight"),
           py::arg("gate_up_bias"), py::arg("down_weight"), py::arg("down_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate_size"), py::arg("scale"));

  py::class_<DecoderStages, std::shared_ptr<DecoderStages>>(
      m, "DecoderStages", "one layer's dense stages over the shared workspace (PIECEWISE)")
      .def("attention_input", &DecoderStages::attention_input, ReleaseGil(), py::arg("delta"), py::arg("residual"),
           py::arg("cos"), py::arg("sin"))
      .def("attention_output", &DecoderStages::attention_output, ReleaseGil(), py::arg("attn"))
      .def("feed_forward", &DecoderStages::feed_forward, ReleaseGil(), py::arg("delta"), py::arg("residual"));

  py::class_<ModelStep>(m, "ModelStep", "the whole forward pass of a single-rank model in one call (FULL)")
      .def(py::init<std::vector<DecoderLayerWeights>, at::Tensor, at::Tensor, double, at::Tensor, at::Tensor,
                    int64_t, bool, bool>(),
           py::arg("layers"), py::arg("embedding"), py::arg("final_norm"), py::arg("final_eps"),
           py::arg("cos_table"), py::arg("sin_table"), py::arg("max_tokens"), py::arg("decode_attention"),
           py::arg("decode_split_keys"))
      .def("set_kv_caches", &ModelStep::set_kv_caches, py::arg("kv_caches"))
      .def("forward", &ModelStep::forward, ReleaseGil(), py::arg("input_ids"), py::arg("positions"),
           py::arg("slot_mapping"), py::arg("block_table"), py::arg("query_start_loc"), py::arg("seq_lens"))
      .def_property_readonly("layers", &ModelStep::layers)
      .def_property_readonly("max_tokens", &ModelStep::max_tokens)
      .def("workspace_buffers", &ModelStep::workspace_buffers);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sluice CPU kernels";
  m.def("paged_attention", &sluice::cpu::paged_attention, "causal attention over the paged KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("decode_path"),
        py::arg("split_keys"));
  m.def("write_kv_cache", &sluice::cpu::write_kv_cache, "copy new key/value rows into their cache slots",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("rms_norm", &sluice::cpu::rms_norm, "rms_norm(x) * weight over each row", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm", &sluice::cpu::add_rms_norm, "residual += delta, then rms_norm(residual) * weight",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &sluice::cpu::silu_and_mul, "silu(gate) * up", py::arg("gate_up"));
  m.def("linear", &sluice::cpu::linear, "x @ weight.T + bias", py::arg("x"), py::arg("weight"),
        py::arg("bias"));
  m.def("gated_linear", &sluice::cpu::gated_linear, "silu(x @ gate.T + b) * (x @ up.T + b) for weight [gate; up]",
        py::arg("x"), py::arg("weight"), py::arg("bias"));
  m.def("linear_float32", &sluice::cpu::linear_float32, "x @ weight.T + bias in float32", py::arg("x"),
        py::arg("weight"), py::arg("bias"));
  // k_blocks: whether the packed GEMM may take K in blocks at 7-64 rows (KernelConfig.gemm_k_blocks).
  m.def("prepare_linear_weight", &sluice::cpu::prepare_linear_weight, "the weight as linear reads it fastest",
        py::arg("weight"), py::arg("k_blocks") = true);
  m.def("prepare_gated_linear_weight", &sluice::cpu::prepare_gated_linear_weight,
        "a [gate; up] weight as gated_linear reads it fastest", py::arg("weight"), py::arg("k_blocks") = true);
  m.def("pack_gated_linear_weight", &sluice::cpu::pack_gated_linear_weight,
        "a bf16 [gate; up] weight in the packed GEMM's gated layout", py::arg("weight"), py::arg("k_blocks") = true);
  m.def("pack_linear_weight", &sluice::cpu::pack_linear_weight, "a bf16 weight in the packed GEMM layout",
        py::arg("weight"), py::arg("k_blocks") = true);
  m.def("argmax_rows", &sluice::cpu::argmax_rows, "each row's argmax, as torch.argmax(dim=-1)", py::arg("x"));
  m.def("rotary_embedding", &sluice::cpu::rotary_embedding, "rotate q and k in place", py::arg("qk"),
        py::arg("cos"), py::arg("sin_signed"));
  m.def("bind_threads", &sluice::cpu::bind_threads,
        "pin thread i of the calling thread's OpenMP pool to core cpu_ids[i]; returns the cores (or -errno)",
        py::arg("cpu_ids"));
  bind_model_step(m);
}
