// A mixture-of-experts feed-forward over the tier's GEMMs (linear.cpp), at every tier and on every packed
// format, quantized ones included. The tokens are grouped by expert (a counting sort of their choices), so
// that each chosen expert runs one GEMM pair over all of its rows and its weights stream from memory once a
// step, not once per token; a decode batch of 64 tokens with 8 experts each reads at most the experts chosen.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "check.h"
#include "ops.h"
#include "packed_weight.h"
#include "parallel.h"

namespace sluice::cpu {
namespace {

// Each token's choices: expert ids and weights, top_k per token, in descending weight.
struct Routing {
  std::vector<int32_t> expert;
  std::vector<float> weight;
};

template <typename T>
Routing route(const Matrix& logits, int64_t top_k, bool renormalize) {
  const int64_t n = logits.rows, experts = logits.cols;
  Routing r{std::vector<int32_t>(n * top_k), std::vector<float>(n * top_k)};
  parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> p(experts);
    std::vector<char> taken(experts);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = logits.row<T>(t);
      float max = -INFINITY;
      for (int64_t e = 0; e < experts; ++e) max = std::max(max, to_float(row[e]));
      float sum = 0.0f;
      for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(to_float(row[e]) - max);
      for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
      std::fill(taken.begin(), taken.end(), 0);
      float chosen = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        // The largest not yet taken; of equal ones the lowest expert. top_k is a few: no heap needed.
        int64_t best = -1;
        for (int64_t e = 0; e < experts; ++e)
          if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        r.expert[t * top_k + j] = int32_t(best);
        r.weight[t * top_k + j] = p[best];
        chosen += p[best];
      }
      if (renormalize)
        for (int64_t j = 0; j < top_k; ++j) r.weight[t * top_k + j] /= chosen;
    }
  });
  return r;
}

// An MLP of gate_up and down over x's rows into out: the dense feed-forward's two GEMMs.
void mlp(const Matrix& x, const PackedRef& gate_up, const PackedRef& down, int64_t inner, const Matrix& out) {
  std::vector<char> act_bytes(x.rows * inner * dtype_size(x.dtype));
  const Matrix act{act_bytes.data(), x.dtype, x.rows, inner, inner};
  if (packed_gated(gate_up.data, gate_up.ints)) {
    linear(x, gate_up.data, gate_up.ints, nullptr, act);
  } else {
    std::vector<char> both(x.rows * 2 * inner * dtype_size(x.dtype));
    const Matrix gate_up_out{both.data(), x.dtype, x.rows, 2 * inner, 2 * inner};
    linear(x, gate_up.data, gate_up.ints, nullptr, gate_up_out);
    silu_and_mul(act, gate_up_out);
  }
  linear(act, down.data, down.ints, nullptr, out);
}

void check_weights(const Matrix& x, const MoeWeights& w, const Matrix& out) {
  SK_CHECK(w.num_experts > 0 && w.top_k > 0 && w.top_k <= w.num_experts, "top_k must be in [1, num_experts = ",
           w.num_experts, "], got ", w.top_k);
  SK_CHECK(w.inner > 0 && w.gate_up != nullptr && w.down != nullptr, "every expert needs gate_up and down");
  SK_CHECK(out.rows == x.rows && out.cols == x.cols && out.dtype == x.dtype, "out must be [", x.rows, ", ",
           x.cols, "] of ", dtype_name(x.dtype));
  const bool shared = w.shared_gate_up.data != nullptr;
  SK_CHECK(shared == (w.shared_down.data != nullptr) && shared == (w.shared_gate.data != nullptr),
           "a shared expert needs gate_up, down and its gate together");
  SK_CHECK(!shared || w.shared_inner > 0, "the shared expert's intermediate size must be positive");
}

}  // namespace

