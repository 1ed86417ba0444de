"""A Hugging Face `tokenizers` tokenizer (tokenizer.json, for the Rust frontend) from a GGUF's metadata.

GGUF keeps the tokenizer as arrays: the vocabulary (`tokenizer.ggml.tokens`), each token's type,
the BPE merges, and llama.cpp's name for the pre-tokenizer (`tokenizer.ggml.pre`). Byte-level BPE
(`tokenizer.ggml.model` "gpt2") is what Sluice rebuilds; the pre-tokenizer names it knows are in
PRE_TOKENIZERS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from sluice.errors import UnsupportedArchitectureError

# llama.cpp's token types (gguf.TokenType).
_CONTROL = 3
_USER_DEFINED = 4


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM splits digits one by one before GPT-2's byte-level split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _byte_level,
    "gpt2": _byte_level,
    "smollm": _smollm,
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    # tokenizer_config.json's entries: the special tokens' text and whether BOS/EOS are added.
    config: dict[str, Any]


def tokenizer_from_gguf(metadata: dict[str, Any]) -> GGUFTokenizer:
    """The tokenizer that `metadata` (GGUF key -> value) describes."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedArchitectureError(
            f"GGUF tokenizer model {kind!r} is not supported; Sluice rebuilds byte-level BPE ('gpt2')"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedArchitectureError(
            f"GGUF pre-tokenizer {pre!r} is not supported; Sluice knows {', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(pair.split(" ", 1)) for pair in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    def token_text(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    bos, eos = token_text("bos"), token_text("eos")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
    specials = [(t, vocab[t]) for t in (bos if add_bos else None, eos if add_eos else None) if t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(single),
        pair=" ".join(single + [s.replace("$A", "$B:1") for s in single]),
        special_tokens=specials,
    )
    config = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_text("unknown"),
        "pad_token": token_text("padding"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    return GGUFTokenizer(tokenizer, {k: v for k, v in config.items() if v is not None})
