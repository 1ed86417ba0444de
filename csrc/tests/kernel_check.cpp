// Checks one kernel library (any tier, any architecture) through its C ABI against plain scalar
// references, with no torch and no Python: the test suite runs it natively for every tier this CPU
// runs, and for the aarch64 build under qemu-user (tests/kernels/test_kernel_build.py).
//   kernel_check LIBRARY        prints one line per group of checks; exit status 0 only if all pass.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../cpu/dtypes.h"
#include "../cpu/ops.h"

using namespace sluice::cpu;

namespace {

// abi.cpp's PackedInfo.
struct PackedInfo {
  int64_t n, k, out_features, total_ints;
  int32_t gated, k_blocks, format, dtype, lanes;
};

struct Library {
  void* handle;
  const char* (*last_error)();
  const char* (*tier)();
  int32_t (*packing_info)(int32_t, int64_t, int64_t, int32_t, int32_t, PackedInfo*);
  int32_t (*pack_weight)(const void*, int32_t, int64_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t*,
                         int64_t);
  int32_t (*linear)(const Matrix*, const int32_t*, int64_t, const void*, const Matrix*);
  int32_t (*pack_quantized)(int32_t, int64_t, int64_t, int32_t, const int64_t*, const int32_t*, const void* const*,
                            const void* const*, int32_t*, int64_t, PackedInfo*);
  int32_t (*rms_norm)(const Matrix*, const Matrix*, const void*, double);
  int32_t (*silu_and_mul)(const Matrix*, const Matrix*);
  int32_t (*argmax_rows)(const Matrix*, int64_t*);
  int32_t (*write_kv_cache)(const Heads*, const Heads*, const KvCache*, const Slots*);
  int32_t (*paged_attention)(const Heads*, const Heads*, const KvCache*, const Batch*, double, int64_t, double,
                             int32_t, int32_t);
  int32_t (*moe)(const Matrix*, const MoeWeights*, const Matrix*);
};

template <typename F>
void bind(void* handle, const char* name, F& slot) {
  slot = reinterpret_cast<F>(dlsym(handle, name));
  if (slot == nullptr) {
    std::fprintf(stderr, "kernel_check: the library lacks %s\n", name);
    std::exit(2);
  }
}

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    if (failures <= 20) std::printf("FAIL %s\n", what.c_str());
  }
}

void ok_or_die(const Library& lib, int32_t status, const char* call) {
  if (status != 0) {
    std::printf("FAIL %s: %s\n", call, lib.last_error());
    std::exit(1);
  }
}

std::mt19937 rng(1234);

float random_value() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }

// n values of type T, rounded from random floats, and the floats they hold.
template <typename T>
std::vector<T> random_values(size_t n, std::vector<float>& held) {
  std::vector<T> out(n);
  held.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = from_float<T>(random_value());
    held[i] = to_float(out[i]);
  }
  return out;
}

template <typename T>
float half_ulp() {
  if constexpr (std::is_same_v<T, bf16>) return 1.0f / 256;
  if constexpr (std::is_same_v<T, fp16>) return 1.0f / 2048;
  return 0.0f;
}

template <typename T>
std::vector<int32_t> pack(const Library& lib, const std::vector<T>& w, int64_t n, int64_t k, int32_t layout) {
  PackedInfo info{};
  ok_or_die(lib, lib.packing_info(int32_t(dtype_of<T>()), n, k, layout, 1, &info), "packing_info");
  std::vector<int32_t> packed(info.total_ints);
  ok_or_die(lib, lib.pack_weight(w.data(), int32_t(dtype_of<T>()), n, k, k, 1, layout, 1, packed.data(), info.total_ints),
            "pack_weight");
  return packed;
}

