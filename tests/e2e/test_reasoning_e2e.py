"""`--reasoning-parser` end to end: `sluice serve --reasoning-parser qwen3` on the default model, driven
with the `openai` client (chat and responses, whole and streamed, with their usage's reasoning tokens)
and the `anthropic` client (thinking blocks).

SmolLM2 never writes a think tag by itself. A prompt that ends inside a think block (an assistant
prefill that opens one) makes its output thinking, as a reasoning model's template does; a plain
prompt leaves it an answer. How an output that closes its thinking is split, in any pieces, is
tested on the parser itself (frontend/src/text/reasoning.rs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from serve_fixtures import Server, openai_client, running_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-reasoning"
QUESTION = {"role": "user", "content": "What is the capital of France?"}
# The answer's prefill opens a think block, so the output goes on inside it.
THINKING = [QUESTION, {"role": "assistant", "content": "<think>\nThe user asks"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--max-model-len", "1024", "--kv-cache-memory", "1", "--reasoning-parser", "qwen3"]
    with running_server(args, log, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24, extra_body=extra
    )


def completion_text(server: Server, client: openai.OpenAI, messages: list[dict[str, Any]]) -> str:
    """The same prompt's output through /v1/completions, which no reasoning parser reads."""
    prompt = server.request("POST", "/tokenize", {"model": MODEL, "messages": messages, **CONTINUE})
    assert prompt.status == 200, prompt
    done = client.completions.create(model=MODEL, prompt=prompt.body["tokens"], temperature=0, max_tokens=24)
    return done.choices[0].text


def test_output_inside_a_think_block_is_reasoning_content(server: Server, client: openai.OpenAI) -> None:
    reply = chat(client, THINKING, **CONTINUE).choices[0]
    assert reply.message.content is None, reply.message
    reasoning = reply.message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and reasoning == completion_text(server, client, THINKING), reply.message
    assert reply.finish_reason in ("stop", "length")


def test_a_plain_answer_has_no_reasoning_content(client: openai.OpenAI) -> None:
    message = chat(client, [QUESTION]).choices[0].message
    assert message.content and "<think>" not in message.content
    assert getattr(message, "reasoning_content", None) is None


def streamed_thinking_and_answer(client: openai.OpenAI, **extra: Any) -> tuple[str, str]:
    """The reasoning_content and content deltas of THINKING's streamed answer, each joined."""
    reasoning, content = "", ""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=THINKING,
        temperature=0,
        max_tokens=24,
        stream=True,
        extra_body={**CONTINUE, **extra},
    )
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content


def test_streamed_reasoning_adds_up_to_the_whole(client: openai.OpenAI) -> None:
    whole = chat(client, THINKING, **CONTINUE).choices[0].message
    reasoning, content = streamed_thinking_and_answer(client)
    assert reasoning == whole.reasoning_content  # type: ignore[attr-defined]
    assert content == ""


def test_usage_counts_the_thinking_tokens_whole_and_streamed(client: openai.OpenAI) -> None:
    # The model never closes its thinking here, so every output token is the thinking's.
    thought = chat(client, THINKING, **CONTINUE).usage
    assert thought is not None and thought.completion_tokens_details is not None
    assert thought.completion_tokens_details.reasoning_tokens == thought.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=THINKING,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=CONTINUE,
    )
    (streamed,) = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert streamed.completion_tokens_details is not None
    assert streamed.completion_tokens_details.reasoning_tokens == thought.completion_tokens
    plain = chat(client, [QUESTION]).usage
    assert plain is not None and plain.completion_tokens_details is not None
    assert plain.completion_tokens_details.reasoning_tokens == 0


def test_responses_usage_counts_no_thinking_in_a_plain_answer(client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model=MODEL, input=QUESTION["content"], max_output_tokens=8, temperature=0
    )
    with client.responses.stream(
        model=MODEL, input=QUESTION["content"], max_output_tokens=8, temperature=0
    ) as stream:
        # Its last event (response.completed, or .incomplete when cut) carries the response.
        streamed = list(stream)[-1].response  # type: ignore[union-attr]
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["message"]
        assert response.usage is not None and response.usage.output_tokens > 0
        assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_a_response_format_constrains_the_answer_not_the_thinking(client: openai.OpenAI) -> None:
    # The model never closes its thinking here, so a constraint on the answer leaves the (greedy)
    # thinking as it is without one, except that it may not end (EOS) before an answer; a constraint
    # on the whole output would have made it JSON from the first token.
    free = chat(client, THINKING, **CONTINUE).choices[0].message
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    constrained = chat(client, THINKING, response_format=response_format, **CONTINUE).choices[0].message
    assert constrained.reasoning_content.startswith(free.reasoning_content)  # type: ignore[attr-defined]
    assert constrained.content is None


