import pytest
import torch

from sluice.sampling_params import SamplingParams
from worker.sampler import (
    Sampler,
    apply_top_p,
    apply_top_p_sorted,
    inverse_cdf_sample,
    process_logits,
    random_probs,
    row_uniforms,
)
from worker.sampling_state import SamplingState

CPU = torch.device("cpu")
EOS = 7
# Distinct values, so that every order and every nucleus is unambiguous.
LOGITS = torch.tensor([1.0, 3.0, -2.0, 0.5, 2.5, -1.0, 0.0, 1.5])
VOCAB = LOGITS.numel()


def state_with(*rows: SamplingParams, prompt=(), output=(), max_rows=8, vocab=VOCAB) -> SamplingState:
    state = SamplingState(max_rows, vocab, CPU, eos_token_ids=(EOS,))
    for row, params in enumerate(rows):
        state.add(row, params, list(prompt), list(output))
    return state


def sample(state: SamplingState, logits: torch.Tensor):
    return Sampler().sample(logits.clone(), state.metadata(logits.shape[0]))


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_all_greedy_fast_path_is_argmax_with_first_index_ties():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    logits[2, 10] = logits[2, 3] = 100.0
    state = state_with(*[SamplingParams(temperature=0.0)] * 5)
    md = state.metadata(5)
    assert md.all_greedy and not md.needs_processing
    out = Sampler().sample(logits, md)
    assert out.token_ids.tolist() == torch.argmax(logits, dim=-1).tolist()
    assert out.token_ids[2].item() == 3
    assert out.logprobs == [None] * 5


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    state = state_with(
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, seed=3),
        vocab=50,
    )
    out = sample(state, logits).token_ids
    assert out[0].item() == logits[0].argmax().item()
    assert out[2].item() == logits[2].argmax().item()


def test_temperature_scales_the_distribution():
    t = 0.7
    state = state_with(SamplingParams(temperature=t))
    probs = random_probs(LOGITS.unsqueeze(0).clone(), state.metadata(1))
    torch.testing.assert_close(probs[0], torch.softmax(LOGITS / t, dim=-1))


def test_empirical_draws_follow_softmax_over_temperature():
    rows, t = 4000, 1.3
    state = state_with(*[SamplingParams(temperature=t)] * rows, max_rows=rows)
    torch.manual_seed(0)
    tokens = sample(state, LOGITS.expand(rows, -1)).token_ids
    freq = torch.bincount(tokens, minlength=VOCAB).float() / rows
    assert (freq - torch.softmax(LOGITS / t, dim=-1)).abs().max().item() < 0.03


def test_seeded_empirical_draws_follow_the_distribution():
    rows = 3000
    state = state_with(*[SamplingParams(temperature=1.0, seed=s) for s in range(rows)], max_rows=rows)
    tokens = sample(state, LOGITS.expand(rows, -1)).token_ids
    freq = torch.bincount(tokens, minlength=VOCAB).float() / rows
    assert (freq - torch.softmax(LOGITS, dim=-1)).abs().max().item() < 0.03


def test_one_seeded_request_follows_the_distribution_over_its_steps():
    steps = 1500
    state = state_with(SamplingParams(temperature=1.0, seed=5))
    sampler = Sampler()
    tokens = []
    for _ in range(steps):
        token = sampler.sample(LOGITS.unsqueeze(0).clone(), state.metadata(1)).token_ids.item()
        state.append_output_token(0, token)
        tokens.append(token)
    freq = torch.bincount(torch.tensor(tokens), minlength=VOCAB).float() / steps
    assert (freq - torch.softmax(LOGITS, dim=-1)).abs().max().item() < 0.04


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0]).expand(5, -1)
    uniforms = torch.tensor([1e-30, 0.25, 0.5, 0.75, 1.0])
    assert inverse_cdf_sample(probs, uniforms).tolist() == [1, 1, 1, 3, 3]
    uniforms = row_uniforms(10_000, [(0, 0), (1, (1 << 63) - 1)], CPU)
    assert uniforms.min().item() > 0.0 and uniforms.max().item() <= 1.0


