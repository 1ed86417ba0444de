// An encoder's attention on CPU: every query row of a sequence attends to all of the sequence's keys, read in
// place from the step's rows (no cache). A work item is one (sequence, head): its keys are widened once,
// K transposed, then each block of query rows takes three passes, all in fp32: the scores of every key as
// register tiles (rows x key vectors, a broadcast query element times a vector of keys), one softmax over the
// whole row (an encoder's sequences are short: no online rescaling, one exponential per score), and P.V as
// register tiles (rows x dim vectors, a broadcast probability times a value row).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "check.h"
#include "ops.h"
#include "parallel.h"
#include "vec16.h"

namespace sluice::cpu {
namespace {

constexpr int kLanes = kNativeLanes;
using V = vn;
// Query rows per block: two accumulators each fill 12 of AVX2's 16 registers, or 24 of AVX-512's 32.
constexpr int kRows = kLanes == 16 ? 12 : 6;
// Keys per score tile (two vectors): every row of scores is padded to a multiple of it.
constexpr int kKeyTile = 2 * kLanes;
// Rows of K, V and Q whose loads are issued ahead of their use: the rows of one head are a whole token's
// q, k and v apart (strides across pages, which the hardware prefetcher does not follow).
constexpr int kPrefetchRows = 8;
// Below this much work (rows x keys) waking the thread pool costs more than it saves.
constexpr int64_t kSerialWork = 4096;

struct Args {
  const Heads& out;
  const Heads& query;
  const Heads& key;
  const Heads& value;
  float scale_log2;
};

struct Scratch {
  // K transposed (kt[d * padded + j]), V widened (v[j * dim + d]), a block's query rows, its scores.
  std::vector<float> kt, v, q, s;

