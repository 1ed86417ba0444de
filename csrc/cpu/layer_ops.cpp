// The elementwise parts of a decoder's layer (and an encoder's GELU), fused so that each costs one dispatch
// instead of three or four. Each rounds to the model dtype exactly where transformers' eager ops do, so that outputs
// track transformers' bit for bit except for the order of additions inside a reduction.
#include <cmath>
#include <cstring>

#include "check.h"
#include "ops.h"
#include "parallel.h"
#include "vec16.h"

namespace sluice::cpu {
namespace {

// Rows are a few hundred to a few thousand elements: split only batches worth waking threads for.
constexpr int64_t kRowGrain = 16;

void check_same(const Matrix& a, const Matrix& b, const char* what) {
  SK_CHECK(a.rows == b.rows && a.cols == b.cols && a.dtype == b.dtype, what, " must be [", b.rows, ", ", b.cols,
           "] of ", dtype_name(b.dtype), ", got [", a.rows, ", ", a.cols, "] of ", dtype_name(a.dtype));
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
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(x[i]) * inv));
}

}  // namespace

void rms_norm(const Matrix& out, const Matrix& x, const void* weight, double eps) {
  check_same(out, x, "out");
  dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* w = static_cast<const T*>(weight);
    parallel_for(0, x.rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(out.row<T>(r), x.row<T>(r), w, x.cols, float(eps));
    });
  });
}

void add_rms_norm(const Matrix& out, const Matrix& residual, const Matrix& delta, const void* weight, double eps) {
  check_same(delta, residual, "delta");
  check_same(out, residual, "out");
  dispatch_dtype(residual.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* w = static_cast<const T*>(weight);
    const int64_t n = residual.cols;
    parallel_for(0, residual.rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = residual.row<T>(r);
        const T* add = delta.row<T>(r);
        for (int64_t i = 0; i < n; ++i) row[i] = from_float<T>(to_float(row[i]) + to_float(add[i]));
        rms_norm_row(out.row<T>(r), row, w, n, float(eps));
      }
    });
  });
}

// GELU with erf (transformers' "gelu", torch's default): x Phi(x), where Phi(-|x|) = erfc(z) / 2 at z = |x| / sqrt 2
// and erfc(z) = t (a1 + t (a2 + ... a5)) e^(-z^2), t = 1 / (1 + p z) (Abramowitz and Stegun 7.1.26; absolute
// error below 1.5e-7, so x Phi(x) is within |x| 7.5e-8 of exact). x Phi(x) = x - x Phi(-x) for positive x.
inline vn gelu_erf(vn x) {
  const vn z = (x < 0.0f ? -x : x) * 0.70710678118654752f;
  const vn t = splat_as<vn>(1.0f) / (splat_as<vn>(1.0f) + z * 0.3275911f);
  vn poly = splat_as<vn>(1.061405429f);
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  const vn below = poly * t * exp2(z * z * -1.4426950408889634f) * 0.5f;
  return x * (x > 0.0f ? splat_as<vn>(1.0f) - below : below);
}

void gelu(const Matrix& x) {
  dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = x.cols;
    parallel_for(0, x.rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = x.row<T>(r);
        int64_t i = 0;
        for (; i + kNativeLanes <= n; i += kNativeLanes) store_as(row + i, gelu_erf(load_as<vn>(row + i)));
        if (i < n) {
          T lanes[kNativeLanes] = {};
          std::memcpy(lanes, row + i, (n - i) * sizeof(T));
          store_as(lanes, gelu_erf(load_as<vn>(lanes)));
          std::memcpy(row + i, lanes, (n - i) * sizeof(T));
        }
      }
    });
  });
}

void silu_and_mul(const Matrix& out, const Matrix& gate_up) {
  SK_CHECK(gate_up.cols % 2 == 0, "gate_up must hold gate and up halves of equal width");
  check_same(out, Matrix{nullptr, gate_up.dtype, gate_up.rows, gate_up.cols / 2, 0}, "out");
  dispatch_dtype(gate_up.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t n = out.cols;
    parallel_for(0, gate_up.rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = gate_up.row<T>(r);
        const T* up = gate + n;
        T* o = out.row<T>(r);
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) store(o + i, silu_times<T>(load(gate + i), load(up + i)));
        if (i < n) {
          // The tail through the same vector code, so that every lane rounds as the GEMM's gated epilogue does.
          T g[16] = {}, u[16] = {}, y[16];
          std::memcpy(g, gate + i, (n - i) * sizeof(T));
          std::memcpy(u, up + i, (n - i) * sizeof(T));
          store(y, silu_times<T>(load(g), load(u)));
          std::memcpy(o + i, y, (n - i) * sizeof(T));
        }
      }
    });
  });
}

