"""Speculative decoding without a model: the n-gram proposer, and the scheduler's side of drafts.

The scheduler runs against a fake greedy model (its next token is a function of the context) and a
fake worker that verifies drafts the way the real one does, so a run with drafts must give the
tokens of a run without them, and leave every KV block free.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from engine.block_pool_audit import audit_block_pool
from engine.ngram_proposer import NgramProposer
from engine.request import Request
from engine.scheduler import Scheduler
from engine.speculation import accepts_drafts
from sluice.config import CacheConfig, SchedulerConfig, SpeculativeConfig, steps_in_flight
from sluice.engine_args import add_engine_arguments, config_from_args
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import ModelRunnerOutput, SchedulerOutput

NextToken = Callable[[list[int]], int]


def test_proposer_continues_the_most_recent_longest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    # The suffix [1, 2, 3] occurred at 0 (followed by 9) and at 5 (followed by 8): the later one wins.
    tokens = [1, 2, 3, 9, 0, 1, 2, 3, 8, 7, 1, 2, 3]
    assert proposer.propose(tokens, 3) == [8, 7, 1]
    # A longer match beats a more recent shorter one: [5, 2, 3] only matches at its start.
    tokens = [5, 2, 3, 40, 41, 0, 2, 3, 50, 5, 2, 3]
    assert proposer.propose(tokens, 2) == [40, 41]


def test_proposer_respects_min_n_and_max_drafts():
    tokens = [4, 1, 2, 6, 3, 2]
    assert NgramProposer(min_n=1, max_n=4).propose(tokens, 5) == [6, 3, 2]
    assert NgramProposer(min_n=2, max_n=4).propose(tokens, 5) == []
    assert NgramProposer(min_n=1, max_n=4).propose(tokens, 1) == [6]
    assert NgramProposer(min_n=1, max_n=4).propose(tokens, 0) == []
    assert NgramProposer(min_n=1, max_n=4).propose([1, 2, 3], 4) == []


def make_scheduler(
    speculative: bool, num_blocks: int = 64, block_size: int = 4, k: int = 4, async_scheduling: bool = False
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=async_scheduling),
        CacheConfig(block_size=block_size),
        num_blocks,
        256,
        SpeculativeConfig(
            method="ngram" if speculative else None, num_speculative_tokens=k, prompt_lookup_min=1
        ),
    )


def copying_model(context: list[int]) -> int:
    """Mostly repeats the token six back, with a twist every ninth token: drafts hit, and sometimes miss."""
    return context[-6] if len(context) % 9 and len(context) >= 6 else 3 + len(context) % 5


def fake_worker(scheduler: Scheduler, out: SchedulerOutput, next_token: NextToken) -> ModelRunnerOutput:
    """Verifies drafts as the worker does: greedy tokens up to the first miss, or one past the last draft."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        drafts = out.scheduled_spec_token_ids.get(request_id, [])
        if request.num_computed_tokens - len(drafts) < request.num_tokens:
            sampled.append([])
            continue
        context = list(request.all_token_ids)
        tokens: list[int] = []
        for draft in [*drafts, None]:
            tokens.append(next_token(context))
            context.append(tokens[-1])
            if tokens[-1] != draft:
                break
        sampled.append(tokens)
    return ModelRunnerOutput(out.step_id, req_ids, sampled, [None] * len(req_ids))


def run(scheduler: Scheduler, requests: list[Request], next_token: NextToken) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for request_id, drafts in out.scheduled_spec_token_ids.items():
            request = scheduler.requests[request_id]
            assert drafts and out.num_scheduled_tokens[request_id] == len(drafts) + 1
            assert request.num_output_tokens + len(drafts) < request.sampling_params.max_tokens
        for engine_output in scheduler.update_from_output(out, fake_worker(scheduler, out, next_token)):
            outputs[engine_output.request_id] += engine_output.new_token_ids
        for request in scheduler.running:
            # Rejected drafts are handed back: only the newest token is left to compute.
            assert request.num_computed_tokens == request.num_tokens - 1
    return outputs


