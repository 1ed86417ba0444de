"""A GGUF file as a model: its config.json and tokenizer files, written once beside it in the cache.

Serving `model.gguf` reads the weights from the file itself (the workers dequantize them at load,
worker/gguf_weights.py). Everything else is text that the frontend, the engine core and the
offline API read from a folder: this module writes that folder (config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, chat_template.jinja, and for an embedding model the
sentence-transformers modules that say how it pools) from the GGUF's metadata, under $SLUICE_CACHE/gguf/,
keyed by the file's path, size and modification time and the folder's format.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sluice.cache_folder import publish_folder
from sluice.config import sluice_cache_dir
from sluice.errors import ModelNotFoundError, UnsupportedArchitectureError
from sluice.pooling import PoolingMethod, write_pooling_modules

GGUF_SUFFIX = ".gguf"
# GGUF's general.architecture -> the Hugging Face architecture and model_type Sluice runs with the same
# weights. llama.cpp writes Mixtral as "llama" with experts (MIXTRAL).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
}
MIXTRAL = ("MixtralForCausalLM", "mixtral")
# An embedding model's file (it has a pooling type): the base model (model_spec.BASE_ARCHITECTURES) it is.
BASE_ARCHITECTURES = {"llama": "LlamaModel", "qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}
# llama.cpp's {arch}.pooling_type: none (a generative model), mean, first token, last token, and a
# reranker's head (rank).
POOLING_TYPES: dict[int, PoolingMethod | None] = {0: None, 1: "mean", 2: "cls", 3: "last"}
RANK_POOLING = 4
# Written into the key of a file's folder: a folder written by an older Sluice is written again.
FOLDER_FORMAT = 2
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


# Rotary settings that llama.cpp's converter writes as tensors, not metadata: Llama 3's scaling (one
# divisor per frequency) and Phi-3's LongRoPE factors. They go into config.json, not the weights.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS_TENSOR, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)
# The layer count of each family's 27B, which llama.cpp reads as the size that scales queries by
# hidden / heads rather than by the head's width (Gemma's query_pre_attn_scalar, not in the metadata).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Every how many layers one is global, where the metadata gives no pattern (llama.cpp's defaults).
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}


def read_metadata(
    gguf_file: Path,
) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], dict[str, list[float]]]:
    """The GGUF's metadata (key -> value), its tensors' shapes (as torch orders them) by name, and the
    values of its rotary tensors (ROPE_TENSORS) by name."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    rope_tensors = {}
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            if tensor.tensor_type.name != "F32":
                raise UnsupportedArchitectureError(
                    f"the GGUF's {tensor.name} is {tensor.tensor_type.name}; llama.cpp writes it as F32"
                )
            rope_tensors[tensor.name] = [float(value) for value in tensor.data.reshape(-1)]
    shapes = {
        tensor.name: tuple(int(n) for n in reversed(tensor.shape.tolist())) for tensor in reader.tensors
    }
    return metadata, shapes, rope_tensors


