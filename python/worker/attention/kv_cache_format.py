"""The KV cache's tensors for --kv-cache-dtype, and the quantized formats' rows in torch.

"auto" caches hold the model's dtype, [num_blocks, block_size, num_kv_heads, head_dim]. int8 and fp8_e4m3
caches hold rows of head_dim one-byte values and then the row's float32 scale (its 4 bytes), head-major
within a block: [num_blocks, num_kv_heads, block_size, head_dim + 4], the layout of csrc/cpu/kv_quant.h,
which says why and documents the rounding. These functions are what the torch backend writes and reads,
and the bit-exact oracle of the kernels' writes.
"""

from __future__ import annotations

import torch

from sluice.config import KvCacheDType
from sluice.kv_cache_layout import QUANTIZED_ROW_SCALE_BYTES as SCALE_BYTES

QUANTIZED_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# The largest magnitude each format's values take: a row's largest element maps to it.
_RANGE = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# The kernels widen e4m3 bits as float16 patterns, which are the value / 256, so the stored scale has the
# 256 in it.
_STORED_SCALE = {torch.int8: 1.0, torch.float8_e4m3fn: 256.0}


def cache_dtype(kv_cache_dtype: KvCacheDType, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else QUANTIZED_DTYPES[kv_cache_dtype]


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _RANGE


def cache_shape(
    kv_cache_dtype: KvCacheDType, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int]:
    if kv_cache_dtype == "auto":
        return (num_blocks, block_size, num_kv_heads, head_dim)
    return (num_blocks, num_kv_heads, block_size, head_dim + SCALE_BYTES)


def token_major(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks, block_size, num_kv_heads, row] (a view: writes through it land in the cache)."""
    return cache.transpose(1, 2) if is_quantized(cache) else cache


def quantized_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A token-major cache of floats [num_blocks, block_size, num_kv_heads, head_dim] as a quantized cache."""
    return quantize_rows(rows, dtype).transpose(1, 2).contiguous()


def head_dim_of(cache: torch.Tensor) -> int:
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] as cache rows [..., head_dim + 4] of dtype (int8 or float8_e4m3fn)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # Tensor by tensor: torch divides by a Python number as a multiplication by its reciprocal, and takes
    # `number / tensor` as one too, each a rounding apart from the kernels' division.
    top = torch.full_like(amax, _RANGE[dtype])
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    scaled = x * inv
    values = torch.round(scaled).to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    scale = amax / top * _STORED_SCALE[dtype]
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(dtype)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows [..., head_dim + 4] as float32 [..., head_dim]."""
    values, scale_bytes = rows[..., :-SCALE_BYTES], rows[..., -SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.uint8).view(torch.float32)
    return values.float() * (scale / _STORED_SCALE[rows.dtype])
