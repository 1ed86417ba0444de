"""The token-budget scheduler: chunking, preemption, policies, stops, aborts and what workers are sent."""

from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from sluice.config import CacheConfig, SchedulerConfig
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    caching: bool = True,
    max_model_len: int = 256,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
        max_model_len,
    )


def make_request(
    request_id: str, num_tokens: int, priority: int = 0, arrival: float = 0.0, **params
) -> Request:
    return Request(
        request_id,
        [100 + i for i in range(num_tokens)],
        SamplingParams(**params),
        arrival_time=arrival,
        priority=priority,
        eos_token_ids=(EOS,),
    )


def runner_output(scheduler: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A fake model: every request whose known tokens are all computed samples `token`."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for request_id in req_ids:
        request = scheduler.requests[request_id]
        sampled.append([token] if request.num_computed_tokens == request.num_tokens else [])
    return ModelRunnerOutput(out.step_id, req_ids, sampled, [None] * len(req_ids))


def step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner_output(scheduler, out, token))


def test_budget_of_16_chunks_every_prompt():
    scheduler = make_scheduler(budget=16)
    for i, length in enumerate([40, 20, 17]):
        scheduler.add_request(make_request(f"r{i}", length, max_tokens=3))
    first_chunk: dict[str, int] = {}
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 16
        for request_id, num_tokens in out.num_scheduled_tokens.items():
            first_chunk.setdefault(request_id, num_tokens)
    assert first_chunk["r0"] == 16 and first_chunk["r1"] < 20 and first_chunk["r2"] < 17
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_new_request_is_sent_in_full_then_as_a_diff():
    scheduler = make_scheduler(budget=6)
    scheduler.add_request(make_request("a", 10, max_tokens=4))
    out, outputs = step(scheduler)
    [new] = out.scheduled_new_reqs
    assert new.req_id == "a" and new.num_computed_tokens == 0 and new.block_ids == [[0, 1]]
    assert out.num_scheduled_tokens == {"a": 6} and outputs == []
    out, outputs = step(scheduler)
    assert out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.req_ids == ["a"]
    assert out.scheduled_cached_reqs.new_block_ids == [[[2]]]
    assert out.scheduled_cached_reqs.num_computed_tokens == [6]
    assert [o.new_token_ids for o in outputs] == [[7]]
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_cached_reqs.new_block_ids == [[[]]]


def test_identical_prompts_admitted_in_one_step_share_blocks():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 12))
    scheduler.add_request(make_request("b", 12))
    out = scheduler.schedule()
    blocks_a, blocks_b = (new.block_ids[0] for new in out.scheduled_new_reqs)
    assert blocks_a[:2] == blocks_b[:2] and blocks_a[2] != blocks_b[2]
    assert out.num_scheduled_tokens == {"a": 12, "b": 4}
    assert out.scheduled_new_reqs[1].num_computed_tokens == 8
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in blocks_a[:2]] == [2, 2]
    stats = scheduler.make_stats()
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 24
    assert scheduler.requests["b"].num_cached_tokens == 8


