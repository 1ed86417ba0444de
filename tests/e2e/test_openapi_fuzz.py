"""The served OpenAPI document, and schemathesis against it on a real `sluice serve` of the default model:
a fixed seed and a CI budget of 2,000 cases (scripts/fuzz_api runs longer)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from schemathesis import GenerationMode

from api_fuzzing import FuzzReport, check_case, fuzz, fuzzed_schema, openai_error_shape_problem
from serve_fixtures import Server, running_server

CI_CASES = 2000
SEED = 20261123
ROUTES = {
    "/v1/completions": {"post"},
    "/v1/chat/completions": {"post"},
    "/v1/messages": {"post"},
    "/v1/messages/count_tokens": {"post"},
    "/v1/responses": {"post"},
    "/v1/responses/{id}": {"get", "delete"},
    "/v1/responses/{id}/input_items": {"get"},
    "/v1/embeddings": {"post"},
    "/score": {"post"},
    "/rerank": {"post"},
    "/v1/rerank": {"post"},
    "/v2/rerank": {"post"},
    "/v1/models": {"get"},
    "/v1/models/{model}": {"get"},
    "/tokenize": {"post"},
    "/detokenize": {"post"},
    "/health": {"get"},
    "/version": {"get"},
    "/metrics": {"get"},
    "/sluice/kv_cache": {"get"},
    "/sluice/block_pool_audit": {"get"},
    "/openapi.json": {"get"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("serve")
    args = ["--max-model-len", "2048", "--kv-cache-memory", "1"]
    args += ["--responses-store", str(folder / "responses.sqlite3")]
    with running_server(args, folder / "serve.log") as running:
        yield running


def test_openapi_json_documents_every_route_and_the_error_shape(server: Server) -> None:
    response = requests.get(f"{server.url}/openapi.json", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    document = response.json()
    assert document["openapi"] == "3.1.0"
    assert {path: set(item) for path, item in document["paths"].items()} == ROUTES
    error = document["components"]["schemas"]["ErrorBody"]
    assert set(error["properties"]) == {"message", "type", "param", "code"}
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}


def test_schemathesis_finds_no_5xx_hang_reset_or_malformed_error(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    report = fuzz(server.url, CI_CASES, SEED)
    with capsys.disabled():
        print(f"\n{report.summary()}")
    assert report.cases >= CI_CASES
    assert report.server_errors == 0 and report.hangs == 0 and report.resets == 0, report.failures
    assert not report.failures, "\n".join(report.failures)
    assert server.health() == 200, server.log_tail()


def test_the_fuzz_reads_a_stream_of_more_events_than_schemathesis_reads_by_default(server: Server) -> None:
    # schemathesis reads 20 events of a stream unless told otherwise. 25 prompts of one token each make 25
    # events (a choice's last update, with its finish reason, is always sent) and [DONE].
    served_model = requests.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    (operation,) = [
        result.ok()
        for result in fuzzed_schema(server.url).get_all_operations()
        if result.ok().path == "/v1/completions"
    ]
    body = {
        "model": served_model,
        "prompt": [f"Count to {i}:" for i in range(25)],
        "max_tokens": 1,
        "stream": True,
    }
    report = FuzzReport()
    check_case(
        operation.Case(body=body, media_type="application/json"),
        server.url,
        served_model,
        GenerationMode.POSITIVE,
        report,
    )
    assert report.statuses == {200: 1} and not report.failures, report.failures


@pytest.mark.parametrize(
    ("status", "body", "accepted"),
    [
        (
            400,
            '{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}',
            True,
        ),
        (404, '{"error": {"message": "m", "type": "t", "param": "model", "code": "model_not_found"}}', True),
        (405, "", False),
        (404, "Not Found", False),
        (400, '{"error": {"message": "m", "type": "t"}}', False),
        (400, '{"error": {"message": "", "type": "t", "param": null, "code": null}}', False),
        (400, '{"error": {"message": "m", "type": "t", "param": 3, "code": null}}', False),
        (400, '{"detail": "m"}', False),
    ],
)
def test_the_error_shape_check_refuses_what_is_not_openais(status: int, body: str, accepted: bool) -> None:
    assert (openai_error_shape_problem(status, body) is None) == accepted
