// x @ W^T + bias over a kFormatFmaLanes weight, for any number of rows. The activations are widened to
// fp32 once per call; the work is a list of items, each a span of column groups times a block of rows,
// which the threads take from an atomic counter (run_items).
#include <algorithm>
#include <utility>
#include <vector>

#include "gemm.h"
#include "gemm_fma.h"
#include "parallel.h"

namespace sluice::cpu {
namespace {

using fma::kTileRows;
using fma::Problem;

// Rows per work item: small enough that two threads share even one column group of a long prefill.
constexpr int64_t kItemRows = 240;
// Work items wanted per call: with dynamic scheduling the threads finish about half an item apart.
constexpr int64_t kMinItems = 16;
// Weight bytes per work item when few rows stream it from memory: longer runs read faster.
constexpr int64_t kStreamBytes = 1 << 20;
// Weight bytes per work item when many rows reuse them: what half of L2 holds while every row tile of
// the item goes over them, its own activations staying in L1.
constexpr int64_t kReuseBytes = 256 << 10;
// Below this many multiply-adds, waking the second thread costs more than it saves.
constexpr int64_t kSerialMacs = 1 << 17;
// Elements of x widened per thread chunk.
constexpr int64_t kWidenGrain = 1 << 16;

template <typename WT, typename Out>
struct Tiles {
  // Index: rows - 1. `wide` spans fma::groups_for_rows(rows) groups, `narrow` one.
  static constexpr auto wide = fma::make_wide_tiles<WT, Out>(std::make_integer_sequence<int, kTileRows>{});
  static constexpr auto narrow = fma::make_narrow_tiles<WT, Out, false>(std::make_integer_sequence<int, kTileRows>{});
  // `narrow` that prefetches as it goes (fma::tile).
  static constexpr auto narrow_prefetching =
      fma::make_narrow_tiles<WT, Out, true>(std::make_integer_sequence<int, kTileRows>{});
};

// Work items: `span` consecutive column groups times one block of `block_rows` rows.
struct Plan {
  int64_t span, block_rows, blocks_per_span, items;
};

Plan plan_items(int64_t groups, int64_t group_bytes, int64_t m) {
  const int64_t stream_span =
      std::clamp(kStreamBytes / group_bytes, int64_t(1), std::max(int64_t(1), groups / kMinItems));
  // A few rows stream the weights: whole wide tiles per item, whose several groups' rows in flight at
  // once keep memory busy (one group's single run of rows, behind one chain of sums, left it half idle).
  const int64_t wide = fma::groups_for_rows(int(std::min<int64_t>(m, kTileRows)));
  const int64_t reuse_span =
      std::clamp(kReuseBytes / group_bytes, int64_t(1), std::max(int64_t(1), groups / kMinItems));
  const int64_t span = m <= kTileRows ? (stream_span + wide - 1) / wide * wide : reuse_span;
  const int64_t spans = (groups + span - 1) / span;
  // Few column groups are split into row blocks too, so that the items are many and the last one small.
  const int64_t split = std::min((kMinItems + spans - 1) / spans, m / kTileRows);
  const int64_t row_blocks = std::max((m + kItemRows - 1) / kItemRows, split);
  // Equal row blocks of whole tiles, so that no item is a sliver.
  const int64_t per_block = (m + row_blocks - 1) / row_blocks;
  const int64_t block_rows = std::min(m, (per_block + kTileRows - 1) / kTileRows * kTileRows);
  const int64_t blocks_per_span = (m + block_rows - 1) / block_rows;
  return {span, block_rows, blocks_per_span, spans * blocks_per_span};
}

// Rows [row0, row0 + rows) of groups [first, end). One tile of rows takes as many groups at a time as
// its accumulators allow; taller blocks go tile by tile (as equal in height as kTileRows allows), each
// over every group of the span, so that the tile's activations stay in L1 and the span's weights in L2.
// Meanwhile the tiles after the first prefetch [prefetch, prefetch_end) (the weights of this thread's next
// item) into L2, a stretch each: the first tile reads this span from memory while the later ones compute
// from cache, and without it memory would idle through them.
template <typename WT, typename Out>
void run_block(const Problem& p, int64_t first, int64_t end, int64_t row0, int64_t rows, const char* prefetch,
               const char* prefetch_end) {
  if (rows <= kTileRows) {
    const int64_t wide = fma::groups_for_rows(int(rows));
    int64_t g = first;
    for (; g + wide <= end; g += wide) Tiles<WT, Out>::wide[rows - 1](p, row0, g, nullptr);
    for (; g < end; ++g) Tiles<WT, Out>::narrow[rows - 1](p, row0, g, nullptr);
    return;
  }
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t base = rows / tiles, extra = rows % tiles;
  const int64_t stretch = p.k / fma::kPrefetchEvery * 64;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t n = base + (t < extra);
    for (int64_t g = first; g < end; ++g) {
      if (t > 0 && prefetch != nullptr && prefetch < prefetch_end) {
        Tiles<WT, Out>::narrow_prefetching[n - 1](p, row0 + r, g, prefetch);
        prefetch += stretch;
      } else {
        Tiles<WT, Out>::narrow[n - 1](p, row0 + r, g, nullptr);
      }
    }
    r += n;
  }
}

template <typename WT, typename Out>
void run(const Problem& p, int64_t m, int64_t groups, int64_t group_bytes, bool prefetch_next) {
  const Plan plan = plan_items(groups, group_bytes, m);
  const bool serial = m * p.features * p.k < kSerialMacs;
  auto span_of = [&](int64_t i) { return i / plan.blocks_per_span * plan.span; };
  auto run_item = [&](int64_t i, int64_t next) {
    const int64_t first = span_of(i), row0 = i % plan.blocks_per_span * plan.block_rows;
    const char* prefetch = nullptr;
    const char* prefetch_end = nullptr;
    if (next >= 0 && span_of(next) != first) {
      prefetch = p.weight + span_of(next) * group_bytes;
      prefetch_end = p.weight + std::min(groups, span_of(next) + plan.span) * group_bytes;
    }
    run_block<WT, Out>(p, first, std::min(groups, first + plan.span), row0, std::min(plan.block_rows, m - row0),
                       prefetch, prefetch_end);
  };
  // The next span is worth fetching where an item is one span's every row tile: with a single row tile
  // (few rows) there is no later tile to fetch during, and with several row blocks a span's next item
  // reads the same weights.
  if (prefetch_next && m > kTileRows && plan.blocks_per_span == 1) {
    run_items_in_order(plan.items, serial, run_item);
  } else {
    run_items(plan.items, serial, [&](int64_t i) { run_item(i, -1); });
  }
}

// x's rows widened to fp32, contiguous: a buffer of the calling thread's, reused from call to call.
template <typename T>
const float* widen_rows(const Matrix& x) {
  static thread_local std::vector<float> widened;
  const int64_t k = x.cols;
  if (widened.size() < size_t(x.rows * k)) widened.resize(x.rows * k);
  float* dst = widened.data();
  parallel_for(0, x.rows, std::max<int64_t>(1, kWidenGrain / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x.row<T>(r);
      for (int64_t c = 0; c < k; ++c) dst[r * k + c] = to_float(src[c]);
    }
  });
  return dst;
}

}  // namespace

