// x @ W^T + bias over a kFormatBf16Pairs weight, for any number of rows. The work is a list of items,
// each one column group (64 output features) times one block of rows, which the threads take from an
// atomic counter (run_items).
#include <algorithm>
#include <cassert>

#include "check.h"
#include "gemm.h"
#include "gemm_bf16.h"
#include "packed_weight.h"
#include "parallel.h"

namespace sluice::cpu {

#ifdef SLUICE_PACKED_GEMM
namespace {

using gemm::Problem;
using gemm::TileFn;

// Rows per tile: 6 rows x 4 vectors = 24 accumulators + 4 weight vectors. Every tile reads its column
// group's rows whole and in order. (Tiles of fewer vectors and more rows, which split each weight row
// between passes, read memory at half the rate: 7-12 rows ran at 0.5-0.7x of this, bench/linear_kernel.py.)
constexpr int kTileRows = 6;
// Up to this many rows, items span several column groups so that each streams kStreamBytes of weights.
constexpr int kFewRows = 12;
// Rows per work item: small enough that two threads share even one column group of a long prefill.
constexpr int64_t kItemRows = 240;
// Work items wanted per call: with dynamic scheduling the threads finish about half an item apart.
constexpr int64_t kMinItems = 16;
// Weight bytes per work item when few rows stream it from memory: longer runs read faster.
constexpr int64_t kStreamBytes = 1 << 20;
// Below this many multiply-adds, waking the second thread costs more than it saves.
constexpr int64_t kSerialMacs = 1 << 17;

// K in blocks (PackedShape.k_blocks; KernelConfig.gemm_k_blocks). Taken whole, a column group's
// first row tile waits on memory while the later ones compute from cache, so memory idles half the
// time. Taken in blocks, every tile of an item computes from cache while it prefetches its share of
// the block after, so that the memory streams during the compute.
// k pairs per block: 24 KB of a group, which stays in L1 beside the tiles' partial sums.
constexpr int64_t kBlockPairs = 96;
// The most rows whose partial sums (256 bytes a row) are carried from block to block.
constexpr int64_t kBlockMaxRows = 64;
// An item's first block is read without a prefetch: only items of at least this many blocks gain.
constexpr int64_t kMinItemBlocks = 4;

template <typename Out>
struct Tiles {
  // Index: rows - 1.
  static constexpr auto table = gemm::make_tile_table<4, Out>(std::make_integer_sequence<int, kTileRows>{});
};

// Rows [row0, row0 + rows) of one column group, in tiles as equal in size as kTileRows allows; in
// blocks of K when k_blocked, prefetching the next group's first block when next_group_follows.
template <typename Out>
void run_group(const Problem& p, int64_t group, int64_t row0, int64_t rows, bool k_blocked,
               bool next_group_follows) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t base = rows / tiles, extra = rows % tiles;
  const int64_t full_pairs = p.k / 2;
  auto each_tile = [&](auto&& range_of) {
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
      const int64_t n = base + (t < extra);
      Tiles<Out>::table[n - 1](p, row0 + r, group, range_of(t, r));
      r += n;
    }
  };
  if (!k_blocked || tiles == 1) {
    each_tile([&](int64_t, int64_t) { return gemm::KRange{0, full_pairs, nullptr, nullptr, nullptr, 0}; });
    return;
  }
  assert(rows <= kBlockMaxRows);
  alignas(64) float partial[kBlockMaxRows][kPairGroupCols];
  constexpr int64_t kRowBytes = kPairGroupCols * int64_t(sizeof(int32_t));
  constexpr int64_t kLine = 64;
  const char* group_start = reinterpret_cast<const char*>(p.weight + group * p.pairs * kPairGroupCols);
  // Each tile prefetches a 1 / tiles share of the next block's lines, at a pace that ends it in time.
  const int per_pair = int((kRowBytes / kLine + tiles - 1) / tiles);
  for (int64_t j0 = 0; j0 < full_pairs; j0 += kBlockPairs) {
    const int64_t j1 = std::min(full_pairs, j0 + kBlockPairs);
    const char* next = group_start + j1 * kRowBytes;
    int64_t next_pairs = std::min(full_pairs, j1 + kBlockPairs) - j1;
    if (next_pairs == 0 && next_group_follows) {
      next = group_start + p.pairs * kRowBytes;
      next_pairs = std::min(full_pairs, kBlockPairs);
    }
    const char* next_end = next + next_pairs * kRowBytes;
    const int64_t share = (next_pairs * kRowBytes / kLine + tiles - 1) / tiles * kLine;
    each_tile([&](int64_t t, int64_t r) {
      const char* from = std::min(next_end, next + t * share);
      return gemm::KRange{j0, j1, partial[r], from, std::min(next_end, from + share), per_pair};
    });
  }
}

