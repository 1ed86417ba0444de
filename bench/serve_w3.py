"""W3: the 64 W1 prompts as streaming requests at concurrency 16 against `sluice serve`.

In the same run the offline engine gets the same prompts with max_num_seqs = 16, so the serving
path's cost is a ratio of two figures taken minutes apart on the same machine. Also reports the
frontend's CPU seconds per 1,000 streamed tokens, read from /proc. Medians over --runs.

Prefix caching is off on both sides: every run sends the same prompts, and cache hits from the
previous run would otherwise make every run after the first look faster than a fresh server.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from harness import log, process_tree_cpu_seconds, w1_prompts
from servers import start_sluice
from w3_client import W3Run, run_w3

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    prompts = w1_prompts()

    runs: list[tuple[W3Run, float]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-w3-") as log_dir:
        server = start_sluice("sluice", None, ["--max-num-seqs", str(args.concurrency)], Path(log_dir))
        log(f"starting sluice serve on port {server.port} (max_num_seqs {args.concurrency})")
        try:
            server.wait_ready()
            front = frontend_pid(server.process.pid)
            log("warming up")
            run_w3(server.url, prompts[: args.concurrency], args.concurrency, 8)
            for run in range(1, args.runs + 1):
                log(f"W3 run {run}/{args.runs}")
                cpu_before = process_tree_cpu_seconds(front)
                figures = run_w3(server.url, prompts, args.concurrency, args.output_tokens)
                cpu = process_tree_cpu_seconds(front) - cpu_before
                runs.append((figures, 1000 * cpu / figures.output_tokens))
        finally:
            server.stop()

    offline = []
    for run in range(1, args.runs + 1):
        log(f"offline run {run}/{args.runs} (max_num_seqs {args.concurrency})")
        offline.append(offline_throughput(prompts, args.concurrency, args.output_tokens))

    def median(field: str) -> float:
        return statistics.median(getattr(figures, field) for figures, _ in runs)

    w3 = median("out_tok_s")
    off = statistics.median(offline)
    print(f"runs: {args.runs} (medians); {len(prompts)} requests, concurrency {args.concurrency}")
    print(f"W3 TTFT p50 / p99:          {median('ttft_p50_ms'):8.1f} / {median('ttft_p99_ms'):8.1f} ms")
    print(f"W3 TPOT p50 / p99:          {median('tpot_p50_ms'):8.1f} / {median('tpot_p99_ms'):8.1f} ms")
    print(f"W3 output throughput:       {w3:8.1f} tok/s")
    print(f"offline (max_num_seqs {args.concurrency}):    {off:8.1f} tok/s")
    print(f"W3 / offline:               {w3 / off:8.2f} (target >= 0.9)")
    print(f"frontend CPU per 1k tokens: {statistics.median(cpu for _, cpu in runs):8.3f} s")


if __name__ == "__main__":
    main()