// x [m, k] @ w^T + bias against float64 sums, within float32 accumulation and T's rounding.
template <typename T>
void check_linear(const Library& lib, int64_t m, int64_t n, int64_t k) {
  std::vector<float> xf, wf, bf;
  const std::vector<T> x = random_values<T>(m * k, xf), w = random_values<T>(n * k, wf), b = random_values<T>(n, bf);
  const std::vector<int32_t> packed = pack(lib, w, n, k, 0);
  std::vector<float> out32(m * n);
  std::vector<T> out(m * n);
  const Matrix xm{const_cast<T*>(x.data()), dtype_of<T>(), m, k, k};
  const Matrix o32{out32.data(), DType::kFloat32, m, n, n}, o{out.data(), dtype_of<T>(), m, n, n};
  ok_or_die(lib, lib.linear(&xm, packed.data(), int64_t(packed.size()), b.data(), &o32), "linear (float32 out)");
  ok_or_die(lib, lib.linear(&xm, packed.data(), int64_t(packed.size()), b.data(), &o), "linear");
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double exact = bf[c], magnitude = std::fabs(bf[c]);
      for (int64_t j = 0; j < k; ++j) {
        exact += double(xf[r * k + j]) * wf[c * k + j];
        magnitude += std::fabs(double(xf[r * k + j]) * wf[c * k + j]);
      }
      const double tolerance = 8 * std::sqrt(double(k)) * std::ldexp(1.0, -24) * magnitude + 1e-30;
      const std::string where = std::string("linear ") + dtype_name(dtype_of<T>()) + " [" + std::to_string(m) +
                                "," + std::to_string(n) + "," + std::to_string(k) + "] at (" + std::to_string(r) +
                                "," + std::to_string(c) + ")";
      expect(std::fabs(out32[r * n + c] - exact) <= tolerance, where + " float32");
      expect(std::fabs(to_float(out[r * n + c]) - exact) <= tolerance + half_ulp<T>() * std::fabs(exact), where);
    }
  }
}

// A gated weight's epilogue equals silu_and_mul over the plain product, bit for bit.
template <typename T>
void check_gated(const Library& lib, int64_t m, int64_t width, int64_t k) {
  std::vector<float> held;
  const std::vector<T> x = random_values<T>(m * k, held), w = random_values<T>(2 * width * k, held);
  const std::vector<int32_t> gated = pack(lib, w, 2 * width, k, 1), plain = pack(lib, w, 2 * width, k, 0);
  std::vector<T> fused(m * width), gate_up(m * 2 * width), unfused(m * width);
  const Matrix xm{const_cast<T*>(x.data()), dtype_of<T>(), m, k, k};
  const Matrix fo{fused.data(), dtype_of<T>(), m, width, width};
  const Matrix go{gate_up.data(), dtype_of<T>(), m, 2 * width, 2 * width};
  const Matrix uo{unfused.data(), dtype_of<T>(), m, width, width};
  ok_or_die(lib, lib.linear(&xm, gated.data(), int64_t(gated.size()), nullptr, &fo), "linear (gated)");
  ok_or_die(lib, lib.linear(&xm, plain.data(), int64_t(plain.size()), nullptr, &go), "linear");
  ok_or_die(lib, lib.silu_and_mul(&uo, &go), "silu_and_mul");
  expect(std::memcmp(fused.data(), unfused.data(), fused.size() * sizeof(T)) == 0,
         std::string("gated ") + dtype_name(dtype_of<T>()) + " equals silu_and_mul of the plain product");
}

