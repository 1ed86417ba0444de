"""Rotary position embedding: a cos/sin table built once, indexed by position each step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from sluice.errors import UnsupportedArchitectureError


@dataclass(frozen=True, slots=True)
class RopeParameters:
    theta: float
    rope_type: str
    scaling: dict[str, Any]


def rope_parameters_of(hf_config: dict[str, Any]) -> RopeParameters:
    """Read rope settings from either layout: transformers 5's `rope_parameters` or the older
    top-level `rope_theta` plus `rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or {})
    params.update(hf_config.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; Sluice implements default, linear and llama3"
        )
    return RopeParameters(theta=float(theta), rope_type=rope_type, scaling=params)


def inverse_frequencies(rope: RopeParameters, head_dim: int, max_position_embeddings: int) -> torch.Tensor:
    """[head_dim // 2] float32, computed with the same float operations as transformers."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.scaling["factor"]
    if rope.rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope.scaling, max_position_embeddings)
    return inv_freq


def _llama3_inverse_frequencies(
    inv_freq: torch.Tensor, scaling: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling["low_freq_factor"]
    high = scaling["high_freq_factor"]
    context = scaling.get("original_max_position_embeddings", max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    long_wave = wavelength > context / low
    short_wave = wavelength < context / high
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended linearly.
    slowed = torch.where(long_wave, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    return torch.where(~short_wave & ~long_wave, blended, slowed)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos and a sign-folded sin table, [max_positions, head_dim] in the model dtype.

    transformers rotates with rotate_half(x) = cat(-x2, x1); folding the minus sign into the
    sin table turns that into a plain half-rotation of x times sin, which is bitwise the same.
    """

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = inv_freq.to(torch.get_default_device())
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        sin_half = freqs.sin()
        self.register_buffer("cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer(
            "sin_signed", torch.cat((-sin_half, sin_half), dim=-1).to(dtype), persistent=False
        )

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, [num_tokens, head_dim]."""
        return self.cos[positions], self.sin_signed[positions]
