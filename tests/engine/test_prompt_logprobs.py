"""Prompt logprobs from the engine on the default model against transformers' log_softmax (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from engine.request import Request
from hf_reference import load_hf_model, mixed_length_prompts
from sluice.errors import InvalidRequestError
from sluice.worker_seam import Logprobs, PromptLogprobs

NUM_TOP = 3
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)
# fp32 on both sides, different kernels: logprobs agree to this much.
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def prompts(w1_prompts: list[list[int]]) -> list[list[int]]:
    # Lengths 3..128, plus a one-token prompt, which has no prompt logprobs at all.
    return [*mixed_length_prompts(w1_prompts, count=8), w1_prompts[9][:1]]


@pytest.fixture(scope="module")
def reference(default_model_path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: transformers' log_softmax over the vocabulary at positions 0..P-2."""
    model = load_hf_model(default_model_path, torch.float32)
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), dim=-1) for p in prompts]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def assert_match_reference(
    results: list[RequestOutput], prompts: list[list[int]], reference: list[torch.Tensor]
) -> None:
    for index, (result, prompt, expected) in enumerate(zip(results, prompts, reference, strict=True)):
        got = result.prompt_logprobs
        assert got is not None and len(got) == len(prompt), f"prompt {index}: one entry per prompt token"
        assert got[0] is None
        for position in range(1, len(prompt)):
            row = expected[position - 1]
            entry = got[position]
            assert entry is not None
            actual = prompt[position]
            where = f"prompt {index} position {position}"
            assert entry[actual].logprob == pytest.approx(row[actual].item(), abs=TOLERANCE), where
            # Ranks agree up to tokens whose logprobs are within the tolerance of the actual one's.
            higher = int((row > row[actual] + TOLERANCE).sum()) + 1
            higher_or_tied = int((row > row[actual] - TOLERANCE).sum()) + 1
            assert higher <= entry[actual].rank <= higher_or_tied, where
            top = sorted((lp.rank, token) for token, lp in entry.items() if lp.rank <= NUM_TOP)
            assert [rank for rank, _ in top] == list(range(1, NUM_TOP + 1)), where
            for _, token in top:
                assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOLERANCE), where
            assert entry[top[0][1]].logprob == pytest.approx(row.max().item(), abs=TOLERANCE), where


def test_prompt_logprobs_equal_transformers_log_softmax(default_model_path, prompts, reference):
    llm = LLM(model=str(default_model_path), dtype="float32")
    results = generate(llm, prompts)
    assert_match_reference(results, prompts, reference)
    # A second run is served from the prefix cache for the other requests, never for these.
    assert_match_reference(generate(llm, prompts), prompts, reference)
    # Without the parameter there are none, and the generated tokens are unchanged by it.
    plain = generate(llm, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert all(r.prompt_logprobs is None for r in plain)
    assert [r.outputs[0].token_ids for r in plain] == [r.outputs[0].token_ids for r in results]


def test_chunked_prefill_and_preemption_give_each_position_once(default_model_path, prompts, reference):
    # A budget of 16 chunks every longer prompt; 30 blocks of 16 hold two long requests at a time.
    llm = LLM(
        model=str(default_model_path),
        dtype="float32",
        max_num_batched_tokens=16,
        max_model_len=256,
        num_kv_blocks=30,
    )
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)
    results = generate(llm, prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    assert_match_reference(results, prompts, reference)


def test_n_samples_share_one_list(default_model_path, prompts, reference):
    llm = LLM(model=str(default_model_path), dtype="float32")
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5, prompt_logprobs=NUM_TOP)
    results = generate(llm, prompts[:2], params)
    assert all(len(r.outputs) == 3 for r in results)
    assert_match_reference(results, prompts[:2], reference[:2])


def test_a_recomputed_chunk_is_kept_once() -> None:
    request = Request("r", [5, 6, 7, 8], SamplingParams(prompt_logprobs=0))
    entry = [Logprobs([6], [-1.0], 1), Logprobs([7], [-2.0], 3), Logprobs([8], [-3.0], 9)]
    request.add_prompt_logprobs(PromptLogprobs(1, entry[:2]))
    assert request.needs_prompt_logprobs
    # Resumed after a preemption, the request recomputes its prompt from the start.
    request.add_prompt_logprobs(PromptLogprobs(1, entry))
    assert not request.needs_prompt_logprobs
    assert request.take_prompt_logprobs() == entry
    assert request.take_prompt_logprobs() is None
    with pytest.raises(AssertionError):
        Request("q", [5, 6, 7], SamplingParams(prompt_logprobs=0)).add_prompt_logprobs(
            PromptLogprobs(2, entry)
        )


def test_prompt_logprobs_out_of_range_are_refused() -> None:
    SamplingParams(prompt_logprobs=20).validate()
    for bad in (-1, 21):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(prompt_logprobs=bad).validate()
        assert info.value.param == "prompt_logprobs"
