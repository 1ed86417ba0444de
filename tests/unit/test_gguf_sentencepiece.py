"""A GGUF's SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma, Phi-3), written
as llama.cpp's converter writes it from a tokenizer.model, rebuilds a tokenizer that splits and joins text
as SentencePiece itself does."""

from __future__ import annotations

from pathlib import Path

import pytest

from sentencepiece_vocab import TEXTS, gguf_metadata, train
from sluice.errors import UnsupportedArchitectureError
from sluice.gguf_tokenizer import tokenizer_from_gguf


@pytest.mark.parametrize("add_space_prefix", [True, False], ids=["llama-style", "gemma-style"])
def test_the_rebuilt_tokenizer_splits_and_joins_as_sentencepiece(
    add_space_prefix: bool, tmp_path: Path
) -> None:
    sp = train(tmp_path, add_space_prefix)
    rebuilt = tokenizer_from_gguf(gguf_metadata(sp, add_space_prefix))
    tokenizer = rebuilt.tokenizer
    for text in TEXTS:
        ids = sp.encode(text)
        assert tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert tokenizer.decode(ids) == sp.decode(ids), text
    # A SentencePiece vocabulary adds BOS unless the file says otherwise (llama.cpp's default).
    assert tokenizer.encode("Hello world").ids == [sp.bos_id(), *sp.encode("Hello world")]
    assert rebuilt.config["add_bos_token"] is True
    assert (rebuilt.config["bos_token"], rebuilt.config["unk_token"]) == ("<s>", "<unk>")
    # Control tokens in the text are themselves, not pieces of it.
    assert tokenizer.encode("</s>", add_special_tokens=False).ids == [sp.eos_id()]


def test_a_sentencepiece_vocabulary_without_scores_is_refused(tmp_path: Path) -> None:
    metadata = gguf_metadata(train(tmp_path, True), True)
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(UnsupportedArchitectureError, match="tokenizer.ggml.scores"):
        tokenizer_from_gguf(metadata)


def test_an_unknown_tokenizer_model_names_both_that_exist() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="'bert'.*'gpt2'.*'llama'"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
