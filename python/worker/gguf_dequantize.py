"""Turn a GGUF tensor's raw bytes into float32 values, one vectorised pass per tensor.

GGML stores a quantized row as blocks; a block's bytes hold its scales and its quantized values.
Blocks of 32 values, with a float16 scale `d` (and a float16 minimum `m`):
- Q8_0: 32 signed bytes q, value = d * q;
- Q4_0 / Q4_1: 16 bytes of two 4-bit values each, value = d * (q - 8) / d * q + m;
- Q5_0 / Q5_1: the same nibbles and a 32-bit word of fifth bits, value = d * (q - 16) / d * q + m.
A byte's low nibble is element j of the block and its high nibble element j + 16; bit j of Q5's
word is element j's fifth bit.

K-quants: super-blocks of 256 values in sub-blocks of 16 or 32, each sub-block with a scale (and a
minimum) quantized against the super-block's float16 `d` (and `dmin`):
- Q4_K / Q5_K: eight sub-blocks of 32 with 6-bit scales and minimums packed into 12 bytes;
  value = d * scale * q - dmin * min, q 4 bits (Q5_K: a fifth bit from qh);
- Q6_K: sixteen sub-blocks of 16 with signed 8-bit scales; value = d * scale * (q - 32), q 6 bits
  (4 low bits in ql, 2 high in qh);
- Q2_K: sixteen sub-blocks of 16, a byte each of 4-bit scale and 4-bit minimum; q 2 bits;
- Q3_K: sixteen sub-blocks of 16 with 6-bit scales (offset by 32) packed into 12 bytes; q 2 bits
  and a high bit from hmask, value = d * (scale - 32) * (q - (4 if the high bit is clear else 0)).
The K-quants lay values out in runs of 32: a 64-value chunk of Q4_K/Q5_K is 32 low nibbles then 32
high nibbles of the same bytes; a 128-value half of Q2_K/Q3_K/Q6_K is four runs of 32 taking
successive 2-bit fields (Q6_K: low and high nibbles of ql) of the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# The float types whose bytes are the values themselves.
PLAIN_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QK_K = 256


class UnsupportedQuantizationError(ValueError):
    """A tensor type that Sluice cannot dequantize."""


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte `offset` of every block, as a float32 column."""
    return blocks[:, offset : offset + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Low nibbles of the bytes, then their high nibbles (the order of a 32-value block)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """Bits 0..count-1 of each little-endian word (one per block), as an array of 0 and 1."""
    return (words[:, None] >> np.arange(count, dtype=np.uint32)) & 1


def _bit_planes(qh: np.ndarray) -> np.ndarray:
    """(blocks, 8, bytes): plane r holds bit r of each byte of `qh`, as 0 or 1."""
    return (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1


# Right shifts that bring each 2-bit field of a byte to the bottom, broadcast over (blocks, half, run, byte).
_TWO_BIT_SHIFTS = np.arange(0, 8, 2, dtype=np.uint8)[None, None, :, None]


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).astype(np.float32) - 8.0)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).astype(np.float32) + _f16(blocks, 2)


def _five_bit(blocks: np.ndarray, qh_offset: int) -> np.ndarray:
    high = _bits(blocks[:, qh_offset : qh_offset + 4].copy().view("<u4")[:, 0], 32)
    return (_nibbles(blocks[:, qh_offset + 4 :]) | (high << 4).astype(np.uint8)).astype(np.float32)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * (_five_bit(blocks, 2) - 16.0)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    return _f16(blocks, 0) * _five_bit(blocks, 4) + _f16(blocks, 2)


def scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the eight 6-bit scales and minimums of each block's 12 scale bytes."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k4(blocks: np.ndarray, q: np.ndarray) -> np.ndarray:
    """value = d * scale * q - dmin * min over eight sub-blocks of 32; q is (blocks, 8, 32)."""
    scales, mins = scale_min_k4(blocks[:, 4:16])
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    values = (d * scales)[:, :, None] * q.astype(np.float32) - (dmin * mins)[:, :, None]
    return values.reshape(len(blocks), QK_K)


