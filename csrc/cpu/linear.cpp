// Linear layers on CPU: every weight that the worker packed at load (packed_weight.h) goes through the
// GEMM of its format; an MLP's gate_up packed gated gets silu(gate) * up from the GEMM's epilogue.
// A quantized weight goes through the integer GEMM of gemm_quant.cpp.
// (A weight left unpacked, KernelConfig.packed_linear off, never reaches here: F.linear takes it.)
#include "check.h"
#include "gemm.h"
#include "ops.h"
#include "packed_weight.h"

namespace sluice::cpu {

namespace {

// A quantized weight (quant_weight.h): never gated, any tier.
void quantized_linear(const Matrix& x, const int32_t* packed, int64_t packed_ints, const void* bias,
                      const Matrix& out) {
  const QuantShape shape = quant_shape(packed, packed_ints);
  SK_CHECK(x.cols == shape.k, "x has ", x.cols, " features but the quantized weight expects ", shape.k);
  SK_CHECK(x.dtype == shape.dtype, "x is ", dtype_name(x.dtype), " but the quantized weight was packed for ",
           dtype_name(shape.dtype), " activations");
  SK_CHECK(out.rows == x.rows && out.cols == shape.n, "out must be [", x.rows, ", ", shape.n, "], got [", out.rows,
           ", ", out.cols, "]");
  SK_CHECK(out.dtype == x.dtype || out.dtype == DType::kFloat32, "out must be ", dtype_name(x.dtype),
           " or float32, got ", dtype_name(out.dtype));
  if (x.rows > 0) quant_gemm(x, shape, packed, bias, out);
}

}  // namespace

void linear(const Matrix& x, const int32_t* packed, int64_t packed_ints, const void* bias, const Matrix& out) {
  if (packed_format(packed, packed_ints) == kFormatQuantBlocks) {
    quantized_linear(x, packed, packed_ints, bias, out);
    return;
  }
  const PackedShape shape = packed_shape(packed, packed_ints);
  SK_CHECK(x.cols == shape.k, "x has ", x.cols, " features but the packed weight expects ", shape.k);
  SK_CHECK(x.dtype == shape.dtype, "x is ", dtype_name(x.dtype), " but the weight was packed from ",
           dtype_name(shape.dtype));
  SK_CHECK(out.rows == x.rows && out.cols == shape.out_features(), "out must be [", x.rows, ", ",
           shape.out_features(), "]", shape.gated ? " (a gated weight's N / 2 features)" : "", ", got [", out.rows,
           ", ", out.cols, "]");
  SK_CHECK(out.dtype == x.dtype || (!shape.gated && out.dtype == DType::kFloat32), "out must be ",
           dtype_name(x.dtype), shape.gated ? "" : " or float32", ", got ", dtype_name(out.dtype));
  if (x.rows == 0) return;
  if (shape.format == kFormatBf16Pairs) {
    SK_CHECK(has_bf16_pairs(), "this weight was packed for the bf16-pair GEMM of the avx512bf16 tier, which the ",
             tier_name(), " tier lacks: pack it again at this tier");
    bf16_pairs_gemm(x, shape, packed, bias, out);
    return;
  }
  SK_CHECK(shape.lanes == fma_lanes(), "this weight was packed for a GEMM of ", shape.lanes,
           "-float vectors, but the ", tier_name(), " tier's has ", fma_lanes(), ": pack it again at this tier");
  fma_gemm(x, shape, packed, bias, out);
}

}  // namespace sluice::cpu
