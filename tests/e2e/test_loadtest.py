"""`sluice bench serve` / `sweep` against the scripted OpenAI-compatible server, and once against `sluice serve`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripted_openai_server import Script, ScriptedServer
from serve_fixtures import SLUICE, free_port, running_server
from sluice.loadtest.arrivals import arrival_offsets
from sluice.loadtest.client import RequestOutcome, RequestSpec
from sluice.loadtest.datasets import (
    SampleRequest,
    prefix_requests,
    random_requests,
    sharegpt_requests,
    shuffled,
)
from sluice.loadtest.errors import DatasetError
from sluice.loadtest.metrics import LATENCY_METRICS, STATISTICS, meets_slos
from sluice.loadtest.serve_run import ServeSettings, measured_run
from sluice.loadtest.token_codec import FileCodec, ServerCodec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(
    server_url: str,
    count: int,
    input_len: int = 8,
    output_len: int = 6,
    rate: float = math.inf,
    endpoint: str = "/v1/completions",
    **settings: Any,
) -> dict[str, Any]:
    samples = random_requests(
        ServerCodec(server_url, "scripted", {}), count, input_len, output_len, 0.0, seed=0
    )
    spec = RequestSpec(server_url, endpoint, "scripted", {})
    return measured_run(spec, samples, ServeSettings(progress=False, **settings), rate)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_measured_latencies_match_the_script(endpoint: str) -> None:
    with ScriptedServer(Script(ttft=0.06, itl=0.015)) as server:
        result = _run(server.url, 6, input_len=12, output_len=9, endpoint=endpoint, max_concurrency=3)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["output_lens"] == [9] * 6 and result["input_lens"] == [12] * 6
    # Lower bounds are exact (the server sleeps at least that long); upper ones allow for two shared cores.
    assert 60 <= result["median_ttft_ms"] < 60 + 40
    assert 14 <= result["median_itl_ms"] < 15 + 10
    assert all(len(itls) == 8 for itls in result["itls"])
    assert 14 <= result["median_tpot_ms"] < 15 + 10
    assert 60 + 8 * 15 <= result["median_e2el_ms"] < 180 + 50
    tpot = [(e - t) / 8 for e, t in zip(result["e2els"], result["ttfts"], strict=True)]
    assert result["mean_tpot_ms"] == pytest.approx(np.mean(tpot) * 1000)


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_gaps_have_the_rate_and_dispersion(burstiness: float) -> None:
    gaps = np.diff(arrival_offsets(20001, rate=50.0, burstiness=burstiness, seed=7))
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    # Gamma(shape k): coefficient of variation 1/sqrt(k); 1 for Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert arrival_offsets(5, math.inf, burstiness, seed=7) == [0.0] * 5


def test_requests_reach_the_server_on_schedule() -> None:
    planned = arrival_offsets(30, rate=60.0, burstiness=1.0, seed=3)
    with ScriptedServer(Script(ttft=0.01, itl=0.002, output_tokens=2)) as server:
        result = _run(server.url, 30, output_len=2, rate=60.0, seed=3)
        lag = np.array(server.arrivals) - np.array(planned)
    assert result["completed"] == 30
    # The schedule is kept if every request lags its planned offset by about the same time; the first request's
    # connection setup alone (about 30 ms on a loaded CI machine) must not count, so compare with the median lag.
    assert np.abs(lag - np.median(lag)).max() < 0.03


def test_concurrency_cap_is_never_exceeded() -> None:
    with ScriptedServer(Script(ttft=0.02, itl=0.005)) as server:
        result = _run(server.url, 20, output_len=3, max_concurrency=3)
        assert server.max_in_flight == 3
    assert result["max_concurrency_reached"] == 3 and result["completed"] == 20


def test_failures_are_counted_by_reason_and_the_run_goes_on() -> None:
    with ScriptedServer(Script(ttft=0.01, itl=0.002, fail_every=3, malformed_every=4)) as server:
        result = _run(server.url, 12, output_len=4, max_concurrency=2)
    # Requests 3, 6, 9, 12 fail with HTTP 500; 4 and 8 stream an invalid line (12 failed first).
    assert result["failures_by_reason"] == {"HTTP 500": 4, "malformed stream": 2}
    assert (result["completed"], result["failed"]) == (6, 6)
    assert sum("scripted failure of request" in e for e in result["errors"]) == 4


def test_unreachable_server_fails_every_request_as_cannot_connect() -> None:
    with ScriptedServer(Script()) as server:
        samples = random_requests(ServerCodec(server.url, "scripted", {}), 3, 8, 4, 0.0, seed=0)
    spec = RequestSpec(f"http://127.0.0.1:{free_port()}", "/v1/completions", "scripted", {})
    result = measured_run(spec, samples, ServeSettings(progress=False), math.inf)
    assert result["failures_by_reason"] == {"cannot connect": 3} and result["completed"] == 0


def test_unreachable_url_gets_a_clear_message_from_the_cli() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [str(SLUICE), "bench", "serve", "--base-url", url, "--num-prompts", "2"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and f"cannot reach {url}" in done.stderr


def test_goodput_counts_exactly_the_requests_meeting_every_slo() -> None:
    def outcome(ttft_ms: float, tpot_ms: float, tokens: int = 11) -> RequestOutcome:
        e2el = (ttft_ms + tpot_ms * (tokens - 1)) / 1000
        return RequestOutcome(prompt_len=4, ttft=ttft_ms / 1000, e2el=e2el, output_tokens=tokens)

    slos = {"ttft": 100.0, "tpot": 10.0}
    assert meets_slos(outcome(100, 10), slos)
    assert not meets_slos(outcome(101, 5), slos) and not meets_slos(outcome(50, 10.5), slos)
    assert not meets_slos(RequestOutcome(prompt_len=4, reason="HTTP 500"), {})

    with ScriptedServer(Script(ttft=0.02, itl=0.004)) as server:
        samples = random_requests(ServerCodec(server.url, "scripted", {}), 12, 8, 8, 0.75, seed=1)
        spec = RequestSpec(server.url, "/v1/completions", "scripted", {})
        slos = {"e2el": 20 + 4 * 6 + 2.0, "ttft": 500.0}
        result = measured_run(
            spec, samples, ServeSettings(progress=False, max_concurrency=4, slos=slos), math.inf
        )
    good = sum(e * 1000 <= slos["e2el"] and t * 1000 <= 500 for e, t in zip(result["e2els"], result["ttfts"]))
    assert 0 < good < 12
    assert result["request_goodput"] * result["duration"] == pytest.approx(good)


def test_random_and_prefix_prompts_have_exact_token_lengths() -> None:
    with ScriptedServer(Script()) as server:
        codec = ServerCodec(server.url, "scripted", {})
        randoms = random_requests(codec, 5, 20, 4, 0.5, seed=0)
        prefixed = prefix_requests(codec, 4, 16, 2, 10, 4, 0.0, seed=0)
    assert all(len(s.prompt) == s.prompt_len and 10 <= s.prompt_len <= 30 for s in randoms)
    assert [len(s.prompt) for s in prefixed] == [26] * 4
    assert prefixed[0].prompt[:16] == prefixed[2].prompt[:16] != prefixed[1].prompt[:16]


def test_shuffle_reorders_the_same_requests_the_same_way_for_a_seed() -> None:
    samples = [SampleRequest(f"prompt {i}", i, 1) for i in range(32)]
    order = shuffled(samples, seed=3)
    assert sorted(order, key=lambda s: s.prompt_len) == samples and order != samples
    assert shuffled(samples, seed=3) == order != shuffled(samples, seed=4)
    assert samples[0].prompt_len == 0


def test_tokenizer_file_gives_exact_lengths_without_the_server(default_model_path: Path) -> None:
    codec = FileCodec(default_model_path / "tokenizer.json")
    for sample in random_requests(codec, 4, 50, 4, 0.0, seed=0):
        assert len(codec.encode(sample.prompt)) == sample.prompt_len == 50


def test_sharegpt_is_filtered_like_vllm(tmp_path: Path) -> None:
    def conversation(prompt: str, reply: str, turns: int = 2) -> dict[str, Any]:
        values = [prompt, reply, "more"][:turns]
        return {"id": prompt, "conversations": [{"from": "x", "value": v} for v in values]}

    data = [
        conversation("a good prompt", "a good reply"),
        conversation("abc", "a good reply"),  # prompt under 4 tokens
        conversation("a good prompt", "abc"),  # reply under 4 tokens
        conversation("a good prompt", "no reply", turns=1),
        conversation("p" * 1025, "a good reply"),  # prompt over 1024
        conversation("p" * 1000, "r" * 1049),  # total over 2048
        conversation("another prompt", "r" * 1048, turns=3),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    with ScriptedServer(Script()) as server:
        codec = ServerCodec(server.url, "scripted", {})
        samples = sharegpt_requests(codec, path, 10, seed=0)
        path.write_text("{not json")
        with pytest.raises(DatasetError, match="not valid JSON"):
            sharegpt_requests(codec, path, 10, seed=0)
    assert sorted((s.prompt, s.prompt_len, s.output_len) for s in samples) == [
        ("a good prompt", 13, 12),
        ("another prompt", 14, 1048),
    ]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [str(SLUICE), "bench", *args, "--no-progress"]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120)


def test_cli_writes_every_json_field_and_a_png(tmp_path: Path) -> None:
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    with ScriptedServer(Script(ttft=0.01, itl=0.002, fail_every=5)) as server:
        done = _bench(
            "serve", "--base-url", server.url, "--num-prompts", "10", "--random-input-len", "16",
            "--random-output-len", "5", "--request-rate", "100", "--max-concurrency", "4", "--num-warmups", "2",
            "--goodput", "ttft:1000", "tpot:1000", "e2el:2000", "--save-result", str(out), "--plot", str(png),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout and "Harness CPU" in done.stdout
    result = json.loads(out.read_text())
    keys = [
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ]
    keys += [f"{s}_{m}_ms" for m in LATENCY_METRICS for s in STATISTICS]
    keys += [
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "errors",
        "request_goodput",
        "max_concurrency_reached",
    ]
    keys += ["failures_by_reason", "harness_cpu_seconds", "model_id"]
    assert not [k for k in keys if k not in result]
    # Two warm-ups took requests 1-2 at the server, so its 5th and 10th are timed requests 3 and 8.
    assert result["failures_by_reason"] == {"HTTP 500": 2} and result["completed"] == 8
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_cli_sweep_writes_one_json_and_one_png(tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    with ScriptedServer(Script(ttft=0.01, itl=0.002)) as server:
        done = _bench(
            "sweep", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "8",
            "--random-output-len", "4", "--request-rates", "50,inf", "--save-result", str(out), "--plot", str(png),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sweep = json.loads(out.read_text())
    assert [run["request_rate"] for run in sweep["runs"]] == [50.0, "inf"]
    assert all(run["completed"] == 6 and "p99_ttft_ms" in run for run in sweep["runs"])
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_bench_serve_against_sluice_serve(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    with running_server(
        ["--max-model-len", "512", "--kv-cache-memory", "1"], tmp_path / "serve.log"
    ) as server:
        done = _bench(
            "serve", "--base-url", server.url, "--num-prompts", "4", "--random-input-len", "24",
            "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "2", "--save-result", str(out),
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["input_lens"] == [24] * 4 and result["output_lens"] == [8] * 4
    assert result["mean_ttft_ms"] > 0 and result["mean_tpot_ms"] > 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
