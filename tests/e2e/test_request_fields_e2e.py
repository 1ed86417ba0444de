"""No silently ignored field, end to end: `sluice serve` on the default model, driven with the official
`openai` package.

Each field of /v1/completions and /v1/chat/completions works, is refused with a 400 that names it, changes
nothing by design (user, metadata, ...), or is unknown: accepted, logged once, and listed in the
`x-sluice-ignored-fields` response header. One server serves every test: the priority policy, one
sequence at a time (so that requests wait in priority order), and the default model's chat template with
a prefix that renders two extra variables (nothing when they are unset). The fcfs policy's refusal of a
priority is checked by validate.rs's unit tests.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer

from openai_errors import refused_param as openai_400_param
from serve_fixtures import Server, running_server

MODEL = "SmolLM2-135M-Instruct"
HEADER = "x-sluice-ignored-fields"
PROMPT = "The capital of France is"
MESSAGES: Any = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
# The extra variables the second server's chat template reads, each as a system message of its own.
TEMPLATE_PREFIX = (
    "{% if system_note %}{{ '<|im_start|>system\\n' + system_note + '<|im_end|>\\n' }}{% endif %}"
    "{% if reasoning_effort %}{{ '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def template_model(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model with a chat template that renders `system_note` and `reasoning_effort`."""
    folder = tmp_path_factory.mktemp("templated") / "SmolLM2-templated"
    folder.mkdir()
    for file in default_model_path.iterdir():
        if file.name != "chat_template.jinja":
            (folder / file.name).symlink_to(file.resolve())
    own = (default_model_path / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(TEMPLATE_PREFIX + own)
    return folder


@pytest.fixture(scope="module")
def server(template_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [str(template_model), "--served-model-name", MODEL, "--max-model-len", "1024"]
    args += ["--kv-cache-memory", "1", "--scheduling-policy", "priority", "--max-num-seqs", "1"]
    with running_server(args, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def refused_param(call: Any, **kwargs: Any) -> str | None:
    """The `param` of the 400 that `call(**kwargs)` must get."""
    return openai_400_param(call, model=MODEL, **kwargs)


def test_an_unknown_field_is_accepted_listed_in_the_header_and_logged_once(
    server: Server, client: openai.OpenAI
) -> None:
    for _ in range(2):
        raw = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=2,
            extra_body={"frobnicate_level": 3, "guided_json_typo": {"type": "object"}},
        )
        assert raw.headers.get(HEADER) == "frobnicate_level, guided_json_typo"
        assert raw.parse().choices[0].text
    streamed = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "sparkle": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"frobnicate_level": 1},
    )
    assert streamed.headers.get(HEADER) == "frobnicate_level, stream_options.sparkle"
    assert [chunk for chunk in streamed.parse()][-1].usage is not None
    log = server.log.read_text(errors="replace")
    assert log.count('ignoring the unknown request field "frobnicate_level"') == 1, server.log_tail()
    assert log.count('ignoring the unknown request field "stream_options.sparkle"') == 1


