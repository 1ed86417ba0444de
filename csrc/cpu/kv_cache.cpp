#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>

#include "ops.h"

namespace sluice::cpu {
namespace {

void check_cache_pair(const at::Tensor& rows, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), name,
              "_cache must be a contiguous [num_blocks, block_size, num_kv_heads, head_dim] tensor");
  TORCH_CHECK(rows.dim() == 3 && rows.size(1) == cache.size(2) && rows.size(2) == cache.size(3), name,
              " must be [num_tokens, num_kv_heads, head_dim] matching the cache");
  TORCH_CHECK(rows.stride(2) == 1, name, " must be contiguous in its last dimension");
}

template <typename Slot>
void copy_rows(const at::Tensor& rows, at::Tensor& cache, const Slot* slots, int64_t n) {
  const int64_t heads = cache.size(2), dim = cache.size(3);
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t esz = cache.element_size();
  const int64_t tok_stride = rows.stride(0) * esz, head_stride = rows.stride(1) * esz;
  const int64_t row_bytes = dim * esz;
  const bool heads_packed = head_stride == row_bytes;
  const char* src = static_cast<const char*>(rows.const_data_ptr());
  char* dst = static_cast<char*>(cache.mutable_data_ptr());
  std::atomic<bool> out_of_range{false};
  // Copies are memory bound: split only when there are enough of them to pay for waking threads.
  at::parallel_for(0, n, 512, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) continue;
      if (slot >= num_slots) {
        out_of_range.store(true, std::memory_order_relaxed);
        continue;
      }
      char* d = dst + slot * heads * row_bytes;
      const char* s = src + t * tok_stride;
      if (heads_packed) {
        std::memcpy(d, s, heads * row_bytes);
      } else {
        for (int64_t h = 0; h < heads; ++h) std::memcpy(d + h * row_bytes, s + h * head_stride, row_bytes);
      }
    }
  });
  TORCH_CHECK(!out_of_range.load(), "slot_mapping holds a slot beyond the cache (", num_slots, " slots)");
}

void write_one(const at::Tensor& rows, at::Tensor& cache, const at::Tensor& slot_mapping) {
  const at::Tensor src = rows.scalar_type() == cache.scalar_type() ? rows : rows.to(cache.scalar_type());
  const int64_t n = slot_mapping.size(0);
  TORCH_CHECK(src.size(0) >= n, "fewer key/value rows than slot_mapping entries");
  if (slot_mapping.scalar_type() == at::kLong) {
    copy_rows(src, cache, slot_mapping.const_data_ptr<int64_t>(), n);
  } else {
    copy_rows(src, cache, slot_mapping.const_data_ptr<int32_t>(), n);
  }
}

}  // namespace

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache_pair(key, key_cache, "key");
  check_cache_pair(value, value_cache, "value");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt),
              "slot_mapping must be a contiguous 1-d int64 or int32 tensor");
  write_one(key, key_cache, slot_mapping);
  write_one(value, value_cache, slot_mapping);
}

}  // namespace sluice::cpu
