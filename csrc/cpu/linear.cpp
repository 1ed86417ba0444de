// Linear layers on CPU. Today every call goes to ATen; a packed-weight kernel lands here.
#include <ATen/ops/linear.h>

#include "ops.h"

namespace sluice::cpu {

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return at::linear(x, weight, bias);
}

}  // namespace sluice::cpu
