"""A model's RoPE settings as its config.json gives them, and the longest context they serve.

The frequencies themselves are the worker's (worker/models/rotary.py); the engine core reads these
settings too, for the context length it may serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.errors import UnsupportedArchitectureError

# Every rope_type of transformers' that changes the frequencies of a text model, each written in
# worker/models/rotary.py from its definition and checked against transformers' own rotary
# (tests/engine/test_rope_scaling.py).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class RopeParameters:
    theta: float
    rope_type: str
    scaling: dict[str, Any]
    # The config's max_position_embeddings, and the context the model was pretrained at (the same,
    # unless the config names an original_max_position_embeddings).
    max_position_embeddings: int
    original_max_position_embeddings: int
    # The share of each head's dimensions that turn (Phi-4-mini's 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's dimensions turn, as transformers rounds it."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def factor(self) -> float:
        """The scaling's factor: the config's, else the extended context over the original one."""
        return (
            self.scaling.get("factor") or self.max_position_embeddings / self.original_max_position_embeddings
        )

    def max_context(self) -> int:
        """The longest context the scaling serves, as vLLM derives it: linear and dynamic stretch
        max_position_embeddings by their factor, YaRN the original context; llama3's and LongRoPE's
        max_position_embeddings is already the extended one."""
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(self.max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return self.max_position_embeddings


def rope_parameters_of(hf_config: dict[str, Any]) -> RopeParameters:
    """Read rope settings from either layout: transformers 5's `rope_parameters` or the older
    top-level `rope_theta` plus `rope_scaling`. A setting that changes the maths and is not
    implemented is refused, by name."""
    params = dict(hf_config.get("rope_parameters") or {})
    params.update(hf_config.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    # Phi-3's first long-context configs name LongRoPE "su".
    rope_type = "longrope" if rope_type == "su" else rope_type
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope_type {rope_type!r} is not supported; Sluice implements {', '.join(ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial <= 1.0:
        raise UnsupportedArchitectureError(f"partial_rotary_factor {partial} must be in (0, 1]")
    max_positions = int(hf_config.get("max_position_embeddings", 2048))
    original = params.get(
        "original_max_position_embeddings", hf_config.get("original_max_position_embeddings")
    )
    return RopeParameters(
        theta=float(theta),
        rope_type=rope_type,
        scaling=params,
        max_position_embeddings=max_positions,
        original_max_position_embeddings=int(original or max_positions),
        partial_rotary_factor=partial,
    )


# transformers' defaults for Gemma 3's two rotary bases: its global layers' and its sliding ones'.
GLOBAL_ROPE_THETA, LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0


def rope_parameters_of_layers(hf_config: dict[str, Any], layer_type: str) -> RopeParameters:
    """The rotary settings of Gemma 3's `layer_type` layers ("full_attention" or "sliding_attention"), from
    transformers 5's per-type rope_parameters or the Hub's rope_theta, rope_scaling (global layers only)
    and rope_local_base_freq."""
    nested = hf_config.get("rope_parameters") or {}
    if layer_type in nested:
        params = dict(nested[layer_type])
    elif layer_type == "full_attention":
        params = {
            "rope_theta": hf_config.get("rope_theta", GLOBAL_ROPE_THETA),
            **(hf_config.get("rope_scaling") or {}),
        }
    else:
        params = {"rope_theta": hf_config.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
    return rope_parameters_of({**hf_config, "rope_parameters": params, "rope_scaling": None})
