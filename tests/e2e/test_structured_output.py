"""Structured output end to end: the real `openai` client against `sluice serve` on the default model.

Twenty JSON schemas (tests/support/structured_schemas.py) produce output that parses and validates, both
greedy and sampled; regex, choice and grammar constraints hold; JSON is compact (no free
whitespace); a constraint that does not compile, or a malformed one, is a 400 naming its field;
structured and plain requests share batches under async scheduling.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from serve_fixtures import Server, running_server
from structured_schemas import SCHEMAS

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-structured"
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("structured") / "serve.log"
    with running_server(["--max-model-len", "1024", "--kv-cache-memory", "1"], log, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


def chat(client: openai.OpenAI, content: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, **extra
    )


def assert_compact(text: str) -> None:
    """No whitespace outside JSON strings: the constraint allowed none."""
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert not re.search(r"\s", outside_strings), text


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_twenty_schemas_parse_and_validate(client: openai.OpenAI, temperature: float) -> None:
    def run(case: tuple[str, dict[str, Any]]) -> tuple[dict[str, Any], Any]:
        prompt, schema = case
        extra = {"seed": 11} if temperature else {}
        reply = chat(
            client,
            prompt + " Answer in JSON.",
            temperature=temperature,
            response_format=schema_format(schema),
            **extra,
        )
        return schema, reply.choices[0]

    # Concurrent, so that the structured requests share batches.
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(run, SCHEMAS))
    for schema, choice in results:
        text = choice.message.content
        assert choice.finish_reason == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)
        assert_compact(text)


def test_json_object_is_a_compact_object(client: openai.OpenAI) -> None:
    # A question with a short answer: an open-ended one ("a JSON object about cats") loops at some kernel
    # tiers' rounding and runs out of tokens mid-object, which says nothing about the constraint.
    reply = chat(
        client,
        "Give me a JSON object with the name and age of a cat.",
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", text
    value = json.loads(text)
    assert isinstance(value, dict)
    assert_compact(text)


def test_guided_regex_and_choice_through_extra_body(client: openai.OpenAI) -> None:
    dated = chat(
        client,
        "When did it happen?",
        temperature=1.0,
        seed=3,
        extra_body={"guided_regex": r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d"},
    )
    assert re.fullmatch(r"(19|20)\d{2}-(0[1-9]|1[0-2])-[0-3]\d", dated.choices[0].message.content)
    choices = ["yes", "no", "maybe (later)"]
    for seed in range(4):
        picked = chat(
            client, "Will it rain?", temperature=1.0, seed=seed, extra_body={"guided_choice": choices}
        )
        assert picked.choices[0].message.content in choices
    completion = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert re.fullmatch("[0-9]{3}", completion.choices[0].text)


def test_guided_json_and_grammar(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = chat(client, "Is it ok?", temperature=0.0, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "left" | "right"'
    reply = chat(client, "Left or right?", temperature=1.0, seed=5, extra_body={"guided_grammar": grammar})
    assert reply.choices[0].message.content in ("The answer is left.", "The answer is right.")


def test_streamed_structured_output_validates(client: openai.OpenAI) -> None:
    prompt, schema = SCHEMAS[11]
    stream = chat(client, prompt, temperature=0.0, response_format=schema_format(schema), stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)


def test_structured_and_plain_requests_share_batches(client: openai.OpenAI) -> None:
    """Async scheduling stays correct: plain requests run while structured ones wait for their token."""
    prompt, schema = SCHEMAS[18]

    def run(i: int) -> tuple[bool, Any]:
        structured = i % 2 == 0
        extra = {"response_format": schema_format(schema)} if structured else {}
        return structured, chat(client, prompt, temperature=1.0, seed=i, **extra).choices[0]

    with ThreadPoolExecutor(8) as pool:
        for structured, choice in pool.map(run, range(8)):
            if structured:
                jsonschema.validate(json.loads(choice.message.content), schema)
            else:
                assert choice.message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        (
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}},
            "structured_outputs",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = server.request("POST", "/v1/chat/completions", request)
    assert response.status == 400, response.body
    error = response.body["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


UNCOMPILABLE = {"type": "object", "minProperties": "x"}


def test_openai_client_raises_bad_request_for_an_uncompilable_schema(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, "hi", response_format=schema_format(UNCOMPILABLE))
    assert raised.value.body["param"] == "response_format"  # type: ignore[index]


def test_a_streamed_uncompilable_schema_is_a_400_not_an_error_event(client: openai.OpenAI) -> None:
    # The engine rejects it while the stream waits for its first answer, before the status line.
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, "hi", response_format=schema_format(UNCOMPILABLE), stream=True)
    assert raised.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=8, stream=True, extra_body={"guided_json": UNCOMPILABLE}
        )
    assert raised.value.body["param"] == "guided_json"  # type: ignore[index]


def token_id(client: openai.OpenAI, text: str) -> int:
    (only,) = client.post("/../tokenize", body={"prompt": text}, cast_to=object)["tokens"]  # type: ignore[index]
    return only


def test_allowed_token_ids_narrow_the_constraint_and_a_disjoint_set_is_a_400(client: openai.OpenAI) -> None:
    # The default model's EOS is 2 (<|im_end|>).
    braces = [token_id(client, "{"), token_id(client, "}"), 2]
    reply = chat(
        client,
        "Give me JSON.",
        temperature=0.0,
        response_format={"type": "json_object"},
        extra_body={"allowed_token_ids": braces},
    )
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("{}", "stop")
    # No JSON object starts with "hello": nothing can be sampled, and the request alone fails.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as raised:
            chat(
                client,
                "Give me JSON.",
                response_format={"type": "json_object"},
                stream=stream,
                extra_body={"allowed_token_ids": [token_id(client, "hello")]},
            )
        assert raised.value.body["param"] == "allowed_token_ids", raised.value.body  # type: ignore[index]


def test_the_server_still_serves_after_rejections(client: openai.OpenAI) -> None:
    reply = chat(client, "Say hi.", temperature=0.0, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")
