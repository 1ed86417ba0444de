#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Sluice CPU kernels";
  m.def("paged_attention", &sluice::cpu::paged_attention, "causal attention over the paged KV cache",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"));
  m.def("write_kv_cache", &sluice::cpu::write_kv_cache, "copy new key/value rows into their cache slots",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
}
