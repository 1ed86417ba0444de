// The kernel library's C ABI: what Python's worker/native_ops.py calls through ctypes. One library is
// built per instruction-set tier (csrc/build_kernels.py), each exporting these same symbols, so the worker
// loads whichever tier its CPU runs. Structs are ops.h's and model_step.h's, passed by pointer; ctypes
// mirrors them field for field (sluice_struct_sizes lets it check). Every function that can fail returns
// 0, or 1 with the reason in sluice_last_error(); none throws, none aborts.
#include <sys/mman.h>

#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "check.h"
#include "gemm.h"
#include "model_step.h"
#include "ops.h"
#include "packed_weight.h"
#include "quant_weight.h"

#define SLUICE_API extern "C" __attribute__((visibility("default")))

namespace {

using namespace sluice::cpu;

// Bumped whenever a signature or a struct below changes; worker/native_ops.py expects the same number.
constexpr int32_t kAbiVersion = 5;

thread_local std::string last_error;

template <typename F>
int32_t guarded(F&& body) {
  try {
    body();
    return 0;
  } catch (const std::bad_alloc&) {
    last_error = "out of memory";
  } catch (const std::exception& e) {
    last_error = e.what();
  }
  return 1;
}

// Layout of a weight as pack_weight and packed_shape report it to Python.
struct PackedInfo {
  int64_t n, k, out_features, total_ints;
  int32_t gated, k_blocks, format, dtype, lanes;
};

PackedInfo info_of(const PackedShape& s) {
  return {s.n, s.k, s.out_features(), s.total_ints(), s.gated, s.k_blocks, s.format, int32_t(s.dtype), s.lanes};
}

PackedInfo info_of(const QuantShape& s) {
  return {s.n, s.k, s.n, s.total_ints, 0, 0, kFormatQuantBlocks, int32_t(s.dtype), 0};
}

void check_dtype(int32_t code) {
  SK_CHECK(code >= 0 && code <= 2, "unknown dtype code ", code);
}

ModelStep& step_of(void* step) {
  SK_CHECK(step != nullptr, "no model step");
  return *static_cast<ModelStep*>(step);
}

}  // namespace

SLUICE_API int32_t sluice_abi_version() { return kAbiVersion; }

SLUICE_API const char* sluice_tier() { return tier_name(); }

SLUICE_API const char* sluice_last_error() { return last_error.c_str(); }

// sizeof each struct that crosses the ABI, in this order, for ctypes to check its mirrors against.
SLUICE_API void sluice_struct_sizes(int64_t* sizes) {
  const int64_t all[] = {sizeof(Matrix),    sizeof(Heads),        sizeof(KvCache),   sizeof(Slots),
                         sizeof(Batch),     sizeof(PackedInfo),   sizeof(PackedRef), sizeof(LayerWeights),
                         sizeof(Workspace), sizeof(ModelShape), sizeof(MoeWeights)};
  std::memcpy(sizes, all, sizeof all);
}

SLUICE_API int32_t sluice_packing_info(int32_t dtype, int64_t n, int64_t k, int32_t layout, int32_t k_blocks,
                                       PackedInfo* info) {
  return guarded([&] {
    check_dtype(dtype);
    *info = info_of(packing_shape(DType(dtype), n, k, layout, k_blocks != 0));
  });
}

SLUICE_API int32_t sluice_pack_weight(const void* w, int32_t dtype, int64_t n, int64_t k, int64_t row_stride,
                                      int64_t col_stride, int32_t layout, int32_t k_blocks, int32_t* dst,
                                      int64_t dst_ints) {
  return guarded([&] {
    check_dtype(dtype);
    const PackedShape shape = packing_shape(DType(dtype), n, k, layout, k_blocks != 0);
    SK_CHECK(dst_ints == shape.total_ints(), "the packed weight needs ", shape.total_ints(), " words, got ",
             dst_ints);
    pack_weight(w, DType(dtype), n, k, row_stride, col_stride, layout, k_blocks != 0, dst);
  });
}

SLUICE_API int32_t sluice_packed_info(const int32_t* packed, int64_t ints, PackedInfo* info) {
  return guarded([&] {
    *info = packed_format(packed, ints) == kFormatQuantBlocks ? info_of(quant_shape(packed, ints))
                                                               : info_of(packed_shape(packed, ints));
  });
}

// A quantized weight (quant_weight.h) of `count` segments, segment s ending at row row_ends[s], of
// kinds[s]: its size in info, and with dst (of dst_ints words) non-null, packed there from each segment's
// values and scales, laid out as quant_weight.h says.
SLUICE_API int32_t sluice_pack_quantized(int32_t dtype, int64_t n, int64_t k, int32_t count, const int64_t* row_ends,
                                         const int32_t* kinds, const void* const* values, const void* const* scales,
                                         int32_t* dst, int64_t dst_ints, PackedInfo* info) {
  return guarded([&] {
    check_dtype(dtype);
    const QuantShape shape = quant_packing_shape(DType(dtype), n, k, count, row_ends, kinds);
    *info = info_of(shape);
    if (dst == nullptr) return;
    SK_CHECK(dst_ints == shape.total_ints, "the quantized weight needs ", shape.total_ints, " words, got ",
             dst_ints);
    pack_quantized(shape, values, scales, dst);
  });
}

