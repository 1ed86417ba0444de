// The elementwise parts of a decoder layer, fused so that each costs one dispatch instead of three
// or four. Each rounds to the model dtype exactly where transformers' eager ops do, so that outputs
// track transformers' bit for bit except for the order of additions inside a reduction.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "elementwise.h"
#include "ops.h"
#include "vec16.h"

namespace sluice::cpu {
namespace {

// Rows are a few hundred to a few thousand elements: split only batches worth waking threads for.
constexpr int64_t kRowGrain = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be a 2-d tensor with contiguous rows");
}

void check_output(const at::Tensor& out, at::IntArrayRef sizes, const at::Tensor& like) {
  TORCH_CHECK(out.sizes() == sizes && out.is_contiguous() && out.scalar_type() == like.scalar_type(),
              "out must be a contiguous ", sizes, " tensor of dtype ", like.scalar_type());
}

template <typename F>
void dispatch_float_types(at::ScalarType type, F&& body) {
  switch (type) {
    case at::kFloat:
      return body(float{});
    case at::kBFloat16:
      return body(c10::BFloat16{});
    case at::kHalf:
      return body(c10::Half{});
    default:
      TORCH_CHECK(false, "expected a float32, bfloat16 or float16 tensor, got ", type);
  }
}

template <typename T>
float sum_of_squares(const T* x, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) {
      const float v = to_float(x[i + l]);
      lanes[l] += v * v;
    }
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  for (float lane : lanes) sum += lane;
  return sum;
}

// transformers: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the statistics in float32.
template <typename T>
void rms_norm_row(T* out, const T* x, const T* weight, int64_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(x[i]) * inv));
  }
}

}  // namespace

void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_output(out, x.sizes(), x);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous vector of x's width and dtype");
  const int64_t n = x.size(1), stride = x.stride(0);
  dispatch_float_types(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* src = x.const_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(dst + r * n, src + r * stride, w, n, eps);
    });
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_into(out, x, weight, eps);
  return out;
}

void add_rms_norm_into(at::Tensor& out, at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                       double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous 2-d tensor");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta must match residual's shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1) &&
                  weight.scalar_type() == residual.scalar_type(),
              "weight must be a contiguous vector of residual's width and dtype");
  check_output(out, residual.sizes(), residual);
  const int64_t n = residual.size(1), delta_stride = delta.stride(0);
  dispatch_float_types(residual.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* res = residual.mutable_data_ptr<T>();
    const T* d = delta.const_data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    at::parallel_for(0, residual.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = res + r * n;
        const T* add = d + r * delta_stride;
        for (int64_t i = 0; i < n; ++i) row[i] = from_float<T>(to_float(row[i]) + to_float(add[i]));
        rms_norm_row(dst + r * n, row, w, n, eps);
      }
    });
  });
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  add_rms_norm_into(out, residual, delta, weight, eps);
  return out;
}

void silu_and_mul_into(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves of equal width");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, stride = gate_up.stride(0);
  check_output(out, {rows, n}, gate_up);
  dispatch_float_types(gate_up.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* src = gate_up.const_data_ptr<T>();
    T* dst = out.mutable_data_ptr<T>();
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = src + r * stride;
        const T* up = gate + n;
        T* o = dst + r * n;
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
          const v16 y = silu_times<T>(load(gate + i), load(up + i));
          if constexpr (std::is_same_v<T, c10::Half>) {
            for (int l = 0; l < 16; ++l) o[i + l] = from_float<T>(y[l]);
          } else {
            store(o + i, y);
          }
        }
        for (; i < n; ++i) {
          const float g = to_float(gate[i]);
          o[i] = from_float<T>(round_to<T>(g / (1.0f + std::exp(-g))) * to_float(up[i]));
        }
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_and_mul_into(out, gate_up);
  return out;
}

void rotary_embedding(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin_signed) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [num_tokens, heads, head_dim], contiguous in head_dim");
  const int64_t tokens = qk.size(0), heads = qk.size(1), dim = qk.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  for (const at::Tensor* t : {&cos, &sin_signed}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == dim && t->stride(1) == 1 &&
                    t->scalar_type() == qk.scalar_type(),
                "cos and sin must be [num_tokens, head_dim] tables of qk's dtype");
  }
  const int64_t tok_stride = qk.stride(0), head_stride = qk.stride(1);
  const int64_t cos_stride = cos.stride(0), sin_stride = sin_signed.stride(0);
  dispatch_float_types(qk.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* base = qk.mutable_data_ptr<T>();
    const T* cos_base = cos.const_data_ptr<T>();
    const T* sin_base = sin_signed.const_data_ptr<T>();
    at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cos_base + t * cos_stride;
        const T* s = sin_base + t * sin_stride;
        for (int64_t h = 0; h < heads; ++h) {
          T* x = base + t * tok_stride + h * head_stride;
          // transformers: x * cos + rotate_half(x) * sin, each product rounded to the dtype; the
          // sign of rotate_half lives in sin_signed, so the partner is a plain half-rotation.
          int64_t i = 0;
          if constexpr (!std::is_same_v<T, c10::Half>) {
            for (; i + 16 <= half; i += 16) {
              const v16 lo = load(x + i), hi = load(x + i + half);
              const v16 new_lo = round_to<T>(lo * load(c + i)) + round_to<T>(hi * load(s + i));
              const v16 new_hi = round_to<T>(hi * load(c + i + half)) + round_to<T>(lo * load(s + i + half));
              store(x + i, new_lo);
              store(x + i + half, new_hi);
            }
          }
          for (; i < half; ++i) {
            const float lo = to_float(x[i]), hi = to_float(x[i + half]);
            const float new_lo = round_to<T>(lo * to_float(c[i])) + round_to<T>(hi * to_float(s[i]));
            const float new_hi =
                round_to<T>(hi * to_float(c[i + half])) + round_to<T>(lo * to_float(s[i + half]));
            x[i] = from_float<T>(new_lo);
            x[i + half] = from_float<T>(new_hi);
          }
        }
      }
    });
  });
}

}  // namespace sluice::cpu
