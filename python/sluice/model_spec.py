"""What the engine core needs to know about a model folder (or GGUF file), read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.config import RunnerChoice
from sluice.errors import InvalidRequestError, ModelNotFoundError, UnsupportedArchitectureError
from sluice.gguf_model import gguf_model_folder, is_gguf_file
from sluice.pooling import PoolingSpec, Runner, cross_encoder_pooling, pooling_spec_of
from sluice.rope_parameters import rope_parameters_of

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    # Llama's layers with q, k and v in one qkv_proj and gate and up in one gate_up_proj (Phi-3 and 3.5).
    "Phi3ForCausalLM",
    # Mixture-of-experts feed-forwards (worker/models/moe.py) in Qwen2's, Qwen3's and Mistral's layers.
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    # Gemma 2, and Gemma 3's text model (worker/models/gemma.py); the multimodal Gemma 3 checkpoints are not.
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# Encoders of the BERT family: the pooling runner only, on worker/models/bert.py.
ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
# Cross-encoders (rerankers): an encoder with a one-label classification head, scoring a pair of texts.
CROSS_ENCODER_ARCHITECTURES = (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    "RobertaForSequenceClassification",
)
# Base models (no LM head), as embedding models ship them (Qwen3-Embedding's checkpoints are a
# Qwen3Model's): served with the pooling runner only, on the layers of the causal model named.
BASE_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    path: Path
    architecture: str
    hf_config: dict[str, Any]
    # The longest context it serves: max_position_embeddings, stretched by linear, dynamic or YaRN RoPE.
    max_context: int
    eos_token_ids: tuple[int, ...]
    # The GGUF file that holds the weights; `path` is then the folder of its config and tokenizer.
    gguf_file: Path | None = None
    # False for a base model (BASE_ARCHITECTURES): its checkpoint names lack the "model." prefix and
    # it has no lm_head, so it only serves embeddings.
    has_lm_head: bool = True
    # A bidirectional encoder (ENCODER_ARCHITECTURES): each prompt is computed whole in one step.
    is_encoder: bool = False
    # An encoder with a classification head (CROSS_ENCODER_ARCHITECTURES): it scores pairs of texts.
    is_cross_encoder: bool = False

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return int(
            self.hf_config.get("head_dim") or self.hf_config["hidden_size"] // self.num_attention_heads
        )


def read_model_spec(path: str | Path) -> ModelSpec:
    """Check that `path` is a loadable model folder or GGUF file and summarise it."""
    gguf_file = Path(path).resolve() if is_gguf_file(path) else None
    folder = Path(path) if gguf_file is None else gguf_model_folder(gguf_file)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {str(folder)!r} does not exist")
    if not config_file.is_file():
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no config.json")
    if gguf_file is None and not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights")
    hf_config = json.loads(config_file.read_text())
    architectures = hf_config.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    base = [BASE_ARCHITECTURES[a] for a in architectures if a in BASE_ARCHITECTURES]
    encoders = [a for a in architectures if a in (*ENCODER_ARCHITECTURES, *CROSS_ENCODER_ARCHITECTURES)]
    if gguf_file is None and encoders and not supported and not base:
        cross_encoder = encoders[0] in CROSS_ENCODER_ARCHITECTURES
        if cross_encoder and _num_labels(hf_config) != 1:
            raise UnsupportedArchitectureError(
                f"{encoders[0]} in {str(folder)!r} has {_num_labels(hf_config)} labels; Sluice serves "
                "cross-encoders of one label (a relevance score)"
            )
        return ModelSpec(
            path=folder,
            architecture=encoders[0],
            hf_config=hf_config,
            max_context=_encoder_context(hf_config),
            eos_token_ids=(),
            has_lm_head=False,
            is_encoder=True,
            is_cross_encoder=cross_encoder,
        )
    if not supported and not base:
        raise UnsupportedArchitectureError(
            f"architecture {architectures or '(none)'} in {str(folder)!r} is not supported; "
            f"Sluice runs {', '.join(SUPPORTED_ARCHITECTURES)}, for embeddings "
            f"{', '.join([*BASE_ARCHITECTURES, *ENCODER_ARCHITECTURES])}, and for scores "
            f"{', '.join(CROSS_ENCODER_ARCHITECTURES)}"
        )
    eos = hf_config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    architecture = (supported or base)[0]
    if not supported:
        # The layers are the causal model's: whoever reads the config builds those.
        hf_config = {**hf_config, "architectures": [architecture]}
    return ModelSpec(
        path=folder,
        architecture=architecture,
        hf_config=hf_config,
        max_context=_max_context(hf_config, architecture),
        eos_token_ids=eos_ids,
        gguf_file=gguf_file,
        has_lm_head=bool(supported),
    )


def _num_labels(hf_config: dict[str, Any]) -> int:
    """A classification head's outputs: transformers writes id2label, older configs num_labels."""
    return len(hf_config["id2label"]) if hf_config.get("id2label") else int(hf_config.get("num_labels", 2))


def _encoder_context(hf_config: dict[str, Any]) -> int:
    """An encoder's absolute positions: RoBERTa's start after its padding index."""
    offset = (
        int(hf_config.get("pad_token_id", 1)) + 1
        if hf_config.get("model_type") in ("xlm-roberta", "roberta")
        else 0
    )
    return int(hf_config["max_position_embeddings"]) - offset


def _max_context(hf_config: dict[str, Any], architecture: str) -> int:
    """The longest context served. Gemma 3's linear scaling turns its global layers, whose
    max_position_embeddings is already the extended context; other families stretch theirs."""
    if architecture == "Gemma3ForCausalLM":
        return int(hf_config["max_position_embeddings"])
    return rope_parameters_of(hf_config).max_context()


def resolve_max_model_len(spec: ModelSpec, requested: int | None) -> int:
    """The context length to serve: the model's own unless a smaller one is asked for."""
    if requested is None:
        return spec.max_context
    if not 0 < requested <= spec.max_context:
        raise InvalidRequestError(
            f"max_model_len {requested} must be in [1, {spec.max_context}], the model's max_position_embeddings "
            "(times its RoPE scaling factor for linear, dynamic and yarn)",
            param="max_model_len",
        )
    return requested


def resolve_runner(spec: ModelSpec, requested: RunnerChoice) -> Runner:
    """The runner to serve: the one asked for, or under "auto" pooling for an embedding model (a
    base model, or a folder with a sentence-transformers modules.json) and generate otherwise."""
    embedding_model = not spec.has_lm_head or (spec.path / "modules.json").is_file()
    if requested == "generate" and not spec.has_lm_head:
        raise InvalidRequestError(
            f"{str(spec.path)!r} is a base model with no LM head: it serves embeddings only (--runner pooling)",
            param="runner",
        )
    if requested == "auto":
        return "pooling" if embedding_model else "generate"
    return requested


def model_pooling(spec: ModelSpec) -> PoolingSpec:
    """How the model pools under the pooling runner: its sentence-transformers modules, else as vLLM
    does, the last token for a decoder and the first ([CLS]) for an encoder, normalised; a cross-encoder
    scores its first token through its head (cross_encoder_pooling)."""
    if spec.is_cross_encoder:
        return cross_encoder_pooling(spec.hf_config)
    return pooling_spec_of(spec.path, spec.hf_config, "cls" if spec.is_encoder else "last")
