"""The graph dispatcher's eager fallbacks reach the engine core's stats (and so the frontend's /metrics)."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams
from worker.graphs.dispatcher import GraphDispatcher, GraphMode, PaddingTable

MAX_TOKENS = 3


def test_engine_stats_carry_the_workers_eager_fallback_count(default_model_path: Path) -> None:
    llm = LLM(
        model=str(default_model_path),
        dtype="float32",
        executor="inproc",
        async_scheduling=False,
        max_model_len=64,
    )
    try:
        runner = llm.engine.executor.worker.model_runner
        assert runner.dispatcher.shape_free and llm.engine.stats().num_eager_fallbacks == 0
        # The CPU's dispatcher never falls back; one with graphs on and nothing captured always does.
        runner.dispatcher = GraphDispatcher(
            frozenset({GraphMode.PIECEWISE}), PaddingTable([]), PaddingTable([])
        )
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        [result] = llm.generate({"prompt_token_ids": [1, 2, 3]}, params)
        assert len(result.outputs[0].token_ids) == MAX_TOKENS
        # One step per token: the prompt fits one chunk, and each step ran eagerly.
        assert runner.num_eager_fallbacks == MAX_TOKENS
        assert llm.engine.stats().num_eager_fallbacks == MAX_TOKENS
    finally:
        llm.engine.shutdown()
