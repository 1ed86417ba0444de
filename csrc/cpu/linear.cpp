// Linear layers on CPU: bf16 weights packed at load (packed_weight.h) go through the packed GEMM;
// every other weight, float32 and float16 included, through ATen, exactly as F.linear. An MLP's
// gate_up goes through gated_linear: one GEMM whose epilogue applies silu(gate) * up where the weight
// was packed gated, else the linear and then silu_and_mul.
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ops.h"
#include "packed_weight.h"

namespace sluice::cpu {
namespace {

// Whether prepare_linear_weight (and prepare_gated_linear_weight) would pack this weight.
bool packs(const at::Tensor& weight) {
  return packed_gemm_available() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
         weight.device().is_cpu();
}

bool is_gated_weight(const at::Tensor& weight) { return is_packed_weight(weight) && packed_shape(weight).gated; }

void check_not_gated(const at::Tensor& weight) {
  TORCH_CHECK(!is_gated_weight(weight), "a gated packed weight (gate and up) goes through gated_linear, not linear");
}

// The packed GEMM over x of any leading dimensions; out has `width` features.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype, int64_t width) {
  const PackedShape shape = packed_shape(weight);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == shape.k, "x has shape ", x.sizes(), " but the packed weight expects ",
              shape.k, " features");
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, shape.k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  at::Tensor out = at::empty({rows.size(0), width}, x.options().dtype(out_dtype));
  packed_gemm(rows, weight, bias, out);
  if (x.dim() == 2) return out;
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = width;
  return out.view(sizes);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (is_packed_weight(weight)) {
    check_not_gated(weight);
    return packed_linear(x, weight, bias, at::kBFloat16, packed_shape(weight).n);
  }
  return at::linear(x, weight, bias);
}

at::Tensor linear_float32(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (is_packed_weight(weight)) {
    check_not_gated(weight);
    return packed_linear(x, weight, bias, at::kFloat, packed_shape(weight).n);
  }
  return at::linear(x, weight, bias).to(at::kFloat);
}

at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (is_gated_weight(weight)) return packed_linear(x, weight, bias, at::kBFloat16, packed_shape(weight).n / 2);
  return silu_and_mul(sluice::cpu::linear(x, weight, bias));
}

// The same kernel as linear, into a preallocated [rows, out_features] buffer: the packed GEMM for a
// packed weight (it checks out's shape and dtype), else ATen's out variant, which runs at::linear's
// addmm/mm, so the two agree bit for bit.
void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  if (is_packed_weight(weight)) {
    check_not_gated(weight);
    packed_gemm(x, weight, bias, out);
    return;
  }
  at::linear_out(out, x, weight, bias);
}

void gated_linear_out(at::Tensor& out, at::Tensor& gate_up, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  if (is_gated_weight(weight)) {
    packed_gemm(x, weight, bias, out);
    return;
  }
  sluice::cpu::linear_out(gate_up, x, weight, bias);
  silu_and_mul_into(out, gate_up);
}

at::Tensor prepare_linear_weight(const at::Tensor& weight, bool k_blocks) {
  return packs(weight) ? pack_linear_weight(weight, k_blocks) : weight;
}

at::Tensor prepare_gated_linear_weight(const at::Tensor& weight, bool k_blocks) {
  return packs(weight) ? pack_gated_linear_weight(weight, k_blocks) : weight;
}

}  // namespace sluice::cpu