def k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: the 128 bytes' nibbles as eight sub-blocks of 32, (blocks, 8, 32): chunk c of 32
    bytes gives sub-block 2c (low nibbles) and 2c + 1 (high nibbles)."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    return _k4(blocks, k4_nibbles(blocks[:, 16:144]))


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    # Sub-block s takes its fifth bits from bit s of the 32 qh bytes.
    return _k4(blocks, k4_nibbles(blocks[:, 48:176]) | (_bit_planes(blocks[:, 16:48]) << 4))


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K: per half of 128, four runs of 32 taking bits 0-1, 2-3, 4-5, 6-7 of its 32 bytes."""
    return ((qs.reshape(-1, 2, 1, 32) >> _TWO_BIT_SHIFTS) & 3).reshape(-1, QK_K)


def _per_16(values: np.ndarray) -> np.ndarray:
    """Each of the sixteen per-sub-block values repeated over its 16 values."""
    return np.repeat(values, 16, axis=1)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    packed = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    scales = _per_16(d * (packed & 0x0F).astype(np.float32))
    mins = _per_16(dmin * (packed >> 4).astype(np.float32))
    return scales * _two_bit_runs(blocks[:, 16:80]).astype(np.float32) - mins


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K: the sixteen 6-bit scales of each block's 12 scale bytes, less their offset of 32."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate(
        [
            (low & 0x0F) | ((high & 3) << 4),
            (mid & 0x0F) | (((high >> 2) & 3) << 4),
            (low >> 4) | (((high >> 4) & 3) << 4),
            (mid >> 4) | (((high >> 6) & 3) << 4),
        ],
        axis=1,
    )
    return scales.astype(np.float32) - 32.0


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 108)
    low2 = _two_bit_runs(blocks[:, 32:96]).astype(np.float32)
    # Run r (0..7) of 32 values takes its high bits from bit r of the 32 hmask bytes.
    high = _bit_planes(blocks[:, 0:32]).reshape(-1, QK_K)
    offset = np.where(high == 1, 0.0, 4.0).astype(np.float32)
    return _per_16(d * _q3_k_scales(blocks[:, 96:108])) * (low2 - offset)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # half, first or second 32 bytes, byte
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # half, byte
    low4 = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # runs: lo0, lo1, hi0, hi1
    q = (low4 | (((qh >> _TWO_BIT_SHIFTS) & 3) << 4)).reshape(-1, QK_K).astype(np.float32) - 32.0
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    return _per_16(_f16(blocks, 208) * scales) * q


@dataclass(frozen=True, slots=True)
class _BlockFormat:
    values: int
    nbytes: int
    decode: Callable[[np.ndarray], np.ndarray]


_BLOCK_FORMATS = {
    "Q8_0": _BlockFormat(32, 34, _q8_0),
    "Q4_0": _BlockFormat(32, 18, _q4_0),
    "Q4_1": _BlockFormat(32, 20, _q4_1),
    "Q5_0": _BlockFormat(32, 22, _q5_0),
    "Q5_1": _BlockFormat(32, 24, _q5_1),
    "Q2_K": _BlockFormat(QK_K, 84, _q2_k),
    "Q3_K": _BlockFormat(QK_K, 110, _q3_k),
    "Q4_K": _BlockFormat(QK_K, 144, _q4_k),
    "Q5_K": _BlockFormat(QK_K, 176, _q5_k),
    "Q6_K": _BlockFormat(QK_K, 210, _q6_k),
}
SUPPORTED_TYPES = (*PLAIN_DTYPES, *_BLOCK_FORMATS)


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a tensor of GGML type `type_name` whose bytes are `raw`, as `shape`
    (row-major, the last dimension the GGUF's first)."""
    if type_name in PLAIN_DTYPES:
        values = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy())
        return values.view(PLAIN_DTYPES[type_name]).to(torch.float32).reshape(shape)
    block = _BLOCK_FORMATS.get(type_name)
    if block is None:
        raise UnsupportedQuantizationError(
            f"GGML type {type_name} is not supported; Sluice dequantizes {', '.join(SUPPORTED_TYPES)}"
        )
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, block.nbytes)
    assert blocks.shape[0] * block.values == int(np.prod(shape)), (blocks.shape, shape)
    return torch.from_numpy(block.decode(blocks)).reshape(shape)
