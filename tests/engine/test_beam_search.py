"""LLM.beam_search: the beams transformers' own beam search finds on a tiny random-init model (fp32),
width 1 being greedy decoding, the prefix cache serving the beams' shared blocks, and the end-of-sequence,
length-penalty and early-stopping rules on hand-made candidates."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.beam_search import BeamSearchSequence, PromptBeams
from hf_reference import load_hf_model
from sluice.errors import InvalidRequestError
from tiny_models import VOCAB_SIZE, tiny_model_dir

NEW_TOKENS = 10


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(VOCAB_SIZE - 64) for _ in range(rng.randint(4, 40))] for _ in range(3)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), dtype="float32", block_size=4)


def hf_beams(prompt: list[int], width: int) -> list[tuple[list[int], float]]:
    """transformers' beam search with no end-of-sequence token: each beam's tokens and summed logprob."""
    model = load_hf_model(tiny_model_dir("llama"), torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        length_penalty=1.0,
        early_stopping=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    # sequences_scores is the summed logprob over the output length (length_penalty 1).
    return [
        (sequence[len(prompt) :].tolist(), float(score) * NEW_TOKENS)
        for sequence, score in zip(out.sequences, out.sequences_scores, strict=True)
    ]


@pytest.mark.parametrize("width", [2, 4])
def test_beams_are_the_ones_transformers_finds(llm, width):
    params = BeamSearchParams(beam_width=width, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts()], params)
    for prompt, result in zip(prompts(), results, strict=True):
        reference = hf_beams(prompt, width)
        got = [(beam.output_token_ids, beam.cum_logprob) for beam in result.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in reference]
        for (_, ours), (_, theirs) in zip(got, reference, strict=True):
            assert ours == pytest.approx(theirs, abs=1e-3)
        assert all(
            beam.finish_reason == "length" and len(beam.logprobs) == NEW_TOKENS for beam in result.sequences
        )


def test_width_one_is_greedy_decoding_and_the_prefix_cache_serves_the_beams(llm):
    batch = [{"prompt_token_ids": p} for p in prompts()]
    greedy = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    hits_before = llm.engine.stats().prefix_cache_hits
    beams = llm.beam_search(batch, BeamSearchParams(beam_width=1, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [b.sequences[0].output_token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]
    # Every step resends each beam: its full blocks of 4 tokens come from the cache.
    assert (
        llm.engine.stats().prefix_cache_hits - hits_before
        > sum(len(p) for p in prompts()) * (NEW_TOKENS - 1) // 2
    )


def beams_of(search: PromptBeams) -> list[list[int]]:
    return [beam.output_token_ids for beam in search.best()]


def test_an_end_of_sequence_candidate_finishes_its_beam_and_the_best_finished_win():
    eos = 9
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    search = PromptBeams(params, (eos,), [BeamSearchSequence([1, 2], 2)])
    # Step 1: EOS is the best candidate and finishes at once; 5 and 6 live on.
    search.advance([{eos: -0.1, 5: -0.5, 6: -0.7, 7: -3.0}])
    assert [b.output_token_ids for b in search.finished] == [[eos]]
    assert [b.output_token_ids for b in search.live] == [[5], [6]]
    # Step 2: one finished beam is not beam_width of them, so the search goes on.
    search.advance([{5: -0.1, 6: -4.0, 7: -5.0, 8: -6.0}, {6: -0.2, 5: -4.0, 7: -5.0, 8: -6.0}])
    assert [b.output_token_ids for b in search.live] == [[5, 5], [6, 6]]
    search.advance([{1: -1.0, 2: -2.0, 3: -3.0, 4: -4.0}, {1: -0.1, 2: -2.0, 3: -3.0, 4: -4.0}])
    assert search.done
    # Scores per output token: [9] -0.1; [6, 6, 1] -1.0 / 3; [5, 5, 1] -1.6 / 3.
    assert beams_of(search) == [[eos], [6, 6, 1]]
    assert [b.finish_reason for b in search.best()] == ["stop", "length"]


def test_length_penalty_and_early_stopping():
    eos = 9

    def search_with(**options) -> PromptBeams:
        params = BeamSearchParams(beam_width=1, max_tokens=4, **options)
        search = PromptBeams(params, (eos,), [BeamSearchSequence([1], 1)])
        search.advance([{eos: -1.0, 5: -0.6}])
        return search

    # One finished beam (score -1.0) fills a width of 1: True stops at once.
    assert search_with(early_stopping=True).done
    # False: the live beam (-0.6) still scores better, so it goes on; "never" always does.
    assert not search_with(early_stopping=False).done
    assert not search_with(early_stopping="never").done
    longer = search_with(early_stopping="never", length_penalty=2.0)
    for _ in range(3):
        longer.advance([{5: -0.6, eos: -5.0}])
    # [5, 5, 5, 5] scores -2.4 / 4**2 = -0.15 against -1.0 for [9]: length_penalty 2 favours the long beam.
    assert beams_of(longer) == [[5, 5, 5, 5]]


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 11}, "beam_width"),
        ({"early_stopping": "soon"}, "early_stopping"),
    ],
)
def test_bad_parameters_are_refused_by_name(llm, options, param):
    params = BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **options})
    with pytest.raises(InvalidRequestError) as refused:
        llm.beam_search("ab", params)
    assert refused.value.param == param
