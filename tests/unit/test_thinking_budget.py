"""The thinking budget's state in the engine core (engine/thinking_budget.py): what it counts, when it
forces the end of thinking, and the bitmask row it fills then."""

from __future__ import annotations

import numpy as np

from engine.thinking_budget import Phase, ThinkingBudgetState
from sluice.sampling_params import ThinkingBudget

START = [90]
END = [91, 92, 93]
VOCAB = 100


def follow(state: ThinkingBudgetState, tokens: list[int]) -> list[int | None]:
    """The forced token before each of `tokens`, feeding each one in."""
    forced = []
    for token in tokens:
        forced.append(state.forced_token)
        assert state.accept_token(token)
    return forced


def allowed(state: ThinkingBudgetState) -> list[int]:
    row = np.full(-(-VOCAB // 32), -1, dtype="<i4")
    state.fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).tolist()


def test_the_thinking_is_cut_at_its_budget_and_the_end_tag_forced_token_by_token() -> None:
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=3, start_token_ids=[], end_token_ids=END))
    assert follow(state, [5, 6, 7]) == [None, None, None]
    assert state.forced_token == 91 and allowed(state) == [91]
    assert follow(state, [91, 92]) == [91, 92]
    assert allowed(state) == [93]
    assert state.accept_token(93)
    assert state.phase is Phase.DONE and state.forced_token is None
    assert follow(state, [5, 6]) == [None, None]


def test_thinking_that_ends_within_its_budget_forces_nothing() -> None:
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=6, start_token_ids=[], end_token_ids=END))
    assert follow(state, [5, 91, 92, 93, 5, 6, 7, 8]) == [None] * 8
    assert state.phase is Phase.DONE


def test_a_tag_begun_at_the_budget_is_finished_not_doubled() -> None:
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=3, start_token_ids=[], end_token_ids=END))
    assert follow(state, [5, 91, 92]) == [None, None, None]
    assert follow(state, [93]) == [93]
    assert state.phase is Phase.DONE


def test_counting_starts_after_an_opening_tag_and_an_output_without_one_does_not_think() -> None:
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=2, start_token_ids=START, end_token_ids=END))
    assert follow(state, [90, 5, 6]) == [None, None, None]
    assert state.forced_token == 91
    answer = ThinkingBudgetState(ThinkingBudget(max_tokens=2, start_token_ids=START, end_token_ids=END))
    assert follow(answer, [5, 6, 7, 8]) == [None] * 4
    assert answer.phase is Phase.DONE


def test_a_budget_of_zero_forces_the_end_at_once() -> None:
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=0, start_token_ids=[], end_token_ids=END))
    assert follow(state, [91, 92, 93, 5]) == [91, 92, 93, None]
    opened = ThinkingBudgetState(ThinkingBudget(max_tokens=0, start_token_ids=START, end_token_ids=END))
    assert follow(opened, [90, 91]) == [None, 91]


def test_a_token_other_than_the_forced_one_is_refused() -> None:
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=1, start_token_ids=[], end_token_ids=END))
    assert state.accept_token(5)
    assert not state.accept_token(6)
    assert state.phase is Phase.DONE


def test_only_a_step_whose_token_may_be_forced_needs_a_mask() -> None:
    # One opening token and a budget of 2: the 4th output token is the first that can be forced.
    state = ThinkingBudgetState(ThinkingBudget(max_tokens=2, start_token_ids=START, end_token_ids=END))
    assert [state.may_force_after(n) for n in range(5)] == [False, False, False, True, True]
    follow(state, [90, 5])
    assert [state.may_force_after(n) for n in range(3)] == [False, True, True]
    follow(state, [6])
    assert state.may_force_after(0)
    follow(state, END)
    assert not state.may_force_after(100)