// A quantized weight of one block kind (quant_weight.h: 1 int8 with d, 2 nibbles with d and m, 3 nibbles
// with d, value d * (q - 8)) against its definition: x quantized to int8 per block of 32 (d = max |x| / 127,
// q rounded half away from zero in one rounding), exact integer dot products, scaled in float64.
void check_quantized(const Library& lib, int32_t kind, int64_t m, int64_t n, int64_t k) {
  const int64_t blocks = k / 32, planes = kind == 2 ? 2 : 1, value_bytes = kind == 1 ? 32 : 16;
  std::vector<uint8_t> values(n * blocks * value_bytes);
  for (uint8_t& v : values) v = uint8_t(kind == 1 ? int8_t(int(rng() % 255) - 127) : int(rng() % 256));
  std::vector<uint16_t> scales(n * planes * blocks);  // [rows][planes][blocks]
  for (uint16_t& d : scales) d = from_float<fp16>(random_value() * 0.02f).bits;
  std::vector<float> x(m * k);
  for (float& v : x) v = random_value();
  const int64_t row_end = n;
  const void* value_parts[] = {values.data()};
  const void* scale_parts[] = {scales.data()};
  PackedInfo info{};
  ok_or_die(lib, lib.pack_quantized(0, n, k, 1, &row_end, &kind, value_parts, scale_parts, nullptr, 0, &info),
            "pack_quantized (size)");
  std::vector<int32_t> packed(info.total_ints);
  ok_or_die(lib,
            lib.pack_quantized(0, n, k, 1, &row_end, &kind, value_parts, scale_parts, packed.data(),
                               info.total_ints, &info),
            "pack_quantized");
  std::vector<float> out(m * n);
  const Matrix xm{x.data(), DType::kFloat32, m, k, k}, om{out.data(), DType::kFloat32, m, n, n};
  ok_or_die(lib, lib.linear(&xm, packed.data(), int64_t(packed.size()), nullptr, &om), "linear (quantized)");
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double exact = 0, magnitude = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = &x[r * k + b * 32];
        float amax = 0;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float dx = amax / 127.0f, inverse = amax > 0 ? 127.0f / amax : 0.0f;
        const uint8_t* wb = &values[(c * blocks + b) * value_bytes];
        int64_t dot = 0, abs_dot = 0, x_sum = 0;
        for (int j = 0; j < 32; ++j) {
          const int64_t q = int64_t(std::fma(xb[j], inverse, xb[j] >= 0 ? 0.5f : -0.5f));
          int64_t w = kind == 1 ? int8_t(wb[j]) : (j < 16 ? wb[j] & 15 : wb[j - 16] >> 4);
          if (kind == 3) w -= 8;
          dot += q * w;
          abs_dot += std::abs(q * w);
          x_sum += q;
        }
        const double scale = double(to_float(fp16{scales[c * planes * blocks + b]}) * dx);
        exact += scale * double(dot);
        magnitude += std::fabs(scale) * double(abs_dot);
        if (kind == 2) {
          const double minimum = to_float(fp16{scales[(c * planes + 1) * blocks + b]}) * double(dx * float(x_sum));
          exact += minimum;
          magnitude += std::fabs(minimum);
        }
      }
      const double tolerance = 4 * double(blocks + 4) * std::ldexp(1.0, -24) * magnitude + 1e-30;
      expect(std::fabs(out[r * n + c] - exact) <= tolerance,
             "quantized linear kind " + std::to_string(kind) + " [" + std::to_string(m) + "," + std::to_string(n) +
                 "," + std::to_string(k) + "] at (" + std::to_string(r) + "," + std::to_string(c) + ")");
    }
  }
}

void check_rms_norm(const Library& lib) {
  const int64_t rows = 5, n = 200;
  std::vector<float> x(rows * n), w(n), out(rows * n);
  for (float& v : x) v = random_value() * 3;
  for (float& v : w) v = random_value();
  const Matrix xm{x.data(), DType::kFloat32, rows, n, n}, om{out.data(), DType::kFloat32, rows, n, n};
  ok_or_die(lib, lib.rms_norm(&om, &xm, w.data(), 1e-5), "rms_norm");
  for (int64_t r = 0; r < rows; ++r) {
    double squares = 0;
    for (int64_t i = 0; i < n; ++i) squares += double(x[r * n + i]) * x[r * n + i];
    const double inv = 1 / std::sqrt(squares / n + 1e-5);
    for (int64_t i = 0; i < n; ++i)
      expect(std::fabs(out[r * n + i] - w[i] * x[r * n + i] * inv) <= 1e-5 * (1 + std::fabs(w[i] * x[r * n + i] * inv)),
             "rms_norm at " + std::to_string(r) + "," + std::to_string(i));
  }
}

void check_argmax(const Library& lib) {
  const int64_t rows = 7, n = 1000;
  std::vector<float> x(rows * n);
  for (float& v : x) v = random_value();
  x[3 * n + 999] = 50;  // in the tail past the last whole vector
  x[5 * n + 10] = x[5 * n + 20] = 60;  // equal maxima: the first
  std::vector<int64_t> got(rows);
  const Matrix xm{x.data(), DType::kFloat32, rows, n, n};
  ok_or_die(lib, lib.argmax_rows(&xm, got.data()), "argmax_rows");
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i)
      if (x[r * n + i] > x[r * n + best]) best = i;
    expect(got[r] == best, "argmax of row " + std::to_string(r));
  }
}

