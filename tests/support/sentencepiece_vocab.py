"""A small SentencePiece model trained on the spot, and its vocabulary as llama.cpp's converter writes it
into a GGUF (tokenizer.ggml.model "llama"), for the tests of the tokenizers Sluice rebuilds from GGUF files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sentencepiece as spm

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.",
    "Hello world! Hello there, world of tokens and tokenizers.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Numbers 12345 and 67890 are written with digits; so is 2026.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
]
TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  two  spaces and a trailing one ",
    "def f(n):\n    return n\t# tab",
    "ünïcödé 日本語 🎉 (bytes, not in the vocabulary)",
    "12345 fibonacci",
    "",
]
# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE = 1, 2, 3, 5, 6


def train(folder: Path, add_dummy_prefix: bool, vocab_size: int = 400) -> spm.SentencePieceProcessor:
    """A small BPE SentencePiece model with byte fallback and no normalisation, as LLMs' are."""
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


def gguf_metadata(sp: spm.SentencePieceProcessor, add_space_prefix: bool) -> dict[str, Any]:
    """What convert_hf_to_gguf.py's _set_vocab_sentencepiece writes: every piece, its score and type."""
    types = []
    for index in range(sp.get_piece_size()):
        if sp.is_unknown(index):
            types.append(UNKNOWN)
        elif sp.is_control(index):
            types.append(CONTROL)
        elif sp.is_unused(index):
            types.append(UNUSED)
        elif sp.is_byte(index):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }
