"""Rotary position embedding: a cos/sin table built once, indexed by position each step."""

from __future__ import annotations

import math
from typing import Any

import torch

from sluice.errors import UnsupportedArchitectureError
from sluice.rope_parameters import RopeParameters


def _exponents(head_dim: int) -> torch.Tensor:
    """2i / head_dim for each pair of dimensions, in float32 as transformers computes it."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim


def rotary_frequencies(rope: RopeParameters, head_dim: int, served_len: int) -> tuple[torch.Tensor, float]:
    """[head_dim // 2] float32 inverse frequencies, and the factor that scales cos and sin (YaRN's and
    LongRoPE's attention factor; 1 for the others), for a model served up to `served_len` positions.
    head_dim is the dimensions that turn: a partial rotary's share of the head, as transformers sizes it.

    dynamic and longrope depend on the length of the sequence in transformers, which recomputes them
    as a sequence grows (its cached keys keep the old rotation). Here they are fixed once, for the
    served context, as vLLM does, so that every cached key stays valid: dynamic's base is stretched
    for `served_len`, and longrope takes its long factors when `served_len` is past the original
    context, its short ones otherwise.
    """
    scaling = rope.scaling
    inv_freq = 1.0 / (rope.theta ** _exponents(head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling, rope.original_max_position_embeddings), 1.0
    if rope.rope_type == "dynamic":
        return _dynamic_inverse_frequencies(rope, head_dim, served_len), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    if rope.rope_type == "longrope":
        return _longrope(rope, head_dim, served_len)
    return inv_freq, 1.0


def _llama3_inverse_frequencies(
    inv_freq: torch.Tensor, scaling: dict[str, Any], context: int
) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling["low_freq_factor"]
    high = scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    long_wave = wavelength > context / low
    short_wave = wavelength < context / high
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended linearly.
    slowed = torch.where(long_wave, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    return torch.where(~short_wave & ~long_wave, blended, slowed)


def _dynamic_inverse_frequencies(rope: RopeParameters, head_dim: int, served_len: int) -> torch.Tensor:
    """NTK-aware scaling: the base grows with the context past max_position_embeddings, so the
    lowest frequencies stretch over it while the highest barely move."""
    factor = rope.factor
    trained = rope.max_position_embeddings
    length = max(served_len, trained)
    base = rope.theta * ((factor * length / trained) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** _exponents(head_dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeParameters, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are
    interpolated by `factor`, those that turn more than beta_fast times kept, a linear ramp between;
    cos and sin are scaled by 0.1 ln(factor) + 1 (or the config's attention_factor or mscales)."""
    scaling = rope.scaling
    original = rope.original_max_position_embeddings
    factor = rope.factor
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dimension_turning(turns: float) -> float:
        # The dimension pair whose wavelength fits `turns` times into the original context.
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = rope.theta ** _exponents(head_dim)
    kept = 1 - ramp
    return (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept, float(attention_factor)


def _longrope(rope: RopeParameters, head_dim: int, served_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): a per-dimension divisor, the long set past the original context, the short
    set within it; cos and sin scaled by sqrt(1 + ln(factor) / ln(original context))."""
    scaling = rope.scaling
    original = rope.original_max_position_embeddings
    factor = rope.factor
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    divisors = scaling["long_factor"] if served_len > original else scaling["short_factor"]
    if len(divisors) != head_dim // 2:
        raise UnsupportedArchitectureError(
            f"rope {'long' if served_len > original else 'short'}_factor has {len(divisors)} values; "
            f"a head of {head_dim} needs {head_dim // 2}"
        )
    inv_freq = 1.0 / (torch.tensor(divisors, dtype=torch.float32) * rope.theta ** _exponents(head_dim))
    return inv_freq, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos and a sign-folded sin table, [max_positions, head_dim] in the model dtype.

    transformers rotates with rotate_half(x) = cat(-x2, x1); folding the minus sign into the
    sin table turns that into a plain half-rotation of x times sin, which is bitwise the same.
    """

    def __init__(
        self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, attention_factor: float = 1.0
    ) -> None:
        """attention_factor scales cos and sin, as transformers scales them (YaRN, LongRoPE)."""
        super().__init__()
        inv_freq = inv_freq.to(torch.get_default_device())
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        sin_half = freqs.sin() * attention_factor
        self.register_buffer("cos", (angles.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer(
            "sin_signed", torch.cat((-sin_half, sin_half), dim=-1).to(dtype), persistent=False
        )

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, [num_tokens, head_dim]."""
        return self.cos[positions], self.sin_signed[positions]