def test_preempted_request_resumes_first_as_a_diff():
    # Three blocks of 4 tokens: two 4-token prompts fit, their first decode tokens do not.
    scheduler = make_scheduler(num_blocks=3, caching=False)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    step(scheduler, token=11)
    scheduler.add_request(make_request("c", 4, max_tokens=3))
    out, _ = step(scheduler, token=12)
    assert out.num_scheduled_tokens == {"a": 1}
    # The workers keep b's tokens: it leaves the batch, it is not dropped.
    assert out.preempted_req_ids == ["b"] and out.finished_req_ids == []
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting.ordered()] == ["b", "c"]
    admitted, resumed = [], []
    while scheduler.has_unfinished_requests():
        out, _ = step(scheduler, token=13)
        admitted += [new.req_id for new in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        resumed += [
            (req_id, blocks, computed, outputs)
            for req_id, flag, blocks, computed, outputs in cached.rows()
            if flag
        ]
    # b comes back before c, as a diff: all its blocks, nothing computed, the one token it kept.
    assert admitted == ["c"]
    req_id, blocks, computed, outputs = resumed[0]
    assert req_id == "b" and len(blocks[0]) == 2 and computed == 0 and outputs == 1
    assert scheduler.make_stats().num_preemptions >= 1
    assert scheduler.kv_cache_manager.num_free_blocks == 3


def test_priority_preempts_the_lowest_priority_and_admits_nothing_that_step():
    scheduler = make_scheduler(num_blocks=3, policy="priority", caching=False)
    scheduler.add_request(make_request("low", 8, priority=5, arrival=0.0, max_tokens=2))
    scheduler.add_request(make_request("high", 4, priority=0, arrival=1.0, max_tokens=2))
    out, _ = step(scheduler)
    assert [new.req_id for new in out.scheduled_new_reqs] == ["high", "low"]
    scheduler.add_request(make_request("mid", 2, priority=1, arrival=2.0, max_tokens=2))
    out, _ = step(scheduler)
    # "high" needed a block: "low" was the victim; "mid" would fit the freed block but must wait.
    assert out.num_scheduled_tokens == {"high": 1} and out.preempted_req_ids == ["low"]
    out, _ = step(scheduler)
    assert [new.req_id for new in out.scheduled_new_reqs] == ["mid"]


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(policy="priority", max_num_seqs=3)
    for request_id, priority, arrival in [("p3", 3, 0.0), ("p1late", 1, 2.0), ("p1", 1, 1.0), ("p2", 2, 0.5)]:
        scheduler.add_request(make_request(request_id, 4, priority=priority, arrival=arrival))
    out = scheduler.schedule()
    assert [new.req_id for new in out.scheduled_new_reqs] == ["p1", "p1late", "p2"]
    assert [r.request_id for r in scheduler.waiting.ordered()] == ["p3"]


def test_fcfs_admits_in_arrival_order_and_respects_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in ["x", "y", "z"]:
        scheduler.add_request(make_request(request_id, 4, priority=-ord(request_id)))
    out = scheduler.schedule()
    assert [new.req_id for new in out.scheduled_new_reqs] == ["x", "y"]


def test_abort_frees_blocks_and_is_reported_next_step():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", 8))
    scheduler.add_request(make_request("b", 8, max_tokens=5))
    step(scheduler)
    scheduler.add_request(make_request("waiting", 40))
    outputs = scheduler.abort_requests(["a", "waiting", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort"), ("waiting", "abort")]
    assert scheduler.kv_cache_manager.get_block_ids("a") == [[]]
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0
    out = scheduler.schedule()
    # Workers never saw "waiting", so only "a" is theirs to drop.
    assert out.finished_req_ids == ["a"] and list(out.num_scheduled_tokens) == ["b"]


def test_frames_for_aborted_requests_are_dropped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4))
    out = scheduler.schedule()
    scheduler.abort_requests(["a"])
    assert scheduler.update_from_output(out, runner_output_for(out, ["a"])) == []


def runner_output_for(out: SchedulerOutput, req_ids: list[str], token: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput(out.step_id, req_ids, [[token]] * len(req_ids), [None] * len(req_ids))


def test_min_tokens_suppresses_eos_then_eos_stops():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, min_tokens=2, max_tokens=10))
    _, outputs = step(scheduler, token=EOS)
    assert outputs[0].finish_reason is None
    _, outputs = step(scheduler, token=EOS)
    assert outputs[0].finish_reason == "stop" and outputs[0].stop_reason is None
    assert scheduler.requests == {} and scheduler.kv_cache_manager.num_free_blocks == 64
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_stop_token_ids_ignore_eos_and_lengths():
    scheduler = make_scheduler(max_model_len=7)
    scheduler.add_request(make_request("stop", 4, stop_token_ids=[9], max_tokens=10, ignore_eos=True))
    scheduler.add_request(make_request("ignore", 4, ignore_eos=True, max_tokens=2))
    scheduler.add_request(make_request("model_len", 5, max_tokens=10, ignore_eos=True))
    _, outputs = step(scheduler, token=EOS)
    assert [o.finish_reason for o in outputs] == [None, None, None]
    _, outputs = step(scheduler, token=9)
    assert {o.request_id: (o.finish_reason, o.stop_reason) for o in outputs} == {
        "stop": ("stop", 9),
        "ignore": ("length", None),
        "model_len": ("length", None),
    }
    assert not scheduler.has_unfinished_requests()


