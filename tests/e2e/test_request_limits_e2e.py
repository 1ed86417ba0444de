"""Requests the engine cannot serve are a 400 naming the field, against a real `sluice serve` on the
default model, with the official `openai` client (and raw HTTP where the client would not send it)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from serve_fixtures import Server, running_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["--max-model-len", "512", "--kv-cache-memory", "1"], log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def refused(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as error:
        call()
    return error.value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # float32 infinity, which became NaN in the sampler and a garbage token repeated.
        ("temperature", 1e39),
        ("temperature", 2.5),
        ("repetition_penalty", 1e39),
        # Underflows to 0 as a float32: a division by zero in the sampler.
        ("repetition_penalty", 1e-50),
        ("top_p", 1e-50),
        ("top_k", -2),
    ],
)
def test_values_the_engine_cannot_represent_are_refused_naming_the_field(
    client: openai.OpenAI, field: str, value: float
) -> None:
    body = {field: value, "min_tokens": 4}
    error = refused(
        lambda: client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, extra_body=body)
    )
    assert error.param == field, error.body
    # The message says what was sent, readably (1e39, not its 40 digits).
    sent = error.message.rsplit("got ", 1)[1]
    assert len(sent) < 24 and math.isclose(float(sent), value, rel_tol=1e-12), error.message
    chat_error = refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, extra_body=body
        )
    )
    assert chat_error.param == field, chat_error.body


def test_values_at_the_limits_are_served(client: openai.OpenAI) -> None:
    for extra in (
        {"temperature": 2.0, "top_k": 0},
        {"top_k": -1, "top_p": 1e-30, "repetition_penalty": 1e-30},
    ):
        result = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, seed=1, extra_body={"min_tokens": 4, **extra}
        )
        assert result.choices[0].finish_reason == "length", extra
        assert result.usage is not None and result.usage.completion_tokens == 4


def test_the_developer_role_is_a_system_message(client: openai.OpenAI) -> None:
    def answer(role: str) -> str | None:
        messages: Any = [
            {"role": role, "content": "You answer in one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ]
        result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        return result.choices[0].message.content

    assert answer("developer") == answer("system")
    tokenized = [
        client.post(
            "/../tokenize",
            body={"messages": [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
            cast_to=object,
        )
        for role in ("developer", "system")
    ]
    assert tokenized[0] == tokenized[1]


def test_a_text_part_without_text_says_the_text_is_missing(server: Server) -> None:
    messages = [{"role": "user", "content": [{"type": "text"}]}]
    response = server.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert response.status == 400, response.body
    error = response.body["error"]
    assert error["param"] == "messages"
    assert 'has no "text"' in error["message"], error["message"]
    assert "not supported" not in error["message"]

    image = [{"role": "user", "content": [{"type": "image_url"}]}]
    response = server.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": image})
    assert response.status == 400
    assert '"image_url" is not supported' in response.body["error"]["message"]


def test_whole_floats_count_as_integers_and_fractions_do_not(server: Server) -> None:
    # vLLM's pydantic models read `4.0` as 4 where an integer is asked for; 4.5 is an error.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4.0, "n": 2.0, "temperature": 0}
    response = server.request("POST", "/v1/completions", body)
    assert response.status == 200, response.body
    assert len(response.body["choices"]) == 2
    assert response.body["usage"]["completion_tokens"] <= 8
    response = server.request("POST", "/v1/completions", {**body, "max_tokens": 4.5})
    assert response.status == 400, response.body
    assert "integer" in response.body["error"]["message"], response.body


def test_a_message_without_content_renders_as_empty_as_in_vllm(client: openai.OpenAI) -> None:
    def tokens(content: Any) -> object:
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": content}]
        return client.post("/../tokenize", body={"messages": messages}, cast_to=object)

    assert tokens(None) == tokens("")
    messages: Any = [{"role": "user", "content": None}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert result.choices[0].finish_reason in ("stop", "length")


def test_a_long_text_tokenizes_as_the_tokenizer_does_it_whole(
    client: openai.OpenAI, default_model_path: Path
) -> None:
    # 300 KB: the frontend encodes it in pieces (--tokenize-piece-bytes, 16 KiB) for a bounded peak
    # of memory; the ids must be the whole text's.
    rng = random.Random(7)
    parts = ["river", "Ab", "42", "é", "世界", "👋🏽", ".", "'s", "<|im_start|>", "don't", "a1", "\t", "--"]
    gaps = [" ", " ", "  ", "\n", ""]
    text = "".join(rng.choice(parts) + rng.choice(gaps) for _ in range(60_000))
    assert len(text.encode()) > 250_000
    expected = Tokenizer.from_file(str(default_model_path / "tokenizer.json")).encode(text).ids
    tokenized: Any = client.post("/../tokenize", body={"prompt": text}, cast_to=object)
    assert tokenized["count"] == len(expected)
    assert tokenized["tokens"] == expected
