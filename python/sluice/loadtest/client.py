"""One streamed request to an OpenAI-compatible endpoint, timed token by token."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sluice.loadtest.datasets import SampleRequest
from sluice.loadtest.options import CHAT_ENDPOINT


@dataclass(slots=True)
class RequestOutcome:
    """What one request measured; times in seconds, `start` on the perf_counter clock."""

    prompt_len: int
    start: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2el: float = 0.0
    output_tokens: int = 0
    usage_reported: bool = False
    reason: str = ""  # empty when the request succeeded; otherwise a short category
    error: str = ""  # the full message behind `reason`
    retry_after: str | None = None  # the Retry-After header of a refusal (429, 503), if it had one

    @property
    def success(self) -> bool:
        return not self.reason

    @property
    def tpot(self) -> float:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(slots=True)
class RequestSpec:
    """How every request of a run is addressed and shaped."""

    base_url: str
    endpoint: str
    model: str
    headers: dict[str, str]
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)

    def payload(self, sample: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": sample.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == CHAT_ENDPOINT:
            body["messages"] = [{"role": "user", "content": sample.prompt}]
        else:
            body["prompt"] = sample.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **self.extra_body}


def _error_message(status: int, raw: bytes) -> str:
    """The `error.message` of an OpenAI error body, or the start of whatever came back."""
    try:
        error = json.loads(raw).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return f"HTTP {status}: {message}"
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {raw[:200].decode(errors='replace')}"


def _token_text(chunk: dict[str, Any]) -> str:
    """The text one chunk adds, for completions (`text`) and chat (`delta.content`) alike."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


class _StreamFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _data_lines(buffer: bytearray) -> list[bytes]:
    """Complete SSE `data:` payloads from the front of `buffer`, which keeps any partial line."""
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[: end + 1]).splitlines()
    del buffer[: end + 1]
    payloads = []
    for line in lines:
        if line.startswith(b"data:"):
            payloads.append(line[5:].strip())
    return payloads


async def _read_stream(response: aiohttp.ClientResponse, outcome: RequestOutcome) -> None:
    buffer = bytearray()
    last = outcome.start
    chunks = 0
    done = False
    async for piece in response.content.iter_any():
        now = time.perf_counter()
        buffer += piece
        for payload in _data_lines(buffer):
            if payload == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(payload)
            except ValueError as exc:
                raise _StreamFailure(
                    "malformed stream", f"invalid JSON in stream: {payload[:100]!r}"
                ) from exc
            if not isinstance(chunk, dict):
                raise _StreamFailure("malformed stream", f"stream chunk is not an object: {payload[:100]!r}")
            if "error" in chunk:
                raise _StreamFailure("stream error", _error_message(response.status, payload))
            if usage := chunk.get("usage"):
                outcome.output_tokens = int(usage.get("completion_tokens") or 0)
                outcome.prompt_len = int(usage.get("prompt_tokens") or outcome.prompt_len)
                outcome.usage_reported = True
            text = _token_text(chunk)
            if not text:
                continue
            chunks += 1
            if chunks == 1:
                outcome.ttft = now - outcome.start
            else:
                outcome.itls.append(now - last)
            last = now
    if not done:
        raise _StreamFailure("stream cut short", "the stream ended without `data: [DONE]`")
    if chunks == 0:
        raise _StreamFailure("no output", "the stream carried no generated text")
    outcome.e2el = last - outcome.start
    if not outcome.usage_reported:
        # Without usage, one token per chunk is the best guess; the report says how many lacked usage.
        outcome.output_tokens = chunks


async def send_request(
    session: aiohttp.ClientSession, spec: RequestSpec, sample: SampleRequest
) -> RequestOutcome:
    """Never raises for a failing server: the failure is the outcome's `reason` and `error`."""
    outcome = RequestOutcome(prompt_len=sample.prompt_len)
    outcome.start = time.perf_counter()
    try:
        async with session.post(
            spec.base_url + spec.endpoint, json=spec.payload(sample), headers=spec.headers
        ) as response:
            if response.status != 200:
                outcome.reason = f"HTTP {response.status}"
                outcome.retry_after = response.headers.get("Retry-After")
                outcome.error = _error_message(response.status, await response.read())
                return outcome
            await _read_stream(response, outcome)
    except _StreamFailure as exc:
        outcome.reason, outcome.error = exc.reason, str(exc)
    except aiohttp.ClientConnectorError as exc:
        outcome.reason, outcome.error = "cannot connect", str(exc)
    except TimeoutError as exc:
        outcome.reason, outcome.error = "timeout", str(exc) or "the request timed out"
    except aiohttp.ClientError as exc:
        outcome.reason, outcome.error = "connection error", f"{type(exc).__name__}: {exc}"
    return outcome
