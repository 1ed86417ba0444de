// Packing a bf16 linear weight into the GEMM's column-group layout (see packed_weight.h).
#include "packed_weight.h"

#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace sluice::cpu {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;

// A decode step streams every weight from memory once; with 4 KiB pages that read ran at about two
// thirds of the speed it reaches on transparent huge pages here (TLB misses on every stream), so the
// packed weight starts on a huge page boundary and asks for them. The tail past the last whole huge
// page stays on small pages, so nothing is rounded up in resident memory.
at::Tensor huge_page_zeros(int64_t ints) {
  const size_t bytes = size_t(ints) * sizeof(int32_t);
  void* data = std::aligned_alloc(kHugePage, (bytes + 63) / 64 * 64);
  TORCH_CHECK(data != nullptr, "cannot allocate ", bytes, " bytes for a packed weight");
#ifdef MADV_HUGEPAGE
  if (bytes >= kHugePage) madvise(data, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // best effort
#endif
  std::memset(data, 0, bytes);
  return at::from_blob(data, {ints}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kInt));
}

}  // namespace

bool is_packed_weight(const at::Tensor& w) {
  return w.scalar_type() == at::kInt && w.dim() == 1 && w.numel() >= kHeaderInts && w.is_contiguous() &&
         w.device().is_cpu() && w.const_data_ptr<int32_t>()[0] == kPackedMagic;
}

PackedShape packed_shape(const at::Tensor& w) {
  const int32_t* header = w.const_data_ptr<int32_t>();
  TORCH_CHECK(header[1] == kPackedVersion, "packed weight has version ", header[1], ", expected ", kPackedVersion);
  TORCH_CHECK(header[4] == kPlainLayout || header[4] == kGatedLayout, "packed weight has unknown layout ",
              header[4]);
  TORCH_CHECK(header[5] == 0 || header[5] == 1, "packed weight has a k_blocks word of ", header[5]);
  const PackedShape shape{header[2], header[3], header[4] == kGatedLayout, header[5] == 1};
  const int64_t groups = (shape.n + kGroupCols - 1) / kGroupCols;
  TORCH_CHECK(w.numel() == kHeaderInts + groups * ((shape.k + 1) / 2) * kGroupInts,
              "packed weight's size does not match its header's [N, K] = [", shape.n, ", ", shape.k, "]");
  return shape;
}

namespace {

// Packs weight [n, K] in `layout`: source_row(n, g, c) is the row that column c of group g holds, or -1.
template <typename SourceRow>
at::Tensor pack(const at::Tensor& weight, int32_t layout, bool k_blocks, SourceRow source_row) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "only a 2-d bfloat16 CPU weight can be packed, got ", weight.scalar_type(), " of shape ",
              weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n <= std::numeric_limits<int32_t>::max() && k <= std::numeric_limits<int32_t>::max(),
              "cannot pack a weight of shape ", weight.sizes());
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols, pairs = (k + 1) / 2;
  at::Tensor packed = huge_page_zeros(kHeaderInts + groups * pairs * kGroupInts);
  int32_t* out = packed.mutable_data_ptr<int32_t>();
  out[0] = kPackedMagic;
  out[1] = kPackedVersion;
  out[2] = int32_t(n);
  out[3] = int32_t(k);
  out[4] = layout;
  out[5] = k_blocks ? 1 : 0;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.const_data_ptr<at::BFloat16>());
  const int64_t row_stride = weight.stride(0), col_stride = weight.stride(1);
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(out + kHeaderInts + g * pairs * kGroupInts);
      for (int64_t c = 0; c < kGroupCols; ++c) {
        const int64_t row = source_row(n, g, c);
        if (row < 0) continue;
        const uint16_t* src = w + row * row_stride;
        for (int64_t kk = 0; kk < k; ++kk) dst[((kk / 2) * kGroupInts + c) * 2 + kk % 2] = src[kk * col_stride];
      }
    }
  });
  return packed;
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight, bool k_blocks) {
  return pack(weight, kPlainLayout, k_blocks, [](int64_t n, int64_t g, int64_t c) {
    const int64_t row = g * kGroupCols + c;
    return row < n ? row : int64_t(-1);
  });
}

at::Tensor pack_gated_linear_weight(const at::Tensor& weight, bool k_blocks) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % 2 == 0,
              "a gated weight must stack gate and up halves of equal height, got shape ", weight.sizes());
  return pack(weight, kGatedLayout, k_blocks, [](int64_t n, int64_t g, int64_t c) {
    constexpr int64_t half = kGroupCols / 2;
    const int64_t width = n / 2, feature = g * half + c % half;
    if (feature >= width) return int64_t(-1);
    return c < half ? feature : width + feature;
  });
}

}  // namespace sluice::cpu
