"""Worker processes and the async batch queue, end to end through the offline engine.

Every combination of executor (a worker process per rank, or the worker in-process) and async
scheduling gives the same tokens: greedy fp32 equal to transformers, seeded sampling equal across
the combinations. A worker that dies, is killed or fails mid-step ends generate() with an error
naming the rank and the cause, and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from hf_reference import MIXED_REFERENCE_TOKENS, ReferenceOutput
from sluice.errors import WorkerDiedError
from sluice.worker_seam import CachedRequestData, SchedulerOutput
from worker.worker_process import STALL_FIRST_STEP_ENV

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_k=40, top_p=0.9, seed=77, ignore_eos=True)
COMBINATIONS = [("mp", True), ("mp", False), ("inproc", True), ("inproc", False)]


@pytest.fixture(scope="module")
def prompts(mixed_prompts: list[list[int]]) -> list[list[int]]:
    return mixed_prompts[:8]


@pytest.fixture(scope="module")
def fp32_reference(fp32_mixed_reference: list[ReferenceOutput]) -> list[ReferenceOutput]:
    assert NEW_TOKENS <= MIXED_REFERENCE_TOKENS
    return [
        ReferenceOutput(ref.token_ids[:NEW_TOKENS], ref.top5[:NEW_TOKENS]) for ref in fp32_mixed_reference[:8]
    ]


@pytest.fixture(scope="module")
def outputs_by_combination(default_model_path, prompts) -> dict[tuple[str, bool], tuple[list, list]]:
    """Greedy and seeded tokens of every combination, under a KV pool small enough to preempt."""
    results = {}
    for executor, async_scheduling in COMBINATIONS:
        llm = LLM(
            model=str(default_model_path),
            dtype="float32",
            executor=executor,
            async_scheduling=async_scheduling,
            max_model_len=256,
            num_kv_blocks=24,
            max_num_seqs=6,
        )
        batch = [{"prompt_token_ids": p} for p in prompts]
        greedy = [r.outputs[0].token_ids for r in llm.generate(batch, GREEDY)]
        seeded = [r.outputs[0].token_ids for r in llm.generate(batch, SEEDED)]
        results[(executor, async_scheduling)] = (greedy, seeded, llm.engine.stats().num_preemptions)
        llm.engine.shutdown()
    return results


@pytest.mark.parametrize("combination", COMBINATIONS, ids=lambda c: f"{c[0]}-async-{c[1]}")
def test_greedy_fp32_equals_transformers(outputs_by_combination, fp32_reference, combination):
    greedy, _, num_preemptions = outputs_by_combination[combination]
    assert greedy == [ref.token_ids for ref in fp32_reference]
    assert num_preemptions > 0, "the pool was meant to force preemptions"


def test_seeded_sampling_is_identical_with_async_on_and_off_and_in_either_executor(outputs_by_combination):
    seeded = {combination: outputs[1] for combination, outputs in outputs_by_combination.items()}
    baseline = seeded[("inproc", False)]
    assert all(tokens == baseline for tokens in seeded.values())
    greedy = outputs_by_combination[("inproc", False)][0]
    assert seeded != greedy, "a seeded request is not greedy in disguise"


def _worker_pids(llm: LLM) -> list[int]:
    return [worker.process.pid for worker in llm.engine.executor.workers]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers signal 0; its parent has not reaped it.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_a_worker_killed_mid_step_fails_generate_and_leaves_nothing(default_model_path, prompts):
    llm = LLM(model=str(default_model_path), dtype="float32", max_num_seqs=8)
    [pid] = _worker_pids(llm)
    killer = threading.Timer(1.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 0 .*killed by signal 9"):
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2000, ignore_eos=True)
        )
    killer.join()
    assert time.monotonic() - started < 60
    assert _gone(pid)
    assert not Path(llm.engine.executor.socket_dir).exists()


def test_a_hung_worker_fails_generate_after_the_step_timeout_and_is_stopped(default_model_path, monkeypatch):
    # The worker stalls 120 s before its first step, as a stuck collective would; the engine core waits 3.
    monkeypatch.setenv(STALL_FIRST_STEP_ENV, "120")
    llm = LLM(model=str(default_model_path), dtype="float32", step_timeout_s=3)
    [pid] = _worker_pids(llm)
    started = time.monotonic()
    with pytest.raises(
        WorkerDiedError, match=r"no step result from the workers within 3 s \(--step-timeout-s\)"
    ):
        llm.generate("Hello", SamplingParams(max_tokens=4))
    assert time.monotonic() - started < 60
    llm.engine.shutdown()
    assert _gone(pid)


def test_a_failing_worker_reports_why(default_model_path):
    llm = LLM(model=str(default_model_path), dtype="float32")
    [pid] = _worker_pids(llm)
    # A diff for a request the worker never saw: the worker fails, says why, and exits.
    bogus = SchedulerOutput(
        10**6, [], CachedRequestData(["nobody"], [False], [[]], [0], [0]), {"nobody": 1}, 1, [], []
    )
    llm.engine.executor.submit(bogus)
    with pytest.raises(WorkerDiedError, match=r"worker rank 0 failed: KeyError: 'nobody'"):
        llm.engine.executor.collect()
    llm.engine.shutdown()
    assert _gone(pid)


def test_shutdown_stops_every_worker(default_model_path):
    llm = LLM(model=str(default_model_path), dtype="float32")
    pids = _worker_pids(llm)
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    llm.engine.shutdown()
    assert all(_gone(pid) for pid in pids)


def _thread_affinities(pid: int) -> list[set[int]]:
    """The cores each thread of process pid may run on."""
    affinities = []
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        line = next(x for x in status.read_text().splitlines() if x.startswith("Cpus_allowed_list:"))
        cores: set[int] = set()
        for part in line.split(":")[1].strip().split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
        affinities.append(cores)
    return affinities


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning threads apart needs two usable cores")
def test_a_cpu_worker_runs_one_thread_pinned_to_each_core_unless_binding_is_off(default_model_path):
    cores = set(os.sched_getaffinity(0))
    pinned_by_bind = {}
    for bind in ("auto", "none"):
        llm = LLM(model=str(default_model_path), dtype="float32", cpu_bind=bind)
        [pid] = _worker_pids(llm)
        # The pool's threads exist once a parallel region has run.
        assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        affinities = _thread_affinities(pid)
        pinned_by_bind[bind] = sorted(next(iter(a)) for a in affinities if len(a) == 1)
        if bind == "none":
            assert all(a == cores for a in affinities), affinities
        llm.engine.shutdown()
    # Auto: one thread per usable core, each on its own core (the rest, ZeroMQ's, unpinned).
    assert pinned_by_bind == {"auto": sorted(cores), "none": []}
    # An in-process worker runs in the caller's process, whose threads it leaves where they were.
    llm = LLM(model=str(default_model_path), dtype="float32", executor="inproc")
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert os.sched_getaffinity(0) == cores
    llm.engine.shutdown()


def _environment(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in entries if entry)


def test_a_worker_process_gets_the_spin_count_of_omp_spin_count(default_model_path, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for spec, expected in (("auto", "10000"), (250, "250"), ("inherit", None)):
        llm = LLM(model=str(default_model_path), dtype="float32", omp_spin_count=spec)
        try:
            [pid] = _worker_pids(llm)
            assert _environment(pid).get("GOMP_SPINCOUNT") == expected, spec
            assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
        finally:
            llm.engine.shutdown()