def test_anthropic_clients_get_a_thinking_block(server: Server, client: openai.OpenAI) -> None:
    whole = chat(client, THINKING, **CONTINUE).choices[0].message
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as messages:
        message = messages.messages.create(
            model=MODEL, max_tokens=24, messages=THINKING, extra_body={"temperature": 0}
        )
        with messages.messages.stream(
            model=MODEL, max_tokens=24, messages=THINKING, extra_body={"temperature": 0}
        ) as stream:
            streamed = stream.get_final_message()
    for answer in (message, streamed):
        (block,) = answer.content
        assert block.type == "thinking", answer.content
        assert block.thinking == whole.reasoning_content  # type: ignore[attr-defined]
        assert answer.stop_reason in ("end_turn", "max_tokens")


# A thinking budget smaller than the thinking the model writes free: the end of thinking is forced.
BUDGET = 6


def completion(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    done = client.completions.create(
        model=MODEL,
        prompt=prompt,
        temperature=0,
        max_tokens=max_tokens,
        extra_body={"return_token_ids": True},
    )
    return done.model_dump()["choices"][0]


def budgeted_output(server: Server, client: openai.OpenAI) -> tuple[str, str, int]:
    """What a budget of BUDGET tokens should give, from /v1/completions (no parser, no budget): the
    model's first BUDGET tokens of thinking, then the answer it writes after them and the forced
    `</think>`; and how many tokens that tag is."""
    prompt = server.request("POST", "/tokenize", {"model": MODEL, "messages": THINKING, **CONTINUE})
    end = server.request(
        "POST", "/tokenize", {"model": MODEL, "prompt": "</think>", "add_special_tokens": False}
    )
    assert prompt.status == 200 and end.status == 200, (prompt, end)
    thinking = completion(client, prompt.body["tokens"], BUDGET)
    assert "</think>" not in thinking["text"], "the model must not close its thinking by itself here"
    forced = prompt.body["tokens"] + thinking["token_ids"] + end.body["tokens"]
    answer = completion(client, forced, 24 - BUDGET - len(end.body["tokens"]))
    # The parser drops the newlines between the tag and the answer.
    return thinking["text"], answer["text"].lstrip("\n"), len(end.body["tokens"])


def test_a_thinking_budget_forces_the_end_of_thinking_and_the_answer_follows(
    server: Server, client: openai.OpenAI
) -> None:
    thinking, answer, tag_tokens = budgeted_output(server, client)
    budgeted = chat(client, THINKING, thinking_token_budget=BUDGET, **CONTINUE)
    message = budgeted.choices[0].message
    assert message.reasoning_content == thinking  # type: ignore[attr-defined]
    assert (message.content or "") == answer
    assert budgeted.usage is not None and budgeted.usage.completion_tokens_details is not None
    assert budgeted.usage.completion_tokens_details.reasoning_tokens == BUDGET + tag_tokens
    assert streamed_thinking_and_answer(client, thinking_token_budget=BUDGET) == (thinking, answer)


def test_a_budgeted_thinking_leaves_the_answer_to_its_constraint(client: openai.OpenAI) -> None:
    # The forced tag is where the constraint starts: the answer is one of the choices.
    budgeted = chat(
        client, THINKING, thinking_token_budget=BUDGET, guided_choice=["Paris", "Lyon"], **CONTINUE
    ).choices[0]
    assert budgeted.message.content in ("Paris", "Lyon"), budgeted.message
    assert budgeted.message.reasoning_content  # type: ignore[attr-defined]
    assert budgeted.finish_reason == "stop"


def test_anthropic_extended_thinking_is_cut_at_its_budget(server: Server, client: openai.OpenAI) -> None:
    thinking, answer, _ = budgeted_output(server, client)
    budget = {"type": "enabled", "budget_tokens": BUDGET}
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as messages:
        message = messages.messages.create(
            model=MODEL, max_tokens=24, messages=THINKING, thinking=budget, extra_body={"temperature": 0}
        )
        with messages.messages.stream(
            model=MODEL, max_tokens=24, messages=THINKING, thinking=budget, extra_body={"temperature": 0}
        ) as stream:
            streamed = stream.get_final_message()
        with pytest.raises(anthropic.BadRequestError) as raised:
            messages.messages.create(
                model=MODEL,
                max_tokens=24,
                messages=THINKING,
                thinking={"type": "enabled", "budget_tokens": 24},
            )
    assert "must be less than max_tokens (24)" in raised.value.body["error"]["message"]  # type: ignore[index]
    for reply in (message, streamed):
        assert reply.content[0].type == "thinking" and reply.content[0].thinking == thinking, reply.content
        text = "".join(block.text for block in reply.content[1:] if block.type == "text")
        assert text == answer, reply.content