def test_top_k_keeps_only_the_k_largest():
    state = state_with(SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0))
    probs = random_probs(LOGITS.expand(2, -1).clone(), state.metadata(2))
    top3 = [1, 4, 7]
    assert support(probs[0]) == set(top3)
    torch.testing.assert_close(probs[0, top3], torch.softmax(LOGITS[top3], dim=-1))
    assert support(probs[1]) == set(range(VOCAB))

    rows = 500
    state = state_with(*[SamplingParams(temperature=2.0, top_k=3)] * rows, max_rows=rows)
    tokens = sample(state, LOGITS.expand(rows, -1)).token_ids
    assert set(tokens.tolist()) == set(top3)


def nucleus(probs: torch.Tensor, p: float) -> list[int]:
    """The fewest most likely tokens whose probabilities sum to at least p."""
    chosen, mass = [], 0.0
    for token in sorted(range(len(probs)), key=lambda i: -probs[i].item()):
        if mass >= p:
            break
        chosen.append(token)
        mass += probs[token].item()
    return chosen


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.8, 0.95])
def test_top_p_keeps_the_nucleus(top_p):
    state = state_with(SamplingParams(temperature=1.0, top_p=top_p), SamplingParams(temperature=1.0))
    probs = random_probs(LOGITS.expand(2, -1).clone(), state.metadata(2))
    expected = nucleus(torch.softmax(LOGITS, dim=-1), top_p)
    assert support(probs[0]) == set(expected)
    torch.testing.assert_close(probs[0, expected], torch.softmax(LOGITS[expected], dim=-1))
    assert support(probs[1]) == set(range(VOCAB))


@pytest.mark.parametrize("num_candidates", [4, 64, 1000])
def test_top_p_from_candidates_matches_a_full_sort(num_candidates):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=gen) * torch.tensor([0.3, 1.0, 2.0, 4.0, 1.0, 0.5]).unsqueeze(1)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.3, 1.0, 0.05])
    fast = apply_top_p(logits.clone(), top_p, num_candidates=num_candidates)
    assert torch.equal(fast.isinf(), apply_top_p_sorted(logits.clone(), top_p).isinf())
    assert not fast[4].isinf().any()


def test_top_k_then_top_p_on_the_renormalised_top_k():
    state = state_with(SamplingParams(temperature=1.0, top_k=4, top_p=0.7))
    probs = random_probs(LOGITS.unsqueeze(0).clone(), state.metadata(1))
    top4 = [1, 4, 7, 0]
    kept = [top4[i] for i in nucleus(torch.softmax(LOGITS[top4], dim=-1), 0.7)]
    assert support(probs[0]) == set(kept)


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.7])
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p):
    state = state_with(SamplingParams(temperature=1.0, min_p=min_p))
    probs = random_probs(LOGITS.unsqueeze(0).clone(), state.metadata(1))
    full = torch.softmax(LOGITS, dim=-1)
    expected = [i for i in range(VOCAB) if full[i] >= min_p * full.max()]
    assert support(probs[0]) == set(expected)
    torch.testing.assert_close(probs[0, expected], torch.softmax(LOGITS[expected], dim=-1))


def test_repetition_penalty_covers_prompt_and_output_tokens():
    penalty = 1.8
    state = state_with(SamplingParams(temperature=0.0, repetition_penalty=penalty), prompt=[1, 2], output=[3])
    state.append_output_token(0, 5)
    state.append_output_token(0, 5)
    processed = process_logits(LOGITS.unsqueeze(0).clone(), state.metadata(1))[0]
    expected = LOGITS.clone()
    for token in (1, 2, 3, 5):
        value = LOGITS[token].item()
        expected[token] = value / penalty if value > 0 else value * penalty
    torch.testing.assert_close(processed, expected)