// A cached value as the kernels read it: a float, or a quantized byte times its row's scale (kv_quant.h),
// decoded here from the formats' definitions.
double cached_value(DType dtype, const uint8_t* row, int d, int dim) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof scale);
  if (dtype == DType::kInt8) return double(int8_t(row[d])) * scale;
  const int bits = row[d], exponent = (bits >> 3) & 15, mantissa = bits & 7;
  const double magnitude =
      exponent == 0 ? std::ldexp(mantissa / 8.0, -6) : std::ldexp(1 + mantissa / 8.0, exponent - 7);
  // The stored scale has the 256 of the kernels' half-precision widening in it.
  return (bits & 0x80 ? -magnitude : magnitude) * scale / 256;
}

// Two sequences in a paged cache (block size 4): a 7-token prefill chunk after 5 cached tokens, and a
// decode at 23 tokens, against softmax attention written out, over every earlier key or a sliding window of
// them (window > 0), with scores soft-capped at softcap tanh(s / softcap) where softcap > 0. A float32 cache
// is filled directly; an int8 or fp8 one (head-major) through write_kv_cache, and the reference reads back
// what it holds.
void check_attention(const Library& lib, bool decode_path, DType cache_dtype, int64_t window, double softcap) {
  const int64_t heads = 4, kv_heads = 2, dim = 32, block = 4, blocks = 16;
  const bool quantized = cache_dtype != DType::kFloat32;
  const int64_t row_bytes = quantized ? dim + 4 : dim * 4;
  const std::vector<int32_t> lens = {12, 23}, q_lens = {7, 1};
  const std::vector<int32_t> qsl = {0, 7, 8};
  std::vector<int32_t> table = {3, 9, 1, -1, -1, -1, 0, 2, 4, 5, 6, 7};  // 2 rows of 6 blocks
  std::vector<float> k_rows(blocks * block * kv_heads * dim), v_rows(k_rows.size());
  for (float& v : k_rows) v = random_value();
  for (float& v : v_rows) v = random_value();
  std::vector<uint8_t> k_cache(blocks * block * kv_heads * row_bytes), v_cache(k_cache.size());
  const KvCache cache{k_cache.data(), v_cache.data(), cache_dtype, blocks, block, kv_heads, dim};
  if (quantized) {
    std::vector<int64_t> slots(blocks * block);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = int64_t(i);
    const int64_t n = blocks * block;
    const Heads kh{k_rows.data(), DType::kFloat32, n, kv_heads, dim, kv_heads * dim, dim};
    const Heads vh{v_rows.data(), DType::kFloat32, n, kv_heads, dim, kv_heads * dim, dim};
    const Slots all{slots.data(), true, n};
    ok_or_die(lib, lib.write_kv_cache(&kh, &vh, &cache, &all), "write_kv_cache");
  } else {
    std::memcpy(k_cache.data(), k_rows.data(), k_cache.size());
    std::memcpy(v_cache.data(), v_rows.data(), v_cache.size());
  }
  // Where slot `slot`'s row of KV head g lives: token-major for floats, head-major when quantized.
  auto value = [&](const std::vector<uint8_t>& c, int64_t slot, int g, int d) {
    const int64_t b = slot / block, o = slot % block;
    const int64_t row = quantized ? (b * kv_heads + g) * block + o : slot * kv_heads + g;
    if (!quantized) return double(reinterpret_cast<const float*>(c.data() + row * row_bytes)[d]);
    return cached_value(cache_dtype, c.data() + row * row_bytes, d, dim);
  };
  std::vector<float> q(8 * heads * dim), out(q.size());
  for (float& v : q) v = random_value();
  const Heads qh{q.data(), DType::kFloat32, 8, heads, dim, heads * dim, dim};
  const Heads oh{out.data(), DType::kFloat32, 8, heads, dim, heads * dim, dim};
  const Batch batch{qsl.data(), lens.data(), 2, table.data(), 2, 6};
  const double scale = 1 / std::sqrt(double(dim));
  ok_or_die(lib, lib.paged_attention(&oh, &qh, &cache, &batch, scale, window, softcap, decode_path, 1),
            "paged_attention");
  for (int s = 0; s < 2; ++s) {
    for (int t = 0; t < q_lens[s]; ++t) {
      const int row = qsl[s] + t, pos = lens[s] - q_lens[s] + t;
      for (int h = 0; h < heads; ++h) {
        const int g = h / (heads / kv_heads);
        const int first = window > 0 ? std::max<int>(0, pos - int(window) + 1) : 0;
        std::vector<double> scores(pos + 1, 0.0);
        double top = -1e300, sum = 0;
        for (int key = first; key <= pos; ++key) {
          const int64_t slot = table[s * 6 + key / block] * block + key % block;
          double dot = 0;
          for (int d = 0; d < dim; ++d) dot += double(q[(row * heads + h) * dim + d]) * value(k_cache, slot, g, d);
          scores[key] = softcap > 0 ? softcap * std::tanh(dot * scale / softcap) : dot * scale;
          top = std::max(top, scores[key]);
        }
        for (int key = first; key <= pos; ++key) sum += (scores[key] = std::exp(scores[key] - top));
        for (int d = 0; d < dim; ++d) {
          double want = 0;
          for (int key = first; key <= pos; ++key)
            want += scores[key] / sum * value(v_cache, table[s * 6 + key / block] * block + key % block, g, d);
          expect(std::fabs(out[(row * heads + h) * dim + d] - want) <= 2e-5,
                 std::string("attention over a ") + dtype_name(cache_dtype) + " cache (decode path " +
                     (decode_path ? "on" : "off") + ", window " + std::to_string(window) + ", softcap " +
                     std::to_string(softcap) + ") row " +
                     std::to_string(row) + " head " + std::to_string(h));
        }
      }
    }
  }
}

}  // namespace

