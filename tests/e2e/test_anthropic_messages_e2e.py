"""Anthropic's Messages API end to end: `sluice serve` on the default model, driven with the official
`anthropic` package (which sends its key as `x-api-key`), whole and streamed, with tools, stop
sequences, count_tokens and Anthropic-shaped errors.

/v1/messages is served as the chat request it means, so a greedy answer must be the very text that
/v1/chat/completions gives for the same conversation, which the `openai` client fetches here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from serve_fixtures import Server, running_server
from weather_tool import ANTHROPIC_TOOL

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-messages"
SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
# Greedy. The `anthropic` client of today has no `temperature` argument (Anthropic's newest models take
# none); older clients and raw requests send it, as the API still takes it.
GREEDY = {"temperature": 0}
WEATHER = ANTHROPIC_TOOL
# A conversation the model answers with a call (greedy), as in test_tools_e2e.py.
PARIS_CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
COPY_A_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [PARIS_CALL]},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{**PARIS_CALL, "id": "toolu_2"}]},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(
        ["--max-model-len", "2048", "--kv-cache-memory", "1"], log, api_key=API_KEY
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def create(client: anthropic.Anthropic, **extra: Any) -> Any:
    fields = {"model": MODEL, "max_tokens": 40, "extra_body": GREEDY, **extra}
    fields.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return client.messages.create(**fields)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_greedy_answer_is_chats_answer_to_the_same_conversation(
    client: anthropic.Anthropic, server: Server
) -> None:
    message = create(client, system=SYSTEM)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg")
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as chat_client:
        chat = chat_client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            max_tokens=40,
            temperature=0,
        )
    assert text_of(message) == chat.choices[0].message.content
    finish = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_reason == finish and message.stop_sequence is None
    usage = message.usage
    # Anthropic counts the prompt tokens the cache served apart from the others.
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.cache_creation_input_tokens == 0


def test_a_repeated_prompt_is_read_from_the_prefix_cache(client: anthropic.Anthropic) -> None:
    long_system = SYSTEM + " " + "Keep every answer short and plain. " * 12
    first = create(client, system=long_system, max_tokens=2)
    again = create(client, system=long_system, max_tokens=2)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens >= 16, again.usage


def test_a_stream_adds_up_to_the_whole_message(client: anthropic.Anthropic) -> None:
    whole = create(client, system=SYSTEM)
    pieces = []
    with client.messages.stream(
        model=MODEL,
        max_tokens=40,
        extra_body=GREEDY,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        kinds = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                pieces.append(event.text)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert total == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    # Anthropic's order: the message opens, one text block opens, grows and closes, the message ends.
    assert kinds[0] == "message_start"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    assert kinds[-2:] == ["message_delta", "message_stop"]


def test_a_stop_sequence_ends_the_answer_and_is_named(client: anthropic.Anthropic) -> None:
    text = text_of(create(client))
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    message = create(client, stop_sequences=["never in the text 1234", stop])
    assert message.stop_reason == "stop_sequence"
    assert message.stop_sequence == stop
    assert text_of(message) == text[: text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_is_a_tool_use_block(client: anthropic.Anthropic, stream: bool) -> None:
    fields = {
        "model": MODEL,
        "max_tokens": 48,
        "extra_body": GREEDY,
        "messages": COPY_A_CALL,
        "tools": [WEATHER],
    }
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    assert message.stop_reason == "tool_use", message
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id


def test_a_tool_result_reaches_the_prompt(client: anthropic.Anthropic) -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [PARIS_CALL]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C and sunny"}],
        },
    ]
    without = client.messages.count_tokens(model=MODEL, messages=history[:1], tools=[WEATHER])
    answered = create(client, messages=history, tools=[WEATHER], max_tokens=8)
    assert answered.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prompt = answered.usage.input_tokens + answered.usage.cache_read_input_tokens
    assert prompt > without.input_tokens + 20


def test_any_forces_a_call_and_tool_names_it(client: anthropic.Anthropic) -> None:
    time_tool = {"name": "get_time", "description": "The time now", "input_schema": {"type": "object"}}
    named = create(
        client, tools=[WEATHER, time_tool], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=32
    )
    (call,) = named.content
    assert call.type == "tool_use" and call.name == "get_weather" and set(call.input) == {"city"}
    assert named.stop_reason == "tool_use"
    forced = create(
        client,
        tools=[WEATHER, time_tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=32,
    )
    calls = [block for block in forced.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(
    client: anthropic.Anthropic, server: Server
) -> None:
    messages = [
        {"role": "user", "content": "Count from 1 to 20."},
        {"role": "assistant", "content": "1, 2, 3,"},
    ]
    message = create(client, messages=messages, max_tokens=12)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as chat_client:
        chat = chat_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
    assert text_of(message) == chat.choices[0].message.content
    assert text_of(message).lstrip().startswith("4"), text_of(message)


def test_output_config_constrains_the_answer_to_its_schema(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    message = create(
        client, output_config={"format": {"type": "json_schema", "schema": schema}}, max_tokens=40
    )
    answer = json.loads(text_of(message))
    assert set(answer) == {"city"} and len(answer["city"]) <= 12, answer


def test_count_tokens_is_the_prompt_of_the_same_request(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages, tools=[WEATHER])
    message = create(client, system=SYSTEM, messages=messages, tools=[WEATHER], max_tokens=1)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    plain = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert plain.input_tokens < counted.input_tokens


def test_an_earlier_turns_thinking_blocks_are_accepted_and_left_out_of_the_prompt(
    client: anthropic.Anthropic,
) -> None:
    def conversation(reply: list[dict]) -> list[dict]:
        return [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Say it again."},
        ]

    answer = {"type": "text", "text": "Paris."}
    thinking = [
        {"type": "thinking", "thinking": "The capital of France is Paris.", "signature": ""},
        {"type": "redacted_thinking", "data": "opaque"},
    ]
    with_thinking = client.messages.count_tokens(model=MODEL, messages=conversation([*thinking, answer]))
    without = client.messages.count_tokens(model=MODEL, messages=conversation([answer]))
    assert with_thinking.input_tokens == without.input_tokens
    message = create(client, messages=conversation([*thinking, answer]), max_tokens=4)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == without.input_tokens


def test_an_unknown_field_is_reported_and_cache_control_is_served(client: anthropic.Anthropic) -> None:
    raw = client.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=4,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"frobnicate": 1, **GREEDY},
    )
    assert raw.headers["x-sluice-ignored-fields"] == "frobnicate"
    assert raw.parse().type == "message"


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
                ]
            },
            "this model takes text only",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "without --reasoning-parser"),
        ({"extra_body": {"temperature": 1.5}}, "temperature must be in [0, 1]"),
        ({"container": "c1"}, "containers are not served"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"model": "claude-opus-4"}, "claude-opus-4"),
    ],
)
def test_bad_requests_are_400s_in_anthropics_shape(
    client: anthropic.Anthropic, extra: dict[str, Any], words: str
) -> None:
    with pytest.raises(anthropic.APIStatusError) as raised:
        create(client, **extra)
    error = raised.value
    expected = "not_found_error" if "model" in extra else "invalid_request_error"
    assert error.status_code == (404 if "model" in extra else 400)
    assert error.body["type"] == "error", error.body  # type: ignore[index]
    assert error.body["error"]["type"] == expected, error.body  # type: ignore[index]
    assert words in error.body["error"]["message"], error.body  # type: ignore[index]


def test_a_wrong_key_and_a_missing_max_tokens_answer_in_anthropics_shape(server: Server) -> None:
    with (
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError) as raised,
    ):
        create(wrong)
    assert raised.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or incorrect API key"},
    }
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    missing = server.request("POST", "/v1/messages", body)
    assert missing.status == 400
    assert missing.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens is required" in missing.body["error"]["message"]
    not_json = server.request("POST", "/v1/messages", b"{")
    assert not_json.status == 400 and not_json.body["type"] == "error", not_json
    nowhere = server.request("POST", "/v1/messages/batches", body)
    assert nowhere.status == 404 and nowhere.body["error"]["type"] == "not_found_error", nowhere
    # The OpenAI routes keep OpenAI's shape.
    chat = server.request("POST", "/v1/chat/completions", {**body, "max_tokens": 0})
    assert chat.status == 400 and set(chat.body) == {"error"} and chat.body["error"]["param"] == "max_tokens"


def test_a_failed_stream_is_not_started_for_a_bad_request(server: Server) -> None:
    # Validation happens before the 200: a bad streamed request is a 400, not an error event.
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "bot", "content": "hi"}]}
    response = server.request("POST", "/v1/messages", body)
    assert response.status == 400, response
    assert '"user" or "assistant"' in response.body["error"]["message"]
