"""Turn a GGUF tensor's raw bytes into float32 values, one vectorised pass per tensor.

GGML stores a quantized row as blocks of 32 values. Each block starts with its float16 scale `d`
(and, for Q4_1, a float16 minimum `m`) followed by the quantized values:
- Q8_0: 32 signed bytes q, value = d * q;
- Q4_0: 16 bytes of two 4-bit values each, value = d * (q - 8);
- Q4_1: the same nibbles, value = d * q + m.
A byte's low nibble is element j of the block and its high nibble element j + 16.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_SIZE = 32
# The float types whose bytes are the values themselves.
PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_BLOCK_LAYOUTS = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", BLOCK_SIZE)]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", BLOCK_SIZE // 2)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", BLOCK_SIZE // 2)]),
}
SUPPORTED_TYPES = (*PLAIN_DTYPES, *_BLOCK_LAYOUTS)


class UnsupportedQuantizationError(ValueError):
    """A tensor type that Sluice cannot dequantize."""


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a tensor of GGML type `type_name` whose bytes are `raw`, as `shape`
    (row-major, the last dimension the GGUF's first)."""
    if type_name in PLAIN_DTYPES:
        values = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy())
        return values.view(PLAIN_DTYPES[type_name]).to(torch.float32).reshape(shape)
    layout = _BLOCK_LAYOUTS.get(type_name)
    if layout is None:
        raise UnsupportedQuantizationError(
            f"GGML type {type_name} is not supported; Sluice dequantizes {', '.join(SUPPORTED_TYPES)}"
        )
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1).view(layout)
    assert blocks.shape[0] * BLOCK_SIZE == int(np.prod(shape)), (blocks.shape, shape)
    scale = torch.from_numpy(blocks["d"].astype(np.float32))[:, None]
    quants = torch.from_numpy(blocks["qs"].copy())
    if type_name == "Q8_0":
        values = scale * quants.to(torch.float32)
    else:
        nibbles = torch.cat([quants & 0x0F, quants >> 4], dim=1).to(torch.float32)
        if type_name == "Q4_0":
            values = scale * (nibbles - 8.0)
        else:
            values = scale * nibbles + torch.from_numpy(blocks["m"].astype(np.float32))[:, None]
    return values.reshape(shape)
