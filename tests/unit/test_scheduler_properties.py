"""Random arrivals, steps, finishes and aborts against the scheduler, with pools small enough to preempt.

A fake worker keeps its own state from the SchedulerOutput diffs alone, as a real one does (block
tables, and the tokens it sampled itself), and writes each computed token into its KV slot, so
prefix sharing and the diff protocol are checked against content, not just bookkeeping. Steps run
through a batch queue one or two deep, as the engine core runs them without and with async
scheduling: with two, a step is planned before the previous step's tokens are known. Some machines
run a hybrid model's groups (sluice/kv_cache_groups.py): one table per group, and a windowed group's
reads cover only its window, from blocks it must still hold.
"""

from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache_manager import RELEASED_BLOCK_ID
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from sluice.config import CacheConfig, SchedulerConfig
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import ModelRunnerOutput, SchedulerOutput

EOS = 2
VOCAB = [EOS, 3, 4, 5, 6]
MAX_PROMPT = 40
MAX_TOKENS = 8
MAX_MODEL_LEN = 64
BASES = [[10 + (i * 7 + j) % 5 for i in range(MAX_PROMPT)] for j in range(2)]
ARRIVAL = st.tuples(
    st.integers(0, len(BASES) - 1),
    st.one_of(st.sampled_from([8, 16, 40]), st.integers(0, MAX_PROMPT)),
    st.lists(st.sampled_from(VOCAB[1:]), max_size=8),
    st.integers(0, 3),
    st.integers(1, MAX_TOKENS),
    st.integers(0, 2),
)