def test_scheduling_before_the_output_plans_a_placeholder_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    first = scheduler.schedule()
    # Step 1 is planned while step 0 runs: "a" decodes the token step 0 has not returned yet.
    second = scheduler.schedule()
    a = scheduler.requests["a"]
    assert first.num_scheduled_tokens == {"a": 4} and second.num_scheduled_tokens == {"a": 1}
    assert a.num_computed_tokens == 5 and a.num_tokens == 4 and a.num_output_placeholders == 2
    assert [
        o.new_token_ids for o in scheduler.update_from_output(first, runner_output_for(first, ["a"], 20))
    ] == [[20]]
    # Two tokens are in flight or known and max_tokens is 3: one more step, then none.
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    assert scheduler.schedule().num_scheduled_tokens == {}
    scheduler.update_from_output(second, runner_output_for(second, ["a"], 21))
    [last] = scheduler.update_from_output(third, runner_output_for(third, ["a"], 22))
    assert last.new_token_ids == [22] and last.finish_reason == "length"
    assert scheduler.requests == {} and scheduler.kv_cache_manager.num_free_blocks == 64


def test_async_frame_after_a_stop_is_dropped_and_blocks_freed():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 4, max_tokens=10))
    first = scheduler.schedule()
    second = scheduler.schedule()
    [stopped] = scheduler.update_from_output(first, runner_output_for(first, ["a"], EOS))
    assert stopped.finish_reason == "stop" and scheduler.kv_cache_manager.num_free_blocks == 64
    # Step 1 computed a token for "a" after its stop: it never reaches the request.
    assert scheduler.update_from_output(second, runner_output_for(second, ["a"], 30)) == []
    assert scheduler.schedule().finished_req_ids == ["a"]


def test_async_frame_for_a_preempted_request_is_dropped_and_resume_says_what_was_kept():
    scheduler = make_scheduler(num_blocks=3, caching=False)
    scheduler.add_request(make_request("a", 4, max_tokens=4))
    scheduler.add_request(make_request("b", 4, max_tokens=4))
    first = scheduler.schedule()
    # Planning step 1 needs a new block for each: the pool has one, so "b" is preempted.
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1} and second.preempted_req_ids == ["b"]
    outputs = scheduler.update_from_output(first, runner_output_for(first, ["a", "b"], 40))
    # b's token from step 0 arrived after its preemption: dropped, and recomputed when it resumes.
    assert [o.request_id for o in outputs] == ["a"] and scheduler.requests["b"].output_token_ids == []
    scheduler.abort_requests(["a"])
    assert scheduler.update_from_output(second, runner_output_for(second, ["a"])) == []
    third = scheduler.schedule()
    cached = third.scheduled_cached_reqs
    assert third.finished_req_ids == ["a"] and cached.req_ids == ["b"] and cached.resumed == [True]
    assert cached.num_output_tokens == [0] and third.num_scheduled_tokens == {"b": 4}


def test_iteration_tokens_count_each_step_in_its_bucket():
    # Bounds 1, 8, 16, 32...: a 20-token prompt in a 16-token budget is steps of 16 and 4, then
    # decode steps of 1 (2 requests: 2 tokens) until both end.
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(make_request("a", 20, max_tokens=2))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make_request("b", 3, max_tokens=2))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    stats = scheduler.make_stats()
    assert stats.iteration_tokens[:4] == [1, 2, 1, 0] and sum(stats.iteration_tokens) == 4
    assert stats.iteration_tokens_sum == 16 + 4 + (1 + 3) + 1


def test_first_scheduled_time_is_set_once_and_kept_across_preemption():
    scheduler = make_scheduler(num_blocks=3, caching=False)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    assert scheduler.requests["b"].first_scheduled_time is None
    _, outputs = step(scheduler, token=11)
    first = scheduler.requests["b"].first_scheduled_time
    assert first is not None and all(o.first_scheduled_time is not None for o in outputs)
    scheduler.add_request(make_request("c", 4, max_tokens=3))
    step(scheduler, token=12)
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    while scheduler.has_unfinished_requests():
        _, outputs = step(scheduler, token=13)
        for output in outputs:
            if output.request_id == "b":
                assert output.first_scheduled_time == first
