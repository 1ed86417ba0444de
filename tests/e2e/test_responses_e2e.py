"""OpenAI's Responses API end to end: `sluice serve` on the default model, driven with the official
`openai` client (`responses.create`, `responses.stream`, `retrieve`, `delete`, `input_items.list`),
whole and streamed, with stored conversations, tools, structured output and OpenAI-shaped errors.

/v1/responses is served as the chat request it means, so a greedy answer must be the very text that
/v1/chat/completions gives for the same conversation; a `previous_response_id` follow-up is the
conversation so far plus the new input, and its earlier turns come from the prefix cache.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from serve_fixtures import Server, openai_client, running_server
from weather_tool import RESPONSES_TOOL

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-responses"
INSTRUCTIONS = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And of Germany?"
GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 40}
BLOCK_SIZE = 16
# Small, so that a test fills it; each stored response here takes about 2 kB.
STORE_MB = "0.03"
WEATHER = RESPONSES_TOOL


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("serve")
    args = ["--max-model-len", "2048", "--kv-cache-memory", "1"]
    args += ["--responses-store", str(folder / "responses.sqlite3"), "--responses-store-max-mb", STORE_MB]
    with running_server(args, folder / "serve.log", api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as running:
        yield running


def chat_answer(client: openai.OpenAI, messages: list[dict[str, str]]) -> str:
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    content = chat.choices[0].message.content
    assert content is not None
    return content


def test_a_greedy_answer_is_chats_answer_to_the_same_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    assert response.object == "response" and response.model == MODEL and response.id.startswith("resp")
    assert response.status == "completed" and response.error is None
    assert response.instructions == INSTRUCTIONS and response.store is True
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    expected = chat_answer(
        client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    )
    assert response.output_text == expected
    usage = response.usage
    assert usage is not None and usage.output_tokens >= 1
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_a_follow_up_continues_the_stored_conversation_from_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=FOLLOW_UP, instructions=INSTRUCTIONS, **GREEDY
    )
    assert second.previous_response_id == first.id
    # The follow-up's prompt is the whole conversation: chat answers it the same.
    conversation = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    assert second.output_text == chat_answer(client, conversation)
    # Its earlier turn was served from the prefix cache: at least every full block of the first
    # prompt (the first answer's blocks too, when its text tokenizes as it was generated).
    first_usage, second_usage = first.usage, second.usage
    assert first_usage is not None and second_usage is not None
    cached = second_usage.input_tokens_details.cached_tokens
    assert cached >= first_usage.input_tokens // BLOCK_SIZE * BLOCK_SIZE > 0, (first_usage, second_usage)
    assert second_usage.input_tokens > first_usage.input_tokens + first_usage.output_tokens
    # Instructions are not carried on: a follow-up without them renders without them.
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks!", **GREEDY)
    assert third.instructions is None and third.status in {"completed", "incomplete"}


def test_a_stored_response_reads_back_until_it_is_deleted(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input=QUESTION, metadata={"run": "e2e"}, **GREEDY)
    read = client.responses.retrieve(created.id)
    assert read.model_dump() == created.model_dump()
    assert read.metadata == {"run": "e2e"}
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(created.id)
    error = raised.value.body
    assert (
        isinstance(error, dict) and error["code"] == "response_not_found" and created.id in error["message"]
    )
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(model=MODEL, previous_response_id=created.id, input=FOLLOW_UP, **GREEDY)
    error = raised.value.body
    assert isinstance(error, dict)
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    assert created.id in error["message"]


def test_a_response_not_stored_cannot_be_continued(client: openai.OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input=QUESTION, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="x", **GREEDY)


def test_input_items_list_a_responses_own_input_a_page_at_a_time(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    page = client.responses.input_items.list(first.id)
    # The instructions are no item.
    (asked,) = page.data
    assert asked.type == "message" and asked.role == "user" and asked.id.startswith("msg_")
    assert [(part.type, part.text) for part in asked.content] == [("input_text", QUESTION)]  # type: ignore[union-attr]
    assert page.has_more is False
    given: Any = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 2?"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "4."}],
            "id": "msg_given",
        },
        {"role": "user", "content": FOLLOW_UP},
    ]
    follow_up = client.responses.create(model=MODEL, previous_response_id=first.id, input=given, **GREEDY)
    # Only its own request's items (not the earlier turn's), newest first as OpenAI lists them.
    newest_first = client.responses.input_items.list(follow_up.id).data
    assert [item.role for item in newest_first] == ["user", "assistant", "user", "developer"]  # type: ignore[union-attr]
    assert newest_first[1].id == "msg_given" and newest_first[1].content[0].type == "output_text"  # type: ignore[union-attr]
    ids = [item.id for item in newest_first]
    assert len(set(ids)) == 4 and client.responses.input_items.list(follow_up.id).data == newest_first
    oldest = client.responses.input_items.list(follow_up.id, order="asc", limit=2)
    assert [item.id for item in oldest.data] == ids[:1:-1] and oldest.has_more is True
    rest = client.responses.input_items.list(follow_up.id, order="asc", limit=2, after=oldest.data[-1].id)
    assert [item.id for item in rest.data] == ids[1::-1] and rest.has_more is False
    # The client's iterator follows `after` from page to page.
    assert [item.id for item in client.responses.input_items.list(follow_up.id, limit=1)] == ids
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.input_items.list(follow_up.id, include=["message.input_image.image_url"])
    error = raised.value.body
    assert isinstance(error, dict) and error["param"] == "include"
    assert "message.input_image.image_url" in error["message"]
    unstored = client.responses.create(model=MODEL, input=QUESTION, store=False, **GREEDY)
    for missing in (unstored.id, "resp_never"):
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.input_items.list(missing)
        error = raised.value.body
        assert (
            isinstance(error, dict) and error["code"] == "response_not_found" and missing in error["message"]
        )


def test_without_a_reasoning_parser_no_token_is_the_thinkings(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    # As vLLM: chat's usage has no completion_tokens_details; the Responses API's field is required.
    assert chat.usage is not None and chat.usage.completion_tokens_details is None
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 0


def test_a_stream_sends_openais_events_in_order_and_adds_up_to_the_whole_answer(
    client: openai.OpenAI,
) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, **GREEDY)
    with client.responses.stream(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert final.id == events[0].response.id != whole.id  # type: ignore[union-attr]
    # A streamed response is stored as well.
    assert client.responses.retrieve(final.id).output_text == deltas


def test_max_output_tokens_makes_the_response_incomplete(client: openai.OpenAI) -> None:
    cut = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=2)
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 2
    (message,) = cut.output
    assert message.type == "message" and message.status == "incomplete"


def test_a_function_call_and_its_output_continue_the_conversation(client: openai.OpenAI) -> None:
    choice: Any = {"type": "function", "name": "get_weather"}
    called = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice, temperature=0
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    assert call.call_id.startswith("call_")
    answered = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        **GREEDY,
    )
    assert answered.output[0].type in {"message", "function_call"}
    usage = answered.usage
    assert usage is not None and usage.input_tokens_details.cached_tokens >= BLOCK_SIZE
    with client.responses.stream(
        model=MODEL, input="What is the weather in Oslo?", tools=[WEATHER], tool_choice=choice, temperature=0
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (streamed_call,) = final.output
    assert streamed_call.type == "function_call" and set(json.loads(streamed_call.arguments)) == {"city"}


def test_text_format_holds_the_answer_to_its_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 30}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    assert set(json.loads(response.output_text)) == {"capital"}
    assert response.text.format is not None and response.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"background": True}, "background", "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "text only",
        ),
        ({"temperature": 3}, "temperature", "temperature"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(
    server: Server, extra: dict[str, Any], param: str, says: str
) -> None:
    response = server.request("POST", "/v1/responses", {"model": MODEL, "input": QUESTION, **extra})
    assert response.status == 400, response
    assert response.body["error"]["param"] == param and says in response.body["error"]["message"], response


def test_unknown_fields_are_reported_not_silently_dropped(server: Server) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {
        "model": MODEL,
        "input": QUESTION,
        "max_output_tokens": 2,
        "reasoning": {"summary": "auto"},
        "frobnicate": 1,
    }
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    connection.request("POST", "/v1/responses", body=json.dumps(body), headers=headers)
    answer = connection.getresponse()
    answer.read()
    connection.close()
    assert answer.status == 200
    assert answer.getheader("x-sluice-ignored-fields") == "frobnicate, reasoning.summary"


def test_the_size_bound_evicts_the_oldest_and_counts_them(client: openai.OpenAI, server: Server) -> None:
    # Runs last: it fills the store.
    before = server.metrics().get("sluice:responses_evicted_total", 0.0)
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    made = 0
    while server.request("GET", f"/v1/responses/{first.id}").status == 200:
        assert made < 200, "the store never evicted its oldest response"
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
        made += 1
    # Evicted when the store was full: a store of 30 kB holds some responses of about 1.5 kB.
    assert made >= 5
    metrics = server.metrics()
    assert metrics["sluice:responses_evicted_total"] > before
    assert 0 < metrics["sluice:responses_stored_bytes"] <= float(STORE_MB) * 1e6
    # Never a failed request for a full store: the newest is there.
    latest = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(latest.id).id == latest.id


def test_the_store_is_the_file_it_was_given(server: Server) -> None:
    store = server.log.parent / "responses.sqlite3"
    assert store.is_file() and store.stat().st_size > 0
