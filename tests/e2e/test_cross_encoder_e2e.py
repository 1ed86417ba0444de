"""A cross-encoder (reranker) end to end: tiny random-init BertForSequenceClassification and
XLMRobertaForSequenceClassification models, whose tokenizers type a pair as their families do (BERT's
second text type 1, XLM-RoBERTa's all type 0), served by `sluice serve` as they come; `/score` and
`/rerank` (raw HTTP: the `openai` client has neither) against sentence-transformers' CrossEncoder on
the same folder, float32 on both sides; and `/v1/embeddings` refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serve_fixtures import Server, running_server
from tiny_models import CROSS_ENCODER_DOCUMENTS, CROSS_ENCODER_QUERY, write_tiny_cross_encoder

QUERY = CROSS_ENCODER_QUERY
DOCUMENTS = CROSS_ENCODER_DOCUMENTS
# Two float32 computations of one score, in different kernels.
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_cross_encoder(request.param, tmp_path_factory.mktemp("cross-encoder") / request.param)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [str(folder), "--dtype", "float32", "--max-model-len", "128"]
    with running_server(args, log) as running:
        yield running


def model(folder: Path) -> str:
    return folder.name


def predict(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    # One pair at a time: the tiny tokenizer's pad token is not the model's padding index.
    scores = CrossEncoder(str(folder), device="cpu").predict(pairs, batch_size=1)
    return np.asarray(scores, dtype=np.float64)


def pair_tokens(folder: Path, pairs: list[tuple[str, str]]) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return sum(len(tokenizer(first, second)["input_ids"]) for first, second in pairs)


def answer(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = server.request("POST", path, body)
    assert response.status == 200, response
    return response.body


def test_score_is_crossencoders_predict_one_to_many_and_pairwise(server: Server, folder: Path) -> None:
    pairs = [(QUERY, document) for document in DOCUMENTS]
    body = answer(server, "/score", {"model": model(folder), "text_1": QUERY, "text_2": DOCUMENTS})
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [item["index"] for item in body["data"]] == list(range(len(DOCUMENTS)))
    got = np.array([item["score"] for item in body["data"]])
    want = predict(folder, pairs)
    np.testing.assert_allclose(got, want, atol=TOLERANCE)
    # Random weights still spread the scores: a test of order, not only of one value.
    assert np.ptp(want) > 1e-3
    tokens = pair_tokens(folder, pairs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    firsts = [QUERY, DOCUMENTS[0]]
    pairwise = answer(server, "/score", {"model": model(folder), "text_1": firsts, "text_2": DOCUMENTS[2:]})
    got = np.array([item["score"] for item in pairwise["data"]])
    want = predict(folder, list(zip(firsts, DOCUMENTS[2:], strict=True)))
    np.testing.assert_allclose(got, want, atol=TOLERANCE)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_that_score(server: Server, folder: Path, path: str) -> None:
    want = predict(folder, [(QUERY, document) for document in DOCUMENTS])
    body = answer(server, path, {"model": model(folder), "query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    results = body["results"]
    assert len(results) == 3
    indices = [result["index"] for result in results]
    got = np.array([result["relevance_score"] for result in results])
    np.testing.assert_allclose(got, want[indices], atol=TOLERANCE)
    # The most relevant first, and none left out that scores higher (but within the tolerance).
    assert (np.diff(got) <= 0).all(), got
    left_out = np.delete(want, indices)
    assert want[indices].min() >= left_out.max() - TOLERANCE
    assert [result["document"]["text"] for result in results] == [DOCUMENTS[index] for index in indices]


def test_embeddings_and_what_cannot_apply_to_a_pair_are_a_400(server: Server, folder: Path) -> None:
    response = server.request("POST", "/v1/embeddings", {"model": model(folder), "input": QUERY})
    assert response.status == 400, response
    error = response.body["error"]
    assert error["param"] == "model" and "cross-encoder" in error["message"], error
    assert "/score" in error["message"] and "/rerank" in error["message"], error
    for field, value in [("truncate_prompt_tokens", 8), ("dimensions", 1), ("use_activation", False)]:
        response = server.request(
            "POST", "/score", {"model": model(folder), "text_1": QUERY, "text_2": DOCUMENTS, field: value}
        )
        assert response.status == 400 and response.body["error"]["param"] == field, response