def test_presence_and_frequency_penalties_cover_output_tokens_only():
    presence, frequency = 0.6, 0.25
    state = state_with(
        SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency),
        SamplingParams(temperature=0.0),
        prompt=[1, 4],
        output=[4, 6, 6],
    )
    state.append_output_token(0, 6)
    state.append_output_token(1, 6)
    processed = process_logits(LOGITS.expand(2, -1).clone(), state.metadata(2))
    counts = torch.bincount(torch.tensor([4, 6, 6, 6]), minlength=VOCAB).float()
    expected = LOGITS - frequency * counts - presence * (counts > 0).float()
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], LOGITS)


def test_penalty_changes_the_greedy_choice():
    state = state_with(SamplingParams(temperature=0.0, repetition_penalty=2.0), output=[1])
    assert sample(state, LOGITS.unsqueeze(0)).token_ids.item() == 4


def test_logit_bias_adds_to_the_logits():
    bias = {2: 10.0, 1: -3.0}
    state = state_with(SamplingParams(temperature=0.0, logit_bias=bias), SamplingParams(temperature=0.0))
    processed = process_logits(LOGITS.expand(2, -1).clone(), state.metadata(2))
    expected = LOGITS.clone()
    expected[2] += 10.0
    expected[1] -= 3.0
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], LOGITS)
    assert sample(state, LOGITS.expand(2, -1)).token_ids.tolist() == [2, 1]


def test_allowed_token_ids_leave_only_those_tokens_to_greedy_and_random_rows():
    allowed = [0, 2, 5]
    state = state_with(
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, allowed_token_ids=allowed, logit_bias={2: 1.0}),
    )
    processed = process_logits(LOGITS.expand(3, -1).clone(), state.metadata(3))
    expected = torch.full((VOCAB,), float("-inf"))
    expected[allowed] = LOGITS[allowed]
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], LOGITS)
    expected[2] += 1.0
    torch.testing.assert_close(processed[2], expected)
    # LOGITS' best among [0, 2, 5] is 0; row 1 takes the whole vocabulary's best, 1.
    drawn = set()
    for _ in range(50):
        tokens = sample(state, LOGITS.expand(3, -1)).token_ids.tolist()
        assert tokens[:2] == [0, 1]
        drawn.add(tokens[2])
    # At temperature 2 each allowed token has a fair chance; nothing else has any.
    assert drawn == set(allowed)


def test_allowed_token_ids_follow_a_moved_row_and_leave_with_a_removed_one():
    state = state_with(
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, allowed_token_ids=[6])
    )
    state.remove(0)
    state.move(1, 0)
    assert sample(state, LOGITS.unsqueeze(0)).token_ids.item() == 6
    state.remove(0)
    state.add(0, SamplingParams(temperature=0.0), [], [])
    assert state.is_plain_greedy(0)
    assert sample(state, LOGITS.unsqueeze(0)).token_ids.item() == 1


def greedy_run(state: SamplingState, steps: int) -> list[int]:
    chosen = []
    for _ in range(steps):
        token = sample(state, LOGITS.unsqueeze(0)).token_ids.item()
        chosen.append(token)
        state.append_output_token(0, token)
    return chosen


def test_a_one_token_bad_word_is_never_sampled():
    # LOGITS' order: 1, 4, 7 (EOS), 0, ...
    state = state_with(SamplingParams(temperature=0.0, bad_words_token_ids=[[1]]))
    assert not state.is_plain_greedy(0)
    assert greedy_run(state, 3) == [4, 4, 4]
    drawn = set()
    state = state_with(SamplingParams(temperature=5.0, bad_words_token_ids=[[1], [4]]))
    for _ in range(100):
        drawn.add(sample(state, LOGITS.unsqueeze(0)).token_ids.item())
    assert drawn == set(range(VOCAB)) - {1, 4}


def test_a_longer_bad_word_bans_its_last_token_only_right_after_the_rest():
    assert greedy_run(state_with(SamplingParams(temperature=0.0)), 4) == [1, 1, 1, 1]
    state = state_with(SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 1]]))
    assert greedy_run(state, 4) == [1, 4, 1, 4]
    # "4 1 1": after 4 then 1, the next 1 is banned; after 1 1 (not preceded by 4) it is not.
    state = state_with(SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 1, 1]]), output=[4])
    assert greedy_run(state, 3) == [1, 4, 1]


