// Linear layers on CPU. Today every call goes to ATen; a packed-weight kernel lands here.
#include <ATen/ops/linear.h>

#include "ops.h"

namespace sluice::cpu {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return at::linear(x, weight, bias);
}

// ATen's out variant runs the same addmm/mm kernel as at::linear, so the two agree bit for bit.
// A packed-weight kernel must take over here exactly where it takes over in linear.
void linear_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  at::linear_out(out, x, weight, bias);
}

}  // namespace sluice::cpu
