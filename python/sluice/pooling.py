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
# A cross-encoder's score from its head's logit: sentence-transformers' CrossEncoder applies a sigmoid to a
# one-label head unless its config.json names another activation_fn (Identity: the raw logit).
ScoreActivation = Literal["sigmoid", "identity"]
_ST_ACTIVATIONS: dict[str, ScoreActivation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity",
}


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """How the served model turns a prompt's hidden states into its embedding."""

    method: PoolingMethod
    normalize: bool
    # None: `dimensions` is refused; (): any size up to the hidden size; else exactly one of these.
    matryoshka_dimensions: tuple[int, ...] | None
    # Set for a cross-encoder: its first token's state goes through the classification head, and the
    # "embedding" is the one score, this activation of the logit.
    score_activation: ScoreActivation | None = None

    @property
    def cross_encoder(self) -> bool:
        return self.score_activation is not None


@dataclass(slots=True)
class PoolingParams:
    """One pooling request's options (vLLM's PoolingParams); their presence makes a request a pooling one."""

    # Keep the first N values of the embedding (before normalising): Matryoshka models only.
    dimensions: int | None = None
    # None: the model's own choice; True or False forces L2 normalisation.
    normalize: bool | None = None


POOLING_PARAMS_RECORD = Record(PoolingParams, (("dimensions", optional(INT)), ("normalize", optional(BOOL))))


def runner_mismatch(runner: Runner, cross_encoder: bool = False) -> str:
    """Why a request of the other kind is refused by a server of this runner."""
    if cross_encoder:
        return (
            "the model is a cross-encoder: it scores pairs of texts on /score and /rerank (LLM.score); it "
            "neither generates nor embeds"
        )
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


def write_pooling_modules(folder: Path, hidden: int, method: PoolingMethod, normalize: bool) -> None:
    """The sentence-transformers modules.json (and its Pooling and Normalize modules) that say how the
    model in `folder` pools: what sentence_transformers_pooling reads back."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST_POOLING},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST_NORMALIZE})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden, **{key: mode == method for key, mode in _ST_MODES.items()}}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


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


def cross_encoder_pooling(hf_config: dict[str, Any]) -> PoolingSpec:
    """A one-label cross-encoder's: the first token through the head, never normalised or truncated."""
    named = (hf_config.get("sentence_transformers") or {}).get("activation_fn")
    if named is not None and named not in _ST_ACTIVATIONS:
        raise ModelNotFoundError(
            f"the cross-encoder's activation_fn {named!r} is not served; Sluice scores with "
            f"{', '.join(_ST_ACTIVATIONS)}"
        )
    return PoolingSpec("cls", False, None, _ST_ACTIVATIONS[named] if named else "sigmoid")


def second_text_start_of(token_types: list[int]) -> int | None:
    """A pair's boundary from the token types its tokenizer's pair template gave: the first type 1, None
    where every token is type 0 (XLM-RoBERTa's template). Types in another pattern have no boundary to
    send, and are refused rather than flattened."""
    start = next((i for i, t in enumerate(token_types) if t != 0), None)
    if start is not None and any(t != 1 for t in token_types[start:]):
        raise InvalidRequestError(
            f"the tokenizer's pair template types tokens as {token_types}; Sluice passes a first text of "
            "type 0 followed by a second of type 1"
        )
    return start


def check_second_text_start(start: int | None, num_tokens: int, spec: PoolingSpec | None) -> None:
    """A pair's boundary: only a cross-encoder's request has one, strictly inside its prompt."""
    if start is None:
        return
    if spec is None or not spec.cross_encoder:
        raise InvalidRequestError(
            "second_text_start marks a pair of texts, which only a cross-encoder takes",
            param="second_text_start",
        )
    if not 0 < start < num_tokens:
        raise InvalidRequestError(
            f"second_text_start must lie inside the prompt of {num_tokens} tokens, got {start}",
            param="second_text_start",
        )


def check_pooling_params(params: PoolingParams, spec: PoolingSpec, embedding_size: int) -> None:
    """Raise InvalidRequestError (param "dimensions") when the model cannot give the size asked for, or
    (a cross-encoder's score) the request asks to truncate or normalise it."""
    if spec.cross_encoder and params.normalize is not None:
        raise InvalidRequestError(
            "a cross-encoder's score is one value: `normalize` does not apply", param="normalize"
        )
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
