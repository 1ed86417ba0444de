"""A GGUF file as a model: its config.json and tokenizer files, written once beside it in the cache.

Serving `model.gguf` reads the weights from the file itself (the workers dequantize them at load,
worker/gguf_weights.py). Everything else is text that the frontend, the engine core and the
offline API read from a folder: this module writes that folder (config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, chat_template.jinja) from the GGUF's metadata, under
$SLUICE_CACHE/gguf/, keyed by the file's path, size and modification time.
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

GGUF_SUFFIX = ".gguf"
# GGUF's general.architecture -> the Hugging Face architecture Sluice runs with the same weights.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX


# llama.cpp's converter writes Llama 3's rope scaling as this tensor: one divisor per frequency.
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def read_metadata(gguf_file: Path) -> tuple[dict[str, Any], set[str], list[float] | None]:
    """The GGUF's metadata (key -> value), the names of its tensors, and its rope_freqs tensor's values
    (None when it has none)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    rope_divisors = None
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            if tensor.tensor_type.name != "F32":
                raise UnsupportedArchitectureError(
                    f"the GGUF's {ROPE_FREQS_TENSOR} is {tensor.tensor_type.name}; llama.cpp writes it as F32"
                )
            rope_divisors = [float(value) for value in tensor.data.reshape(-1)]
    return metadata, {tensor.name for tensor in reader.tensors}, rope_divisors


def hf_config_from_metadata(
    metadata: dict[str, Any], tensor_names: set[str], rope_divisors: list[float] | None = None
) -> dict[str, Any]:
    """config.json for the architecture that `metadata` describes; `rope_divisors` are its rope_freqs
    tensor's values (read_metadata)."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; Sluice loads {', '.join(ARCHITECTURES)}"
        )

    if metadata.get(f"{arch}.expert_count"):
        # Mixtral's GGUF files say "llama" and hold their experts stacked; Sluice reads experts from folders.
        raise UnsupportedArchitectureError(
            f"this GGUF file holds a mixture of experts ({arch}.expert_count = {metadata[f'{arch}.expert_count']}); "
            "Sluice loads mixture-of-experts models from their Hugging Face folder, not yet from GGUF"
        )

    def value(key: str, default: Any = None) -> Any:
        found = metadata.get(f"{arch}.{key}", default)
        if found is None:
            raise UnsupportedArchitectureError(f"the GGUF's metadata lacks {arch}.{key}")
        return found

    heads = int(value("attention.head_count"))
    hidden = int(value("embedding_length"))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(value("feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(value("attention.head_count_kv", heads)),
        "head_dim": int(value("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(value("context_length")),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "vocab_size": int(value("vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(value("rope.scaling.factor"))}
        if scaling == "yarn":
            original = int(value("rope.scaling.original_context_length"))
            config["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling != "none":
        raise UnsupportedArchitectureError(
            f"GGUF rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported; Sluice reads linear and yarn"
        )
    if rope_divisors is not None:
        if "rope_scaling" in config:
            raise UnsupportedArchitectureError(
                f"the GGUF has both {arch}.rope.scaling.type {scaling!r} and {ROPE_FREQS_TENSOR}; Sluice reads one"
            )
        head_dim = config["head_dim"]
        if len(rope_divisors) != head_dim // 2:
            raise UnsupportedArchitectureError(
                f"the GGUF's {ROPE_FREQS_TENSOR} has {len(rope_divisors)} values; a head of {head_dim} needs "
                f"{head_dim // 2}"
            )
        # Each frequency divided by its own factor and cos/sin unscaled: LongRoPE's maths with one set of
        # factors for every length (and what llama.cpp computes from the tensor).
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": rope_divisors,
            "long_factor": rope_divisors,
            "attention_factor": 1.0,
            "original_max_position_embeddings": config["max_position_embeddings"],
        }
    for key in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token_id)
    return config


def gguf_model_folder(gguf_file: str | Path, cache_dir: Path | None = None) -> Path:
    """The folder of text files that describe `gguf_file`, written on first use."""
    source = Path(gguf_file).resolve()
    if not source.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf_file)!r} does not exist")
    stat = source.stat()
    key = hashlib.sha256(f"{source}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
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

    metadata, tensor_names, rope_divisors = read_metadata(source)
    config = hf_config_from_metadata(metadata, tensor_names, rope_divisors)
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
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    for name, content in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
