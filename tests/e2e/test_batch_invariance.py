"""Greedy bf16 outputs do not depend on the batch a request lands in: 32 requests sent together give the
tokens each gives alone, at every CPU kernel tier this machine runs, and under tensor parallelism (2 and 3
ranks), through the engine and through `sluice serve` with the openai client."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from engine import LLM, SamplingParams
from hf_reference import mixed_length_prompts
from serve_fixtures import running_server
from tiers import ALL_TIERS
from tiny_models import VOCAB_SIZE, tiny_model_dir

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(w1_prompts: list[list[int]]) -> list[list[int]]:
    return mixed_length_prompts(w1_prompts, count=32)


def together_and_alone(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    together = [
        r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    ]
    alone = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in prompts]
    return together, alone


@pytest.mark.parametrize("cpu_isa", ALL_TIERS)
def test_a_batch_of_32_gives_each_request_its_tokens_alone(
    default_model_path: Path, prompts: list[list[int]], cpu_isa: str
) -> None:
    llm = LLM(model=str(default_model_path), dtype="bfloat16", cpu_isa=cpu_isa, executor="inproc")
    together, alone = together_and_alone(llm, prompts)
    assert together == alone


def test_two_tensor_parallel_ranks_keep_batch_invariance(prompts: list[list[int]]) -> None:
    # The tiny model's 4 heads split over 2 ranks (the default model's 9 do not); 3 ranks are checked
    # through `sluice serve` below.
    folder = tiny_model_dir("llama", "bfloat16")
    requests = [[t % VOCAB_SIZE for t in p] for p in prompts]
    llm = LLM(model=str(folder), dtype="bfloat16", tensor_parallel_size=2, max_model_len=256)
    try:
        together, alone = together_and_alone(llm, requests)
    finally:
        llm.engine.shutdown()
    assert together == alone


def test_sluice_serve_with_three_ranks_answers_16_concurrent_requests_as_it_answers_each_alone(
    default_model_path: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    args = [str(default_model_path), "--tensor-parallel-size", "3", "--max-model-len", "512"]
    with running_server(args, tmp_path / "serve.log") as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        async def complete(prompt: list[int]) -> list[str]:
            response = await client.completions.create(
                model=default_model_path.name,
                prompt=prompt,
                max_tokens=NEW_TOKENS,
                temperature=0.0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            return response.choices[0].logprobs.tokens

        async def run() -> tuple[list[list[str]], list[list[str]]]:
            # Sixteen of the prompts: three ranks on two cores make every step slow, and each runs alone too.
            served = prompts[:16]
            together = await asyncio.gather(*(complete(p) for p in served))
            alone = [await complete(p) for p in served]
            return list(together), alone

        together, alone = asyncio.run(run())
    assert together == alone
