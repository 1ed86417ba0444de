// Causal paged attention on CPU. One work item is (sequence, kv head, tile of query tokens); its
// rows are every query head of the kv head's group for every token of the tile, so each K/V row
// fetched through the block table serves the whole group. Keys go 16 at a time: K is widened to
// float and transposed so that scores come out as one 16-lane vector per row, then an online
// softmax rescales the float accumulators. Decode items (one query token) take their own path, see
// attend_decode; where a batch has too few of them to share out evenly, their keys are split into parts
// (see plan_tiles and merge_parts). An int8 or fp8 cache (kv_quant.h) is widened like a bf16 one; its
// rows' scales multiply the scores (keys) and the probabilities (values), once per key, not per dim.
#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_dot.h"
#include "check.h"
#include "kv_quant.h"
#include "ops.h"
#include "parallel.h"
#include "vec16.h"

namespace sluice::cpu {
namespace {

constexpr int kChunk = 16;
// Query rows per decode kernel call: all of a KV head's group at once where it has up to 4, so that each
// K and V row is widened once for the whole group.
constexpr int kDecodeRows = 4;
#if defined(__AVX512F__)
// Register tiles for 32 registers of 16 floats: QK rows, P.V rows x 16-dim vectors (prefill), 16-dim
// vectors per decode P.V pass (4 rows x 4 key quads of accumulators fill half the registers).
constexpr int kQkRows = 12;
constexpr int kPvRows = 6;
constexpr int kPvVecs = 4;
constexpr int kDecodePvVecs = 4;
#else
// On 16 registers of 8 floats (AVX2), where a v16 takes two, the tiles that fit without spilling.
constexpr int kQkRows = 6;
constexpr int kPvRows = 2;
constexpr int kPvVecs = 2;
constexpr int kDecodePvVecs = 1;
#endif
// Rows (query tokens x group heads) per work item: enough to amortise widening K, few enough that
// the float query and accumulator tiles stay near L1.
constexpr int kTileRows = 48;
// Below this much work (rows x keys) waking the thread pool costs more than it saves.
constexpr int64_t kSerialWork = 4096;
// Keys whose scores are computed before one softmax pass and one P.V pass; the online rescale runs
// once per segment. 256 keys of K and V for a 64-dim bf16 head stay in L1.
constexpr int kSegKeys = 256;
constexpr int kMaxDecodeRows = 16;
constexpr int kMaxDecodeDim = 1024;
// How many 16-key chunks ahead of the dot products the decode path prefetches K and V into L2.
constexpr int kFarChunks = 3;
// A decode item's keys are split only into parts of at least this many keys: below it, writing and
// merging a part's sums costs more than the idle thread it saves.
constexpr int kMinPartKeys = 512;
// Batches with at least this many decode items per thread are not split: dynamic hand-out of that many
// items already ends close to even.
constexpr int kSplitBelowItemsPerThread = 4;
// Stands in for keys past the context in a padded chunk, for every cache dtype (all-zero bits).
alignas(64) const float kZeros[kMaxDecodeDim] = {};

struct Problem {
  const void* query;
  int64_t q_tok, q_head;
  void* out;
  int64_t o_tok, o_head;
  const void* k_cache;
  const void* v_cache;
  // Where a row lives (kv_quant.h).
  RowStrides at;
  const int32_t* block_table;
  int64_t bt_stride;
  int block_size, head_dim, group;
  float scale_log2;
  // A sliding window: a query at position i sees keys i - window + 1 .. i; 0 sees every earlier key.
  int window;
  // Scores soft-capped at softcap (Gemma 2), in the log2 units scores are kept in; 0: none.
  float softcap_log2;
  bool decode_path;
  // Partial sums of split decode items: per part, per row, its max score, its sum of exponentials and its
  // unnormalised output row (dim floats).
  float* parts;
};

struct Tile {
  int32_t seq, kv_head, q_row, t0, t1, prefix;
  int64_t cost;
  // Decode items attend keys [key_lo, key_hi) of the context; a tile's rows start from key_lo (its first row's
  // window) and end at their own positions. A part of a split item (part >= 0) writes its partial sums to
  // that slot of the parts buffer instead of the output.
  int32_t key_lo, key_hi, part;
};

// One decode item whose keys went to parts first_part .. first_part + parts - 1.
struct SplitItem {
  int32_t kv_head, q_row, first_part, parts;
};

struct Scratch {
  std::vector<float> q, acc, kt, scores, lsum, mrow, alpha, probs;
  // Per key of a chunk (tile path) or segment (decode path): the scales of its K and V rows.
  std::vector<float> kscale, vscale;
  std::vector<const void*> k_rows, v_rows;