def test_fields_that_change_nothing_are_accepted_without_a_header(client: openai.OpenAI) -> None:
    no_ops: dict[str, Any] = {
        "user": "someone",
        "metadata": {"team": "sluice"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"spaces_between_special_tokens": True, "use_beam_search": False, "modalities": ["text"]},
        **no_ops,
    )
    assert HEADER not in raw.headers
    assert raw.parse().choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, user="someone", suffix="", extra_body={"priority": 0}
    )
    assert HEADER not in completion.headers


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        ("completions", {"suffix": " and that is all."}, "suffix"),
        ("chat", {"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        ("completions", {"extra_body": {"length_penalty": 0.5}}, "length_penalty"),
        ("completions", {"extra_body": {"bad_words": ["Paris", " "]}}, "bad_words"),
        ("completions", {"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
        ("chat", {"extra_body": {"truncate_prompt_tokens": 5000}}, "truncate_prompt_tokens"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"modalities": ["text", "audio"]}, "modalities"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
        ("chat", {"extra_body": {"cache_salt": ""}}, "cache_salt"),
        ("chat", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        # This server runs no reasoning parser: there is no thinking to budget.
        ("chat", {"extra_body": {"thinking_token_budget": 8}}, "thinking_token_budget"),
        ("completions", {"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ("chat", {"extra_body": {"allowed_token_ids": [5, 49152]}}, "allowed_token_ids"),
        # The default model's EOS is 2 (<|im_end|>): under min_tokens nothing could be sampled.
        ("completions", {"extra_body": {"allowed_token_ids": [2], "min_tokens": 1}}, "allowed_token_ids"),
    ],
)
def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(
    client: openai.OpenAI, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    if endpoint == "completions":
        got = refused_param(client.completions.create, prompt=PROMPT, max_tokens=2, **fields)
    else:
        got = refused_param(client.chat.completions.create, messages=MESSAGES, max_tokens=2, **fields)
    assert got == param


def test_allowed_token_ids_restrict_every_sampled_token(client: openai.OpenAI) -> None:
    # Token ids of " yes", " no" and " maybe" in the default model's vocabulary, from its tokenizer.
    tokens = client.post("/../tokenize", body={"prompt": " yes no maybe"}, cast_to=object)["tokens"]  # type: ignore[index]
    allowed = sorted(set(tokens))
    assert len(allowed) == 3
    for temperature in (0.0, 1.5):
        completion = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=temperature,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True},
        )
        choice = completion.choices[0]
        got = choice.token_ids  # type: ignore[attr-defined]
        assert len(got) == 12 and set(got) <= set(allowed), (temperature, got)
    # Unrestricted, the model's greedy answer is none of them ("Paris").
    free = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert not set(free.choices[0].token_ids) <= set(allowed)  # type: ignore[attr-defined]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    assert chat.choices[0].message.content.strip().split() == chat.choices[0].message.content.split()
    assert set(chat.choices[0].message.content.split()) <= {"yes", "no", "maybe"}


def contains_run(ids: list[int], run: list[int]) -> bool:
    return any(ids[i : i + len(run)] == run for i in range(len(ids) - len(run) + 1))


def test_bad_words_never_appear_as_their_tokens(client: openai.OpenAI) -> None:
    def tokens(text: str) -> list[int]:
        return client.post(
            "/../tokenize", body={"prompt": text, "add_special_tokens": False}, cast_to=object
        )["tokens"]  # type: ignore[index]

    # Unconstrained, the greedy answer is " Paris" (one token); then the model repeats itself.
    free = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    paris, the_capital = tokens(" Paris"), tokens(" the capital")
    assert len(paris) == 1 and len(the_capital) == 2
    free_ids: list[int] = free.choices[0].token_ids  # type: ignore[attr-defined]
    assert contains_run(free_ids, paris) and " Paris" in free.choices[0].text
    for temperature in (0.0, 1.0):
        banned = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=24,
            temperature=temperature,
            seed=7,
            extra_body={"bad_words": ["Paris", "the capital"], "ignore_eos": True, "return_token_ids": True},
        )
        ids: list[int] = banned.choices[0].token_ids  # type: ignore[attr-defined]
        assert len(ids) == 24
        for word in ("Paris", " Paris", "the capital", " the capital"):
            assert not contains_run(ids, tokens(word)), (temperature, word, banned.choices[0].text)
    # The same through chat, whose reply names Paris unconstrained.
    free_chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
    assert "Paris" in free_chat.choices[0].message.content
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,
        extra_body={"bad_words": [" Paris"], "return_token_ids": True},
    )
    chat_ids: list[int] = chat.choices[0].token_ids  # type: ignore[attr-defined]
    assert not contains_run(chat_ids, tokens("Paris")) and not contains_run(chat_ids, tokens(" Paris"))


def test_cache_salt_shares_the_prefix_cache_only_under_the_same_salt(
    server: Server, client: openai.OpenAI
) -> None:
    # A prompt no other test sends, of several 16-token blocks.
    prompt = "Salted cache check: " + " ".join(f"item{i}" for i in range(60))

    def hit_tokens(**salt: str) -> float:
        before = server.metrics()["sluice:prefix_cache_hits_total"]
        usage = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=salt
        ).usage
        hits = server.metrics()["sluice:prefix_cache_hits_total"] - before
        # The response's own count of cached prompt tokens agrees with the engine's counter.
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == hits
        return hits

    assert hit_tokens(cache_salt="tenant-a") == 0
    assert hit_tokens(cache_salt="tenant-a") >= 64
    # Another salt, or none, finds nothing of tenant-a's; the unsalted prompt then hits its own.
    assert hit_tokens(cache_salt="tenant-b") == 0
    assert hit_tokens() == 0
    assert hit_tokens() >= 64


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI) -> None:
    tokens = client.post("/../tokenize", body={"prompt": PROMPT}, cast_to=object)["tokens"]  # type: ignore[index]
    assert len(tokens) > 3
    tail = client.post("/../detokenize", body={"tokens": tokens[-3:]}, cast_to=object)["prompt"]  # type: ignore[index]
    cut = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert cut.usage.prompt_tokens == 3
    # The echo is the text the model saw, and the model continued from the same three tokens.
    as_ids = client.completions.create(model=MODEL, prompt=tokens[-3:], max_tokens=4, temperature=0)
    assert cut.choices[0].text == tail + as_ids.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"truncate_prompt_tokens": 6}
    )
    assert chat.usage.prompt_tokens == 6


