"""Pooling (embedding) models: how a model pools its hidden states, and what one request asks of it.

A server runs one runner: "generate" (tokens) or "pooling" (one embedding per prompt). A folder with
a sentence-transformers `modules.json` says how it pools (its Pooling module's config.json) and whether it
normalises (a `Normalize` module); a generative model served with `--runner pooling` pools its last
token and normalises, as vLLM's converted models do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sluice.errors import InvalidRequestError, ModelNotFoundError
from sluice.wire import BOOL, INT, Record, optional

Runner = Literal["generate", "pooling"]
RUNNERS: tuple[Runner, ...] = ("generate", "pooling")
# "last": the last prompt token's final hidden state (decoders), "mean": the average over the prompt,
# "cls": the first token's.
PoolingMethod = Literal["last", "mean", "cls"]
# sentence-transformers' pooling_mode_* keys, and the method each names.
_ST_MODES: dict[str, PoolingMethod] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """How the served model turns a prompt's hidden states into its embedding."""

    method: PoolingMethod
    normalize: bool
    # None: `dimensions` is refused; (): any size up to the hidden size; else exactly one of these.
    matryoshka_dimensions: tuple[int, ...] | None


@dataclass(slots=True)
class PoolingParams:
    """One pooling request's options (vLLM's PoolingParams); their presence makes a request a pooling one."""

    # Keep the first N values of the embedding (before normalising): Matryoshka models only.
    dimensions: int | None = None
    # None: the model's own choice; True or False forces L2 normalisation.
    normalize: bool | None = None


POOLING_PARAMS_RECORD = Record(PoolingParams, (("dimensions", optional(INT)), ("normalize", optional(BOOL))))


def runner_mismatch(runner: Runner) -> str:
    """Why a request of the other kind is refused by a server of this runner."""
    if runner == "pooling":
        return (
            "the model is served as an embedding model (--runner pooling): it answers /v1/embeddings "
            "(LLM.embed), not generation"
        )
    return (
        "the model is served as a generative model (--runner generate): it answers completions, chat, "
        "messages and responses; embeddings need a pooling model (--runner pooling, or an embedding model folder)"
    )


def sentence_transformers_pooling(folder: Path) -> tuple[PoolingMethod, bool] | None:
    """The pooling method and normalisation that a sentence-transformers folder declares; None without modules.json."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        raise ModelNotFoundError(f"{str(modules_file)!r} has no {_ST_POOLING} module")
    pooling_config = json.loads((folder / pooling.get("path", "1_Pooling") / "config.json").read_text())
    enabled = sorted(k for k, v in pooling_config.items() if k.startswith("pooling_mode_") and v)
    if len(enabled) != 1 or enabled[0] not in _ST_MODES:
        raise ModelNotFoundError(
            f"{str(folder)!r} pools with {enabled}; Sluice pools with exactly one of {', '.join(_ST_MODES)}"
        )
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    return _ST_MODES[enabled[0]], normalize


def pooling_spec_of(folder: Path, hf_config: dict[str, Any], default_method: PoolingMethod) -> PoolingSpec:
    """The folder's own pooling, else default_method with normalisation (as vLLM: last for a decoder
    served for embeddings, the first token for an encoder)."""
    method, normalize = sentence_transformers_pooling(folder) or (default_method, True)
    matryoshka: tuple[int, ...] | None = None
    if hf_config.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in hf_config["matryoshka_dimensions"])
    elif hf_config.get("is_matryoshka"):
        matryoshka = ()
    return PoolingSpec(method, normalize, matryoshka)


def check_pooling_params(params: PoolingParams, spec: PoolingSpec, embedding_size: int) -> None:
    """Raise InvalidRequestError (param "dimensions") when the model cannot give the size asked for."""
    if params.dimensions is None:
        return
    allowed = spec.matryoshka_dimensions
    if allowed is None:
        raise InvalidRequestError(
            "the model does not support `dimensions`: it is not a Matryoshka model "
            '(its config.json has neither "is_matryoshka" nor "matryoshka_dimensions")',
            param="dimensions",
        )
    if not 1 <= params.dimensions <= embedding_size or (allowed and params.dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {embedding_size}"
        raise InvalidRequestError(
            f"dimensions must be one of the model's sizes ({sizes}), got {params.dimensions}",
            param="dimensions",
        )


def finish_embedding(pooled: np.ndarray, params: PoolingParams, spec: PoolingSpec) -> bytes:
    """The embedding a client gets, as little-endian float32 bytes: truncated to `dimensions`, then
    L2-normalised if the request or else the model says so (truncation first, so that a Matryoshka
    prefix is a unit vector too)."""
    vector = pooled[: params.dimensions].astype(np.float32)
    if spec.normalize if params.normalize is None else params.normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        # A zero vector stays zero rather than turning into NaNs.
        if norm > 0.0:
            vector = (vector / norm).astype(np.float32)
    return vector.astype("<f4").tobytes()
