"""A thinking budget in the engine core, through the offline API on worker processes: the output is the
model's own first N tokens, then the forced end tag, then what the model writes after both, with
async scheduling on and off and with the bitmask computed before the step is sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine import LLM
from sluice.sampling_params import SamplingParams, StructuredOutput, ThinkingBudget

PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "List three colours:"]
MAX_TOKENS = 16


def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


@pytest.mark.parametrize(
    "settings",
    [
        {"async_scheduling": True},
        {"async_scheduling": False},
        {"async_scheduling": True, "structured_output_overlap": False},
    ],
    ids=["async", "sync", "async-mask-before-step"],
)
def test_the_output_is_the_free_thinking_the_forced_tag_and_its_answer(
    default_model_path: Path, settings: dict[str, bool]
) -> None:
    llm = LLM(model=str(default_model_path), executor="mp", max_model_len=256, num_kv_blocks=32, **settings)
    end = llm.tokenizer.encode("</think>", add_special_tokens=False)
    budgets = [0, 3, 7]
    prompt_ids = [llm.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    expected = []
    for ids, budget in zip(prompt_ids, budgets, strict=True):
        thought = (
            llm.generate({"prompt_token_ids": ids}, greedy(budget))[0].outputs[0].token_ids if budget else []
        )
        assert len(thought) == budget and end[0] not in thought, "the model must not write the tag itself"
        rest = MAX_TOKENS - budget - len(end)
        answer = llm.generate({"prompt_token_ids": ids + thought + end}, greedy(rest))[0].outputs[0].token_ids
        expected.append(thought + end + answer)
    budgeted = [
        greedy(MAX_TOKENS, thinking_budget=ThinkingBudget(budget, start_token_ids=[], end_token_ids=end))
        for budget in budgets
    ]
    # Beside a structured request and a plain one, in one batch.
    others = [
        greedy(MAX_TOKENS, structured_output=StructuredOutput("regex", "[a-z ]{4,8}")),
        greedy(MAX_TOKENS),
    ]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids] + ["Say hello:", "Count to ten:"]
    outputs = [r.outputs[0] for r in llm.generate(prompts, budgeted + others)]
    llm.engine.shutdown()
    assert [o.token_ids for o in outputs[:3]] == expected
    assert all(o.error is None for o in outputs)


def test_an_output_that_does_not_open_with_the_tag_is_never_forced(default_model_path: Path) -> None:
    llm = LLM(model=str(default_model_path), executor="inproc", max_model_len=256, num_kv_blocks=32)
    tokenizer = llm.tokenizer
    free = llm.generate("The capital of France is", greedy(MAX_TOKENS))[0].outputs[0]
    # A start tag the model does not write: it never thinks, so nothing is forced.
    budget = ThinkingBudget(
        2,
        start_token_ids=tokenizer.encode("<think>", add_special_tokens=False),
        end_token_ids=tokenizer.encode("</think>", add_special_tokens=False),
    )
    assert free.token_ids[: len(budget.start_token_ids)] != budget.start_token_ids
    unthought = llm.generate("The capital of France is", greedy(MAX_TOKENS, thinking_budget=budget))
    assert unthought[0].outputs[0].token_ids == free.token_ids
    llm.engine.shutdown()


def test_a_forced_tag_that_other_masks_forbid_fails_that_request_alone(default_model_path: Path) -> None:
    llm = LLM(model=str(default_model_path), executor="inproc", max_model_len=256, num_kv_blocks=32)
    end = llm.tokenizer.encode("</think>", add_special_tokens=False)
    hello = llm.tokenizer.encode("hello", add_special_tokens=False)[0]
    assert hello != end[0]
    # allowed_token_ids holds no token of the tag: the forced step's row allows nothing.
    forbidden = greedy(
        MAX_TOKENS,
        allowed_token_ids=[hello],
        thinking_budget=ThinkingBudget(2, start_token_ids=[], end_token_ids=end),
    )
    failed, served = llm.generate(["The capital of France is", "Count to ten:"], [forbidden, greedy(4)])
    llm.engine.shutdown()
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == [hello, hello]
    assert failed.outputs[0].error_param == "allowed_token_ids"
    assert "forced by its budget" in failed.outputs[0].error
    assert served.outputs[0].error is None and len(served.outputs[0].token_ids) == 4
