// Writing a step's new key and value rows into their slots of the paged cache: copied as they are, or
// quantized row by row into an int8 or fp8 cache (kv_quant.h).
#include <atomic>
#include <cstring>

#include "check.h"
#include "kv_quant.h"
#include "ops.h"
#include "parallel.h"

namespace sluice::cpu {
namespace {

// Copies are memory bound: split only when there are enough of them to pay for waking threads.
constexpr int64_t kTokenGrain = 512;

void check_rows(const Heads& rows, const KvCache& cache, const char* name) {
  SK_CHECK(rows.heads == cache.kv_heads && rows.dim == cache.head_dim, name,
           " must be [num_tokens, num_kv_heads, head_dim] matching the cache");
  // A quantized cache takes rows of any activation dtype; a float cache, rows of its own.
  SK_CHECK(rows.dtype == cache.dtype || (is_quantized_cache(cache.dtype) && !is_quantized_cache(rows.dtype)), name,
           " is ", dtype_name(rows.dtype), " but the cache holds ", dtype_name(cache.dtype));
}

// Calls write(t, slot) for every token whose slot is in the cache; slots below zero are padding.
template <typename Slot, typename Write>
void for_each_slot(const KvCache& shape, const Slot* slots, int64_t n, int64_t grain, Write&& write) {
  const int64_t num_slots = shape.num_blocks * shape.block_size;
  std::atomic<bool> out_of_range{false};
  parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) continue;
      if (slot >= num_slots) {
        out_of_range.store(true, std::memory_order_relaxed);
        continue;
      }
      write(t, slot);
    }
  });
  SK_CHECK(!out_of_range.load(), "slot_mapping holds a slot beyond the cache (", num_slots, " slots)");
}

template <typename Slot>
void copy_rows(const Heads& rows, void* cache, const KvCache& shape, const Slot* slots, int64_t n) {
  const int64_t size = dtype_size(rows.dtype);
  const int64_t row_bytes = rows.dim * size;
  const bool heads_packed = rows.head_stride == rows.dim;
  const char* src = static_cast<const char*>(rows.data);
  char* dst = static_cast<char*>(cache);
  for_each_slot(shape, slots, n, kTokenGrain, [&](int64_t t, int64_t slot) {
    char* d = dst + slot * shape.kv_heads * row_bytes;
    const char* s = src + t * rows.token_stride * size;
    if (heads_packed) {
      std::memcpy(d, s, shape.kv_heads * row_bytes);
    } else {
      for (int64_t h = 0; h < shape.kv_heads; ++h)
        std::memcpy(d + h * row_bytes, s + h * rows.head_stride * size, row_bytes);
    }
  });
}

// Quantizing costs a pass over each row for its maximum and one to scale it: split sooner than copies.
constexpr int64_t kQuantizeGrain = 64;

template <typename T, typename C, typename Slot>
void quantize_rows(const Heads& rows, void* cache, const KvCache& shape, const Slot* slots, int64_t n) {
  const int dim = int(rows.dim);
  const RowStrides at = cache_row_strides(shape);
  const T* src = static_cast<const T*>(rows.data);
  C* dst = static_cast<C*>(cache);
  for_each_slot(shape, slots, n, kQuantizeGrain, [&](int64_t t, int64_t slot) {
    float x[kMaxKvHeadDim];
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      const T* s = src + t * rows.token_stride + h * rows.head_stride;
      for (int d = 0; d < dim; ++d) x[d] = to_float(s[d]);
      quantize_row(x, dim, dst + slot / shape.block_size * at.block + h * at.head + slot % shape.block_size * at.token);
    }
  });
}

template <typename Slot>
void write_rows(const Heads& rows, void* cache, const KvCache& shape, const Slot* slots, int64_t n) {
  if (!is_quantized_cache(shape.dtype)) return copy_rows(rows, cache, shape, slots, n);
  SK_CHECK(rows.dim <= kMaxKvHeadDim, "a quantized KV cache takes head_dim up to ", kMaxKvHeadDim);
  dispatch_dtype(rows.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (shape.dtype == DType::kInt8) {
      quantize_rows<T, q8>(rows, cache, shape, slots, n);
    } else {
      quantize_rows<T, e4m3>(rows, cache, shape, slots, n);
    }
  });
}

}  // namespace

void write_kv_cache(const Heads& key, const Heads& value, const KvCache& cache, const Slots& slots) {
  check_rows(key, cache, "key");
  check_rows(value, cache, "value");
  SK_CHECK(key.tokens >= slots.count && value.tokens >= slots.count,
           "fewer key/value rows than slot_mapping entries");
  for (const auto& [rows, data] : {std::pair{&key, cache.key}, std::pair{&value, cache.value}}) {
    if (slots.wide) {
      write_rows(*rows, data, cache, static_cast<const int64_t*>(slots.data), slots.count);
    } else {
      write_rows(*rows, data, cache, static_cast<const int32_t*>(slots.data), slots.count);
    }
  }
}

}  // namespace sluice::cpu
