"""The engine's greedy outputs on the default model against transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from hf_reference import MIXED_REFERENCE_TOKENS, ReferenceOutput, hf_greedy, load_hf_model
from tiers import ALL_TIERS

NEW_TOKENS = MIXED_REFERENCE_TOKENS
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(mixed_prompts: list[list[int]]) -> list[list[int]]:
    return mixed_prompts


@pytest.fixture(scope="module")
def fp32_reference(fp32_mixed_reference: list[ReferenceOutput]) -> list[ReferenceOutput]:
    return fp32_mixed_reference


def generate_tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [r.outputs[0].token_ids for r in results]


def assert_identical(ours: list[list[int]], reference: list[ReferenceOutput]) -> None:
    for i, (got, ref) in enumerate(zip(ours, reference, strict=True)):
        assert got == ref.token_ids, f"prompt {i}: first difference at {first_divergence(got, ref.token_ids)}"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def record_schedules(llm: LLM) -> list[dict[str, int]]:
    """Spy on the scheduler: every step's per-request token counts."""
    seen: list[dict[str, int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        seen.append(dict(out.num_scheduled_tokens))
        return out

    llm.engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("cpu_isa", ALL_TIERS)
def test_fp32_batch_matches_transformers_one_prompt_at_a_time(
    default_model_path, prompts, fp32_reference, cpu_isa
):
    llm = LLM(model=str(default_model_path), dtype="float32", cpu_isa=cpu_isa)
    assert_identical(generate_tokens(llm, prompts), fp32_reference)


@pytest.fixture(scope="module")
def bf16_reference(default_model_path: Path, prompts: list[list[int]]) -> list[ReferenceOutput]:
    model = load_hf_model(default_model_path, torch.bfloat16)
    return [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("cpu_isa", ALL_TIERS)
def test_bf16_matches_transformers_up_to_first_divergence(
    default_model_path, prompts, bf16_reference, cpu_isa
):
    llm = LLM(model=str(default_model_path), dtype="bfloat16", cpu_isa=cpu_isa)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (ref, result) in enumerate(zip(bf16_reference, results, strict=True)):
        ours = result.outputs[0]
        pos = first_divergence(ours.token_ids, ref.token_ids)
        if pos is None:
            continue
        our_top5 = sorted(ours.logprobs[pos].items(), key=lambda kv: kv[1].rank)
        our_top5_ids = [t for t, lp in our_top5 if lp.rank <= 5]
        assert ours.token_ids[pos] in ref.top5[pos], f"prompt {i} pos {pos}: ours not in transformers' top 5"
        assert ref.token_ids[pos] in our_top5_ids, f"prompt {i} pos {pos}: transformers' not in our top 5"


def test_chunked_prefill_with_budget_16(default_model_path, prompts, fp32_reference):
    llm = LLM(model=str(default_model_path), dtype="float32", max_num_batched_tokens=16)
    steps = record_schedules(llm)
    assert_identical(generate_tokens(llm, prompts), fp32_reference)
    assert max(sum(s.values()) for s in steps) <= 16
    # Every prompt longer than the budget was computed over several steps.
    for index, prompt in enumerate(prompts):
        if len(prompt) > 16:
            chunks = [s[f"{index}-0"] for s in steps if s.get(f"{index}-0", 0) > 1]
            assert len(chunks) >= -(-len(prompt) // 16) - 1, f"prompt {index} was not chunked"


def test_max_num_seqs_3(default_model_path, prompts, fp32_reference):
    llm = LLM(model=str(default_model_path), dtype="float32", max_num_seqs=3)
    steps = record_schedules(llm)
    assert_identical(generate_tokens(llm, prompts), fp32_reference)
    assert max(len(s) for s in steps) == 3


def test_preemption_keeps_outputs_identical(default_model_path, prompts, fp32_reference):
    # 160 tokens per request at most: 10 blocks of 16; 30 blocks hold only three at a time.
    llm = LLM(model=str(default_model_path), dtype="float32", max_model_len=256, num_kv_blocks=30)
    assert_identical(generate_tokens(llm, prompts), fp32_reference)
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_caching_shares_long_prefixes(default_model_path, w1_prompts):
    shared = w1_prompts[0][:112]
    prompts = [shared + w1_prompts[i][: 8 + i] for i in range(1, 7)]
    model = load_hf_model(default_model_path, torch.float32)
    reference = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(model=str(default_model_path), dtype="float32", enable_prefix_caching=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # The first prompt fills the cache; the rest arrive after and must hit it.
    first = generate_tokens(llm, prompts[:1], params)
    rest = generate_tokens(llm, prompts[1:], params)
    assert_identical(first + rest, reference)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 5 * 112 - 5 * 16


def test_greedy_and_seeded_requests_mixed_in_one_batch(default_model_path, prompts, fp32_reference):
    llm = LLM(model=str(default_model_path), dtype="float32")
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)
    mixed_params = [GREEDY if i % 2 == 0 else seeded for i in range(len(prompts))]
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], mixed_params)
    greedy_idx = [i for i in range(len(prompts)) if i % 2 == 0]
    assert_identical(
        [mixed[i].outputs[0].token_ids for i in greedy_idx], [fp32_reference[i] for i in greedy_idx]
    )
    # Each seeded request alone gives what it gave inside the mixed batch.
    for i in (1, 7):
        (alone,) = llm.generate([{"prompt_token_ids": prompts[i]}], seeded)
        assert alone.outputs[0].token_ids == mixed[i].outputs[0].token_ids
    # A seeded request is not greedy in disguise.
    assert any(mixed[i].outputs[0].token_ids != fp32_reference[i].token_ids for i in range(1, 16, 2))
