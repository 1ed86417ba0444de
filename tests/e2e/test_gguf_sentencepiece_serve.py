"""`sluice serve` of a GGUF file whose vocabulary is SentencePiece's (a tiny Phi-3, as Phi-3's files are): the
Rust frontend tokenizes and detokenizes with the tokenizer rebuilt from the metadata as SentencePiece itself
does, and answers the official openai client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import sentencepiece as spm

from gguf_families import write_family_gguf
from sentencepiece_vocab import TEXTS, gguf_metadata, train
from serve_fixtures import Server, running_server
from tiny_models import write_tiny_model

MODEL = "tiny-phi3-sentencepiece"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[spm.SentencePieceProcessor, Server]]:
    root = tmp_path_factory.mktemp("sentencepiece-gguf")
    # The tiny models have 320 rows of embeddings: 3 specials, 256 bytes and 61 merged pieces.
    sp = train(root, add_dummy_prefix=True, vocab_size=320)
    folder = write_tiny_model("phi3", root / "folder")
    path = root / f"{MODEL}.gguf"
    write_family_gguf(folder, "phi3", path, sentencepiece=gguf_metadata(sp, add_space_prefix=True))
    args = [str(path), "--max-model-len", "256", "--kv-cache-memory", "0.05"]
    with running_server(args, root / "serve.log") as server:
        yield sp, server


def test_the_frontend_tokenizes_and_detokenizes_as_sentencepiece(served) -> None:
    sp, server = served
    for text in TEXTS:
        ids = sp.encode(text)
        tokens = server.request("POST", "/tokenize", {"model": MODEL, "prompt": text}).body["tokens"]
        # A SentencePiece vocabulary adds BOS (llama.cpp's default, which the file does not override).
        assert tokens == [sp.bos_id(), *ids], text
        if ids:
            detokenized = server.request("POST", "/detokenize", {"model": MODEL, "tokens": ids}).body[
                "prompt"
            ]
            assert detokenized == sp.decode(ids), text


def test_a_completion_counts_the_prompt_as_sentencepiece_does(served) -> None:
    sp, server = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
    assert reply.usage.prompt_tokens == 1 + len(sp.encode(prompt))
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"
