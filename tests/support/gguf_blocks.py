"""Random GGUF tensors of any GGML type, as raw bytes that a file could hold (finite scales)."""

from __future__ import annotations

import gguf
import numpy as np


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of a rows x cols tensor of GGML type `type_name`: random quants, finite scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if type_name == "F32":
        return rng.normal(size=(rows, cols)).astype(np.float32).view(np.uint8)
    if type_name == "F16":
        return rng.normal(size=(rows, cols)).astype(np.float16).view(np.uint8)
    if type_name == "BF16":
        as_float = rng.normal(size=(rows, cols)).astype(np.float32)
        return (as_float.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows * cols // block_size, block_bytes), dtype=np.uint8)
    for offset in FLOAT16_OFFSETS[type_name]:
        raw[:, offset : offset + 2] = rng.normal(size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# Where each block type keeps its float16 scales (d, and m or dmin), from ggml-common.h's block structs:
# random bytes there could be infinities or NaNs, which no file holds.
FLOAT16_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