def requests(**params) -> list[Request]:
    prompts = [[11, 12, 13, 14, 15, 16] * 3, [21, 22, 23, 24] * 2 + [25], [31, 32, 33]]
    return [
        Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, **params), eos_token_ids=(2,))
        for i, prompt in enumerate(prompts)
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_drafts_give_the_tokens_of_plain_decoding_and_leak_no_block(block_size):
    plain = run(make_scheduler(False, block_size=block_size), requests(), copying_model)
    scheduler = make_scheduler(True, block_size=block_size)
    speculated = run(scheduler, requests(), copying_model)
    assert speculated == plain
    assert all(len(tokens) == 40 for tokens in plain.values())
    speculator = scheduler.speculator
    assert speculator is not None
    # Some drafts held and some missed, and fewer steps than tokens were needed.
    assert 0 < speculator.num_accepted_tokens < speculator.num_draft_tokens
    stats = scheduler.make_stats()
    assert stats.spec_decode_num_draft_tokens == speculator.num_draft_tokens
    assert stats.spec_decode_num_accepted_tokens == speculator.num_accepted_tokens
    assert stats.spec_decode_num_drafts == speculator.num_drafts > 0
    audit = audit_block_pool(scheduler.kv_cache_manager, scheduler.requests.keys())
    assert audit.consistent, audit.problems
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    stop = 13
    plain = run(make_scheduler(False), requests(stop_token_ids=[stop]), copying_model)
    scheduler = make_scheduler(True)
    speculated = run(scheduler, requests(stop_token_ids=[stop]), copying_model)
    assert speculated == plain and plain["r0"][-1] == stop and len(plain["r0"]) < 40
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_drafts_never_cost_a_preemption():
    # Exactly the blocks for r0's 18 prompt and 40 output tokens: no room for drafts near its end.
    scheduler = make_scheduler(True, num_blocks=15, block_size=4)
    speculated = run(scheduler, requests()[:1], copying_model)
    assert speculated == run(
        make_scheduler(False, num_blocks=15, block_size=4), requests()[:1], copying_model
    )
    assert scheduler.num_preemptions == 0 and scheduler.make_stats().spec_decode_num_drafts > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 15


def test_preempted_requests_with_drafts_resume_to_the_same_tokens():
    # Room for any one request with its drafts, not for all three at once.
    scheduler = make_scheduler(True, num_blocks=16, block_size=4)
    speculated = run(scheduler, requests(), copying_model)
    assert speculated == run(make_scheduler(False, num_blocks=16, block_size=4), requests(), copying_model)
    assert scheduler.num_preemptions > 0
    audit = audit_block_pool(scheduler.kv_cache_manager, scheduler.requests.keys())
    assert audit.consistent and scheduler.kv_cache_manager.num_free_blocks == 16


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.8},
        {"temperature": 0.0, "logprobs": 0},
        {"temperature": 0.0, "repetition_penalty": 1.2},
        {"temperature": 0.0, "presence_penalty": 0.5},
        {"temperature": 0.0, "logit_bias": {5: 1.0}},
    ],
)
def test_requests_that_are_not_plain_greedy_get_no_drafts(params):
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=8, **params))
    assert not accepts_drafts(request)
    scheduler = make_scheduler(True)
    scheduler.add_request(request)
    for _ in range(4):
        out = scheduler.schedule()
        assert out.scheduled_spec_token_ids == {}
        scheduler.update_from_output(out, fake_worker(scheduler, out, copying_model))


def test_min_tokens_defers_drafts_until_it_is_met():
    request = Request(
        "r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=2)
    )
    assert not accepts_drafts(request)
    request.append_output_token(3)
    request.append_output_token(1)
    assert accepts_drafts(request)


def test_cli_options_make_the_speculative_config():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "3"])
    args.ngram_prompt_lookup_max = 5
    config = config_from_args(args, model_path="/models/any")
    assert config.speculative == SpeculativeConfig("ngram", 3, 2, 5)
    assert steps_in_flight(config) == 1 and config.scheduler.async_scheduling
    plain = config_from_args(parser.parse_args([]), model_path="/models/any")
    assert not plain.speculative.enabled and steps_in_flight(plain) == 2