def test_bad_words_count_the_output_before_preemption_and_follow_a_moved_row():
    state = state_with(
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 1]]),
        output=[1],
    )
    state.remove(0)
    state.move(1, 0)
    assert greedy_run(state, 2) == [4, 1]
    state.remove(0)
    state.add(0, SamplingParams(temperature=0.0), [], [1])
    assert state.is_plain_greedy(0)
    assert greedy_run(state, 1) == [1]


def test_bad_words_and_min_tokens_suppression_combine():
    state = state_with(
        SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[4], bad_words_token_ids=[[1]])
    )
    # 1 is a bad word, 4 a stop id and 7 EOS under min_tokens: 0 is the best left; then 4 may end it.
    assert greedy_run(state, 2) == [0, 4]


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 4.0]).unsqueeze(0)
    state = state_with(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]))
    chosen = []
    for _ in range(3):
        token = sample(state, logits).token_ids.item()
        chosen.append(token)
        state.append_output_token(0, token)
    assert chosen == [2, 2, EOS]


def test_min_tokens_counts_tokens_generated_before_preemption():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 4.0]).unsqueeze(0)
    state = state_with(SamplingParams(temperature=0.0, min_tokens=3), output=[2, 2])
    assert sample(state, logits).token_ids.item() == 4
    state.append_output_token(0, 4)
    assert sample(state, logits).token_ids.item() == EOS


def test_ignore_eos_leaves_eos_alone_under_min_tokens_but_stop_ids_stay_suppressed():
    logits = torch.tensor([0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 4.0]).unsqueeze(0)
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[EOS, 4], ignore_eos=True)
    state = state_with(params)
    assert sample(state, logits).token_ids.item() == 2
    state = state_with(SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True))
    assert sample(state, logits).token_ids.item() == EOS


def test_logprobs_are_raw_log_softmax_with_top_n_and_rank():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    state = state_with(
        SamplingParams(temperature=0.8, seed=5, logprobs=3, logit_bias={0: 5.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={int(logits[2].argmin()): 100.0}),
        vocab=40,
    )
    out = sample(state, logits)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for row, n in ((0, 3), (2, 0)):
        entry = out.logprobs[row]
        token = out.token_ids[row].item()
        assert entry is not None and len(entry.token_ids) == n + 1
        assert entry.token_ids[0] == token
        order = torch.argsort(raw[row], descending=True).tolist()
        assert entry.token_ids[1:] == order[:n]
        expected = [raw[row, t].item() for t in entry.token_ids]
        assert entry.logprobs == pytest.approx(expected, abs=1e-6)
        assert entry.sampled_rank == order.index(token) + 1
    # The bias decided row 2's token, but its logprob is the raw, unbiased one.
    assert out.logprobs[2].sampled_rank == 40


def run_steps(
    state: SamplingState, row: int, steps: list[torch.Tensor], num_rows: int, other=None
) -> list[int]:
    """Sample `row` over the given logits rows, placing them into a batch of num_rows."""
    sampler = Sampler()
    tokens = []
    for step, row_logits in enumerate(steps):
        batch = torch.randn(num_rows, row_logits.numel(), generator=torch.Generator().manual_seed(100 + step))
        batch[row] = row_logits
        out = sampler.sample(batch, state.metadata(num_rows)).token_ids.tolist()
        for r in range(num_rows):
            state.append_output_token(r, out[r])
        tokens.append(out[row])
    return tokens


def step_logits(num_steps: int, vocab: int = 500) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(vocab, generator=gen) for _ in range(num_steps)]


def test_seed_gives_the_same_tokens_whatever_the_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    steps = step_logits(8)
    alone = SamplingState(8, 500, CPU)
    alone.add(0, seeded, [1, 2], [])
    torch.manual_seed(0)
    expected = run_steps(alone, 0, steps, num_rows=1)

    crowded = SamplingState(8, 500, CPU)
    others = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=5, seed=99),
        None,
        SamplingParams(temperature=0.7, min_p=0.1, presence_penalty=0.5),
    ]
    for row, params in enumerate(others):
        crowded.add(row, params or seeded, [3], [])
    torch.manual_seed(1)
    assert run_steps(crowded, 3, steps, num_rows=5) == expected
    assert len(set(expected)) > 1


