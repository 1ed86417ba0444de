"""How big a KV block is and how many the budget holds: decided by the engine core before any worker starts."""

from __future__ import annotations

from sluice.config import SluiceConfig
from sluice.errors import KVCacheTooSmallError
from sluice.kv_cache_groups import KVCacheGroups, model_kv_cache_groups
from sluice.model_spec import ModelSpec

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# An int8 or fp8_e4m3 row: a byte per value and a float32 scale (worker/attention/kv_cache_format.py).
QUANTIZED_ROW_SCALE_BYTES = 4


def kv_heads_per_rank(spec: ModelSpec, tensor_parallel_size: int) -> int:
    return spec.num_kv_heads // tensor_parallel_size


def kv_cache_bytes_per_block(config: SluiceConfig, spec: ModelSpec, groups: KVCacheGroups) -> int:
    """One block's keys and values in each of its group's layers (every layer, where the model has one
    group), on one tensor-parallel rank."""
    heads = kv_heads_per_rank(spec, config.parallel.tensor_parallel_size)
    if config.cache.kv_cache_dtype == "auto":
        row_bytes = spec.head_dim * DTYPE_BYTES[config.model.dtype]
    else:
        row_bytes = spec.head_dim + QUANTIZED_ROW_SCALE_BYTES
    per_layer = 2 * config.cache.block_size * heads * row_bytes
    return per_layer * groups.num_slots


def num_kv_blocks(config: SluiceConfig, spec: ModelSpec, max_model_len: int) -> int:
    """Blocks that --kv-cache-memory (per worker) holds; at least one max_model_len request must fit."""
    cache = config.cache
    if spec.is_encoder:
        # An encoder reads no KV cache: its blocks only account for the step's prompts (each whole, each
        # rounded up to a block), so a token budget's worth is all it is given.
        return config.scheduler.max_num_seqs + -(-config.scheduler.max_num_batched_tokens // cache.block_size)
    groups = model_kv_cache_groups(spec, max_model_len, cache.hybrid_kv_cache)
    bytes_per_block = kv_cache_bytes_per_block(config, spec, groups)
    num_blocks = cache.num_gpu_blocks_override or int(cache.kv_cache_memory_gib * GIB // bytes_per_block)
    whole = -(-max_model_len // cache.block_size)
    # A windowed group holds its window, a step's tokens and the drafts it may roll back at most
    # (engine/kv_cache_manager.py), and a block on either side where they do not fall on a block's edge.
    speculative = config.speculative
    step = config.scheduler.max_num_batched_tokens + (
        speculative.num_speculative_tokens if speculative.enabled else 0
    )
    blocks_per_request = sum(
        min(whole, -(-(window + step) // cache.block_size) + 1) if window else whole
        for window in groups.windows
    )
    if num_blocks < blocks_per_request:
        need_gib = blocks_per_request * bytes_per_block / GIB
        raise KVCacheTooSmallError(
            f"the KV cache holds {num_blocks} blocks of {cache.block_size} tokens "
            f"({cache.kv_cache_memory_gib} GiB), but one request of max_model_len "
            f"{max_model_len} needs {blocks_per_request} blocks ({need_gib:.3f} GiB): "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    return num_blocks
