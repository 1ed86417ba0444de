"""A Hugging Face `tokenizers` tokenizer (tokenizer.json, for the Rust frontend) from a GGUF's metadata.

GGUF keeps the tokenizer as arrays: the vocabulary (`tokenizer.ggml.tokens`), each token's type, and
either the BPE merges and llama.cpp's name for the pre-tokenizer (`tokenizer.ggml.pre`), or each token's
score. Sluice rebuilds two kinds (`tokenizer.ggml.model`):
- "gpt2", byte-level BPE, with the pre-tokenizers named in PRE_TOKENIZERS;
- "llama", SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma, Phi-3): the merges are the
  pairs of tokens that make up another token, ranked by that token's score, as SentencePiece merges;
  spaces are "▁", with one put before the text unless `tokenizer.ggml.add_space_prefix` is false.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from sluice.errors import UnsupportedArchitectureError

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
# SentencePiece's word boundary, which stands for a space.
_SPACE = "\u2581"


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
    if kind not in ("gpt2", "llama"):
        raise UnsupportedArchitectureError(
            f"GGUF tokenizer model {kind!r} is not supported; Sluice rebuilds byte-level BPE ('gpt2') and "
            "SentencePiece BPE ('llama')"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    tokenizer = (
        _byte_level_bpe(metadata, tokens) if kind == "gpt2" else _sentencepiece_bpe(metadata, tokens, types)
    )
    # SentencePiece's unknown token is as special as its control tokens.
    special = (_CONTROL, _UNKNOWN) if kind == "llama" else (_CONTROL,)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in special]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    def token_text(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    bos, eos = token_text("bos"), token_text("eos")
    # llama.cpp's defaults: a SentencePiece vocabulary adds BOS, a byte-level one does not.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = [*([bos] if add_bos else []), "$A", *([eos] if add_eos else [])]
    specials = [
        (
            tokens[int(metadata[f"tokenizer.ggml.{key}_token_id"])],
            int(metadata[f"tokenizer.ggml.{key}_token_id"]),
        )
        for key, added in (("bos", add_bos), ("eos", add_eos))
        if added
    ]
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


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str]) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedArchitectureError(
            f"GGUF pre-tokenizer {pre!r} is not supported; Sluice knows {', '.join(PRE_TOKENIZERS)}"
        )
    merges = [tuple(pair.split(" ", 1)) for pair in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise UnsupportedArchitectureError(
            "the GGUF's SentencePiece vocabulary needs tokenizer.ggml.scores, one per token, to rank its merges"
        )
    vocab = {token: index for index, token in enumerate(tokens)}
    # Every split of a normal token into two tokens is a merge; SentencePiece merges the pair whose
    # union scores highest first, which is a BPE merge list ranked by that score.
    ranked = []
    for index, (token, kind) in enumerate(zip(tokens, types)):
        if kind != _NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[index]), vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unknown is None else tokens[int(unknown)],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend(_SPACE)] if add_prefix else []), normalizers.Replace(" ", _SPACE)]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            # The space put before the text is not the text's.
            *([decoders.Strip(" ", 1, 0)] if add_prefix else []),
        ]
    )
    return tokenizer
