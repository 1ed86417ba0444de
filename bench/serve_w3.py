"""W3: the 64 W1 prompts as streaming requests at concurrency 16 against `sluice serve`.

In the same run the offline engine gets the same prompts with max_num_seqs = 16, so the serving
path's cost is a ratio of two figures taken minutes apart on the same machine. Also reports the
frontend's CPU seconds per 1,000 streamed tokens, read from /proc. Medians over --runs.

Prefix caching is off on both sides: every run sends the same prompts, and cache hits from the
previous run would otherwise make every run after the first look faster than a fresh server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHARED_BENCH = Path(__file__).resolve().parent / "workloads"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class RequestTiming:
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(self.output_tokens - 1, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat; fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def frontend_pid(serve_pid: int) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == serve_pid and cmdline and cmdline[0].endswith(b"sluice-frontend"):
            return int(entry.name)
    raise RuntimeError("could not find the sluice-frontend process under sluice serve")


def start_server(port: int, max_num_seqs: int) -> subprocess.Popen[str]:
    sluice = str(Path(sys.executable).parent / "sluice")
    cmd = [
        sluice,
        "serve",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-model-len",
        "2048",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.stdout is not None
    for line in server.stdout:
        if "Sluice is serving" in line:
            return server
    raise RuntimeError(f"sluice serve exited with {server.wait()} before it was ready")


def stop_server(server: subprocess.Popen[str]) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


async def one_request(client, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
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
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    e2e = time.perf_counter() - start
    assert tokens == max_tokens, f"expected {max_tokens} tokens, got {tokens}"
    return RequestTiming(ttft if ttft is not None else e2e, e2e, tokens)


async def run_w3(port: int, prompts: list[list[int]], concurrency: int, max_tokens: int):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> RequestTiming:
        async with gate:
            return await one_request(client, model, prompt, max_tokens)

    start = time.perf_counter()
    timings = await asyncio.gather(*(gated(p) for p in prompts))
    elapsed = time.perf_counter() - start
    await client.close()
    return timings, elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def offline_throughput(prompts: list[list[int]], max_num_seqs: int, max_tokens: int) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(
        model=None,
        dtype="bfloat16",
        max_num_seqs=max_num_seqs,
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=4))
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = json.loads((SHARED_BENCH / "w1_prompts.json").read_text())["prompts"]

    port = free_port()
    log(f"starting sluice serve on port {port} (max_num_seqs {args.concurrency})")
    server = start_server(port, args.concurrency)
    runs = []
    try:
        front = frontend_pid(server.pid)
        log("warming up")
        asyncio.run(run_w3(port, prompts[: args.concurrency], args.concurrency, 8))
        for run in range(1, args.runs + 1):
            log(f"W3 run {run}/{args.runs}")
            cpu_before = cpu_seconds(front)
            timings, elapsed = asyncio.run(run_w3(port, prompts, args.concurrency, args.output_tokens))
            cpu = cpu_seconds(front) - cpu_before
            tokens = sum(t.output_tokens for t in timings)
            runs.append((timings, tokens / elapsed, 1000 * cpu / tokens))
    finally:
        stop_server(server)

    offline = []
    for run in range(1, args.runs + 1):
        log(f"offline run {run}/{args.runs} (max_num_seqs {args.concurrency})")
        offline.append(offline_throughput(prompts, args.concurrency, args.output_tokens))

    def median_of(metric) -> float:
        return statistics.median(metric(r) for r in runs)

    w3 = median_of(lambda r: r[1])
    off = statistics.median(offline)
    print(f"runs: {args.runs} (medians); {len(prompts)} requests, concurrency {args.concurrency}")
    for name, attr in (("TTFT", "ttft"), ("TPOT", "tpot")):
        p50 = median_of(lambda r, a=attr: percentile([getattr(t, a) for t in r[0]], 50))
        p99 = median_of(lambda r, a=attr: percentile([getattr(t, a) for t in r[0]], 99))
        print(f"W3 {name} p50 / p99:        {1000 * p50:8.1f} / {1000 * p99:8.1f} ms")
    print(f"W3 output throughput:       {w3:8.1f} tok/s")
    print(f"offline (max_num_seqs {args.concurrency}):    {off:8.1f} tok/s")
    print(f"W3 / offline:               {w3 / off:8.2f} (target >= 0.9)")
    print(f"frontend CPU per 1k tokens: {median_of(lambda r: r[2]):8.3f} s")


if __name__ == "__main__":
    main()