// Work items: `span` consecutive column groups times one block of `block_rows` rows.
struct Plan {
  int64_t span, block_rows, blocks_per_span, items;
  bool k_blocked;
};

Plan plan_items(const Problem& p, int64_t m, bool k_blocks) {
  const int64_t groups = (p.n + kPairGroupCols - 1) / kPairGroupCols;
  const int64_t group_bytes = p.pairs * kPairGroupCols * int64_t(sizeof(int32_t));
  const int64_t stream_span =
      std::clamp(kStreamBytes / group_bytes, int64_t(1), std::max(int64_t(1), groups / kMinItems));
  const int64_t group_blocks = (p.k / 2 + kBlockPairs - 1) / kBlockPairs;
  const bool k_blocked = k_blocks && m > kTileRows &&
                         m <= kBlockMaxRows && stream_span * group_blocks >= kMinItemBlocks;
  const int64_t span = m <= kFewRows || k_blocked ? stream_span : 1;
  const int64_t spans = (groups + span - 1) / span;
  // Few column groups are split into row blocks too, so that the items are many and the last one small.
  const int64_t split = std::min((kMinItems + spans - 1) / spans, m / kTileRows);
  const int64_t row_blocks = std::max((m + kItemRows - 1) / kItemRows, split);
  // Equal row blocks of whole tiles, so that no item is a sliver.
  const int64_t per_block = (m + row_blocks - 1) / row_blocks;
  const int64_t block_rows = std::min(m, (per_block + kTileRows - 1) / kTileRows * kTileRows);
  const int64_t blocks_per_span = (m + block_rows - 1) / block_rows;
  return {span, block_rows, blocks_per_span, spans * blocks_per_span, k_blocked};
}

template <typename Out>
void run(const Problem& p, int64_t m, bool k_blocks) {
  const Plan plan = plan_items(p, m, k_blocks);
  const int64_t groups = (p.n + kPairGroupCols - 1) / kPairGroupCols;
  run_items(plan.items, m * p.n * p.k < kSerialMacs, [&](int64_t i) {
    const int64_t first = i / plan.blocks_per_span * plan.span, row0 = i % plan.blocks_per_span * plan.block_rows;
    const int64_t rows = std::min(plan.block_rows, m - row0);
    const int64_t end = std::min(groups, first + plan.span);
    for (int64_t g = first; g < end; ++g) run_group<Out>(p, g, row0, rows, plan.k_blocked, g + 1 < end);
  });
}

}  // namespace

bool has_bf16_pairs() { return true; }

void bf16_pairs_gemm(const Matrix& x, const PackedShape& shape, const int32_t* packed, const void* bias,
                     const Matrix& out) {
  const int64_t m = x.rows;
  const Problem p{
      static_cast<const uint16_t*>(x.data),
      x.stride,
      packed + kHeaderInts,
      (shape.k + 1) / 2,
      shape.k,
      shape.n,
      static_cast<const uint16_t*>(bias),
      out.data,
      out.stride,
  };
  if (shape.gated) {
    run<gemm::SiluGated>(p, m, shape.k_blocks);
  } else if (out.dtype == DType::kFloat32) {
    run<float>(p, m, shape.k_blocks);
  } else {
    run<uint16_t>(p, m, shape.k_blocks);
  }
}

#else

bool has_bf16_pairs() { return false; }

void bf16_pairs_gemm(const Matrix&, const PackedShape&, const int32_t*, const void*, const Matrix&) {
  fail("the ", tier_name(), " tier has no bf16-pair GEMM (it needs AVX512_BF16)");
}

#endif

}  // namespace sluice::cpu