void rotary_embedding(const Heads& qk, const Matrix& cos, const Matrix& sin_signed) {
  for (const Matrix* t : {&cos, &sin_signed}) {
    SK_CHECK(t->rows == qk.tokens && t->cols == cos.cols && t->cols <= qk.dim && t->cols % 2 == 0 &&
                 t->dtype == qk.dtype,
             "cos and sin must be [num_tokens, rotary_dim] tables of qk's dtype, rotary_dim even and at most "
             "head_dim");
  }
  // A partial rotary (Phi-4-mini) turns the first rotary_dim dimensions of each head, pairing i with
  // i + rotary_dim / 2, and leaves the rest as they are.
  const int64_t half = cos.cols / 2;
  dispatch_dtype(qk.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, qk.tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cos.row<T>(t);
        const T* s = sin_signed.row<T>(t);
        for (int64_t h = 0; h < qk.heads; ++h) {
          T* x = static_cast<T*>(qk.data) + t * qk.token_stride + h * qk.head_stride;
          // transformers: x * cos + rotate_half(x) * sin, each product rounded to the dtype; the
          // sign of rotate_half lives in sin_signed, so the partner is a plain half-rotation.
          // On native vectors: a v16's roundings on AVX2 go through the stack.
          int64_t i = 0;
          for (; i + kNativeLanes <= half; i += kNativeLanes) {
            const vn lo = load_as<vn>(x + i), hi = load_as<vn>(x + i + half);
            const vn new_lo = round_to<T>(lo * load_as<vn>(c + i)) + round_to<T>(hi * load_as<vn>(s + i));
            const vn new_hi =
                round_to<T>(hi * load_as<vn>(c + i + half)) + round_to<T>(lo * load_as<vn>(s + i + half));
            store_as(x + i, new_lo);
            store_as(x + i + half, new_hi);
          }
          for (; i < half; ++i) {
            const float lo = to_float(x[i]), hi = to_float(x[i + half]);
            const float new_lo = round_to<T>(lo * to_float(c[i])) + round_to<T>(hi * to_float(s[i]));
            const float new_hi = round_to<T>(hi * to_float(c[i + half])) + round_to<T>(lo * to_float(s[i + half]));
            x[i] = from_float<T>(new_lo);
            x[i + half] = from_float<T>(new_hi);
          }
        }
      }
    });
  });
}

void qk_norm(const Heads& qk, int64_t q_heads, const void* q_weight, const void* k_weight, double eps) {
  SK_CHECK(q_heads >= 0 && q_heads <= qk.heads, "q_heads must be at most the heads of qk");
  dispatch_dtype(qk.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, qk.tokens, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t h = 0; h < qk.heads; ++h) {
          T* x = static_cast<T*>(qk.data) + t * qk.token_stride + h * qk.head_stride;
          rms_norm_row(x, x, static_cast<const T*>(h < q_heads ? q_weight : k_weight), qk.dim, float(eps));
        }
      }
    });
  });
}

void gather_rows(const Matrix& out, const Matrix& table, const int64_t* ids) {
  SK_CHECK(out.cols == table.cols && out.dtype == table.dtype, "out must have the table's width and dtype");
  for (int64_t r = 0; r < out.rows; ++r)
    SK_CHECK(ids[r] >= 0 && ids[r] < table.rows, "row id ", ids[r], " is outside the table's ", table.rows, " rows");
  const int64_t size = dtype_size(table.dtype);
  parallel_for(0, out.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      std::memcpy(static_cast<char*>(out.data) + r * out.stride * size,
                  static_cast<const char*>(table.data) + ids[r] * table.stride * size, table.cols * size);
  });
}

}  // namespace sluice::cpu
