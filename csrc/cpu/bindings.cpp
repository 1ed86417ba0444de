#include <torch/extension.h>

#include "ops.h"
#include "packed_weight.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sluice CPU kernels";
  m.def("paged_attention", &sluice::cpu::paged_attention, "causal attention over the paged KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"));
  m.def("write_kv_cache", &sluice::cpu::write_kv_cache, "copy new key/value rows into their cache slots",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("rms_norm", &sluice::cpu::rms_norm, "rms_norm(x) * weight over each row", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm", &sluice::cpu::add_rms_norm, "residual += delta, then rms_norm(residual) * weight",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &sluice::cpu::silu_and_mul, "silu(gate) * up", py::arg("gate_up"));
  m.def("linear", &sluice::cpu::linear, "x @ weight.T + bias", py::arg("x"), py::arg("weight"),
        py::arg("bias"));
  m.def("linear_float32", &sluice::cpu::linear_float32, "x @ weight.T + bias in float32", py::arg("x"),
        py::arg("weight"), py::arg("bias"));
  m.def("prepare_linear_weight", &sluice::cpu::prepare_linear_weight, "the weight as linear reads it fastest",
        py::arg("weight"));
  m.def("pack_linear_weight", &sluice::cpu::pack_linear_weight, "a bf16 weight in the packed GEMM layout",
        py::arg("weight"));
  m.def("rotary_embedding", &sluice::cpu::rotary_embedding, "rotate q and k in place", py::arg("qk"),
        py::arg("cos"), py::arg("sin_signed"));
}