void fma_gemm(const Matrix& x, const PackedShape& shape, const int32_t* packed, const void* bias, const Matrix& out) {
  dispatch_dtype(shape.dtype, [&](auto tag) {
    using WT = decltype(tag);
    const bool widened = !std::is_same_v<WT, float>;
    const Problem p{
        widened ? widen_rows<WT>(x) : static_cast<const float*>(x.data),
        widened ? x.cols : x.stride,
        reinterpret_cast<const char*>(packed + kHeaderInts),
        shape.group_bytes(),
        shape.row_bytes(),
        shape.k,
        shape.out_features(),
        bias,
        out.data,
        out.stride,
    };
    const int64_t groups = shape.groups(), group_bytes = shape.group_bytes();
    // A weight packed for K blocks (KernelConfig.gemm_k_blocks) lets this GEMM stream its next span
    // during the current one, the FMA tiers' way of keeping memory busy while the units compute.
    const bool prefetch_next = shape.k_blocks;
    if (shape.gated) {
      run<WT, fma::SiluGated<WT>>(p, x.rows, groups, group_bytes, prefetch_next);
    } else if (out.dtype == DType::kFloat32) {
      run<WT, float>(p, x.rows, groups, group_bytes, prefetch_next);
    } else {
      run<WT, WT>(p, x.rows, groups, group_bytes, prefetch_next);
    }
  });
}

int fma_lanes() { return fma::kLanes; }

}  // namespace sluice::cpu