def test_continue_final_message_continues_the_assistants_text(client: openai.OpenAI) -> None:
    start = "The capital of France is"
    messages: Any = [*MESSAGES, {"role": "assistant", "content": start}]

    def tokens(body: dict[str, Any]) -> list[int]:
        return client.post("/../tokenize", body=body, cast_to=object)["tokens"]  # type: ignore[index]

    # The rendered conversation with its generation prompt, then the start of the answer.
    prompt = tokens({"messages": MESSAGES}) + tokens({"prompt": start, "add_special_tokens": False})
    as_tokens = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    continued = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    assert continued.usage.prompt_tokens == len(prompt)
    assert continued.choices[0].message.content == as_tokens.choices[0].text
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    assert raised.value.body["param"] == "continue_final_message"  # type: ignore[index]


def test_chat_echo_leads_with_the_prefilled_answer_whole_and_streamed(client: openai.OpenAI) -> None:
    """vLLM's chat `echo`: with the assistant's prefilled start as the final message, each choice's
    content is that start followed by what the model wrote; a final user message echoes nothing."""
    start = "The capital of France is"
    messages: Any = [*MESSAGES, {"role": "assistant", "content": start}]
    common: Any = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**common, extra_body={"continue_final_message": True})
    generated = plain.choices[0].message.content
    assert generated
    extra = {"continue_final_message": True, "echo": True}
    echoed = client.chat.completions.create(**common, n=2, extra_body=extra)
    assert [c.message.content for c in echoed.choices] == [start + generated] * 2
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    stream = client.chat.completions.create(**common, stream=True, extra_body=extra)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces) == start + generated
    # Content parts are joined one per line, as the template sees them.
    parts: Any = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": start}]}]
    as_parts = client.chat.completions.create(**{**common, "messages": parts}, extra_body=extra)
    assert as_parts.choices[0].message.content == start + generated
    after_user = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, extra_body={"echo": True}
    )
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert after_user.choices[0].message.content == without.choices[0].message.content


def test_without_a_generation_prompt_the_answer_has_the_final_messages_role(client: openai.OpenAI) -> None:
    """As vLLM: add_generation_prompt false goes on with the final message, so the choices' messages
    (whole and streamed) have its role, and echo repeats it; with the prompt they are the assistant's."""
    common: Any = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    going_on = {"add_generation_prompt": False}
    whole = client.chat.completions.create(**common, extra_body=going_on)
    assert whole.choices[0].message.role == "user"  # type: ignore[comparison-overlap]
    stream = client.chat.completions.create(**common, stream=True, extra_body=going_on)
    roles = [chunk.choices[0].delta.role for chunk in stream if chunk.choices]
    assert roles[0] == "user" and not any(roles[1:])  # type: ignore[comparison-overlap]
    echoed = client.chat.completions.create(**common, extra_body={**going_on, "echo": True})
    assert echoed.choices[0].message.content == MESSAGES[-1]["content"] + whole.choices[0].message.content
    answer = client.chat.completions.create(**common)
    assert answer.choices[0].message.role == "assistant"