  void reserve(int rows, int dim) {
    auto grow = [](std::vector<float>& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(q, size_t(rows) * dim);
    grow(acc, size_t(rows) * dim);
    grow(kt, size_t(dim) * kChunk);
    grow(scores, size_t(rows) * kChunk);
    grow(lsum, size_t(rows) * kChunk);
    grow(mrow, rows);
    grow(alpha, rows);
    grow(probs, size_t(rows) * kChunk / 2);
    grow(kscale, kChunk);
    grow(vscale, kChunk);
  }

  // q holds each row as dim / 4 vectors (float) or dim / 8 (bf16 pairs); scores and probs one
  // segment per row; lsum one float per row.
  void reserve_decode(int rows, int dim) {
    auto grow = [](auto& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    grow(q, size_t(rows) * dim * 4);
    grow(acc, size_t(rows) * dim + dim);
    grow(scores, size_t(rows) * kSegKeys);
    grow(probs, size_t(rows) * kSegKeys);
    grow(kscale, kSegKeys);
    grow(vscale, kSegKeys);
    grow(lsum, rows);
    grow(mrow, rows);
    grow(alpha, rows);
  }

  void reserve_rows(int keys) {
    if (k_rows.size() < size_t(keys)) {
      k_rows.resize(keys);
      v_rows.resize(keys);
    }
  }
};

// s[r] = q[r] . K for R rows, where kt holds the chunk's keys transposed: kt[d * 16 + key].
template <int R>
void qk_rows(const float* q, int dim, const float* kt, float* s) {
  constexpr int N = kChunk / kNativeLanes;
  vn acc[R][N] = {};
  for (int d = 0; d < dim; ++d) {
    vn k[N];
    for (int n = 0; n < N; ++n) k[n] = load_as<vn>(kt + d * kChunk + n * kNativeLanes);
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < N; ++n) acc[r][n] += q[r * dim + d] * k[n];
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) store_as(s + r * kChunk + n * kNativeLanes, acc[r][n]);
}

template <int... I>
constexpr auto make_qk_table(std::integer_sequence<int, I...>) {
  return std::array<void (*)(const float*, int, const float*, float*), sizeof...(I)>{&qk_rows<I + 1>...};
}
constexpr auto kQkTable = make_qk_table(std::make_integer_sequence<int, kQkRows>{});

void qk(const float* q, int dim, const float* kt, int rows, float* s) {
  int r = 0;
  for (; r + kQkRows <= rows; r += kQkRows) qk_rows<kQkRows>(q + r * dim, dim, kt, s + r * kChunk);
  if (r < rows) kQkTable[rows - r - 1](q + r * dim, dim, kt, s + r * kChunk);
}

// acc[r] = acc[r] * alpha[r] + sum_i p[r][i] * v[i] over Z vectors of dims starting at `off`.
template <typename C, int R, int Z>
void pv_rows(float* acc, int dim, const float* p, const float* alpha, const C* const* v, int nk, int off) {
  constexpr int N = Z * 16 / kNativeLanes;
  vn a[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) a[r][n] = load_as<vn>(acc + r * dim + off + n * kNativeLanes) * alpha[r];
  for (int i = 0; i < nk; ++i) {
    vn vv[N];
    for (int n = 0; n < N; ++n) vv[n] = load_as<vn>(v[i] + off + n * kNativeLanes);
    for (int r = 0; r < R; ++r) {
      const float w = p[r * kChunk + i];
      for (int n = 0; n < N; ++n) a[r][n] += w * vv[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) store_as(acc + r * dim + off + n * kNativeLanes, a[r][n]);
}

template <typename C, int R>
void pv_row_group(float* acc, int dim, const float* p, const float* alpha, const C* const* v, int nk) {
  int off = 0;
  for (; off + kPvVecs * 16 <= dim; off += kPvVecs * 16) pv_rows<C, R, kPvVecs>(acc, dim, p, alpha, v, nk, off);
  switch ((dim - off) / 16) {
    case 1: pv_rows<C, R, 1>(acc, dim, p, alpha, v, nk, off); break;
    case 2: pv_rows<C, R, 2>(acc, dim, p, alpha, v, nk, off); break;
    case 3: pv_rows<C, R, 3>(acc, dim, p, alpha, v, nk, off); break;
    default: break;
  }
}

template <typename C, int... I>
constexpr auto make_pv_table(std::integer_sequence<int, I...>) {
  using Fn = void (*)(float*, int, const float*, const float*, const C* const*, int);
  return std::array<Fn, sizeof...(I)>{&pv_row_group<C, I + 1>...};
}

template <typename C>
void pv(float* acc, int dim, const float* p, const float* alpha, const C* const* v, int nk, int rows) {
  static constexpr auto table = make_pv_table<C>(std::make_integer_sequence<int, kPvRows>{});
  int r = 0;
  for (; r + kPvRows <= rows; r += kPvRows)
    pv_row_group<C, kPvRows>(acc + r * dim, dim, p + r * kChunk, alpha + r, v, nk);
  if (r < rows) table[rows - r - 1](acc + r * dim, dim, p + r * kChunk, alpha + r, v, nk);
}

template <typename T>
void store_row(T* dst, const float* src, float mul, int dim) {
  for (int d = 0; d < dim; d += 16) store(dst + d, load(src + d) * mul);
}

// Native vectors per 16-key chunk: one on AVX-512, two on AVX2.
constexpr int kHalves = kChunk / kNativeLanes;

// Lane indices of a native vector.
template <size_t... I>
constexpr vin native_lanes(std::index_sequence<I...>) {
  return vin{int32_t(I)...};
}
const vin native_lane = native_lanes(std::make_index_sequence<kNativeLanes>{});

// A 16-key chunk's native vectors as one v16 (bf16dot's probabilities, on AVX-512 only).
inline v16 as_chunk(const vn* parts) {
#if defined(__AVX512F__)
  return parts[0];
#else
  return joined<v16>(parts[0], parts[1]);
#endif
}

// The horizontal max and sum of a 16-key chunk's native vectors, lane by lane first as a v16's halves are.
inline float chunk_max(const vn* x) {
#if defined(__AVX512F__)
  return hmax(x[0]);
#else
  return hmax(vmax(x[0], x[1]));
#endif
}

inline float chunk_sum(const vn* x) {
#if defined(__AVX512F__)
  return hsum(x[0]);
#else
  return hsum(x[0] + x[1]);
#endif
}

template <typename Q, typename C, bool Dot>
void attend_tile(const Problem& p, const Tile& w, Scratch& s) {
  const int dim = p.head_dim, group = p.group;
  const int rows = (w.t1 - w.t0) * group;
  s.reserve(rows, dim);
  float* qs = s.q.data();
  float* acc = s.acc.data();
  float* kt = s.kt.data();
  float* sc = s.scores.data();
  float* lsum = s.lsum.data();
  float* mrow = s.mrow.data();
  float* alpha = s.alpha.data();

  for (int m = 0; m < rows; ++m) {
    const int t = w.t0 + m / group, h = w.kv_head * group + m % group;
    const Q* src = static_cast<const Q*>(p.query) + (w.q_row + t) * p.q_tok + h * p.q_head;
    if constexpr (Dot) {
      std::memcpy(reinterpret_cast<uint16_t*>(qs) + m * dim, src, dim * sizeof(uint16_t));
    }
    for (int d = 0; d < dim; d += 16) {
      if constexpr (!Dot) store(qs + m * dim + d, load(src + d) * p.scale_log2);
      store(acc + m * dim + d, v16{});
    }
    store(lsum + m * kChunk, v16{});
    mrow[m] = -std::numeric_limits<float>::infinity();
  }

  const int n_keys = w.prefix + w.t1;
  const int32_t* blocks = p.block_table + int64_t(w.seq) * p.bt_stride;
  const C* k_base = static_cast<const C*>(p.k_cache) + w.kv_head * p.at.head;
  const C* v_base = static_cast<const C*>(p.v_cache) + w.kv_head * p.at.head;
  // Row pointers for this chunk and the next: the next chunk's rows are prefetched while this one
  // is computed, since blocks are scattered and the hardware prefetcher cannot follow the table.
  const C* rows_buf[2][2][kChunk];
  int block = w.key_lo / p.block_size, offset = w.key_lo % p.block_size;
  auto locate = [&](const C** k_rows, const C** v_rows, int count) {
    for (int i = 0; i < count; ++i) {
      const int64_t at = blocks[block] * p.at.block + offset * p.at.token;
      k_rows[i] = k_base + at;
      v_rows[i] = v_base + at;
      if (++offset == p.block_size) {
        offset = 0;
        ++block;
      }
    }
  };
  const vn neg_inf = splat_as<vn>(-std::numeric_limits<float>::infinity());
  const int row_bytes = cache_row_bytes<C>(dim);
  float* kscale = s.kscale.data();
  float* vscale = s.vscale.data();
  locate(rows_buf[0][0], rows_buf[0][1], std::min(kChunk, n_keys - w.key_lo));

  for (int k0 = w.key_lo, buf = 0; k0 < n_keys; k0 += kChunk, buf ^= 1) {
    const int nk = std::min(kChunk, n_keys - k0);
    const C* const* k_rows = rows_buf[buf][0];
    const C* const* v_rows = rows_buf[buf][1];
    const int next = std::min(kChunk, n_keys - k0 - kChunk);
    if (next > 0) {
      locate(rows_buf[buf ^ 1][0], rows_buf[buf ^ 1][1], next);
      for (int i = 0; i < next; ++i) {
        for (int b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(rows_buf[buf ^ 1][0][i]) + b);
          __builtin_prefetch(reinterpret_cast<const char*>(rows_buf[buf ^ 1][1][i]) + b);
        }
      }
    }
    if constexpr (kQuantizedRows<C>) {
      for (int i = 0; i < kChunk; ++i) {
        kscale[i] = i < nk ? row_scale(k_rows[i], dim) : 0.0f;
        vscale[i] = i < nk ? row_scale(v_rows[i], dim) : 0.0f;
      }
    }
    // Rows of tokens before k0 see none of this chunk; rows are in token order, so skip a prefix. Under a
    // window, rows whose first visible key lies past the chunk see none of it either: skip a suffix.
    const int m0 = std::max(0, k0 - w.prefix - w.t0) * group;
    const int m1 =
        p.window > 0 ? std::clamp((k0 + nk + p.window - 1 - w.prefix - w.t0) * group, m0, rows) : rows;
    if (m1 == m0) continue;
    const uint16_t* k_bits[kChunk];
    const uint16_t* v_bits[kChunk];
    if constexpr (Dot) {
      for (int i = 0; i < kChunk; ++i) {
        k_bits[i] = i < nk ? reinterpret_cast<const uint16_t*>(k_rows[i]) : bf16dot::kZeroRow;
        v_bits[i] = i < nk ? reinterpret_cast<const uint16_t*>(v_rows[i]) : bf16dot::kZeroRow;
      }
      auto* kp = reinterpret_cast<uint32_t*>(kt);
      bf16dot::pack_keys(k_bits, dim, kp);
      bf16dot::qk(reinterpret_cast<const uint32_t*>(qs) + m0 * dim / 2, dim, kp, m1 - m0, sc + m0 * kChunk);
    } else {
      for (int d0 = 0; d0 < dim; d0 += 16) {
        v16 r[kChunk];
        for (int i = 0; i < kChunk; ++i) r[i] = i < nk ? load(k_rows[i] + d0) : v16{};
        transpose16(r);
        for (int j = 0; j < kChunk; ++j) store(kt + (d0 + j) * kChunk, r[j]);
      }
      qk(qs + m0 * dim, dim, kt, m1 - m0, sc + m0 * kChunk);
    }
    // Each row's online softmax over the chunk, on native vectors (see attend_decode's).
    for (int m = m0; m < m1; ++m) {
      const int position = w.prefix + w.t0 + m / group;
      const int visible = std::min(nk, position - k0 + 1);
      // Keys that left the window: at least one key of the chunk stays visible (m < m1, m >= m0).
      const int below = p.window > 0 ? position - p.window + 1 - k0 : 0;
      vn x[kHalves];
      for (int h = 0; h < kHalves; ++h) {
        const int at = h * kNativeLanes;
        x[h] = load_as<vn>(sc + m * kChunk + at);
        if constexpr (Dot) x[h] = x[h] * p.scale_log2;
        if constexpr (kQuantizedRows<C>) x[h] = x[h] * load_as<vn>(kscale + at);
        if (p.softcap_log2 > 0.0f) x[h] = soft_cap(x[h], p.softcap_log2);
        const vin lane = native_lane + at;
        if (visible < kChunk) x[h] = lane < visible ? x[h] : neg_inf;
        if (below > 0) x[h] = lane < below ? neg_inf : x[h];
      }
      const float old = mrow[m];
      const float top = std::max(old, chunk_max(x));
      const float a = top > old ? std::exp2(old - top) : 1.0f;
      const vn top_n = splat_as<vn>(top), a_n = splat_as<vn>(a);
      vn e[kHalves];
      for (int h = 0; h < kHalves; ++h) {
        const int at = h * kNativeLanes;
        e[h] = exp2(x[h] - top_n);
        if constexpr (kQuantizedRows<C>) {
          store_as(sc + m * kChunk + at, e[h] * load_as<vn>(vscale + at));
        } else if constexpr (!Dot) {
          store_as(sc + m * kChunk + at, e[h]);
        }
        store_as(lsum + m * kChunk + at, load_as<vn>(lsum + m * kChunk + at) * a_n + e[h]);
      }
      if constexpr (Dot)
        bf16dot::store_probs(as_chunk(e), reinterpret_cast<uint32_t*>(s.probs.data()) + m * kChunk / 2);
      mrow[m] = top;
      alpha[m] = a;
    }
    if constexpr (Dot) {
      bf16dot::pv(acc + m0 * dim, dim, reinterpret_cast<const uint32_t*>(s.probs.data()) + m0 * kChunk / 2,
                  alpha + m0, v_bits, nk, m1 - m0);
    } else {
      pv<C>(acc + m0 * dim, dim, sc + m0 * kChunk, alpha + m0, v_rows, nk, m1 - m0);
    }
  }

  for (int m = 0; m < rows; ++m) {
    const int t = w.t0 + m / group, h = w.kv_head * group + m % group;
    Q* dst = static_cast<Q*>(p.out) + (w.q_row + t) * p.o_tok + h * p.o_head;
    store_row(dst, acc + m * dim, 1.0f / hsum(load(lsum + m * kChunk)), dim);
  }
}

#if defined(__AVX512F__)
// How the decode path holds a float query row: dim / 4 vectors, each 4 of its dims in every 128-bit lane.
constexpr int kQueryFloatsPerDim = 4;

// s[r][key] = q[r] . k[key] for 16 keys, with q as dim / 4 vectors per row, each holding 4 of its
// dims (pre-scaled) in every 128-bit lane; see bf16dot::decode_qk for the layout.
template <typename C, int R>
void decode_qk_float(const float* q, int dim, const C* const* k, float* s, int s_stride) {
  const int q_stride = dim * 4;
  v16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = v16{};
  for (int d0 = 0; d0 < dim; d0 += 16) {
    for (int g = 0; g < 4; ++g) {
      v16 x[4];
      key_quads(load(k[g] + d0), load(k[g + 4] + d0), load(k[g + 8] + d0), load(k[g + 12] + d0), x);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][g] += x[j] * load(q + r * q_stride + (d0 / 4 + j) * 16);
    }
  }
  for (int r = 0; r < R; ++r) store(s + r * s_stride, sum_quads(acc[r]));
}
#else
// How the decode path holds a float query row: its dims, pre-scaled.
constexpr int kQueryFloatsPerDim = 1;

// s[r][key] = q[r] . k[key] for 16 keys, on 8-lane vectors: two keys at a time for every row, each row's
// dot product with each key an 8-lane partial sum over the dims, summed across its lanes once (sum4). So
// each K row is widened once for all R rows, and R x 2 accumulators fit AVX2's 16 registers.
template <typename C, int R>
void decode_qk_float(const float* q, int dim, const C* const* k, float* s, int s_stride) {
  for (int k0 = 0; k0 < kChunk; k0 += 2) {
    v8 acc[R][2] = {};
    for (int d = 0; d < dim; d += 8) {
      const v8 key[2] = {load_as<v8>(k[k0] + d), load_as<v8>(k[k0 + 1] + d)};
      for (int r = 0; r < R; ++r) {
        const v8 query = load_as<v8>(q + r * dim + d);
        acc[r][0] += query * key[0];
        acc[r][1] += query * key[1];
      }
    }
    for (int r = 0; r < R; r += 2) {
      float sums[4];
      const v8 four[4] = {acc[r][0], acc[r][1], acc[r + 1 < R ? r + 1 : r][0], acc[r + 1 < R ? r + 1 : r][1]};
      sum4(four, sums);
      s[r * s_stride + k0] = sums[0];
      s[r * s_stride + k0 + 1] = sums[1];
      if (r + 1 < R) {
        s[(r + 1) * s_stride + k0] = sums[2];
        s[(r + 1) * s_stride + k0 + 1] = sums[3];
      }
    }
  }
}
#endif

// acc[r] += sum_i p[r][i] * v[i] over Z vectors of dims starting at `off`.
template <typename C, int R, int Z>
void decode_pv_float(float* acc, int dim, const float* p, int p_stride, const C* const* v, int nk, int off) {
  constexpr int N = Z * 16 / kNativeLanes;
  vn a[R][N];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) a[r][n] = load_as<vn>(acc + r * dim + off + n * kNativeLanes);
  for (int i = 0; i < nk; ++i) {
    vn vv[N];
    for (int n = 0; n < N; ++n) vv[n] = load_as<vn>(v[i] + off + n * kNativeLanes);
    for (int r = 0; r < R; ++r) {
      const float w = p[r * p_stride + i];
      for (int n = 0; n < N; ++n) a[r][n] += w * vv[n];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < N; ++n) store_as(acc + r * dim + off + n * kNativeLanes, a[r][n]);
}

template <typename C, bool Dot, int R>
void decode_qk_rows(const float* q, int dim, const C* const* k, float* s) {
  if constexpr (Dot) {
    bf16dot::decode_qk<R>(q, dim, reinterpret_cast<const uint16_t* const*>(k), s,
                          kSegKeys);
  } else {
    decode_qk_float<C, R>(q, dim, k, s, kSegKeys);
  }
}

template <typename C, bool Dot, int R>
void decode_pv_rows(float* acc, int dim, const float* probs, const C* const* v, int nk) {
  if constexpr (Dot) {
    const auto* pp = reinterpret_cast<const uint32_t*>(probs);
    const auto* vv = reinterpret_cast<const uint16_t* const*>(v);
    int off = 0;
    for (; off + 64 <= dim; off += 64) bf16dot::decode_pv<R, 2>(acc, dim, pp, kSegKeys, vv, nk / 2, off);
    if (off < dim) bf16dot::decode_pv<R, 1>(acc, dim, pp, kSegKeys, vv, nk / 2, off);
  } else {
    int off = 0;
    for (; off + kDecodePvVecs * 16 <= dim; off += kDecodePvVecs * 16)
      decode_pv_float<C, R, kDecodePvVecs>(acc, dim, probs, kSegKeys, v, nk, off);
    switch ((dim - off) / 16) {
      case 1: decode_pv_float<C, R, 1>(acc, dim, probs, kSegKeys, v, nk, off); break;
      case 2: decode_pv_float<C, R, 2>(acc, dim, probs, kSegKeys, v, nk, off); break;
      case 3: decode_pv_float<C, R, 3>(acc, dim, probs, kSegKeys, v, nk, off); break;
      default: break;
    }
  }
}

// GCC drops __builtin_prefetch of addresses it loads from the row tables here, so x86 gets the
// instruction itself: prefetcht0 into L1, prefetcht2 into L2 (both vendors fill L2 for t1 and t2).
template <bool IntoL1>
inline void prefetch_line(const char* p) {
#if defined(__x86_64__)
  if constexpr (IntoL1) {
    asm volatile("prefetcht0 %0" : : "m"(*p));
  } else {
    asm volatile("prefetcht2 %0" : : "m"(*p));
  }
#else
  __builtin_prefetch(p, 0, IntoL1 ? 3 : 1);
#endif
}

// One query token, so only `group` rows: per 16-key chunk the work is too small to carry the fixed
// costs of the tile path (widening or transposing K, a horizontal max, a rescale). Instead, a whole
// segment of keys is scored first, then one softmax pass per row, then one P.V pass that keeps the
// accumulators in registers. Keys are padded to a multiple of 16 with zero rows and -inf scores.
template <typename Q, typename C, bool Dot>
void attend_decode(const Problem& p, const Tile& w, Scratch& s) {
  const int dim = p.head_dim, rows = p.group;
  s.reserve_decode(rows, dim);
  float* qv = s.q.data();
  float* acc = s.acc.data();
  float* sc = s.scores.data();
  float* probs = s.probs.data();
  float* lsum = s.lsum.data();
  float* mrow = s.mrow.data();
  // Floats per prepared query row: dim / 8 vectors of bf16 pairs, or the float layout of decode_qk_float.
  const int q_stride = Dot ? dim * 2 : dim * kQueryFloatsPerDim;

  for (int m = 0; m < rows; ++m) {
    const int h = w.kv_head * rows + m;
    const Q* src = static_cast<const Q*>(p.query) + (w.q_row + w.t0) * p.q_tok + h * p.q_head;
    float* dst = qv + m * q_stride;
    if constexpr (Dot) {
      bf16dot::broadcast_query(dst, reinterpret_cast<const uint16_t*>(src), dim);
    } else if constexpr (kQueryFloatsPerDim == 4) {
      for (int c = 0; c < dim / 16; ++c) {
        const v16 x = load(src + c * 16) * p.scale_log2;
        for (int j = 0; j < 4; ++j) {
          const vi16 quad = vi16{0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3} + 4 * j;
          store(dst + (c * 4 + j) * 16, __builtin_shuffle(x, quad));
        }
      }
    } else {
      for (int c = 0; c < dim; c += 16) store(dst + c, load(src + c) * p.scale_log2);
    }
    for (int d = 0; d < dim; d += 16) store(acc + m * dim + d, v16{});
    lsum[m] = 0.0f;
    mrow[m] = -std::numeric_limits<float>::infinity();
  }

  const int n_keys = w.key_hi - w.key_lo;
  const int32_t* blocks = p.block_table + int64_t(w.seq) * p.bt_stride;
  const C* k_base = static_cast<const C*>(p.k_cache) + w.kv_head * p.at.head;
  const C* v_base = static_cast<const C*>(p.v_cache) + w.kv_head * p.at.head;
  const C* zeros = reinterpret_cast<const C*>(kZeros);
  const int row_bytes = cache_row_bytes<C>(dim);
  float* kscale = s.kscale.data();
  float* vscale = s.vscale.data();
  // Blocks are scattered, so the hardware prefetcher cannot follow the table: K and V rows are fetched
  // into L1 one chunk ahead of the dot products (V is read a whole pass later), and into L2
  // kFarChunks ahead. Into L1 alone, the misses in flight are bounded by L1's miss buffers, which
  // held a core to about 15 GB/s from DRAM; L1 further ahead measured slower still.
  // A run of rows next to each other (a quantized cache's within a block, head-major) is one span of lines,
  // each fetched once.
  const int64_t row_elems = cache_row_bytes<C>(dim) / int(sizeof(C));
  const vn neg_inf = splat_as<vn>(-std::numeric_limits<float>::infinity());
  auto prefetch = [&](const C* const* r, int count, auto line) {
    for (int i = 0; i < count;) {
      int j = i + 1;
      while (j < count && r[j] == r[j - 1] + row_elems) ++j;
      const uintptr_t end = reinterpret_cast<uintptr_t>(r[j - 1]) + row_bytes;
      for (uintptr_t at = reinterpret_cast<uintptr_t>(r[i]) & ~uintptr_t(63); at < end; at += 64)
        line(reinterpret_cast<const char*>(at));
      i = j;
    }
  };
  const int n_padded = (n_keys + kChunk - 1) / kChunk * kChunk;
  s.reserve_rows(n_padded);
  const C** k_rows = reinterpret_cast<const C**>(s.k_rows.data());
  const C** v_rows = reinterpret_cast<const C**>(s.v_rows.data());
  for (int i = 0; i < n_keys;) {
    const int key = w.key_lo + i, offset = key % p.block_size;
    const int64_t first = blocks[key / p.block_size] * p.at.block + offset * p.at.token;
    // Keys inside one block are evenly spaced, so their rows need no per-key lookup.
    const int run = std::min(p.block_size - offset, n_keys - i);
    for (int j = 0; j < run; ++j) {
      const int64_t at = first + j * p.at.token;
      k_rows[i + j] = k_base + at;
      v_rows[i + j] = v_base + at;
    }
    i += run;
  }
  for (int i = n_keys; i < n_padded; ++i) k_rows[i] = v_rows[i] = zeros;
  auto prefetch_chunk = [&](const C* const* r, int k0, auto line) {
    if (k0 < n_keys) prefetch(r + k0, std::min(kChunk, n_keys - k0), line);
  };
  auto prefetch_keys = [&](int k0) {
    prefetch_chunk(k_rows, k0, prefetch_line<true>);
    prefetch_chunk(v_rows, k0, prefetch_line<true>);
    prefetch_chunk(k_rows, k0 + (kFarChunks - 1) * kChunk, prefetch_line<false>);
    prefetch_chunk(v_rows, k0 + (kFarChunks - 1) * kChunk, prefetch_line<false>);
  };
  for (int k0 = 0; k0 < (kFarChunks - 1) * kChunk; k0 += kChunk) {
    prefetch_chunk(k_rows, k0, prefetch_line<false>);
    prefetch_chunk(v_rows, k0, prefetch_line<false>);
  }
  prefetch_keys(0);

  for (int seg0 = 0; seg0 < n_keys; seg0 += kSegKeys) {
    const int n = std::min(kSegKeys, n_keys - seg0);
    const int padded = (n + kChunk - 1) / kChunk * kChunk;
    for (int k0 = 0; k0 < padded; k0 += kChunk) {
      prefetch_keys(seg0 + k0 + kChunk);
      if constexpr (kQuantizedRows<C>) {
        // Read here, once the chunk's rows are in L1 (padding rows are kZeros: their scales read as 0).
        for (int i = k0; i < k0 + kChunk; ++i) {
          kscale[i] = row_scale(k_rows[seg0 + i], dim);
          vscale[i] = row_scale(v_rows[seg0 + i], dim);
        }
      }
      int r0 = 0;
      const C* const* kr = k_rows + seg0 + k0;
      for (; r0 + kDecodeRows <= rows; r0 += kDecodeRows)
        decode_qk_rows<C, Dot, kDecodeRows>(qv + r0 * q_stride, dim, kr, sc + r0 * kSegKeys + k0);
      switch (rows - r0) {
        case 1: decode_qk_rows<C, Dot, 1>(qv + r0 * q_stride, dim, kr, sc + r0 * kSegKeys + k0); break;
        case 2: decode_qk_rows<C, Dot, 2>(qv + r0 * q_stride, dim, kr, sc + r0 * kSegKeys + k0); break;
        case 3: decode_qk_rows<C, Dot, 3>(qv + r0 * q_stride, dim, kr, sc + r0 * kSegKeys + k0); break;
        default: break;
      }
    }

    // One softmax pass per row over the segment, on native vectors: each 16-key chunk is kHalves of them,
    // each with its own running max and sum, so the lanes sum the same keys in the same order as a v16
    // would. (On AVX2 a v16's selects and exp2 went through the stack, a store-forwarding stall each.)
    for (int m = 0; m < rows; ++m) {
      float* x = sc + m * kSegKeys;
      vn top[kHalves], sum[kHalves];
      for (int h = 0; h < kHalves; ++h) {
        top[h] = neg_inf;
        sum[h] = vn{};
      }
      for (int k0 = 0; k0 < padded; k0 += kChunk) {
        for (int h = 0; h < kHalves; ++h) {
          const int at = k0 + h * kNativeLanes;
          vn v = load_as<vn>(x + at);
          if constexpr (Dot) v = v * p.scale_log2;
          if constexpr (kQuantizedRows<C>) v = v * load_as<vn>(kscale + at);
          if (p.softcap_log2 > 0.0f) v = soft_cap(v, p.softcap_log2);
          if (at + kNativeLanes > n) v = native_lane < n - at ? v : neg_inf;
          store_as(x + at, v);
          top[h] = vmax(top[h], v);
        }
      }
      const float old = mrow[m];
      const float t = std::max(old, chunk_max(top));
      const float a = t > old ? std::exp2(old - t) : 1.0f;
      mrow[m] = t;
      const vn tn = splat_as<vn>(t);
      for (int k0 = 0; k0 < padded; k0 += kChunk) {
        vn e[kHalves];
        for (int h = 0; h < kHalves; ++h) {
          const int at = k0 + h * kNativeLanes;
          e[h] = exp2(load_as<vn>(x + at) - tn);
          sum[h] += e[h];
          if constexpr (kQuantizedRows<C>) {
            store_as(probs + m * kSegKeys + at, e[h] * load_as<vn>(vscale + at));
          } else if constexpr (!Dot) {
            store_as(probs + m * kSegKeys + at, e[h]);
          }
        }
        if constexpr (Dot)
          bf16dot::store_probs(as_chunk(e), reinterpret_cast<uint32_t*>(probs + m * kSegKeys) + k0 / 2);
      }
      lsum[m] = lsum[m] * a + chunk_sum(sum);
      if (a != 1.0f)
        for (int d = 0; d < dim; d += 16) store(acc + m * dim + d, load(acc + m * dim + d) * a);
    }

    int r0 = 0;
    for (; r0 + kDecodeRows <= rows; r0 += kDecodeRows)
      decode_pv_rows<C, Dot, kDecodeRows>(acc + r0 * dim, dim, probs + r0 * kSegKeys, v_rows + seg0, padded);
    switch (rows - r0) {
      case 1: decode_pv_rows<C, Dot, 1>(acc + r0 * dim, dim, probs + r0 * kSegKeys, v_rows + seg0, padded); break;
      case 2: decode_pv_rows<C, Dot, 2>(acc + r0 * dim, dim, probs + r0 * kSegKeys, v_rows + seg0, padded); break;
      case 3: decode_pv_rows<C, Dot, 3>(acc + r0 * dim, dim, probs + r0 * kSegKeys, v_rows + seg0, padded); break;
      default: break;
    }
  }

  float* ordered = acc + rows * dim;
  if (w.part >= 0) {
    float* part = p.parts + int64_t(w.part) * rows * (dim + 2);
    for (int m = 0; m < rows; ++m, part += dim + 2) {
      const float* row = acc + m * dim;
      if constexpr (Dot) {
        for (int d = 0; d < dim; d += 32) bf16dot::unpack_order(row + d, ordered + d);
        row = ordered;
      }
      part[0] = mrow[m];
      part[1] = lsum[m];
      std::memcpy(part + 2, row, sizeof(float) * dim);
    }
    return;
  }
  for (int m = 0; m < rows; ++m) {
    const int h = w.kv_head * rows + m;
    Q* dst = static_cast<Q*>(p.out) + (w.q_row + w.t0) * p.o_tok + h * p.o_head;
    const float* row = acc + m * dim;
    if constexpr (Dot) {
      for (int d = 0; d < dim; d += 32) bf16dot::unpack_order(row + d, ordered + d);
      row = ordered;
    }
    store_row(dst, row, 1.0f / lsum[m], dim);
  }
}

// Whether items of one query token take attend_decode (the only path that attends a part of the keys).
bool takes_decode_path(const Problem& p) {
  return p.decode_path && p.group <= kMaxDecodeRows && p.head_dim <= kMaxDecodeDim;
}

template <typename Q, typename C, bool Dot>
void attend(const Problem& p, const Tile& w, Scratch& s) {
  if (w.t1 - w.t0 == 1 && takes_decode_path(p)) {
    attend_decode<Q, C, Dot>(p, w, s);
  } else {
    assert(w.part < 0 && "only the decode path attends a part of the keys");
    attend_tile<Q, C, Dot>(p, w, s);
  }
}

// Combines each split item's parts: the softmax over all its keys is the parts' sums, each rescaled from
// its own maximum to the overall one.
template <typename Q>
void merge_parts(const Problem& p, const std::vector<SplitItem>& splits) {
  const int dim = p.head_dim, rows = p.group;
  std::vector<float> acc(dim);
  for (const SplitItem& item : splits) {
    const float* first = p.parts + int64_t(item.first_part) * rows * (dim + 2);
    for (int m = 0; m < rows; ++m) {
      float top = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < item.parts; ++i) top = std::max(top, first[(int64_t(i) * rows + m) * (dim + 2)]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float sum = 0.0f;
      for (int i = 0; i < item.parts; ++i) {
        const float* part = first + (int64_t(i) * rows + m) * (dim + 2);
        const float weight = std::exp2(part[0] - top);
        sum += part[1] * weight;
        for (int d = 0; d < dim; ++d) acc[d] += part[2 + d] * weight;
      }
      const int h = item.kv_head * rows + m;
      Q* dst = static_cast<Q*>(p.out) + item.q_row * p.o_tok + h * p.o_head;
      store_row(dst, acc.data(), 1.0f / sum, dim);
    }
  }
}

using TileFn = void (*)(const Problem&, const Tile&, Scratch&);
using MergeFn = void (*)(const Problem&, const std::vector<SplitItem>&);

struct Kernels {
  TileFn tile;
  MergeFn merge;
};

#ifdef SLUICE_BF16_DOT
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

template <typename Q>
TileFn pick_for_cache(DType cache, int dim) {
  switch (cache) {
    case DType::kFloat32: return &attend<Q, float, false>;
    case DType::kBFloat16:
      if constexpr (kHasBf16Dot && std::is_same_v<Q, bf16>) {
        if (dim % 32 == 0 && dim <= 1024) return &attend<Q, bf16, true>;
      }
      return &attend<Q, bf16, false>;
    case DType::kFloat16: return &attend<Q, fp16, false>;
    case DType::kInt8: return &attend<Q, q8, false>;
    case DType::kFp8E4M3: return &attend<Q, e4m3, false>;
  }
  fail("paged_attention: unknown cache dtype");
}

template <typename Q>
Kernels kernels_for(DType cache, int dim) {
  return {pick_for_cache<Q>(cache, dim), &merge_parts<Q>};
}

Kernels pick_kernels(DType query, DType cache, int dim) {
  Kernels kernels{};
  dispatch_dtype(query, [&](auto tag) { kernels = kernels_for<decltype(tag)>(cache, dim); });
  return kernels;
}

// Splits every sequence into work items, costliest first so that dynamic hand-out ends balanced. Where
// decode items (of sequences with one query token) are too few to share evenly among the threads, each
// is split into parts of its keys, as many as make the items a multiple of the threads (split_parts).
int64_t plan_tiles(std::vector<Tile>& tiles, std::vector<SplitItem>& splits, const int32_t* qsl,
                   const int32_t* seq_lens, int num_seqs, int num_kv_heads, int group, int split_parts,
                   int window) {
  tiles.clear();
  splits.clear();
  const int tile_tokens = std::max(1, kTileRows / group);
  int64_t total = 0;
  int parts_used = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = qsl[s + 1] - qsl[s];
    if (q_len <= 0) continue;
    const int prefix = seq_lens[s] - q_len;
    SK_CHECK(prefix >= 0, "paged_attention: sequence ", s, " has more query tokens than context");
    // The first key that the window lets a row at `position` see.
    const auto first_key = [&](int position) { return window > 0 ? std::max(0, position - window + 1) : 0; };
    const int keys = seq_lens[s], lowest = first_key(keys - 1);
    const int parts = q_len == 1 ? std::min(split_parts, (keys - lowest) / kMinPartKeys) : 1;
    if (parts > 1) {
      for (int g = 0; g < num_kv_heads; ++g) {
        splits.push_back({g, qsl[s], parts_used, parts});
        for (int i = 0; i < parts; ++i) {
          // Boundaries on 16-key chunks past the first key, so that only the last part pads its final chunk.
          const int64_t span = keys - lowest;
          const int lo = lowest + int(span * i / parts) / kChunk * kChunk;
          const int hi = i + 1 == parts ? keys : lowest + int(span * (i + 1) / parts) / kChunk * kChunk;
          const int64_t cost = int64_t(hi - lo) * (group + 8);
          tiles.push_back({s, g, qsl[s], 0, 1, prefix, cost, lo, hi, parts_used++});
          total += cost;
        }
      }
      continue;
    }
    for (int t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int t1 = std::min(q_len, t0 + tile_tokens);
      const int lo = first_key(prefix + t0);
      // Widening and transposing K costs about as much as eight rows of dot products.
      const int64_t cost = int64_t(prefix + t1 - lo) * ((t1 - t0) * group + 8);
      for (int g = 0; g < num_kv_heads; ++g)
        tiles.push_back({s, g, qsl[s], t0, t1, prefix, cost, lo, prefix + t1, -1});
      total += cost * num_kv_heads;
    }
  }
  std::sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return total;
}

// How many parts each decode item's keys go into: none (1) where the decode items already share out
// evenly among the threads, or are many; otherwise the fewest parts that make a multiple of the threads.
int decode_split_parts(int decode_items, int threads) {
  if (threads <= 1 || decode_items == 0 || decode_items % threads == 0 ||
      decode_items >= kSplitBelowItemsPerThread * threads)
    return 1;
  for (int parts = 2; parts <= threads; ++parts)
    if (decode_items * parts % threads == 0) return parts;
  return threads;
}

}  // namespace

void paged_attention(const Heads& out, const Heads& query, const KvCache& cache, const Batch& batch, double scale,
                     int64_t window, double softcap, bool decode_path, bool split_keys) {
  SK_CHECK(window >= 0 && window <= std::numeric_limits<int32_t>::max(), "window must be 0 (none) or positive");
  SK_CHECK(softcap >= 0.0, "softcap must be 0 (none) or positive");
  SK_CHECK(out.tokens == query.tokens && out.heads == query.heads && out.dim == query.dim &&
               out.dtype == query.dtype,
           "out must match query's shape and dtype");
  const int num_heads = int(query.heads), head_dim = int(query.dim);
  const int num_kv_heads = int(cache.kv_heads);
  SK_CHECK(cache.head_dim == head_dim && head_dim % 16 == 0, "head_dim must match and be a multiple of 16");
  SK_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int num_seqs = int(batch.num_seqs);
  SK_CHECK(batch.block_table_rows >= num_seqs, "block_table is shorter than seq_lens");
  const int32_t* qsl = batch.query_start_loc;
  SK_CHECK(qsl[num_seqs] <= query.tokens, "query_start_loc points past the query rows");

  Problem problem{
      query.data,
      query.token_stride,
      query.head_stride,
      out.data,
      out.token_stride,
      out.head_stride,
      cache.key,
      cache.value,
      cache_row_strides(cache),
      batch.block_table,
      batch.block_table_stride,
      int(cache.block_size),
      head_dim,
      num_heads / num_kv_heads,
      float(scale * M_LOG2E),
      int(window),
      float(softcap * M_LOG2E),
      decode_path,
      nullptr,
  };
  const Kernels kernels = pick_kernels(query.dtype, cache.dtype, head_dim);
  const TileFn tile_fn = kernels.tile;

  const int threads = num_threads();
  const bool parallel = threads > 1 && !in_parallel_region();
  int split_parts = 1;
  if (split_keys && parallel && takes_decode_path(problem)) {
    int decode_seqs = 0;
    for (int s = 0; s < num_seqs; ++s) decode_seqs += qsl[s + 1] - qsl[s] == 1;
    split_parts = decode_split_parts(decode_seqs * num_kv_heads, threads);
  }
  static thread_local std::vector<Tile> tiles;
  static thread_local std::vector<SplitItem> splits;
  static thread_local std::vector<float> parts;
  const int64_t work =
      plan_tiles(tiles, splits, qsl, batch.seq_lens, num_seqs, num_kv_heads, problem.group, split_parts, int(window));
  if (!splits.empty()) {
    const SplitItem& last = splits.back();
    parts.resize(size_t(last.first_part + last.parts) * problem.group * (head_dim + 2));
    problem.parts = parts.data();
  }
  const std::vector<Tile>& plan = tiles;
  run_items(int64_t(plan.size()), !parallel || work < kSerialWork, [&](int64_t i) {
    static thread_local Scratch scratch;
    tile_fn(problem, plan[i], scratch);
  });
  if (!splits.empty()) kernels.merge(problem, splits);
}

}  // namespace sluice::cpu
