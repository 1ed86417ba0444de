"""A GGUF tensor's blocks converted to the block kinds of Sluice's integer GEMM (csrc/cpu/quant_weight.h).

The kinds hold blocks of 32 values along a row, with float16 scales:
- Q8: 32 signed bytes q, value = d * q;
- Q4: 16 bytes of nibbles (element j low, j + 16 high, GGML's order), value = d * q + m;
- Q4 symmetric: the same nibbles, value = d * (q - 8).

From each GGML type:
- Q8_0 -> Q8, Q4_0 -> Q4 symmetric, Q4_1 -> Q4, Q5_0 -> Q8 (q - 16 fits a byte): the same values, bit
  for bit;
- Q4_K -> Q4 with each 32-value sub-block's d * scale and dmin * min rounded to float16 (a relative
  error of at most 2^-11 on a scale, far below the 4-bit step);
- Q5_1, Q5_K, Q6_K, Q3_K and Q2_K (and float tensors fused beside quantized ones) -> Q8 requantized
  from their exact values, 32 at a time, as llama.cpp's quantize_row_q8_0 does (d = max |x| / 127):
  an error below half an 8-bit step, under a quarter of the source's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.config import QUANTIZATION_BLOCK
from worker import gguf_dequantize
from worker.native_abi import QUANT_Q4, QUANT_Q4_SYM, QUANT_Q8

# The GGML types converted without any change of value, and the one whose scales are rounded.
EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")
NEAR_EXACT_TYPES = ("Q4_K",)
REQUANTIZED_TYPES = ("Q5_1", "Q5_K", "Q6_K", "Q3_K", "Q2_K")
QUANTIZED_TYPES = (*EXACT_TYPES, *NEAR_EXACT_TYPES, *REQUANTIZED_TYPES)


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """Rows of a linear weight in one block kind: values [rows, blocks, 32 or 16] uint8, scales
    [rows, blocks, 1 or 2] float16 (d, and Q4's m)."""

    kind: int
    values: np.ndarray
    scales: np.ndarray
    # The GGML type it came from, for messages.
    source: str

    def __post_init__(self) -> None:
        assert self.values.dtype == np.uint8 and self.scales.dtype == np.float16, (
            self.values.dtype,
            self.scales.dtype,
        )
        width = QUANTIZATION_BLOCK if self.kind == QUANT_Q8 else QUANTIZATION_BLOCK // 2
        assert self.values.shape[2] == width and self.scales.shape[2] == (2 if self.kind == QUANT_Q4 else 1)
        assert self.values.shape[:2] == self.scales.shape[:2]

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1] * QUANTIZATION_BLOCK

    def rows(self, index: slice | np.ndarray) -> QuantizedRows:
        return QuantizedRows(self.kind, self.values[index], self.scales[index], self.source)

    def columns(self, start: int, stop: int) -> QuantizedRows:
        """Columns [start, stop), which must fall on block boundaries (a row-parallel shard)."""
        assert start % QUANTIZATION_BLOCK == 0 and stop % QUANTIZATION_BLOCK == 0, (start, stop)
        part = slice(start // QUANTIZATION_BLOCK, stop // QUANTIZATION_BLOCK)
        return QuantizedRows(self.kind, self.values[:, part], self.scales[:, part], self.source)

    def padded(self, rows: int) -> QuantizedRows:
        """With zero rows (values and scales 0: every value 0) appended up to `rows`."""
        extra = rows - self.values.shape[0]
        if extra <= 0:
            return self
        pad = ((0, extra), (0, 0), (0, 0))
        return QuantizedRows(self.kind, np.pad(self.values, pad), np.pad(self.scales, pad), self.source)

    def dequantize(self) -> torch.Tensor:
        """The float32 values, [rows, K]."""
        d = self.scales[..., :1].astype(np.float32)
        if self.kind == QUANT_Q8:
            q = self.values.view(np.int8).astype(np.float32)
            return torch.from_numpy((d * q).reshape(self.shape))
        q = np.concatenate([self.values & 0x0F, self.values >> 4], axis=-1).astype(np.float32)
        if self.kind == QUANT_Q4_SYM:
            return torch.from_numpy((d * (q - 8.0)).reshape(self.shape))
        return torch.from_numpy((d * q + self.scales[..., 1:].astype(np.float32)).reshape(self.shape))


def quantize_q8(values: torch.Tensor, source: str) -> QuantizedRows:
    """Float rows [rows, K] (K a multiple of 32) as Q8 blocks: d = max |x| / 127, q = round(x / d)."""
    rows, k = values.shape
    assert k % QUANTIZATION_BLOCK == 0, k
    x = values.detach().to(torch.float32).numpy().reshape(rows, k // QUANTIZATION_BLOCK, QUANTIZATION_BLOCK)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    d = (amax / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)
    inverse = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.round(x * inverse), -127, 127).astype(np.int8)
    return QuantizedRows(QUANT_Q8, q.view(np.uint8), d, source)


def quantize_q4(values: torch.Tensor, source: str) -> QuantizedRows:
    """Float rows [rows, K] (K a multiple of 32) as Q4 blocks with a minimum: m = min x, d = (max x - m)
    / 15, q = round((x - m) / d) from the float16 d and m, clipped to 0..15."""
    rows, k = values.shape
    assert k % QUANTIZATION_BLOCK == 0, k
    x = values.detach().to(torch.float32).numpy().reshape(rows, k // QUANTIZATION_BLOCK, QUANTIZATION_BLOCK)
    low, high = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    m = low.astype(np.float16)
    d = ((high - low) / 15.0).astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    inverse = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    q = np.clip(np.round((x - m32) * inverse), 0, 15).astype(np.uint8)
    return QuantizedRows(QUANT_Q4, _pack_nibbles(q), np.concatenate([d, m], axis=-1), source)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset : offset + 2].copy().view(np.float16)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Values 0..15 [..., 32] as 16 bytes, element j low and j + 16 high."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _from_q8_0(blocks: np.ndarray) -> QuantizedRows:
    return QuantizedRows(QUANT_Q8, blocks[..., 2:34].copy(), _f16(blocks, 0), "Q8_0")


def _from_q4_0(blocks: np.ndarray) -> QuantizedRows:
    return QuantizedRows(QUANT_Q4_SYM, blocks[..., 2:18].copy(), _f16(blocks, 0), "Q4_0")


def _from_q4_1(blocks: np.ndarray) -> QuantizedRows:
    return QuantizedRows(
        QUANT_Q4,
        blocks[..., 4:20].copy(),
        np.concatenate([_f16(blocks, 0), _f16(blocks, 2)], axis=-1),
        "Q4_1",
    )


def _from_q5_0(blocks: np.ndarray) -> QuantizedRows:
    low = np.concatenate([blocks[..., 6:22] & 0x0F, blocks[..., 6:22] >> 4], axis=-1)
    high = (blocks[..., 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    q = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 16
    return QuantizedRows(QUANT_Q8, q.astype(np.int8).view(np.uint8), _f16(blocks, 0), "Q5_0")


def _from_q4_k(blocks: np.ndarray) -> QuantizedRows:
    rows, supers = blocks.shape[:2]
    flat = blocks.reshape(-1, blocks.shape[-1])
    scales, mins = gguf_dequantize.scale_min_k4(flat[:, 4:16])
    d, dmin = _f16(flat, 0).astype(np.float32), _f16(flat, 2).astype(np.float32)
    # (supers, 8 sub-blocks, 32): sub-block s's nibbles in value order.
    q = gguf_dequantize.k4_nibbles(flat[:, 16:144])
    values = _pack_nibbles(q).reshape(rows, supers * 8, 16)
    block_d = (d * scales).astype(np.float16).reshape(rows, supers * 8, 1)
    block_m = (-dmin * mins).astype(np.float16).reshape(rows, supers * 8, 1)
    return QuantizedRows(QUANT_Q4, values, np.concatenate([block_d, block_m], axis=-1), "Q4_K")


_CONVERTERS = {
    "Q8_0": (34, _from_q8_0),
    "Q4_0": (18, _from_q4_0),
    "Q4_1": (20, _from_q4_1),
    "Q5_0": (22, _from_q5_0),
    "Q4_K": (144, _from_q4_k),
}


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedRows:
    """A GGUF tensor of `type_name` (one of QUANTIZED_TYPES) whose bytes are `raw`, as [rows, K] blocks."""
    rows, k = shape
    assert type_name in QUANTIZED_TYPES and k % QUANTIZATION_BLOCK == 0, (type_name, shape)
    if type_name in _CONVERTERS:
        nbytes, convert = _CONVERTERS[type_name]
        blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1, nbytes)
        return convert(blocks)
    return quantize_q8(gguf_dequantize.dequantize(raw, type_name, shape), type_name)


# Per parameter (its name in model.named_parameters()), this rank's quantized parts: (first row, rows).
QuantizedParts = dict[str, list[tuple[int, QuantizedRows]]]


def covering_parts(parts: list[tuple[int, QuantizedRows]], dense: torch.Tensor) -> list[QuantizedRows]:
    """The parts top to bottom, with the rows between them (loaded as floats into `dense`, as a fused
    weight's part in a float type is) quantized to Q8, so that together they cover every row."""
    covered: list[QuantizedRows] = []
    row = 0
    for start, rows in sorted(parts, key=lambda part: part[0]):
        assert start >= row, "quantized parts overlap"
        if start > row:
            covered.append(quantize_q8(dense[row:start], "float"))
        covered.append(rows)
        row = start + rows.shape[0]
    if row < dense.shape[0]:
        covered.append(quantize_q8(dense[row:], "float"))
    return covered


def parts_under(quantized: QuantizedParts, prefix: str) -> QuantizedParts:
    """The parts of the parameters under a module's prefix (ending in "."), named within that module."""
    return {name.removeprefix(prefix): parts for name, parts in quantized.items() if name.startswith(prefix)}
