// The GEMM families behind linear (linear.cpp), each over its own packed format (packed_weight.h).
// Both take x in the weight's dtype with contiguous rows; linear has checked every shape and dtype.
#pragma once

#include <cstdint>

#include "ops.h"
#include "packed_weight.h"
#include "quant_weight.h"

namespace sluice::cpu {

// kFormatFmaLanes: fp32 FMA over weights widened in registers (gemm_fma.h), at every tier.
void fma_gemm(const Matrix& x, const PackedShape& shape, const int32_t* packed, const void* bias, const Matrix& out);

// kFormatBf16Pairs: vdpbf16ps over bf16 pairs (gemm_bf16.h); only where has_bf16_pairs().
void bf16_pairs_gemm(const Matrix& x, const PackedShape& shape, const int32_t* packed, const void* bias,
                     const Matrix& out);

// kFormatQuantBlocks: integer dot products over int8-quantized activations (gemm_quant.cpp), at every tier.
void quant_gemm(const Matrix& x, const QuantShape& shape, const int32_t* packed, const void* bias,
                const Matrix& out);

// The tier this library was built for (the builder's -DSLUICE_TIER), for messages.
inline const char* tier_name() { return SLUICE_TIER; }

}  // namespace sluice::cpu
