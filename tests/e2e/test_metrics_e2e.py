"""/metrics on a real `sluice serve`, read over HTTP while real requests run.

The first server (one running request at a time, so that a second one queues, and no prefix
caching, so that every prompt token is computed) checks what the numbers mean; the second, with
`--metrics-prefix vllm`, checks that vLLM's Grafana dashboard finds every name it queries. Our own
dashboard (deploy/grafana/sluice.json) is checked against the first.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from serve_fixtures import SLUICE, Server, running_server

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[2]
VLLM_DASHBOARD_NAMES = Path(__file__).resolve().parents[1] / "data" / "vllm_grafana_metric_names.txt"
OUR_DASHBOARD = REPO / "deploy" / "grafana" / "sluice.json"
SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--max-num-seqs", "1"]
SERVER_ARGS += ["--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("metrics") / "serve.log"
    with running_server(SERVER_ARGS, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def series(server: Server) -> dict[str, float]:
    """Each series of /metrics (name with its labels) and its value."""
    response = server.request("GET", "/metrics")
    assert response.status == 200, response
    found = {}
    for line in str(response.body).splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def changed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each metric's growth between two reads of Server.metrics()."""
    return {name: after[name] - before.get(name, 0.0) for name in after}


def prompt_length(server: Server, prompt: str) -> int:
    response = server.request("POST", "/tokenize", {"model": MODEL, "prompt": prompt})
    assert response.status == 200, response
    return int(response.body["count"])


def stream(client: openai.OpenAI, prompt: str, max_tokens: int) -> Any:
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        temperature=0.8,
        extra_body={"ignore_eos": True},
    )


def test_a_request_queued_behind_a_long_one_has_queue_time_below_its_ttft(
    server: Server, client: openai.OpenAI
) -> None:
    before = server.metrics()
    long_stream = stream(client, "Count to a thousand:", 160)
    next(iter(long_stream))
    queued_sent = time.monotonic()
    queued: dict[str, Any] = {}

    def send_queued() -> None:
        queued["text"] = "".join(c.choices[0].text for c in stream(client, "Hello", 4))

    thread = threading.Thread(target=send_queued)
    thread.start()
    for _ in long_stream:
        pass
    long_ended = time.monotonic()
    thread.join(60)
    assert not thread.is_alive() and queued["text"]
    # One request runs at a time: the second waited at least until the first ended.
    waited = long_ended - queued_sent
    assert waited > 0.5, "the long request ended too soon to make the second one wait"
    grown = changed(before, server.metrics())
    assert grown["sluice:request_queue_time_seconds_count"] == 2
    assert grown["sluice:time_to_first_token_seconds_count"] == 2
    queue, ttft = (
        grown["sluice:request_queue_time_seconds_sum"],
        grown["sluice:time_to_first_token_seconds_sum"],
    )
    # The long one hardly queued; the second queued about `waited` (less the two HTTP trips).
    assert 0.8 * waited < queue < ttft, (queue, ttft, waited)
    assert grown["sluice:request_prefill_time_seconds_count"] == 2
    assert grown["sluice:request_prefill_time_seconds_sum"] == pytest.approx(ttft - queue, abs=1e-6)
    assert grown["sluice:request_decode_time_seconds_count"] == 2
    assert (
        0 < grown["sluice:request_decode_time_seconds_sum"] < grown["sluice:e2e_request_latency_seconds_sum"]
    )


def test_token_counters_rise_while_a_stream_runs(server: Server, client: openai.OpenAI) -> None:
    prompt = "Tell me a very long story about a lighthouse keeper:"
    before = server.metrics()
    chunks = iter(stream(client, prompt, 120))
    for _ in range(20):
        next(chunks)
    during = changed(before, server.metrics())
    assert during["sluice:prompt_tokens_total"] == prompt_length(server, prompt)
    assert 20 <= during["sluice:generation_tokens_total"] < 120
    assert during["sluice:request_success_total"] == 0
    for _ in chunks:
        pass
    after = changed(before, server.metrics())
    assert after["sluice:prompt_tokens_total"] == prompt_length(server, prompt)
    assert after["sluice:generation_tokens_total"] == 120
    assert after["sluice:request_success_total"] == 1