void moe(const Matrix& x, const MoeWeights& w, const Matrix& out) {
  check_weights(x, w, out);
  const int64_t n = x.rows, hidden = x.cols, k = w.top_k, size = dtype_size(x.dtype);
  if (n == 0) return;
  std::vector<char> logit_bytes(n * w.num_experts * size);
  const Matrix logits{logit_bytes.data(), x.dtype, n, w.num_experts, w.num_experts};
  linear(x, w.router.data, w.router.ints, nullptr, logits);
  Routing routing;
  dispatch_dtype(x.dtype, [&](auto tag) { routing = route<decltype(tag)>(logits, k, w.renormalize != 0); });

  // Counting sort of the n * k choices by expert: expert e's rows are sorted[first[e] .. first[e + 1]).
  std::vector<int64_t> first(w.num_experts + 1, 0);
  for (int32_t e : routing.expert) ++first[e + 1];
  std::partial_sum(first.begin(), first.end(), first.begin());
  std::vector<int64_t> slot_of(n * k), next(first.begin(), first.end() - 1);
  for (int64_t c = 0; c < n * k; ++c) slot_of[c] = next[routing.expert[c]]++;
  std::vector<char> gathered(n * k * hidden * size), expert_out(n * k * hidden * size);
  const auto row_bytes = [&](std::vector<char>& b, int64_t r) { return b.data() + r * hidden * size; };
  parallel_for(0, n * k, 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      std::memcpy(row_bytes(gathered, slot_of[c]), static_cast<const char*>(x.data) + (c / k) * x.stride * size,
                  hidden * size);
  });

  std::vector<int32_t> active;
  for (int64_t e = 0; e < w.num_experts; ++e)
    if (first[e + 1] > first[e]) active.push_back(int32_t(e));
  const auto run_expert = [&](int64_t i) {
    const int32_t e = active[i];
    const int64_t rows = first[e + 1] - first[e];
    mlp({row_bytes(gathered, first[e]), x.dtype, rows, hidden, hidden}, w.gate_up[e], w.down[e], w.inner,
        {row_bytes(expert_out, first[e]), x.dtype, rows, hidden, hidden});
  };
  // Enough experts to go round: each thread takes whole experts (their GEMMs then run on it alone). Fewer:
  // one at a time, each GEMM split among the threads.
  run_items(int64_t(active.size()), int64_t(active.size()) < num_threads(), run_expert);

  std::vector<char> shared_bytes, shared_logit_bytes;
  if (w.shared_gate_up.data != nullptr) {
    shared_bytes.resize(n * hidden * size);
    shared_logit_bytes.resize(n * size);
    mlp(x, w.shared_gate_up, w.shared_down, w.shared_inner, {shared_bytes.data(), x.dtype, n, hidden, hidden});
    linear(x, w.shared_gate.data, w.shared_gate.ints, nullptr, {shared_logit_bytes.data(), x.dtype, n, 1, 1});
  }

  dispatch_dtype(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(hidden);
      std::vector<int64_t> order(k);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(sum.begin(), sum.end(), 0.0f);
        std::iota(order.begin(), order.end(), t * k);
        std::sort(order.begin(), order.end(),
                  [&](int64_t a, int64_t b) { return routing.expert[a] < routing.expert[b]; });
        for (int64_t c : order) {
          const T* y = reinterpret_cast<const T*>(row_bytes(expert_out, slot_of[c]));
          const float weight = routing.weight[c];
          for (int64_t h = 0; h < hidden; ++h) sum[h] += to_float(y[h]) * weight;
        }
        if (!shared_bytes.empty()) {
          const float logit = to_float(reinterpret_cast<const T*>(shared_logit_bytes.data())[t]);
          const float gate = 1.0f / (1.0f + std::exp(-logit));
          const T* y = reinterpret_cast<const T*>(shared_bytes.data()) + t * hidden;
          for (int64_t h = 0; h < hidden; ++h) sum[h] += to_float(y[h]) * gate;
        }
        T* o = out.row<T>(t);
        for (int64_t h = 0; h < hidden; ++h) o[h] = from_float<T>(sum[h]);
      }
    });
  });
}

}  // namespace sluice::cpu