@dataclass
class WorkerRequest:
    tokens: list[int]
    num_prompt_tokens: int
    # One table per KV cache group.
    blocks: list[list[int]]
    # Per group, the places the engine core released (checked each step).
    released: list[set[int]] = field(default_factory=list)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        extra_blocks=st.integers(0, 4),
        budget=st.sampled_from([1, 3, 8, 16, 64]),
        max_num_seqs=st.integers(1, 6),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        depth=st.sampled_from([1, 2]),
        # Each group's window (0: the whole context): one full group, a window every layer shares, hybrids.
        group_windows=st.sampled_from([(0,), (6,), (0, 5), (0, 3, 3), (0, 0, 4)]),
    )
    def setup(self, block_size, extra_blocks, budget, max_num_seqs, policy, caching, depth, group_windows):
        self.block_size = block_size
        self.group_windows = group_windows
        # The pool always holds one request of the longest possible length alone, so nothing livelocks.
        blocks_per_group = -(-(MAX_PROMPT + MAX_TOKENS) // block_size)
        self.num_blocks = blocks_per_group * len(group_windows) + extra_blocks
        self.budget = budget
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching),
            self.num_blocks,
            MAX_MODEL_LEN,
            group_windows=group_windows,
        )
        self.depth = depth
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.next_id = 0
        self.worker: dict[str, WorkerRequest] = {}
        self.slots: dict[tuple[int, int], int] = {}

    @rule(arrivals=st.lists(ARRIVAL, min_size=1, max_size=4))
    def add(self, arrivals):
        for base, prefix_len, suffix, priority, max_tokens, min_tokens in arrivals:
            prompt = (BASES[base][:prefix_len] + suffix)[:MAX_PROMPT] or [1]
            params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens))
            request_id = f"r{self.next_id}"
            self.scheduler.add_request(
                Request(request_id, prompt, params, float(self.next_id), priority, eos_token_ids=(EOS,))
            )
            self.next_id += 1

    @rule(num_steps=st.integers(1, 6), data=st.data())
    def step(self, num_steps, data):
        for _ in range(num_steps):
            self.run_step(lambda: data.draw(st.sampled_from(VOCAB)))

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        request_ids = sorted(self.scheduler.requests)
        request_id = data.draw(st.sampled_from(request_ids))
        [output] = self.scheduler.abort_requests([request_id])
        assert output.finish_reason == "abort" and request_id not in self.scheduler.requests

    def teardown(self):
        if hasattr(self, "scheduler"):
            self.drain()

    def drain(self):
        for _ in range(5000):
            if not self.scheduler.has_unfinished_requests() and not self.in_flight:
                break
            self.run_step(lambda: 3)
        assert not self.scheduler.has_unfinished_requests(), "requests never finished"
        # The last finishes are reported to the workers by one more step.
        self.mirror_worker(self.scheduler.schedule(), lambda: 3)
        assert not self.worker
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.num_free_blocks == self.num_blocks
        assert all(block.ref_cnt == 0 for block in pool.blocks)
        stats = self.scheduler.make_stats()
        event(f"preempted: {stats.num_preemptions > 0}")
        event(f"prefix cache hit: {stats.prefix_cache_hits > 0}")

    def run_step(self, draw_token) -> None:
        """What EngineCore.step does: fill the batch queue, then fold in the oldest step's output."""
        scheduler = self.scheduler
        while len(self.in_flight) < self.depth:
            waiting_before = scheduler.waiting.ordered()
            out = scheduler.schedule()
            self.check_budget(out)
            self.check_admission_order(out, waiting_before)
            runner_output = self.mirror_worker(out, draw_token)
            if out.total_num_scheduled_tokens == 0 and not out.finished_req_ids and not out.preempted_req_ids:
                break
            self.in_flight.append((out, runner_output))
        if self.in_flight:
            for output in scheduler.update_from_output(*self.in_flight.popleft()):
                assert output.new_token_ids or output.finished

    def check_budget(self, out: SchedulerOutput) -> None:
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= self.budget
        assert len(out.num_scheduled_tokens) <= self.max_num_seqs
        assert all(n > 0 for n in out.num_scheduled_tokens.values())

    def check_admission_order(self, out: SchedulerOutput, waiting_before: list[Request]) -> None:
        # Admissions are a prefix of the waiting order: (priority, arrival) under the priority
        # policy, so no request is admitted while a strictly higher-priority one is left waiting.
        cached = out.scheduled_cached_reqs
        resumed = [req_id for req_id, flag in zip(cached.req_ids, cached.resumed, strict=True) if flag]
        admitted = [new.req_id for new in out.scheduled_new_reqs] + resumed
        assert set(admitted) == {request.request_id for request in waiting_before[: len(admitted)]}
        if self.policy == "priority" and admitted:
            left = [r.priority for r in waiting_before[len(admitted) :] if r.status != RequestStatus.RUNNING]
            worst_admitted = max(r.priority for r in waiting_before[: len(admitted)])
            assert all(worst_admitted <= priority for priority in left)

    def mirror_worker(self, out: SchedulerOutput, draw_token) -> ModelRunnerOutput:
        """Apply the diffs as a worker would, write the step's KV, check what each request reads, sample."""
        manager = self.scheduler.kv_cache_manager
        for request_id in out.finished_req_ids:
            del self.worker[request_id]
        for request_id in out.preempted_req_ids:
            self.worker[request_id].blocks = [[] for _ in self.group_windows]
        starts = {}
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.worker, "a request the workers know was sent in full"
            self.worker[new.req_id] = WorkerRequest(
                list(new.prompt_token_ids), len(new.prompt_token_ids), [list(t) for t in new.block_ids]
            )
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for request_id, resumed, new_block_ids, num_computed, num_outputs in cached.rows():
            state = self.worker[request_id]
            if resumed:
                del state.tokens[state.num_prompt_tokens + num_outputs :]
                state.blocks = [list(table) for table in new_block_ids]
            else:
                for table, new_ids in zip(state.blocks, new_block_ids, strict=True):
                    table.extend(new_ids)
            starts[request_id] = num_computed
        assert starts.keys() == out.num_scheduled_tokens.keys()
        size = self.block_size
        for request_id, start in starts.items():
            state = self.worker[request_id]
            # The workers never hear of a released block: its old id stays in their table, unread.
            engine_tables = manager.get_block_ids(request_id)
            assert [
                [i for i, e in zip(table, engine, strict=True) if e != RELEASED_BLOCK_ID]
                for table, engine in zip(state.blocks, engine_tables, strict=True)
            ] == [[e for e in engine if e != RELEASED_BLOCK_ID] for engine in engine_tables], (
                "block tables drifted"
            )
            state.released = [
                {i for i, e in enumerate(engine) if e == RELEASED_BLOCK_ID} for engine in engine_tables
            ]
            engine_tokens = self.scheduler.requests[request_id].all_token_ids
            assert state.tokens[: len(engine_tokens)] == engine_tokens, "worker and engine tokens drifted"
            end = start + out.num_scheduled_tokens[request_id]
            assert end <= len(state.tokens), "scheduled a token the worker does not know"
            for table, released in zip(state.blocks, state.released, strict=True):
                for pos in range(start, end):
                    assert pos // size not in released, "a step writes into a released block"
                    self.slots[(table[pos // size], pos % size)] = state.tokens[pos]
        # Attention reads after every write of the step, as each layer does.
        req_ids, sampled = [], []
        for request_id, start in starts.items():
            state = self.worker[request_id]
            end = start + out.num_scheduled_tokens[request_id]
            for table, released, window in zip(state.blocks, state.released, self.group_windows, strict=True):
                # What the step's first query sees, and every later one's keys.
                first = max(0, start - window + 1) if window else 0
                assert not released & set(range(first // size, -(-end // size))), "reads a released block"
                read = [self.slots.get((table[pos // size], pos % size)) for pos in range(first, end)]
                assert read == state.tokens[first:end], f"{request_id} would attend to someone else's KV"
            req_ids.append(request_id)
            if end == len(state.tokens):
                state.tokens.append(draw_token())
                sampled.append([state.tokens[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(out.step_id, req_ids, sampled, [None] * len(req_ids))

    @invariant()
    def ref_counts_match_holders(self):
        if not hasattr(self, "scheduler"):
            return
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        holders = [0] * self.num_blocks
        for request_id, tables in manager.req_to_blocks.items():
            request = self.scheduler.requests[request_id]
            assert request.status == RequestStatus.RUNNING
            blocks = manager.held_blocks(request_id)
            assert len({block.block_id for block in blocks}) == len(blocks)
            assert {len(table) for table in tables} == {-(-request.num_computed_tokens // self.block_size)}
            assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders
            for block in blocks:
                holders[block.block_id] += 1
        assert [block.ref_cnt for block in pool.blocks] == holders
        free = pool.free_block_queue.blocks()
        assert {block.block_id for block in free} == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert len(free) == pool.num_free_blocks
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        for request in self.scheduler.requests.values():
            assert request.num_tokens <= MAX_MODEL_LEN
            assert request.num_output_placeholders <= self.depth
            if request.status != RequestStatus.RUNNING:
                assert request.request_id not in manager.req_to_blocks and request.num_computed_tokens == 0
        stats = self.scheduler.make_stats()
        assert stats.num_running + stats.num_waiting == len(self.scheduler.requests)
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries


SchedulerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
