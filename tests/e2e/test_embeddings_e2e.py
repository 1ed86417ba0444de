"""/v1/embeddings end to end: `sluice serve` of the default model as an embedding model (`--runner
pooling`: a decoder without a sentence-transformers config pools its last token and L2-normalises it,
as vLLM does), driven with the official `openai` client (`embeddings.create`), directly and through
`sluice router`, and checked against transformers' AutoModel on the same folder (float32 on both
sides). `/score` and `/rerank` (which the `openai` client lacks, so raw HTTP) against the cosines of
those embeddings. The generative server's refusal of /v1/embeddings is in test_serve_e2e.py, with its
server; the router's pass-through of each route to a generative replica is in test_router_e2e.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel

from router_fixtures import client_of, running_router
from serve_fixtures import Server, openai_client, running_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-embeddings"
TEXTS = ["The capital of France is Paris.", "def fibonacci(n):", "日本語 👋🏽 and more"]
QUERY = "Which city is France's capital?"
DOCUMENTS = ["Bananas are yellow.", *TEXTS, "Paris is the capital of France."]
# Two float32 computations of one embedding, batched differently, agree this closely.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # float32, as the reference runs.
    args = ["--runner", "pooling", "--dtype", "float32"]
    args += ["--max-model-len", "512", "--kv-cache-memory", "0.25"]
    with running_server(args, log, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as running:
        yield running


def hidden_size(model_path: Path) -> int:
    return json.loads((model_path / "config.json").read_text())["hidden_size"]


def token_ids(server: Server, text: str) -> list[int]:
    """The tokens /v1/embeddings embeds for `text`: with the tokenizer's special tokens."""
    response = server.request("POST", "/tokenize", {"model": MODEL, "prompt": text})
    assert response.status == 200, response
    return response.body["tokens"]


def embeddings(client: openai.OpenAI, inputs: str | list[str] | list[int] | list[list[int]]) -> np.ndarray:
    response = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    return np.array([item.embedding for item in response.data])


def test_each_input_has_a_unit_embedding_of_the_hidden_size_in_order(
    server: Server, client: openai.OpenAI, default_model_path: Path
) -> None:
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert response.object == "list" and response.model == MODEL
    assert [item.index for item in response.data] == [0, 1, 2]
    assert all(item.object == "embedding" for item in response.data)
    vectors = np.array([item.embedding for item in response.data])
    assert vectors.shape == (len(TEXTS), hidden_size(default_model_path))
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=TOLERANCE)
    prompt_tokens = sum(len(token_ids(server, text)) for text in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == prompt_tokens
    # Each input's embedding is its own: alone, it is the same.
    alone = np.concatenate([embeddings(client, text) for text in TEXTS])
    np.testing.assert_allclose(alone, vectors, atol=TOLERANCE)
    assert np.abs(vectors[0] - vectors[1]).max() > 0.01


def test_embeddings_are_deterministic(client: openai.OpenAI) -> None:
    first = embeddings(client, TEXTS)
    np.testing.assert_array_equal(embeddings(client, TEXTS), first)


def test_base64_is_the_float32_values_that_float_gives(client: openai.OpenAI) -> None:
    floats = embeddings(client, TEXTS)
    encoded = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for item, expected in zip(encoded.data, floats, strict=True):
        assert isinstance(item.embedding, str)
        decoded = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
        np.testing.assert_array_equal(decoded.astype(np.float64), expected)
    # Without encoding_format the client asks for base64 and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=TEXTS)
    np.testing.assert_array_equal(np.array([item.embedding for item in default.data]), floats)


def test_token_ids_embed_as_the_text_they_tokenize_to(server: Server, client: openai.OpenAI) -> None:
    ids = [token_ids(server, text) for text in TEXTS]
    from_text = embeddings(client, TEXTS)
    np.testing.assert_allclose(embeddings(client, ids), from_text, atol=TOLERANCE)
    np.testing.assert_allclose(embeddings(client, ids[0]), from_text[:1], atol=TOLERANCE)


def test_the_embedding_is_transformers_last_hidden_state_normalised(
    server: Server, client: openai.OpenAI, default_model_path: Path
) -> None:
    model = AutoModel.from_pretrained(default_model_path, dtype=torch.float32).eval()
    served = embeddings(client, TEXTS)
    for text, embedding in zip(TEXTS, served, strict=True):
        with torch.inference_mode():
            hidden = model(torch.tensor([token_ids(server, text)])).last_hidden_state[0, -1]
        reference = torch.nn.functional.normalize(hidden, dim=0).numpy()
        cosine = float(np.dot(reference, embedding) / np.linalg.norm(embedding))
        assert cosine >= 0.9999, (text, cosine)


def test_dimensions_are_refused_for_a_model_that_is_not_matryoshka(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="Hello", dimensions=64)
    assert refused.value.param == "dimensions"
    assert "Matryoshka" in refused.value.message


def test_an_empty_input_list_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=[])
    assert refused.value.param == "input"