def hf_config_from_metadata(
    metadata: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_tensors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """config.json for the architecture that `metadata` describes; `tensor_shapes` and `rope_tensors` are
    read_metadata's."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; Sluice loads {', '.join(ARCHITECTURES)} "
            "(and Mixtral, as llama with experts)"
        )

    def value(key: str, default: Any = None) -> Any:
        found = metadata.get(f"{arch}.{key}", default)
        if found is None:
            raise UnsupportedArchitectureError(f"the GGUF's metadata lacks {arch}.{key}")
        return found

    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    architecture, model_type = MIXTRAL if arch == "llama" and experts else ARCHITECTURES[arch]
    if pooling_method(metadata) is not None:
        if arch not in BASE_ARCHITECTURES or experts:
            raise UnsupportedArchitectureError(
                f"a GGUF embedding model of architecture {arch!r} is not supported; Sluice embeds with "
                f"{', '.join(BASE_ARCHITECTURES)} files"
            )
        architecture = BASE_ARCHITECTURES[arch]
    heads = int(value("attention.head_count"))
    hidden = int(value("embedding_length"))
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(value("feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value("attention.head_count_kv", heads)),
        "head_dim": int(value("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(value("context_length")),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        # The embedding's rows: llama.cpp's Gemma 3 converter cuts them to the tokenizer's real tokens.
        "vocab_size": int(
            tensor_shapes["token_embd.weight"][0]
            if "token_embd.weight" in tensor_shapes
            else value("vocab_size", len(metadata["tokenizer.ggml.tokens"]))
        ),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_output.bias" in tensor_shapes,
    }
    if experts:
        _add_experts(config, arch, experts, value)
    if arch in _GEMMA_WINDOW_PATTERN:
        _add_gemma(config, arch, value)
    config.update(_rope_scaling(arch, value, rope_tensors or {}, config))
    if arch == "phi3":
        rotary_dims = int(value("rope.dimension_count", config["head_dim"]))
        if rotary_dims != config["head_dim"]:
            config["partial_rotary_factor"] = rotary_dims / config["head_dim"]
        # Phi-4's files say 0: no window.
        config["sliding_window"] = int(value("attention.sliding_window", 0)) or None
    for key in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def _add_experts(config: dict[str, Any], arch: str, experts: int, value: Any) -> None:
    config["num_experts" if arch != "llama" else "num_local_experts"] = experts
    config["num_experts_per_tok"] = int(value("expert_used_count"))
    if arch == "llama":
        # Mixtral's experts are as wide as its feed_forward_length, and it renormalises its top-k always.
        return
    config["moe_intermediate_size"] = int(value("expert_feed_forward_length"))
    # llama.cpp's graphs: Qwen3-MoE renormalises the chosen experts' weights, Qwen2-MoE does not; every
    # layer is sparse in both.
    config["norm_topk_prob"] = arch == "qwen3moe"
    config["decoder_sparse_step"], config["mlp_only_layers"] = 1, []
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(value("expert_shared_feed_forward_length"))


def _add_gemma(config: dict[str, Any], arch: str, value: Any) -> None:
    del config["hidden_act"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    config["query_pre_attn_scalar"] = (
        config["hidden_size"] // heads if layers == _GEMMA_27B_LAYERS[arch] else config["head_dim"]
    )
    window = int(value("attention.sliding_window", 4096 if arch == "gemma2" else 0))
    if window:
        config["sliding_window"] = window
        pattern = value("attention.sliding_window_pattern", _GEMMA_WINDOW_PATTERN[arch])
        sliding = (
            [bool(flag) for flag in pattern]
            if isinstance(pattern, list)
            else [index % int(pattern) < int(pattern) - 1 for index in range(layers)]
        )
        config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    else:
        config["layer_types"] = ["full_attention"] * layers
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        config[key] = float(value(key, 0.0)) or None
    if arch == "gemma3":
        config["rope_local_base_freq"] = float(value("rope.freq_base_swa", 10000.0))


def _rope_scaling(
    arch: str, value: Any, rope_tensors: dict[str, list[float]], config: dict[str, Any]
) -> dict[str, Any]:
    """config.json's rope_scaling, from the metadata's scaling type or the rotary tensors; {} for none."""
    scaling = value("rope.scaling.type", "none")
    rotary_dims = int(value("rope.dimension_count", config["head_dim"]))
    found = sorted(name for name in ROPE_TENSORS if name in rope_tensors)
    if found and scaling != "none":
        raise UnsupportedArchitectureError(
            f"the GGUF has both {arch}.rope.scaling.type {scaling!r} and {', '.join(found)}; Sluice reads one"
        )
    for name in found:
        if len(rope_tensors[name]) != rotary_dims // 2:
            raise UnsupportedArchitectureError(
                f"the GGUF's {name} has {len(rope_tensors[name])} values; {rotary_dims} rotary dimensions "
                f"need {rotary_dims // 2}"
            )
    if scaling in ("linear", "yarn"):
        rope = {"rope_type": scaling, "factor": float(value("rope.scaling.factor"))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(value("rope.scaling.original_context_length"))
        return {"rope_scaling": rope}
    if scaling != "none":
        raise UnsupportedArchitectureError(
            f"GGUF rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported; Sluice reads linear and yarn"
        )
    if ROPE_FREQS_TENSOR in rope_tensors:
        if len(found) > 1:
            raise UnsupportedArchitectureError(f"the GGUF has {', '.join(found)}; Sluice reads one kind")
        # Each frequency divided by its own factor and cos/sin unscaled: LongRoPE's maths with one set of
        # factors for every length (and what llama.cpp computes from the tensor).
        divisors = rope_tensors[ROPE_FREQS_TENSOR]
        original = config["max_position_embeddings"]
        return {"rope_scaling": _longrope(divisors, divisors, original, 1.0)}
    if ROPE_FACTORS_LONG in rope_tensors or ROPE_FACTORS_SHORT in rope_tensors:
        if not (ROPE_FACTORS_LONG in rope_tensors and ROPE_FACTORS_SHORT in rope_tensors):
            raise UnsupportedArchitectureError(
                f"the GGUF has only one of {ROPE_FACTORS_LONG} and {ROPE_FACTORS_SHORT}; LongRoPE needs both"
            )
        original = int(value("rope.scaling.original_context_length"))
        # Phi-3's LongRoPE: short factors up to the original context, long ones past it.
        rope = _longrope(
            rope_tensors[ROPE_FACTORS_SHORT],
            rope_tensors[ROPE_FACTORS_LONG],
            original,
            float(value("rope.scaling.attn_factor", 1.0)),
        )
        return {"rope_scaling": rope, "original_max_position_embeddings": original}
    return {}


def _longrope(
    short: list[float], long: list[float], original: int, attention_factor: float
) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "attention_factor": attention_factor,
        "original_max_position_embeddings": original,
    }


def pooling_method(metadata: dict[str, Any]) -> PoolingMethod | None:
    """How an embedding model's file pools (its pooling type); None for a generative model's."""
    arch = metadata.get("general.architecture")
    pooling_type = int(metadata.get(f"{arch}.pooling_type", 0))
    if pooling_type == RANK_POOLING:
        raise UnsupportedArchitectureError(
            "the GGUF is a reranker (pooling type rank): Sluice serves cross-encoders from their Hugging Face folders"
        )
    if pooling_type not in POOLING_TYPES:
        raise UnsupportedArchitectureError(
            f"the GGUF's pooling type {pooling_type} is not one llama.cpp defines"
        )
    return POOLING_TYPES[pooling_type]


def gguf_model_folder(gguf_file: str | Path, cache_dir: Path | None = None) -> Path:
    """The folder of text files that describe `gguf_file`, written on first use."""
    source = Path(gguf_file).resolve()
    if not source.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf_file)!r} does not exist")
    stat = source.stat()
    key = hashlib.sha256(
        f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FOLDER_FORMAT}".encode()
    ).hexdigest()[:16]
    target = Path(cache_dir or sluice_cache_dir()) / "gguf" / f"{source.stem}-{key}"
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed at the end, so a crash never leaves a folder that looks complete.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_folder(source, staging)
        publish_folder(staging, target, _is_complete)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in FOLDER_FILES)


def _write_folder(source: Path, out: Path) -> None:
    from sluice.gguf_tokenizer import tokenizer_from_gguf

    metadata, tensor_shapes, rope_tensors = read_metadata(source)
    config = hf_config_from_metadata(metadata, tensor_shapes, rope_tensors)
    tokenizer = tokenizer_from_gguf(metadata)
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        **tokenizer.config,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = metadata.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = template
        (out / "chat_template.jinja").write_text(template)
    method = pooling_method(metadata)
    if method is not None:
        # llama.cpp normalises embeddings unless told not to (--embd-normalize), and a file cannot say.
        write_pooling_modules(out, config["hidden_size"], method, normalize=True)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for name, content in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