// Asks for transparent huge pages over the whole 2 MiB pages of [p, p + bytes): a decode step streams
// every weight once, and on 4 KiB pages that read ran at about two thirds of its speed on huge pages
// (TLB misses on every stream). Best effort: a kernel without them says no, and nothing changes.
SLUICE_API int32_t sluice_advise_huge_pages(void* p, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes)) & ~(kHugePage - 1);
  if (end > begin) return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0 ? 0 : 1;
#endif
  return 1;
}

SLUICE_API int32_t sluice_linear(const Matrix* x, const int32_t* packed, int64_t ints, const void* bias,
                                 const Matrix* out) {
  return guarded([&] { linear(*x, packed, ints, bias, *out); });
}

SLUICE_API int32_t sluice_moe(const Matrix* x, const MoeWeights* weights, const Matrix* out) {
  return guarded([&] { moe(*x, *weights, *out); });
}

SLUICE_API int32_t sluice_rms_norm(const Matrix* out, const Matrix* x, const void* weight, double eps) {
  return guarded([&] { rms_norm(*out, *x, weight, eps); });
}

SLUICE_API int32_t sluice_add_rms_norm(const Matrix* out, const Matrix* residual, const Matrix* delta,
                                       const void* weight, double eps) {
  return guarded([&] { add_rms_norm(*out, *residual, *delta, weight, eps); });
}

SLUICE_API int32_t sluice_silu_and_mul(const Matrix* out, const Matrix* gate_up) {
  return guarded([&] { silu_and_mul(*out, *gate_up); });
}

SLUICE_API int32_t sluice_gelu(const Matrix* x) {
  return guarded([&] { gelu(*x); });
}

SLUICE_API int32_t sluice_rotary_embedding(const Heads* qk, const Matrix* cos, const Matrix* sin_signed) {
  return guarded([&] { rotary_embedding(*qk, *cos, *sin_signed); });
}

SLUICE_API int32_t sluice_qk_norm(const Heads* qk, int64_t q_heads, const void* q_weight, const void* k_weight,
                                  double eps) {
  return guarded([&] { qk_norm(*qk, q_heads, q_weight, k_weight, eps); });
}

SLUICE_API int32_t sluice_argmax_rows(const Matrix* x, int64_t* out) {
  return guarded([&] { argmax_rows(*x, out); });
}

SLUICE_API int32_t sluice_write_kv_cache(const Heads* key, const Heads* value, const KvCache* cache,
                                         const Slots* slots) {
  return guarded([&] { write_kv_cache(*key, *value, *cache, *slots); });
}

SLUICE_API int32_t sluice_paged_attention(const Heads* out, const Heads* query, const KvCache* cache,
                                          const Batch* batch, double scale, int64_t window, double softcap,
                                          int32_t decode_path, int32_t split_keys) {
  return guarded([&] {
    paged_attention(*out, *query, *cache, *batch, scale, window, softcap, decode_path != 0, split_keys != 0);
  });
}

SLUICE_API int32_t sluice_attention_within_sequences(const Heads* out, const Heads* query, const Heads* key,
                                                     const Heads* value, const int32_t* query_start_loc,
                                                     int64_t num_seqs, double scale) {
  return guarded([&] { attention_within_sequences(*out, *query, *key, *value, query_start_loc, num_seqs, scale); });
}

SLUICE_API int32_t sluice_bind_threads(const int64_t* cpu_ids, int64_t count, int64_t* bound) {
  return guarded([&] {
    const std::vector<int64_t> result = bind_threads(std::vector<int64_t>(cpu_ids, cpu_ids + count));
    std::memcpy(bound, result.data(), result.size() * sizeof(int64_t));
  });
}

// A new model step, or null with the reason in sluice_last_error().
SLUICE_API void* sluice_model_step_new(const LayerWeights* layers, int64_t num_layers, const ModelShape* shape,
                                       const void* embedding, const void* final_norm, double final_eps,
                                       const void* cos_table, const void* sin_table, const Workspace* workspace,
                                       int32_t decode_attention, int32_t decode_split_keys) {
  ModelStep* step = nullptr;
  guarded([&] {
    step = new ModelStep(std::vector<LayerWeights>(layers, layers + num_layers), *shape, embedding, final_norm,
                         final_eps, cos_table, sin_table, *workspace, decode_attention != 0,
                         decode_split_keys != 0);
  });
  return step;
}

SLUICE_API void sluice_model_step_free(void* step) { delete static_cast<ModelStep*>(step); }

SLUICE_API int32_t sluice_model_step_set_kv_caches(void* step, const KvCache* caches, int64_t count) {
  return guarded([&] { step_of(step).set_kv_caches(std::vector<KvCache>(caches, caches + count)); });
}

SLUICE_API int32_t sluice_model_step_forward(void* step, const int64_t* input_ids, const int64_t* positions,
                                             int64_t n, const Slots* slots, const Batch* batch) {
  return guarded([&] { step_of(step).forward(input_ids, positions, n, *slots, *batch); });
}

SLUICE_API int32_t sluice_model_step_attention_input(void* step, int64_t layer, const Matrix* delta,
                                                     const Matrix* residual, const Matrix* cos, const Matrix* sin) {
  return guarded([&] { step_of(step).attention_input(layer, delta, *residual, *cos, *sin); });
}

SLUICE_API int32_t sluice_model_step_attention_output(void* step, int64_t layer, const Matrix* attn) {
  return guarded([&] { step_of(step).attention_output(layer, *attn); });
}

SLUICE_API int32_t sluice_model_step_feed_forward(void* step, int64_t layer, const Matrix* delta,
                                                  const Matrix* residual) {
  return guarded([&] { step_of(step).feed_forward(layer, *delta, *residual); });
}