def test_n_choices_count_their_prompt_once(server: Server, client: openai.OpenAI) -> None:
    prompts = ["The sea is", "Three things I like about mountains are"]
    before = server.metrics()
    response = client.completions.create(
        model=MODEL, prompt=prompts, n=3, max_tokens=5, temperature=0.8, extra_body={"ignore_eos": True}
    )
    assert len(response.choices) == 6
    grown = changed(before, server.metrics())
    prompt_tokens = sum(prompt_length(server, p) for p in prompts)
    assert response.usage is not None and response.usage.prompt_tokens == prompt_tokens
    assert grown["sluice:prompt_tokens_total"] == prompt_tokens
    assert grown["sluice:generation_tokens_total"] == 6 * 5
    assert grown["sluice:request_prompt_tokens_count"] == 2
    assert grown["sluice:request_prompt_tokens_sum"] == prompt_tokens
    assert grown["sluice:request_generation_tokens_count"] == 6
    assert grown["sluice:request_max_num_generation_tokens_count"] == 2
    assert grown["sluice:request_max_num_generation_tokens_sum"] == 2 * 5
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_decode_time"):
        assert grown[f"sluice:{name}_seconds_count"] == 6, name
    # Five tokens each: four gaps between them.
    assert grown["sluice:inter_token_latency_seconds_count"] == 6 * 4


def test_iteration_tokens_count_every_engine_step(server: Server, client: openai.OpenAI) -> None:
    prompt = "Name a colour:"
    length, max_tokens = prompt_length(server, prompt), 8
    before = series(server)
    client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    after = series(server)
    labels = f'model_name="{MODEL}"'

    def grown(name: str) -> float:
        return after[name] - before[name]

    # One step computes the prompt, then one per token but the last (sampled, never computed).
    assert grown(f"sluice:iteration_tokens_total_count{{{labels}}}") == max_tokens
    assert grown(f"sluice:iteration_tokens_total_sum{{{labels}}}") == length + max_tokens - 1
    assert grown(f'sluice:iteration_tokens_total_bucket{{{labels},le="1"}}') == max_tokens - 1
    assert grown(f'sluice:iteration_tokens_total_bucket{{{labels},le="+Inf"}}') == max_tokens


def queried_names(dashboard: dict[str, Any]) -> set[str]:
    """The metric names in a Grafana dashboard's panel queries."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\b[a-z_]+:[a-z_]+\b", expr)}


def test_our_dashboard_queries_only_metrics_the_server_renders(server: Server) -> None:
    dashboard = json.loads(OUR_DASHBOARD.read_text())
    names = queried_names(dashboard)
    assert len(dashboard["panels"]) >= 10 and len(names) >= 20
    rendered = {name.split("{", 1)[0] for name in series(server)}
    assert all(name.startswith("sluice:") for name in names), names
    assert names <= rendered, f"queried but not rendered: {sorted(names - rendered)}"


@pytest.fixture(scope="module")
def vllm_named_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("metrics-vllm") / "serve.log"
    with running_server([*SERVER_ARGS, "--metrics-prefix", "vllm"], log) as running:
        yield running


def test_vllm_prefix_renders_every_name_vllms_dashboard_queries(vllm_named_server: Server) -> None:
    with openai.OpenAI(base_url=vllm_named_server.url + "/v1", api_key="none", max_retries=0) as client:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    wanted = [
        line.strip()
        for line in VLLM_DASHBOARD_NAMES.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(wanted) == 21
    rendered = series(vllm_named_server)
    for name in wanted:
        # The dashboard selects every series by {model_name="$model_name"}.
        assert any(s.startswith(f'{name}{{model_name="{MODEL}"') for s in rendered), name
    assert not [s for s in rendered if s.startswith("sluice:")]
    assert rendered[f'vllm:request_success_total{{model_name="{MODEL}",finished_reason="length"}}'] == 1


def test_an_unknown_metrics_prefix_is_refused_naming_the_choices() -> None:
    done = subprocess.run(
        [str(SLUICE), "serve", "--metrics-prefix", "prometheus"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--metrics-prefix" in done.stderr and "'sluice', 'vllm'" in done.stderr, done.stderr