def test_return_token_ids_puts_the_prompts_and_outputs_ids_in_the_response(client: openai.OpenAI) -> None:
    def tokens(body: dict[str, Any]) -> list[int]:
        return client.post("/../tokenize", body=body, cast_to=object)["tokens"]  # type: ignore[index]

    shown = {"extra_body": {"return_token_ids": True}, "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **shown).model_dump()
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == tokens({"prompt": PROMPT})
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    text = client.post("/../detokenize", body={"tokens": choice["token_ids"]}, cast_to=object)["prompt"]  # type: ignore[index]
    assert text == choice["text"]
    chunks = [
        c.model_dump() for c in client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **shown)
    ]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **shown).model_dump()
    assert chat["prompt_token_ids"] == tokens({"messages": MESSAGES})
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    streamed = [
        c.model_dump()
        for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **shown)
    ]
    assert streamed[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    ids = [t for c in streamed for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert ids == chat["choices"][0]["token_ids"]


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    before = text[: text.index(stop)]
    for include, expected in [(False, before), (True, before + stop)]:
        whole = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            extra_body={"include_stop_str_in_output": include},
        ).choices[0]
        assert (whole.text, whole.finish_reason) == (expected, "stop")
        chunks = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=True,
            extra_body={"include_stop_str_in_output": include},
        )
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected


def test_skip_special_tokens_and_the_stop_token(client: openai.OpenAI) -> None:
    def reply(**extra_body: bool) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0, extra_body=extra_body
        ).choices[0]

    plain = reply()
    # The model ends its turn with <|im_end|>, its EOS token, within 64 tokens.
    assert plain.finish_reason == "stop" and plain.message.content
    assert "<|im_end|>" not in plain.message.content
    # The stop token's text comes only with include_stop_str_in_output, and only if special tokens show.
    assert reply(skip_special_tokens=False).message.content == plain.message.content
    assert reply(include_stop_str_in_output=True).message.content == plain.message.content
    shown = reply(skip_special_tokens=False, include_stop_str_in_output=True).message.content
    assert shown == plain.message.content + "<|im_end|>"


def test_continuous_usage_stats_put_usage_on_every_chunk(client: openai.OpenAI) -> None:
    for create, kwargs in [
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ]:
        chunks = list(
            create(
                model=MODEL,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
                extra_body={"ignore_eos": True},
                **kwargs,
            )
        )
        assert all(chunk.usage is not None for chunk in chunks)
        counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None]
        assert counts == sorted(counts) and counts[-1] == 6
        prompt_tokens = {chunk.usage.prompt_tokens for chunk in chunks if chunk.usage is not None}
        assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0


def test_priority_orders_the_waiting_requests(client: openai.OpenAI) -> None:
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, priority: int) -> None:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": priority})
        with lock:
            finished.append(name)

    # The server runs one sequence at a time: while this stream holds it, the other two wait.
    running = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=512, stream=True, extra_body={"ignore_eos": True}
    )
    assert next(iter(running)).choices
    threads = [
        threading.Thread(target=run, args=("early but lax", 5)),
        threading.Thread(target=run, args=("late but urgent", -5)),
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.5)
    # Closing the stream aborts its request; the waiting ones then run, the more urgent (lower) first.
    running.close()
    for thread in threads:
        thread.join(120)
    assert finished == ["late but urgent", "early but lax"]


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(
    server: Server, client: openai.OpenAI
) -> None:
    def prompt_tokens(**extra: Any) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **extra)
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    def tokens_of(text: str) -> int:
        body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
        return len(server.request("POST", "/tokenize", body).body["tokens"])

    plain = prompt_tokens()
    note = "Always answer in French."
    with_note = prompt_tokens(extra_body={"chat_template_kwargs": {"system_note": note}})
    assert with_note == plain + tokens_of(f"<|im_start|>system\n{note}<|im_end|>\n")
    with_effort = prompt_tokens(reasoning_effort="low")
    assert with_effort == plain + tokens_of("<|im_start|>system\nReasoning: low<|im_end|>\n")
    # The template's own variables cannot be replaced.
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}) == plain


