// x @ W^T + bias over a packed bf16 weight, for any number of rows. The work is a list of items,
// each one column group (64 output features) times one block of rows; threads take items from an
// atomic counter, so a thread that the OS descheduled delays the call by at most the item it holds
// while the other keeps taking work (static partitioning would leave half the work waiting on it).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cassert>

#include "gemm_bf16.h"
#include "packed_weight.h"

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
  alignas(64) float partial[kBlockMaxRows][kGroupCols];
  constexpr int64_t kRowBytes = kGroupInts * int64_t(sizeof(int32_t));
  constexpr int64_t kLine = 64;
  const char* group_start = reinterpret_cast<const char*>(p.weight + group * p.pairs * kGroupInts);
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
  const int64_t groups = (p.n + kGroupCols - 1) / kGroupCols;
  const int64_t group_bytes = p.pairs * kGroupInts * int64_t(sizeof(int32_t));
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
  const int64_t groups = (p.n + kGroupCols - 1) / kGroupCols;
  auto item = [&](int64_t i) {
    const int64_t first = i / plan.blocks_per_span * plan.span, row0 = i % plan.blocks_per_span * plan.block_rows;
    const int64_t rows = std::min(plan.block_rows, m - row0);
    const int64_t end = std::min(groups, first + plan.span);
    for (int64_t g = first; g < end; ++g) run_group<Out>(p, g, row0, rows, plan.k_blocked, g + 1 < end);
  };
  const int threads = at::get_num_threads();
  if (threads <= 1 || plan.items == 1 || m * p.n * p.k < kSerialMacs || at::in_parallel_region()) {
    for (int64_t i = 0; i < plan.items; ++i) item(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, plan.items), 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < plan.items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      item(i);
  });
}

}  // namespace

bool packed_gemm_available() { return true; }

void packed_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  const PackedShape shape = packed_shape(packed);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be a 2-d bfloat16 tensor with contiguous rows");
  TORCH_CHECK(x.size(1) == shape.k, "x has ", x.size(1), " features but the packed weight expects ", shape.k);
  if (shape.gated) {
    TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == shape.n / 2 && out.stride(1) == 1 &&
                    out.scalar_type() == at::kBFloat16,
                "a gated weight's out must be a bfloat16 [M, N / 2] tensor with contiguous rows");
  } else {
    TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == shape.n && out.stride(1) == 1 &&
                    (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
                "out must be a bfloat16 or float32 [M, N] tensor with contiguous rows");
  }
  const uint16_t* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == shape.n,
                "bias must be a contiguous bfloat16 vector of ", shape.n, " features");
    bias_data = reinterpret_cast<const uint16_t*>(bias->const_data_ptr<at::BFloat16>());
  }
  const int64_t m = x.size(0);
  if (m == 0) return;
  const Problem p{
      reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()),
      x.stride(0),
      packed.const_data_ptr<int32_t>() + kHeaderInts,
      (shape.k + 1) / 2,
      shape.k,
      shape.n,
      bias_data,
      out.mutable_data_ptr(),
      out.stride(0),
  };
  if (shape.gated) {
    run<gemm::SiluGated>(p, m, shape.k_blocks);
  } else if (out.scalar_type() == at::kFloat) {
    run<float>(p, m, shape.k_blocks);
  } else {
    run<uint16_t>(p, m, shape.k_blocks);
  }
}

#else

bool packed_gemm_available() { return false; }

void packed_gemm(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::Tensor&) {
  TORCH_CHECK(false, "this build of Sluice's CPU kernels has no AVX512_BF16, so it cannot use packed weights");
}

#endif

}  // namespace sluice::cpu