  void reserve(int padded, int dim) {
    auto grow = [](std::vector<float>& x, size_t n) {
      if (x.size() < n) x.resize(n);
    };
    grow(kt, size_t(dim) * padded);
    grow(v, size_t(padded) * dim);
    grow(q, size_t(kRows) * dim);
    grow(s, size_t(kRows) * padded);
  }
};

template <typename T>
const T* row_of(const Heads& h, int64_t token, int64_t head) {
  return static_cast<const T*>(h.data) + token * h.token_stride + head * h.head_stride;
}

// s[r * padded + j] = q[r] . k[j] for the block's kRows rows and every key tile.
void scores(const float* q, const float* kt, int dim, int padded, float* s) {
  for (int j0 = 0; j0 < padded; j0 += kKeyTile) {
    V acc[kRows][2] = {};
    for (int d = 0; d < dim; ++d) {
      const V k0 = load_as<V>(kt + d * padded + j0), k1 = load_as<V>(kt + d * padded + j0 + kLanes);
      for (int r = 0; r < kRows; ++r) {
        const V x = splat_as<V>(q[r * dim + d]);
        acc[r][0] += x * k0;
        acc[r][1] += x * k1;
      }
    }
    for (int r = 0; r < kRows; ++r) {
      store_as(s + r * padded + j0, acc[r][0]);
      store_as(s + r * padded + j0 + kLanes, acc[r][1]);
    }
  }
}

// Each row's scores (log2 units, keys from n on at -inf) become its unnormalised probabilities; each row's
// 1 / sum goes to inv_sum.
void softmax_rows(float* s, int padded, float* inv_sum) {
  for (int r = 0; r < kRows; ++r) {
    float* row = s + r * padded;
    V top = load_as<V>(row);
    for (int j = kLanes; j < padded; j += kLanes) top = vmax(top, load_as<V>(row + j));
    float m = top[0];
    for (int i = 1; i < kLanes; ++i) m = std::max(m, top[i]);
    const V mv = splat_as<V>(m);
    V sum{};
    for (int j = 0; j < padded; j += kLanes) {
      const V e = exp2(load_as<V>(row + j) - mv);
      store_as(row + j, e);
      sum += e;
    }
    float total = 0.0f;
    for (int i = 0; i < kLanes; ++i) total += sum[i];
    inv_sum[r] = 1.0f / total;
  }
}

// out rows = p . V over dims [d0, d0 + Vecs * kLanes), scaled by each row's 1 / sum.
template <typename T, int Vecs>
void pv_block(const float* p, const float* v, const float* inv_sum, int n, int padded, int dim, int d0, int rows,
              T* const* dst) {
  V acc[kRows][Vecs] = {};
  for (int j = 0; j < n; ++j) {
    V vv[Vecs];
    for (int i = 0; i < Vecs; ++i) vv[i] = load_as<V>(v + j * dim + d0 + i * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const V x = splat_as<V>(p[r * padded + j]);
      for (int i = 0; i < Vecs; ++i) acc[r][i] += x * vv[i];
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < Vecs; ++i) store_as(dst[r] + d0 + i * kLanes, acc[r][i] * inv_sum[r]);
}

template <typename T>
void attend_head(const Args& a, int64_t first, int n, int head, Scratch& s) {
  const int dim = int(a.query.dim), kv_head = int(head / (a.query.heads / a.key.heads));
  const int padded = (n + kKeyTile - 1) / kKeyTile * kKeyTile;
  s.reserve(padded, dim);
  float* kt = s.kt.data();
  float* v = s.v.data();
  const int row_bytes = dim * int(sizeof(T));
  for (int j = 0; j < padded; ++j) {
    if (j + kPrefetchRows < n) {
      for (int b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(row_of<T>(a.key, first + j + kPrefetchRows, kv_head)) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(row_of<T>(a.value, first + j + kPrefetchRows, kv_head)) + b);
        __builtin_prefetch(reinterpret_cast<const char*>(row_of<T>(a.query, first + j + kPrefetchRows, head)) + b);
      }
    }
    if (j < n) {
      const T* k_row = row_of<T>(a.key, first + j, kv_head);
      const T* v_row = row_of<T>(a.value, first + j, kv_head);
      for (int d = 0; d < dim; ++d) kt[d * padded + j] = to_float(k_row[d]);
      for (int d = 0; d < dim; d += kLanes) store_as(v + j * dim + d, load_as<V>(v_row + d));
    } else {
      for (int d = 0; d < dim; ++d) kt[d * padded + j] = 0.0f;
    }
  }
  float* q = s.q.data();
  float* sc = s.s.data();
  float inv_sum[kRows];
  T* dst[kRows];
  for (int r0 = 0; r0 < n; r0 += kRows) {
    const int rows = std::min(kRows, n - r0);
    for (int r = 0; r < kRows; ++r) {
      if (r < rows) {
        const T* q_row = row_of<T>(a.query, first + r0 + r, head);
        for (int d = 0; d < dim; d += kLanes) store_as(q + r * dim + d, load_as<V>(q_row + d) * a.scale_log2);
        dst[r] = static_cast<T*>(a.out.data) + (first + r0 + r) * a.out.token_stride + head * a.out.head_stride;
      } else {
        std::memset(q + r * dim, 0, dim * sizeof(float));
      }
    }
    scores(q, kt, dim, padded, sc);
    for (int r = 0; r < kRows; ++r)
      std::fill(sc + r * padded + n, sc + (r + 1) * padded, -std::numeric_limits<float>::infinity());
    softmax_rows(sc, padded, inv_sum);
    int d0 = 0;
    for (; d0 + 2 * kLanes <= dim; d0 += 2 * kLanes) pv_block<T, 2>(sc, v, inv_sum, n, padded, dim, d0, rows, dst);
    for (; d0 < dim; d0 += kLanes) pv_block<T, 1>(sc, v, inv_sum, n, padded, dim, d0, rows, dst);
  }
}

}  // namespace

void attention_within_sequences(const Heads& out, const Heads& query, const Heads& key, const Heads& value,
                                const int32_t* query_start_loc, int64_t num_seqs, double scale) {
  SK_CHECK(out.tokens == query.tokens && out.heads == query.heads && out.dim == query.dim &&
               out.dtype == query.dtype,
           "out must match query's shape and dtype");
  SK_CHECK(key.tokens == query.tokens && value.tokens == key.tokens && value.heads == key.heads &&
               value.dim == key.dim && key.dim == query.dim && key.dtype == query.dtype && value.dtype == key.dtype,
           "key and value must have the query's tokens, head_dim and dtype, and one shape");
  SK_CHECK(query.dim % 16 == 0, "head_dim must be a multiple of 16");
  SK_CHECK(key.heads > 0 && query.heads % key.heads == 0, "num_heads must be a multiple of num_kv_heads");
  SK_CHECK(num_seqs >= 0 && query_start_loc[0] == 0 && query_start_loc[num_seqs] <= query.tokens,
           "query_start_loc must start at 0 and end within the query rows");
  // Items (sequence, head), longest sequences first, so that dynamic hand-out ends balanced.
  static thread_local std::vector<std::pair<int64_t, int64_t>> items;  // (-length, sequence * heads + head)
  items.clear();
  int64_t work = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = query_start_loc[s + 1] - query_start_loc[s];
    SK_CHECK(n >= 0, "query_start_loc must not decrease");
    if (n == 0) continue;
    for (int64_t h = 0; h < query.heads; ++h) items.emplace_back(-n, s * query.heads + h);
    work += n * n * query.heads;
  }
  std::sort(items.begin(), items.end());
  const Args args{out, query, key, value, float(scale * M_LOG2E)};
  // The pool's threads read this thread's list (a thread_local named inside the lambda would be their own).
  const std::vector<std::pair<int64_t, int64_t>>& plan = items;
  dispatch_dtype(query.dtype, [&](auto tag) {
    using T = decltype(tag);
    run_items(int64_t(plan.size()), work < kSerialWork, [&](int64_t i) {
      static thread_local Scratch scratch;
      const int64_t s = plan[i].second / query.heads, h = plan[i].second % query.heads;
      attend_head<T>(args, query_start_loc[s], int(-plan[i].first), int(h), scratch);
    });
  });
}

}  // namespace sluice::cpu