def test_tokenize_renders_messages_as_chat_does_and_reports_its_fields(
    server: Server, client: openai.OpenAI, default_model_path: Path
) -> None:
    def tokenize(body: dict[str, Any]) -> Any:
        return client.post("/../tokenize", body={"model": MODEL, **body}, cast_to=object)

    continued: Any = [*MESSAGES, {"role": "assistant", "content": "The capital of France is"}]
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    for messages, extra in [
        (continued, {"continue_final_message": True}),
        (MESSAGES, {"chat_template_kwargs": {"system_note": "Answer in French."}}),
        (MESSAGES, {"tools": tools}),
    ]:
        chat = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body={"return_token_ids": True, **extra}
        ).model_dump()
        tokens = tokenize({"messages": messages, **extra})["tokens"]
        assert tokens == chat["prompt_token_ids"], extra
        assert tokens != tokenize({"messages": messages})["tokens"], f"{extra} changed nothing"

    vocabulary = Tokenizer.from_file(str(default_model_path / "tokenizer.json"))
    shown = tokenize({"prompt": PROMPT, "return_token_strs": True})
    assert shown["token_strs"] == [vocabulary.id_to_token(i) for i in shown["tokens"]]
    assert "token_strs" not in tokenize({"prompt": PROMPT})

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        body = json.dumps({"prompt": PROMPT, "frobnicate_level": 2})
        connection.request("POST", "/tokenize", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.getheader(HEADER) == "frobnicate_level"
        assert json.loads(response.read())["tokens"] == shown["tokens"]
    finally:
        connection.close()
    for body, param in [
        ({"prompt": PROMPT, "add_generation_prompt": True}, "add_generation_prompt"),
        ({"prompt": PROMPT, "tools": tools}, "tools"),
        ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
        (
            {"messages": continued, "continue_final_message": True, "add_generation_prompt": True},
            "continue_final_message",
        ),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            tokenize(body)
        assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


OWN_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def trusting_server(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [str(default_model_path), "--served-model-name", MODEL, "--max-model-len", "512"]
    args += ["--kv-cache-memory", "0.25", "--trust-request-chat-template"]
    with running_server(args, log) as running:
        yield running


def test_a_trusted_request_renders_with_its_own_chat_template(
    trusting_server: Server, default_model_path: Path
) -> None:
    vocabulary = Tokenizer.from_file(str(default_model_path / "tokenizer.json"))
    expected = vocabulary.encode(
        "[user] What is the capital of France? Answer in one short sentence.\n[assistant] ",
        add_special_tokens=False,
    ).ids
    with openai.OpenAI(
        base_url=trusting_server.url + "/v1", api_key="none", max_retries=0, timeout=120
    ) as client:
        tokens = client.post(
            "/../tokenize",
            body={"model": MODEL, "messages": MESSAGES, "chat_template": OWN_TEMPLATE},
            cast_to=object,
        )
        assert tokens["tokens"] == expected  # type: ignore[index]
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"chat_template": OWN_TEMPLATE}
        )
        assert reply.usage is not None and reply.usage.prompt_tokens == len(expected)
        # The model's own template makes a different prompt.
        plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert plain.usage is not None and plain.usage.prompt_tokens != len(expected)
        for template in (
            "{% for m in messages %}",  # does not compile
            "{{ raise_exception('not this conversation') }}",
            # Runs out of its bounded work long before it would end.
            "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
        ):
            got = refused_param(
                client.chat.completions.create,
                messages=MESSAGES,
                max_tokens=2,
                extra_body={"chat_template": template},
            )
            assert got == "chat_template", template
    assert trusting_server.health() == 200
