"""`sluice serve` on the default model, end to end, driven with the official `openai` package.

One server (with an API key) serves most tests; the last ones use a second, small server: its
waiting queue holds one request (429), then its engine core is killed (with --no-restart-engine, so
that serve exits; tests/e2e/test_engine_restart.py covers restarts).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from serve_fixtures import SLUICE, Server, alive, cmdline, descendants, openai_client, running_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-sluice-test"
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 65536
# Greedy picks may differ between batch shapes only where two tokens were this close in logprob.
TIE_LOGPROB = 0.3
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "def fibonacci(n):",
    "The quick brown fox",
    "Water boils at a temperature of",
    "My favourite book is",
    "In 1969, astronauts",
]


@dataclass
class Logprobs:
    tokens: list[str]
    top_logprobs: list[dict[str, float]]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "1"]
    args += ["--max-body-bytes", str(MAX_BODY_BYTES)]
    with running_server(args, log, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server) as c:
        yield c


def greedy(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 16, **extra: Any) -> Any:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
    ).choices[0]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_reports_usage(server: Server, client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    (choice,) = result.choices
    assert choice.text and choice.finish_reason == "length"
    tokens = server.request("POST", "/tokenize", {"model": MODEL, "prompt": PROMPTS[0]}).body["tokens"]
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(tokens), 8)
    assert result.usage.total_tokens == len(tokens) + 8
    assert (
        server.request("POST", "/detokenize", {"model": MODEL, "tokens": tokens}).body["prompt"] == PROMPTS[0]
    )


def test_metrics_count_no_eager_fallbacks_on_cpu(server: Server, client: openai.OpenAI) -> None:
    assert greedy(client, PROMPTS[2], max_tokens=4).text
    lines = str(server.request("GET", "/metrics").body).splitlines()
    assert "# TYPE sluice:graph_eager_fallbacks_total counter" in lines
    # The CPU's dispatcher takes every batch shape, so no step falls back to eager.
    assert f'sluice:graph_eager_fallbacks_total{{model_name="{MODEL}"}} 0' in lines


def test_streamed_completion_joins_to_the_same_text_with_usage_last(client: openai.OpenAI) -> None:
    expected = greedy(client, PROMPTS[1], max_tokens=20).text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not_agree(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a river in Egypt."},
    ]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    (choice,) = result.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert result.usage is not None and result.usage.completion_tokens <= 24
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == result.usage.total_tokens
    # The second time, every full 16-token block of the prompt but one holding its last token is a
    # prefix-cache hit, and the closing usage says so.
    details = chunks[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == (result.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_n_2_returns_two_choices(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=2, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert all(c.text for c in result.choices)
    assert result.usage is not None and result.usage.completion_tokens == 16
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=8, n=2, seed=7
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs_for_completions_and_chat(client: openai.OpenAI) -> None:
    choice = greedy(client, PROMPTS[0], max_tokens=6, logprobs=2)
    logprobs = choice.logprobs
    assert logprobs is not None and len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    for sampled, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert sampled <= 0.0 and 2 <= len(top) <= 3
        # Greedy: the sampled token is the most likely one.
        assert sampled == pytest.approx(max(top.values()), abs=1e-4)

    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert content is not None and 1 <= len(content) <= 5
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(t.logprob <= 0.0 and len(t.top_logprobs) == 2 for t in content)


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI) -> None:
    full = greedy(client, PROMPTS[1], max_tokens=32).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    choice = greedy(client, PROMPTS[1], max_tokens=32, stop=[stop, "no such string"])
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproduces_a_sample(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL, prompt=PROMPTS[6], max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_greedy_text_equals_the_offline_engine(server: Server, client: openai.OpenAI) -> None:
    from engine import LLM, SamplingParams

    ids = [
        server.request("POST", "/tokenize", {"model": MODEL, "prompt": p}).body["tokens"] for p in PROMPTS[:4]
    ]
    served = [greedy(client, prompt_ids, max_tokens=24).text for prompt_ids in ids]
    llm = LLM(model=None, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, kv_cache_memory=0.25)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    # One at a time, as they were served: a batch of another shape may round differently in bfloat16.
    offline = [llm.generate([{"prompt_token_ids": prompt_ids}], params)[0] for prompt_ids in ids]
    assert served == [o.outputs[0].text for o in offline]
    assert ids == [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:4]]


def assert_same_greedy_tokens(got: Any, reference: Any, label: str) -> None:
    """Equal token by token, except where bfloat16 rounding in a batch of another shape broke a near-tie."""
    assert len(got.tokens) == len(reference.tokens), label
    for i, (token, expected) in enumerate(zip(got.tokens, reference.tokens, strict=True)):
        if token != expected:
            top = got.top_logprobs[i]
            assert expected in top and top[token] - top[expected] < TIE_LOGPROB, (label, i, top, expected)
            return


def test_64_concurrent_streams_complete_correctly(server: Server, client: openai.OpenAI) -> None:
    ignore_eos = {"ignore_eos": True}
    references = [greedy(client, p, max_tokens=12, logprobs=2, extra_body=ignore_eos) for p in PROMPTS]

    async def stream(prompt: str) -> tuple[Any, str | None, int]:
        chunks = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=ignore_eos,
        )
        logprobs = Logprobs(tokens=[], top_logprobs=[])
        text, reason, tokens = "", None, 0
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
                logprobs.tokens += chunk.choices[0].logprobs.tokens
                logprobs.top_logprobs += chunk.choices[0].logprobs.top_logprobs
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        assert text and len(logprobs.tokens) == tokens
        return logprobs, reason, tokens

    async def all_streams() -> list[tuple[Any, str | None, int]]:
        async with aclient:
            return await asyncio.gather(*(stream(PROMPTS[i % len(PROMPTS)]) for i in range(64)))

    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    results = asyncio.run(all_streams())
    for i, (logprobs, reason, tokens) in enumerate(results):
        assert (reason, tokens) == ("length", 12), f"request {i}"
        assert_same_greedy_tokens(logprobs, references[i % len(PROMPTS)].logprobs, f"request {i}")


def test_client_disconnect_frees_the_kv_cache(server: Server, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    metrics = server.metrics()
    assert metrics["sluice:kv_cache_usage_perc"] > 0 and metrics["sluice:num_requests_running"] == 1
    stream.close()
    # Finishing 1500 tokens would take far longer: only an abort frees the blocks this soon.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["sluice:kv_cache_usage_perc"] == 0 and metrics["sluice:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    assert metrics["sluice:kv_cache_usage_perc"] == 0
    assert metrics["sluice:num_requests_running"] == 0


def assert_openai_error(response: Any, status: int) -> dict[str, Any]:
    assert response.status == status, response
    error = response.body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b'{"model": "x", "prompt": ', 400),
        ("/v1/completions", completion(max_tokens="four"), 400),
        ("/v1/completions", completion(prompt=7), 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
        ("/v1/completions", completion(model="no-such-model"), 404),
        (
            "/v1/chat/completions",
            {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            404,
        ),
        ("/v1/completions", completion(temperature=-1.0), 400),
        ("/v1/completions", completion(top_p=1.5), 400),
        ("/v1/completions", completion(n=0), 400),
        ("/v1/completions", completion(max_tokens=0), 400),
        ("/v1/completions", completion(logprobs=1000), 400),
        ("/v1/completions", completion(prompt=[504] * (MAX_MODEL_LEN + 1)), 400),
        ("/v1/completions", completion(prompt="hello " * (MAX_MODEL_LEN + 10)), 400),
        ("/v1/completions", completion(max_tokens=MAX_MODEL_LEN), 400),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
        ("/v1/completions", completion(prompt="x" * MAX_BODY_BYTES * 2), 413),
    ],
    ids=[
        "malformed-json",
        "string-max-tokens",
        "int-prompt",
        "string-messages",
        "unknown-model",
        "unknown-chat-model",
        "negative-temperature",
        "top-p-over-1",
        "n-0",
        "max-tokens-0",
        "too-many-logprobs",
        "prompt-ids-over-max-model-len",
        "prompt-text-over-max-model-len",
        "max-tokens-cannot-fit",
        "empty-messages",
        "body-over-limit",
    ],
)
def test_bad_input_gets_its_status_and_an_openai_error(
    server: Server, path: str, body: bytes | dict[str, Any], status: int
) -> None:
    assert_openai_error(server.request("POST", path, body), status)


def test_api_key_is_required(server: Server) -> None:
    for key in (None, "sk-wrong"):
        assert_openai_error(server.request("POST", "/v1/completions", completion(), api_key=key), 401)
        assert_openai_error(server.request("GET", "/v1/models", api_key=key), 401)
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert server.health() == 200


def test_errors_reach_the_openai_client_typed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=-3)
    assert greedy(client, "Hi", max_tokens=2).text


def test_embeddings_of_a_generative_model_are_refused_naming_the_pooling_runner(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="Hi")
    message = refused.value.message
    assert "generative model" in message and "--runner pooling" in message, message


def test_sigterm_drains_then_exits_0_leaving_no_processes(server: Server, client: openai.OpenAI) -> None:
    children = descendants(server.process.pid)
    # The frontend, the engine core and one worker process (TP=1, the mp executor).
    assert len(children) == 3, [cmdline(pid) for pid in children]
    assert len(server.worker_pids()) == 1 and server.engine_pid() in children
    ignore_eos = {"ignore_eos": True}
    expected = greedy(client, PROMPTS[4], max_tokens=48, extra_body=ignore_eos).text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=48, temperature=0, stream=True, extra_body=ignore_eos
    )
    chunks = [next(iter(stream))]
    server.process.send_signal(signal.SIGTERM)
    chunks += list(stream)
    # The request in flight drains to its end.
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.process.wait(30) == 0
    assert not [pid for pid in children if alive(pid)]
    assert server.socket_dir is not None and not server.socket_dir.exists()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-small") / "serve.log"
    args = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--max-num-seqs", "1"]
    args += ["--max-waiting-requests", "1", "--exit-grace-seconds", "3", "--no-restart-engine"]
    with running_server(args, log) as running:
        yield running


def test_full_waiting_queue_answers_429(small_server: Server) -> None:
    results: list[Any] = []

    def call() -> None:
        with openai.OpenAI(base_url=small_server.url + "/v1", api_key="none", max_retries=0) as c:
            try:
                # Long enough to outlast the stagger below on a fast machine (64 tokens did not
                # on a Zen 5: each finished before the next arrived, and the queue never filled).
                c.completions.create(
                    model=MODEL, prompt="Count:", max_tokens=400, extra_body={"ignore_eos": True}
                )
                results.append("ok")
            except openai.RateLimitError as exc:
                results.append(exc)

    threads = []
    # Staggered, so that a limit counted from the engine's stats sees each earlier request.
    for _ in range(8):
        threads.append(threading.Thread(target=call))
        threads[-1].start()
        time.sleep(0.3)
        if any(isinstance(r, openai.RateLimitError) for r in results):
            break
    for thread in threads:
        thread.join(120)
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert limited and "ok" in results, results
    assert limited[0].status_code == 429
    assert isinstance(limited[0].body, dict) and set(limited[0].body) >= {"message", "type"}


def assert_a_kill_fails_the_stream_and_serve_exits(server: Server, victim: int, cause: str) -> None:
    """SIGKILL `victim` mid-stream: the stream ends with an error event matching `cause`, /health
    turns 503, and sluice serve exits non-zero leaving no process behind."""
    children = descendants(server.process.pid)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        stream = c.completions.create(
            model=MODEL, prompt="Count:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(openai.APIError, match=cause) as failure:
            for _ in stream:
                pass
        # An error event, not a dropped connection.
        assert not isinstance(failure.value, openai.APIConnectionError), failure.value
    # The engine core fails the requests first, then exits; /health follows its exit.
    deadline = time.monotonic() + 10
    while server.health() != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health() == 503
    assert server.process.wait(30) != 0
    assert not [pid for pid in children if alive(pid)]


def test_engine_death_fails_streams_turns_health_503_and_exits_nonzero(small_server: Server) -> None:
    assert_a_kill_fails_the_stream_and_serve_exits(small_server, small_server.engine_pid(), r".")


def test_worker_death_fails_streams_with_the_cause_and_exits_nonzero(tmp_path: Path) -> None:
    args = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--exit-grace-seconds", "3"]
    args.append("--no-restart-engine")
    with running_server(args, tmp_path / "serve.log") as server:
        [worker] = server.worker_pids()
        assert_a_kill_fails_the_stream_and_serve_exits(server, worker, r"worker rank 0 .*killed by signal 9")


def test_serve_refuses_a_missing_frontend(tmp_path: Path) -> None:
    env = {**os.environ, "SLUICE_FRONTEND": str(tmp_path / "absent")}
    done = subprocess.run(
        [str(SLUICE), "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "frontend binary" in done.stderr, done.stderr