// A float32 mixture of experts (top 2 of 6, renormalised, with a shared expert) against float64 sums, token
// by token; a token whose second and third logits lie within 0.05 of each other is left out, since
// rounding may pick either.
void check_moe(const Library& lib, int64_t m) {
  constexpr int64_t kExperts = 6, kTopK = 2, kHidden = 32, kInner = 24;
  std::vector<float> x(m * kHidden), router(kExperts * kHidden), shared_gate(kHidden);
  for (float& v : x) v = random_value();
  for (float& v : router) v = random_value();
  for (float& v : shared_gate) v = 0.3f * random_value();
  // Experts 0 .. 5, then the shared one: [gate; up] and down.
  std::vector<std::vector<float>> gate_up(kExperts + 1, std::vector<float>(2 * kInner * kHidden)),
      down(kExperts + 1, std::vector<float>(kHidden * kInner));
  std::vector<std::vector<int32_t>> packed_gate_up, packed_down;
  std::vector<PackedRef> gate_up_refs, down_refs;
  for (int64_t e = 0; e <= kExperts; ++e) {
    for (float& v : gate_up[e]) v = 0.2f * random_value();
    for (float& v : down[e]) v = 0.2f * random_value();
    packed_gate_up.push_back(pack(lib, gate_up[e], 2 * kInner, kHidden, 1));
    packed_down.push_back(pack(lib, down[e], kHidden, kInner, 0));
  }
  for (int64_t e = 0; e <= kExperts; ++e) {
    gate_up_refs.push_back({packed_gate_up[e].data(), int64_t(packed_gate_up[e].size())});
    down_refs.push_back({packed_down[e].data(), int64_t(packed_down[e].size())});
  }
  const std::vector<int32_t> packed_router = pack(lib, router, kExperts, kHidden, 0);
  const std::vector<int32_t> packed_shared_gate = pack(lib, shared_gate, 1, kHidden, 0);
  const MoeWeights w{{packed_router.data(), int64_t(packed_router.size())},
                     gate_up_refs.data(),
                     down_refs.data(),
                     kExperts,
                     kTopK,
                     kInner,
                     1,
                     gate_up_refs[kExperts],
                     down_refs[kExperts],
                     {packed_shared_gate.data(), int64_t(packed_shared_gate.size())},
                     kInner};
  std::vector<float> out(m * kHidden);
  const Matrix xm{x.data(), DType::kFloat32, m, kHidden, kHidden}, om{out.data(), DType::kFloat32, m, kHidden, kHidden};
  ok_or_die(lib, lib.moe(&xm, &w, &om), "moe");
  const auto expert = [&](int64_t e, const float* xt, double* y) {
    for (int64_t i = 0; i < kInner; ++i) {
      double g = 0, u = 0;
      for (int64_t j = 0; j < kHidden; ++j) {
        g += double(gate_up[e][i * kHidden + j]) * xt[j];
        u += double(gate_up[e][(kInner + i) * kHidden + j]) * xt[j];
      }
      const double act = g / (1 + std::exp(-g)) * u;
      for (int64_t h = 0; h < kHidden; ++h) y[h] += act * down[e][h * kInner + i];
    }
  };
  for (int64_t t = 0; t < m; ++t) {
    const float* xt = &x[t * kHidden];
    std::vector<double> logits(kExperts), y(kHidden, 0.0);
    for (int64_t e = 0; e < kExperts; ++e)
      for (int64_t j = 0; j < kHidden; ++j) logits[e] += double(router[e * kHidden + j]) * xt[j];
    std::vector<int64_t> order(kExperts);
    for (int64_t e = 0; e < kExperts; ++e) order[e] = e;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logits[a] > logits[b]; });
    if (logits[order[kTopK - 1]] - logits[order[kTopK]] < 0.05) continue;
    // Renormalised over the chosen two, the softmax's denominator cancels.
    const double e0 = 1.0, e1 = std::exp(logits[order[1]] - logits[order[0]]);
    std::vector<double> y0(kHidden, 0.0), y1(kHidden, 0.0), shared(kHidden, 0.0);
    expert(order[0], xt, y0.data());
    expert(order[1], xt, y1.data());
    expert(kExperts, xt, shared.data());
    double gate_logit = 0;
    for (int64_t j = 0; j < kHidden; ++j) gate_logit += double(shared_gate[j]) * xt[j];
    const double gate = 1 / (1 + std::exp(-gate_logit));
    for (int64_t h = 0; h < kHidden; ++h) {
      const double exact = (e0 * y0[h] + e1 * y1[h]) / (e0 + e1) + gate * shared[h];
      expect(std::fabs(out[t * kHidden + h] - exact) <= 1e-4 * (1 + std::fabs(exact)),
             "moe [" + std::to_string(m) + " tokens] at (" + std::to_string(t) + "," + std::to_string(h) + ")");
    }
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: kernel_check LIBRARY\n");
    return 2;
  }
  Library lib{};
  lib.handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib.handle == nullptr) {
    std::fprintf(stderr, "kernel_check: %s\n", dlerror());
    return 2;
  }
  bind(lib.handle, "sluice_last_error", lib.last_error);
  bind(lib.handle, "sluice_tier", lib.tier);
  bind(lib.handle, "sluice_packing_info", lib.packing_info);
  bind(lib.handle, "sluice_pack_weight", lib.pack_weight);
  bind(lib.handle, "sluice_linear", lib.linear);
  bind(lib.handle, "sluice_pack_quantized", lib.pack_quantized);
  bind(lib.handle, "sluice_rms_norm", lib.rms_norm);
  bind(lib.handle, "sluice_silu_and_mul", lib.silu_and_mul);
  bind(lib.handle, "sluice_argmax_rows", lib.argmax_rows);
  bind(lib.handle, "sluice_write_kv_cache", lib.write_kv_cache);
  bind(lib.handle, "sluice_paged_attention", lib.paged_attention);
  bind(lib.handle, "sluice_moe", lib.moe);
  for (int64_t m : {1, 3, 7, 13, 40}) {
    for (auto [n, k] : {std::pair<int64_t, int64_t>{17, 3}, {64, 64}, {130, 257}}) {
      check_linear<float>(lib, m, n, k);
      check_linear<bf16>(lib, m, n, k);
      check_linear<fp16>(lib, m, n, k);
    }
    check_gated<float>(lib, m, 40, 33);
    check_gated<bf16>(lib, m, 40, 33);
    check_gated<fp16>(lib, m, 40, 33);
  }
  std::printf("linear: done\n");
  for (int32_t kind : {1, 2, 3})
    for (int64_t m : {1, 3, 7})
      for (int64_t k : {96, 288}) check_quantized(lib, kind, m, 13, k);
  std::printf("quantized linear: done\n");
  for (int64_t m : {1, 5, 40}) check_moe(lib, m);
  std::printf("moe: done\n");
  check_rms_norm(lib);
  check_argmax(lib);
  for (DType cache : {DType::kFloat32, DType::kInt8, DType::kFp8E4M3}) {
    for (int64_t window : {0, 1, 5}) {
      for (double softcap : {0.0, 0.5}) {
        check_attention(lib, true, cache, window, softcap);
        check_attention(lib, false, cache, window, softcap);
      }
    }
  }
  std::printf("kernel_check: %s tier: %s\n", lib.tier(), failures == 0 ? "every check passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