def test_generation_routes_refuse_an_embedding_model(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert "/v1/embeddings" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert "/v1/embeddings" in refused.value.message
    assert server.health() == 200


def test_the_router_passes_embeddings_and_scores_through(
    server: Server, client: openai.OpenAI, tmp_path: Path
) -> None:
    args = ["--policy", "round-robin", f"--replica={server.url}"]
    with running_router(args, tmp_path / "router.log", API_KEY) as router, client_of(router) as routed:
        through = routed.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
        np.testing.assert_array_equal(
            np.array([item.embedding for item in through.data]), embeddings(client, TEXTS)
        )
        with pytest.raises(openai.BadRequestError) as refused:
            routed.embeddings.create(model=MODEL, input=[])
        assert refused.value.param == "input"
        for path, body in (
            ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
            ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ):
            status, _, routed_body = router.call("POST", path, json.dumps({"model": MODEL, **body}).encode())
            assert status == 200, routed_body
            direct = answer(server, path, body)
            key = "data" if path == "/score" else "results"
            assert json.loads(routed_body)[key] == direct[key], path


def answer(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The 200 answer of POST `path` with `body` and the model."""
    response = server.request("POST", path, {"model": MODEL, **body})
    assert response.status == 200, response
    return response.body


def scores(items: list[dict[str, Any]], field: str) -> np.ndarray:
    return np.array([item[field] for item in items])


def cosines(client: openai.OpenAI, first: list[str], second: list[str]) -> np.ndarray:
    """Each first text's cosine with its second text, or the one first text's with each second one, from
    the /v1/embeddings vectors."""
    a, b = embeddings(client, first), embeddings(client, second)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_score_is_the_cosine_of_the_embeddings_one_to_many_and_pairwise(
    server: Server, client: openai.OpenAI
) -> None:
    body = answer(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("score-")
    assert [item["index"] for item in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(item["object"] == "score" for item in body["data"])
    np.testing.assert_allclose(
        scores(body["data"], "score"), cosines(client, [QUERY], DOCUMENTS), atol=TOLERANCE
    )
    # Each text embedded once: the query and each document.
    tokens = sum(len(token_ids(server, text)) for text in [QUERY, *DOCUMENTS])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    firsts = [QUERY, *TEXTS]
    pairwise = answer(server, "/score", {"text_1": firsts, "text_2": DOCUMENTS[1:]})
    np.testing.assert_allclose(
        scores(pairwise["data"], "score"), cosines(client, firsts, DOCUMENTS[1:]), atol=TOLERANCE
    )


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_orders_the_documents_by_that_cosine(server: Server, client: openai.OpenAI, path: str) -> None:
    expected = cosines(client, [QUERY], DOCUMENTS)
    order = np.argsort(-expected, kind="stable").tolist()
    body = answer(server, path, {"query": QUERY, "documents": DOCUMENTS})
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    results = body["results"]
    assert [result["index"] for result in results] == order
    assert [result["document"]["text"] for result in results] == [DOCUMENTS[i] for i in order]
    np.testing.assert_allclose(scores(results, "relevance_score"), expected[order], atol=TOLERANCE)
    best = answer(
        server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    )
    assert [result["index"] for result in best["results"]] == order[:2]
    assert all("document" not in result for result in best["results"])


def test_mismatched_score_pairs_are_a_400_naming_text_2(server: Server) -> None:
    response = server.request("POST", "/score", {"model": MODEL, "text_1": TEXTS[:2], "text_2": TEXTS})
    assert response.status == 400, response
    assert response.body["error"]["param"] == "text_2"
    assert response.body["error"]["type"] == "invalid_request_error"
