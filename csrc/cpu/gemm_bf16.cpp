// x @ W^T + bias over a packed bf16 weight, for any number of rows. The work is a list of items,
// each one column group (64 output features) times one block of rows; threads take items from an
// atomic counter, so a thread that the OS descheduled delays the call by at most the item it holds
// while the other keeps taking work (static partitioning would leave half the work waiting on it).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>

#include "gemm_bf16.h"
#include "packed_weight.h"

namespace sluice::cpu {

#ifdef SLUICE_PACKED_GEMM
namespace {

using gemm::Problem;
using gemm::TileFn;

// Rows per tile: 6 rows x 4 vectors = 24 accumulators + 4 weight vectors. Every tile reads its column
// group's rows whole and in order; the first from memory, the rest from L2. (Tiles of fewer vectors and
// more rows, which split each weight row between passes, read memory at half the rate: 7-12 rows ran at
// 0.5-0.7x of this, bench/linear_kernel.py.)
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

template <typename Out>
struct Tiles {
  // Index: rows - 1.
  static constexpr auto table = gemm::make_tile_table<4, Out>(std::make_integer_sequence<int, kTileRows>{});
};

// Rows [row0, row0 + rows) of one column group, in tiles as equal in size as kTileRows allows.
template <typename Out>
void run_group(const Problem& p, int64_t group, int64_t row0, int64_t rows) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t base = rows / tiles, extra = rows % tiles;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int64_t n = base + (t < extra);
    Tiles<Out>::table[n - 1](p, row0 + r, group);
    r += n;
  }
}

// Work items: `span` consecutive column groups times one block of `block_rows` rows.
struct Plan {
  int64_t span, block_rows, blocks_per_span, items;
};

Plan plan_items(const Problem& p, int64_t m) {
  const int64_t groups = (p.n + kGroupCols - 1) / kGroupCols;
  const int64_t group_bytes = p.pairs * kGroupInts * int64_t(sizeof(int32_t));
  const int64_t span = m <= kFewRows ? std::clamp(kStreamBytes / group_bytes, int64_t(1),
                                                  std::max(int64_t(1), groups / kMinItems))
                                     : 1;
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

template <typename Out>
void run(const Problem& p, int64_t m) {
  const Plan plan = plan_items(p, m);
  const int64_t groups = (p.n + kGroupCols - 1) / kGroupCols;
  auto item = [&](int64_t i) {
    const int64_t first = i / plan.blocks_per_span * plan.span, row0 = i % plan.blocks_per_span * plan.block_rows;
    const int64_t rows = std::min(plan.block_rows, m - row0);
    for (int64_t g = first; g < std::min(groups, first + plan.span); ++g) run_group<Out>(p, g, row0, rows);
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
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == shape.n && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out must be a bfloat16 or float32 [M, N] tensor with contiguous rows");
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
  if (out.scalar_type() == at::kFloat) {
    run<float>(p, m);
  } else {
    run<uint16_t>(p, m);
  }
}

#else

bool packed_gemm_available() { return false; }

void packed_gemm(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, at::Tensor&) {
  TORCH_CHECK(false, "this build of Sluice's CPU kernels has no AVX512_BF16, so it cannot use packed weights");
}

#endif

}  // namespace sluice::cpu
