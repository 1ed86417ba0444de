"""`sluice serve --data-parallel-size N`: the option's checks, and two replicas of the default model behind
the real `sluice-router`, driven with the official `openai` client on serve's one port.

The end-to-end tests run the router binary that `pip install` builds next to the interpreter (or
$SLUICE_ROUTER).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import openai
import pytest

from serve_fixtures import SLUICE, Server, alive, cmdline, descendants, running_server
from sluice.cpu_binding import cores_per_replica
from sluice.serve import run as serve

MODEL = "SmolLM2-135M-Instruct"
USABLE = sorted(os.sched_getaffinity(0))
# Small replicas: two of them share this machine with the rest of the suite.
REPLICA_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--data-parallel-size", "2"]


def refusal(*args: str) -> str:
    """stderr of `sluice serve ARGS`, which must exit with status 2 before starting anything."""
    done = subprocess.run(
        [str(SLUICE), "serve", "--port", "1", *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    return done.stderr


def test_a_data_parallel_size_below_one_is_refused() -> None:
    assert "--data-parallel-size/-dp: must be at least 1, got 0" in refusal("--data-parallel-size", "0")


def test_more_replicas_than_usable_cores_is_refused_naming_both() -> None:
    too_many = len(USABLE) + 1
    stderr = refusal("--data-parallel-size", str(too_many))
    assert f"data_parallel_size {too_many} needs at least one core per replica" in stderr, stderr
    assert f"may use {len(USABLE)} cores" in stderr, stderr


def test_an_explicit_core_list_is_refused_with_replicas() -> None:
    stderr = refusal("--data-parallel-size", "2", "--cpu-bind", "0")
    assert "--cpu-bind '0' names cores" in stderr and "use auto or none" in stderr, stderr


def test_replicas_take_consecutive_shares_the_first_ones_larger() -> None:
    assert cores_per_replica([0, 1], 2) == [[0], [1]]
    assert cores_per_replica([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert cores_per_replica([2, 5, 7, 9], 3) == [[2, 5], [7], [9]]
    assert cores_per_replica([4, 6], 1) == [[4, 6]]


def replica_processes(server: Server) -> list[list[int]]:
    """Per replica (in the order of their ports' replica numbers), its frontend, engine core and workers."""
    replicas: dict[str, list[int]] = {}
    for pid in descendants(server.process.pid):
        words = cmdline(pid).split()
        if "engine.engine_core_server" in words:
            socket = words[words.index("--input") + 1]
            replicas.setdefault(socket, []).extend([pid, *descendants(pid)])
        elif words and words[0].endswith("sluice-frontend"):
            replicas.setdefault(words[words.index("--engine-input") + 1], []).append(pid)
    return sorted(replicas.values(), key=min)


def router_pid(server: Server) -> int:
    """The one process under serve that belongs to no replica."""
    in_replicas = {pid for pids in replica_processes(server) for pid in pids}
    (pid,) = set(descendants(server.process.pid)) - in_replicas
    return pid


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    with running_server(REPLICA_ARGS, log) as running:
        yield running


@pytest.fixture(scope="module")
def client(dp_server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=dp_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_two_replicas_serve_through_one_port(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    prompts = ["The capital of France is", "def fibonacci(n):", "List three primary colors:", "My dog"]
    for prompt in prompts:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert result.choices[0].finish_reason == "length" and result.choices[0].text
        assert result.usage is not None and result.usage.completion_tokens == 6
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.content
    stream = client.completions.create(
        model=MODEL, prompt="Count:", max_tokens=10, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_each_replica_runs_on_its_share_of_the_cores(dp_server: Server) -> None:
    # Consecutive halves of the cores this test may use (the same as serve's), the first one larger.
    half = (len(USABLE) + 1) // 2
    shares = [set(USABLE[:half]), set(USABLE[half:])]
    replicas = replica_processes(dp_server)
    assert len(replicas) == 2, replicas
    seen = []
    for pids in replicas:
        affinities = {frozenset(os.sched_getaffinity(pid)) for pid in pids}
        assert len(affinities) == 1, (pids, affinities)
        seen.append(set(next(iter(affinities))))
        # Every thread, the workers' pinned ones included, stays within its replica's share.
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                assert os.sched_getaffinity(int(task.name)) <= seen[-1], (pid, task.name)
    assert sorted(seen, key=min) == shares
    # Each replica's worker sized its threads to its share and pinned them there.
    log = dp_server.log.read_text(errors="replace")
    for share in shares:
        assert f"rank 0: {len(share)} threads pinned to cores {sorted(share)}" in log, log[-3000:]
    # The router is no replica's: it may run anywhere.
    assert os.sched_getaffinity(router_pid(dp_server)) == set(USABLE)


@pytest.mark.parametrize("victim", ["a replica's engine core", "the router"])
def test_a_dying_child_ends_serve_nonzero_leaving_nothing(victim: str, tmp_path: Path) -> None:
    # Without restarts, a dead engine core ends serve as the router's death does.
    with running_server([*REPLICA_ARGS, "--no-restart-engine"], tmp_path / "serve.log") as server:
        children = descendants(server.process.pid)
        if victim == "the router":
            pid, status, cause = router_pid(server), 1, r"the router was killed by signal 9"
        else:
            replica = replica_processes(server)[1]
            pid = next(p for p in replica if "engine.engine_core_server" in cmdline(p))
            status, cause = 3, r"the replica \d engine core was killed by signal 9"
        os.kill(pid, signal.SIGKILL)
        assert server.process.wait(60) == status, server.log_tail()
        assert re.search(cause, server.log.read_text()), server.log_tail()
        deadline = time.monotonic() + 5
        while [pid for pid in children if alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [(pid, cmdline(pid)) for pid in children if alive(pid)]


def test_every_engine_core_and_worker_gets_the_default_spin_count(dp_server: Server) -> None:
    assert not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(os.environ), "the test needs libgomp's default"
    engine_pids = [
        pid for pids in replica_processes(dp_server) for pid in pids if "sluice-frontend" not in cmdline(pid)
    ]
    # Per replica an engine core and its worker.
    assert len(engine_pids) == 4, engine_pids
    for pid in engine_pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"GOMP_SPINCOUNT=10000" in environ, (pid, cmdline(pid))


def test_replica_ports_are_never_serves_own_or_one_already_handed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel may offer a port again once its probe closes: here it offers 8000 (serve's own,
    # which the router binds only after the replicas start) and 9001 twice.
    offered = iter([8000, 9001, 9001, 8000, 9002])

    class Probe:
        def __enter__(self) -> Self:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(serve.socket, "socket", Probe)
    taken = {8000}
    assert [serve.free_port(taken), serve.free_port(taken)] == [9001, 9002]
    assert taken == {8000, 9001, 9002}