def test_different_seeds_give_different_tokens():
    steps = step_logits(8)
    results = []
    for seed in (1, 2):
        state = SamplingState(1, 500, CPU)
        state.add(0, SamplingParams(temperature=1.0, seed=seed), [], [])
        results.append(run_steps(state, 0, steps, num_rows=1))
    assert results[0] != results[1]


def test_seed_survives_preemption_and_a_new_row():
    params = SamplingParams(temperature=1.0, seed=77, repetition_penalty=1.3)
    steps = step_logits(8)
    state = SamplingState(4, 500, CPU)
    state.add(0, params, [5, 6], [])
    expected = run_steps(state, 0, steps, num_rows=1)

    state = SamplingState(4, 500, CPU)
    state.add(0, params, [5, 6], [])
    state.add(1, SamplingParams(temperature=1.0), [], [])
    first = run_steps(state, 0, steps[:3], num_rows=2)
    state.remove(0)
    state.remove(1)
    state.add(0, SamplingParams(temperature=0.5), [], [])
    state.add(1, SamplingParams(temperature=0.0), [], [])
    state.add(2, params, [5, 6], first)
    rest = run_steps(state, 2, steps[3:], num_rows=3)
    assert first + rest == expected


def test_moved_row_keeps_its_parameters_and_history():
    params = SamplingParams(temperature=0.8, seed=11, frequency_penalty=1.0, logprobs=2, min_tokens=5)
    steps = step_logits(6)
    state = SamplingState(4, 500, CPU, eos_token_ids=(EOS,))
    state.add(0, params, [], [])
    expected = run_steps(state, 0, steps, num_rows=1)

    state = SamplingState(4, 500, CPU, eos_token_ids=(EOS,))
    state.add(0, SamplingParams(temperature=0.0), [], [])
    state.add(1, SamplingParams(temperature=0.0, logit_bias={3: 1.0}), [], [])
    state.add(2, params, [], [])
    first = run_steps(state, 2, steps[:2], num_rows=3)
    state.remove(1)
    state.move(2, 1)
    md = state.metadata(2)
    assert md.suppress_rows is not None and md.suppress_token_ids is not None
    assert (md.suppress_rows.tolist(), md.suppress_token_ids.tolist()) == ([1], [EOS])
    rest = run_steps(state, 1, steps[2:], num_rows=2)
    assert first + rest == expected
    md = state.metadata(2)
    assert md.logprob_rows == [1] and md.all_greedy is False
    assert md.output_counts is not None and md.output_counts[1].sum().item() == 6


def test_removed_rows_leave_no_features_behind():
    state = state_with(
        SamplingParams(temperature=0.0),
        SamplingParams(
            temperature=0.5,
            top_k=2,
            top_p=0.5,
            min_p=0.1,
            seed=1,
            logprobs=1,
            logit_bias={1: 1.0},
            repetition_penalty=1.2,
            min_tokens=3,
        ),
    )
    state.remove(1)
    md = state.metadata(1)
    assert md.all_greedy and not md.needs_processing
    assert sample(state, LOGITS.unsqueeze(0)).token_ids.item() == 1


def test_draws_come_from_the_samplers_generator_alone():
    # Tensor-parallel ranks sample with generators seeded alike, whatever their default generators hold.
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    state = state_with(*[SamplingParams(temperature=2.0)] * 6, vocab=40)
    draws = []
    for default_seed in (1, 2):
        torch.manual_seed(default_seed)
        sampler = Sampler(torch.Generator().manual_seed(9))
        draws.append([sampler.sample(logits.clone(), state.metadata(6)).token_ids.tolist() for _ in range(3)])
    assert draws[0] == draws[1]
    assert draws[0][0] != draws[0][1] or draws[0][1] != draws[0][2]
