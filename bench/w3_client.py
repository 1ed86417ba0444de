"""The W3 client: the W1 prompts as streaming /v1/completions requests, through the official `openai` client.

Per request: TTFT is the time to the first chunk carrying text; TPOT is (end - TTFT) / (tokens - 1);
tokens come from the stream's usage. Throughput is all output tokens over the run's wall time.
Works against any OpenAI-compatible server that takes token-id prompts and `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harness import percentile

if TYPE_CHECKING:
    from openai import AsyncOpenAI


@dataclass(frozen=True, slots=True)
class RequestTiming:
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.output_tokens - 1, 1)


@dataclass(frozen=True, slots=True)
class W3Run:
    """One run's figures: throughput in tok/s, latencies in ms."""

    out_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tokens: int

    @classmethod
    def of(cls, timings: list[RequestTiming], elapsed: float) -> W3Run:
        ttft = [1e3 * t.ttft for t in timings]
        tpot = [1e3 * t.tpot for t in timings]
        tokens = sum(t.output_tokens for t in timings)
        return cls(
            out_tok_s=tokens / elapsed,
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p99_ms=percentile(ttft, 99),
            tpot_p50_ms=percentile(tpot, 50),
            tpot_p99_ms=percentile(tpot, 99),
            output_tokens=tokens,
        )


async def one_request(
    client: AsyncOpenAI, model: str, prompt: list[int], max_tokens: int, extra: dict[str, Any]
) -> RequestTiming:
    start = time.perf_counter()
    ttft = None
    tokens = 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    e2e = time.perf_counter() - start
    assert tokens == max_tokens, f"expected {max_tokens} tokens, got {tokens}"
    return RequestTiming(ttft if ttft is not None else e2e, e2e, tokens)


async def _run(
    base_url: str, prompts: list[list[int]], concurrency: int, max_tokens: int, extra: dict[str, Any]
) -> W3Run:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> RequestTiming:
        async with gate:
            return await one_request(client, model, prompt, max_tokens, extra)

    start = time.perf_counter()
    timings = await asyncio.gather(*(gated(p) for p in prompts))
    elapsed = time.perf_counter() - start
    await client.close()
    return W3Run.of(list(timings), elapsed)


def run_w3(
    base_url: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    extra: dict[str, Any] | None = None,
) -> W3Run:
    """All `prompts`, at most `concurrency` in flight, each streaming `max_tokens` tokens; `extra` fields
    go with every request (a server's own switches, such as llama-server's cache_prompt)."""
    return asyncio.run(_run(base_url, prompts, concurrency, max_tokens, extra or {}))
