"""A bounded soak of mixed traffic against one running `sluice serve`, with its RSS curve (issue 10,
item 7).

`concurrency` clients (the real `openai` async client: the package's test extra) send requests back
to back until the time is up: completions and chat, streamed and not, temperature, top_p,
max_tokens, logprobs, n > 1, stop strings and seeds drawn at random; some are aborted by their client
at a random point and some are invalid on purpose (and must get a 400 in OpenAI's shape). Every other
request must succeed and be well formed: n choices, each finished, no stop string in its text. The
RSS of every process is sampled throughout; after warm-up none may grow by 5% or more. Afterwards the
engine must be idle and the block-pool audit clean. bench/soak.py runs it full-size,
tests/e2e/test_soak.py short.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai

from sluice.stress.process_rss import RssSampler, mib, plot_rss, rss_growth, snapshot
from sluice.stress.progress import log, report_progress
from sluice.stress.server_state import block_pool_audit, served_model, wait_until_idle

MAX_RSS_GROWTH = 0.05
# The openai client's timeout: the whole answer of a non-streamed request, the gap between two
# chunks of a stream. Generous: on two shared cores a 64-token, n=3 request can take minutes.
REQUEST_TIMEOUT_S = 600.0
PROMPTS = (
    "Write a haiku about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "List three uses of copper. Then explain why it conducts electricity.",
    "Tell a story about a cat, a dog and a parrot who open a bakery together.",
)
STOPS = (None, ["."], [" the", "\n"], ["cat", "!", "?"])
OK = "ok"
ABORTED = "aborted by the client"
REFUSED_AS_INVALID = "invalid, 400 as expected"
REFUSED_429 = "429 with Retry-After"
CLIENTS_OWN = (OK, ABORTED, REFUSED_AS_INVALID, REFUSED_429)


class Malformed(Exception):
    """A 200 whose content breaks what was asked for."""


def draw_request(rng: random.Random, model: str) -> tuple[str, dict[str, Any], str]:
    """(endpoint, keyword arguments for the openai client, what the client will do with it)."""
    chat = rng.random() < 0.5
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.choice((1, 4, 16, 32, 64)),
        "temperature": rng.choice((0.0, 0.7, 1.0, 1.5)),
        "top_p": rng.choice((1.0, 0.9, 0.5)),
        "n": rng.choice((1, 1, 2, 3)),
        "stream": rng.random() < 0.6,
    }
    if stop := rng.choice(STOPS):
        kwargs["stop"] = stop
    if rng.random() < 0.2:
        kwargs["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.3:
        if chat:
            kwargs |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
        else:
            kwargs["logprobs"] = rng.randint(0, 5)
    if kwargs["stream"] and rng.random() < 0.5:
        kwargs["stream_options"] = {"include_usage": True}
    prompt = rng.choice(PROMPTS)
    if chat:
        kwargs["messages"] = [{"role": "user", "content": prompt}]
    else:
        kwargs["prompt"] = prompt
    roll = rng.random()
    if roll < 0.15:
        return ("chat" if chat else "completions"), kwargs, "abort"
    if roll < 0.2:
        kwargs[rng.choice(("temperature", "top_p"))] = -1.0
        return ("chat" if chat else "completions"), kwargs, "invalid"
    return ("chat" if chat else "completions"), kwargs, "complete"


def _check_choices(kwargs: dict[str, Any], texts: dict[int, str], finishes: dict[int, str | None]) -> None:
    if sorted(texts) != list(range(kwargs["n"])) or sorted(finishes) != sorted(texts):
        raise Malformed(f"asked n={kwargs['n']}, got choices {sorted(texts)} finished {sorted(finishes)}")
    for index, reason in finishes.items():
        if reason not in ("stop", "length"):
            raise Malformed(f"choice {index} finished with {reason!r}")
        for stop in kwargs.get("stop") or ():
            if stop in texts[index]:
                raise Malformed(f"choice {index}'s text {texts[index]!r} holds its stop string {stop!r}")


async def complete(client: openai.AsyncOpenAI, endpoint: str, kwargs: dict[str, Any]) -> None:
    """One request to its end; Malformed if the answer is not what was asked for."""
    api = client.chat.completions if endpoint == "chat" else client.completions
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    if kwargs["stream"]:
        stream = await api.create(**kwargs)
        async for chunk in stream:
            for choice in chunk.choices:
                piece = choice.delta.content if endpoint == "chat" else choice.text
                texts[choice.index] = texts.get(choice.index, "") + (piece or "")
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
    else:
        response = await api.create(**kwargs)
        for choice in response.choices:
            texts[choice.index] = (choice.message.content if endpoint == "chat" else choice.text) or ""
            finishes[choice.index] = choice.finish_reason
            if kwargs.get("logprobs") and choice.logprobs is None:
                raise Malformed("logprobs were asked for and none came back")
    _check_choices(kwargs, texts, finishes)


async def abort(
    client: openai.AsyncOpenAI, endpoint: str, kwargs: dict[str, Any], rng: random.Random
) -> None:
    """Leave a request at a random point: a stream after a few chunks, anything after a random wait."""
    api = client.chat.completions if endpoint == "chat" else client.completions
    if kwargs["stream"]:
        stream = await api.create(**kwargs)
        chunks = rng.randint(0, 8)
        async for _ in stream:
            chunks -= 1
            if chunks <= 0:
                break
        await stream.close()
    else:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(api.create(**kwargs), rng.uniform(0.0, 1.5))


async def one_request(client: openai.AsyncOpenAI, rng: random.Random, model: str) -> tuple[str, str]:
    """(outcome class, detail) of one drawn request."""
    endpoint, kwargs, plan = draw_request(rng, model)
    started = time.monotonic()

    def detail(what: object) -> str:
        return f"{endpoint} {kwargs} after {time.monotonic() - started:.0f} s: {what}"

    try:
        if plan == "abort":
            await abort(client, endpoint, kwargs, rng)
            return ABORTED, ""
        await complete(client, endpoint, kwargs)
    except openai.BadRequestError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        shaped = {"message", "type", "param", "code"} <= body.keys()
        if plan == "invalid" and shaped:
            return REFUSED_AS_INVALID, ""
        return "400 for a valid request" if plan != "invalid" else "400 not in OpenAI's shape", detail(exc)
    except openai.RateLimitError as exc:
        if exc.response.headers.get("retry-after", "").isdigit():
            return REFUSED_429, ""
        return "429 without Retry-After", detail(exc)
    except openai.APIStatusError as exc:
        return f"HTTP {exc.status_code}", detail(exc)
    except openai.APITimeoutError as exc:
        return f"hang (nothing for {REQUEST_TIMEOUT_S:.0f} s)", detail(exc)
    except openai.APIConnectionError as exc:
        return "connection error", detail(repr(exc.__cause__ or exc))
    except Malformed as exc:
        return "malformed answer", detail(exc)
    if plan == "invalid":
        return "invalid request accepted", detail("200")
    return OK, ""


async def soak_traffic(
    base_url: str, duration_s: float, concurrency: int, seed: int, describe_rss: Any
) -> tuple[Counter[str], dict[str, str]]:
    model = served_model(base_url)
    outcomes: Counter[str] = Counter()
    first_errors: dict[str, str] = {}
    deadline = time.monotonic() + duration_s
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:

        async def loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                kind, detail = await one_request(client, rng, model)
                outcomes[kind] += 1
                if kind not in CLIENTS_OWN:
                    first_errors.setdefault(kind, detail)

        def describe() -> str:
            return f"{outcomes.total()} requests: {dict(outcomes)}; RSS MiB {describe_rss()}"

        progress = asyncio.create_task(report_progress(describe))
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        progress.cancel()
    return outcomes, first_errors


def run_soak(
    base_url: str,
    root_pid: int,
    duration_s: float,
    concurrency: int,
    seed: int,
    png: Path | None,
    warmup_share: float = 0.3,
) -> dict[str, Any]:
    """The soak against a running server; `ok` when every error was the client's, no process grew by
    MAX_RSS_GROWTH or more after warm-up, and the engine ended idle with a clean block pool."""
    warmup_s = duration_s * warmup_share
    window_s = max(duration_s * 0.1, 5.0)
    sampler = RssSampler(root_pid, interval_s=1.0 if duration_s < 300 else 2.0)
    with sampler.running():
        outcomes, first_errors = asyncio.run(
            soak_traffic(base_url, duration_s, concurrency, seed, lambda: mib(snapshot(root_pid)))
        )
    gauges = wait_until_idle(base_url)
    audit = block_pool_audit(base_url)
    growth = rss_growth(sampler, warmup_s, window_s)
    if png is not None:
        plot_rss(
            sampler,
            warmup_s,
            window_s,
            png,
            f"sluice serve RSS, {duration_s:.0f} s soak, {concurrency} clients",
        )
        log(f"wrote {png}")
    server_errors = {kind: count for kind, count in outcomes.items() if kind not in CLIENTS_OWN}
    grown = {role: g for role, g in growth.items() if g["growth"] >= MAX_RSS_GROWTH}
    result = {
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "concurrency": concurrency,
        "seed": seed,
        "outcomes": dict(outcomes),
        "server_errors": server_errors,
        "first_errors": first_errors,
        "rss_growth": growth,
        "max_rss_growth": MAX_RSS_GROWTH,
        "gauges_after": gauges,
        "audit": audit,
        "png": str(png) if png else None,
        "rss": sampler.to_json(),
    }
    result["ok"] = (
        not server_errors
        and not grown
        and not any(gauges.values())
        and audit["consistent"]
        and outcomes[OK] > 0
    )
    for kind, detail in first_errors.items():
        log(f"first {kind}: {detail}")
    log(f"{outcomes.total()} requests: {dict(outcomes)}")
    log(
        "RSS growth after warm-up: "
        + ", ".join(
            f"{role} {100 * g['growth']:+.1f}% (peak {100 * g['peak_growth']:+.1f}%)"
            for role, g in growth.items()
        )
    )
    log(f"after: {gauges}; audit {'consistent' if audit['consistent'] else audit['problems']}")
    return result
