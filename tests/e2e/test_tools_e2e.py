"""Tool calling on /v1/chat/completions, end to end: `sluice serve` on the default model, driven with the
official `openai` package, streamed and not.

SmolLM2's chat template knows nothing of tools, so they reach the model as a Hermes-style system prompt
and `auto` outputs are read with the Hermes parser. The forced calls (`tool_choice` "required" or a named
function) run on the engine's structured output: the call's JSON is constrained by the tools' schemas.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from serve_fixtures import Server, openai_client, running_server
from sluice.serve.argv import frontend_argv
from sluice.serve.flags import add_serve_arguments
from weather_tool import CHAT_TOOL

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-tools"
WEATHER = CHAT_TOOL
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# A conversation the model answers with a call (greedy): twice before, it called get_weather for the
# same question.
PARIS_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
COPY_A_CALL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
    {"role": "user", "content": "Weather in Paris?"},
]


def test_the_tool_call_parser_flag_reaches_the_frontend() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    argv = frontend_argv(
        parser.parse_args(["--tool-call-parser", "mistral"]), Path("/m"), "m", Path("/s"), "h", 1
    )
    assert argv[argv.index("--tool-call-parser") + 1] == "mistral"
    assert "--tool-call-parser" not in frontend_argv(
        parser.parse_args([]), Path("/m"), "m", Path("/s"), "h", 1
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "qwen"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(
        ["--max-model-len", "2048", "--kv-cache-memory", "1"], log, api_key=API_KEY
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=48, **extra
    )


def streamed(
    client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any
) -> tuple[str, list[Any], str]:
    """A stream joined as a client joins it: content, calls as [id, name, arguments], the finish reason."""
    content, calls, finish = "", [], ""
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=48, stream=True, **extra
    )
    for chunk in chunks:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                # A call opens with its id, type and name, before any of its arguments.
                assert delta.index == len(calls) and delta.type == "function", delta
                assert delta.function.name and delta.function.arguments == "", delta
                calls.append([delta.id, delta.function.name, ""])
            else:
                assert delta.function.name is None, delta
                calls[delta.index][2] += delta.function.arguments
        finish = choice.finish_reason or finish
    return content, calls, finish


def prompt_tokens(client: openai.OpenAI, **extra: Any) -> int:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, **extra)
    return reply.usage.prompt_tokens


def test_tools_reach_the_prompt_unless_tool_choice_is_none(client: openai.OpenAI) -> None:
    plain = prompt_tokens(client)
    with_tools = prompt_tokens(client, tools=[WEATHER])
    assert with_tools > plain + 40
    assert prompt_tokens(client, tools=[WEATHER, TIME]) > with_tools
    assert prompt_tokens(client, tools=[WEATHER], tool_choice="none") == plain


def test_auto_reads_a_call_from_the_output(client: openai.OpenAI) -> None:
    reply = chat(client, COPY_A_CALL, tools=[WEATHER])
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None


def test_a_call_that_auto_opens_is_held_to_the_tool_schema(client: openai.OpenAI) -> None:
    # The lazy grammar (hermes): text is free, but once the model opens a call it must be one of
    # the tools with arguments its schema allows; greedy, this history is answered with Paris.
    lyon_only = json.loads(json.dumps(WEATHER))
    lyon_only["function"]["parameters"]["properties"]["city"] = {"type": "string", "enum": ["Lyon"]}
    for stream in (False, True):
        if stream:
            _, calls, finish = streamed(client, COPY_A_CALL, tools=[lyon_only])
            arguments = [call[2] for call in calls]
        else:
            choice = chat(client, COPY_A_CALL, tools=[lyon_only]).choices[0]
            finish = choice.finish_reason
            arguments = [call.function.arguments for call in choice.message.tool_calls]
        assert finish == "tool_calls"
        assert [json.loads(text) for text in arguments] == [{"city": "Lyon"}]


def test_a_streamed_call_adds_up_to_the_whole_one(client: openai.OpenAI) -> None:
    whole = chat(client, COPY_A_CALL, tools=[WEATHER]).choices[0]
    content, calls, finish = streamed(client, COPY_A_CALL, tools=[WEATHER])
    assert finish == "tool_calls"
    assert content == (whole.message.content or "")
    assert [call[1:] for call in calls] == [
        [call.function.name, call.function.arguments] for call in whole.message.tool_calls
    ]


def test_without_a_call_the_answer_is_plain_content(client: openai.OpenAI) -> None:
    plain = chat(client, [{"role": "user", "content": "Say hello."}])
    with_tools = chat(
        client, [{"role": "user", "content": "Say hello."}], tools=[WEATHER], tool_choice="none"
    )
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    assert with_tools.choices[0].message.tool_calls is None
    assert with_tools.choices[0].finish_reason in ("stop", "length")


def test_calls_and_tool_results_in_the_history_are_accepted(client: openai.OpenAI) -> None:
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    reply = chat(client, history, tools=[WEATHER])
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The call and its result are in the prompt, as text the model can read.
    assert reply.usage.prompt_tokens > prompt_tokens(client, tools=[WEATHER]) + 20


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "get_weather"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, extra_body=extra)
    assert error.value.body["param"] == param, error.value.body


# The forced calls below run on the engine's structured output.


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called(client: openai.OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        content, calls, finish = streamed(client, QUESTION, tools=[WEATHER, TIME], tool_choice=choice)
    else:
        reply = chat(client, QUESTION, tools=[WEATHER, TIME], tool_choice=choice).choices[0]
        content, finish = reply.message.content or "", reply.finish_reason
        calls = [[c.id, c.function.name, c.function.arguments] for c in reply.message.tool_calls]
    assert content == "" and finish == "tool_calls"
    ((call_id, name, arguments),) = calls
    assert call_id.startswith("call_") and name == "get_weather"
    assert set(json.loads(arguments)) == {"city"}


@pytest.mark.parametrize("stream", [False, True])
def test_required_makes_at_least_one_call(client: openai.OpenAI, stream: bool) -> None:
    extra = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    if stream:
        _, calls, finish = streamed(client, QUESTION, **extra)
    else:
        choice = chat(client, QUESTION, **extra).choices[0]
        finish = choice.finish_reason
        calls = [[c.id, c.function.name, c.function.arguments] for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    ((_, name, arguments),) = calls
    assert name in ("get_weather", "get_time")
    assert isinstance(json.loads(arguments), dict)


def test_a_forced_call_with_a_response_format_is_a_400_naming_tool_choice(client: openai.OpenAI) -> None:
    # Both would constrain the same output; vLLM refuses the pair too.
    with pytest.raises(openai.BadRequestError) as raised:
        chat(
            client,
            QUESTION,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert raised.value.body["param"] == "tool_choice", raised.value.body  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_whose_schema_cannot_compile_is_a_400_naming_tools(
    client: openai.OpenAI, stream: bool
) -> None:
    # The frontend passes the parameters on as JSON; the engine's grammar compiler rejects them, and
    # the rejection names the field the schema came from, not the forced call's response_format.
    broken = {
        "type": "function",
        "function": {"name": "broken", "parameters": {"type": "object", "minProperties": "x"}},
    }
    choice = {"type": "function", "function": {"name": "broken"}}
    with pytest.raises(openai.BadRequestError) as raised:
        if stream:
            streamed(client, QUESTION, tools=[broken], tool_choice=choice)
        else:
            chat(client, QUESTION, tools=[broken], tool_choice=choice)
    assert raised.value.body["param"] == "tools", raised.value.body  # type: ignore[index]
