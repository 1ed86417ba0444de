"""The token-budget scheduler.

There is no prefill phase and no decode phase. Each request has num_computed_tokens chasing
num_tokens (prompt plus outputs); every step hands out allotments that close those gaps under one
token budget and a cap on the batch width. A long prompt is chunked because its gap is clamped to
what is left of the budget, nothing more.

Under async scheduling the next step is planned before the last one's tokens are known: a step
that samples leaves a placeholder, and the gap counts it, so a decoding request is scheduled again
at once; the worker feeds the token it sampled into that next step itself.

With speculative decoding (engine.speculation) a decoding request's allotment is its one token
plus draft tokens; what the worker rejects of them is handed back when its output arrives.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.speculation import Speculator
from sluice.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from sluice.frontend_seam import ITERATION_TOKENS_BOUNDS, EngineOutput, EngineStats
from sluice.pooling import PoolingSpec, finish_embedding
from sluice.sampling_params import params_to_wire
from sluice.worker_seam import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput


class FcfsQueue:
    """Waiting requests in arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def ordered(self) -> list[Request]:
        return list(self._queue)


class PriorityQueue:
    """Waiting requests by (priority, arrival_time); there is no front, so a preempted one re-enters by key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def ordered(self) -> list[Request]:
        return [entry[3] for entry in sorted(self._heap, key=lambda e: e[:3])]


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        speculative_config: SpeculativeConfig | None = None,
        group_windows: Sequence[int] = (0,),
        pooling_spec: PoolingSpec | None = None,
    ) -> None:
        """group_windows: the window of each group of the model's layers (sluice/kv_cache_groups.py), 0 for
        the whole context; a windowed group's requests release the blocks its queries can no longer see.
        pooling_spec: the model's pooling under the pooling runner, which finishes its requests'
        embeddings; None under the generate runner."""
        self.pooling_spec = pooling_spec
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.policy = scheduler_config.policy
        # The engine core sends a structured step's masks after the step before it is folded in.
        self.masks_follow_tokens_in_flight = scheduler_config.structured_output_overlap
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            group_windows,
            # Rejected drafts move a request's computed count back by up to this many tokens.
            speculative_config.num_speculative_tokens
            if speculative_config is not None and speculative_config.enabled
            else 0,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: FcfsQueue | PriorityQueue = (
            PriorityQueue() if self.policy == "priority" else FcfsQueue()
        )
        # Under the priority policy kept sorted by (priority, arrival): the last one is always the victim.
        self.running: list[Request] = []
        # Ids whose worker state must be dropped, and ids that left the batch, for the next schedule().
        self.finished_req_ids: list[str] = []
        self.preempted_req_ids: list[str] = []
        # Requests the workers hold state for: from their first step until their finish is sent.
        self.known_to_workers: set[str] = set()
        self._step_ids = itertools.count()
        # Breaks (priority, arrival) ties among running requests by admission order.
        self._admission_seq = itertools.count()
        self._running_key: dict[str, tuple[int, float, int]] = {}
        self.num_preemptions = 0
        # As the workers last reported it: they count their own eager fallbacks.
        self.num_eager_fallbacks = 0
        # Steps per bucket of scheduled tokens (ITERATION_TOKENS_BOUNDS, then one above), and their tokens.
        self.iteration_tokens = [0] * (len(ITERATION_TOKENS_BOUNDS) + 1)
        self.iteration_tokens_sum = 0
        self.speculator = (
            Speculator(speculative_config, max_model_len)
            if speculative_config is not None and speculative_config.enabled
            else None
        )

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
        assert request.num_tokens <= self.max_model_len, "the boundary checks prompt length"
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[Request] = []
        resumed_reqs: list[Request] = []
        cached_reqs = CachedRequestData()
        spec_token_ids: dict[str, list[int]] = {}
        preempted = False

        # Running requests first: they hold blocks already and protect inter-token latency.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(self._num_tokens_to_compute(request), token_budget)
            if num_new_tokens == 0:
                # Its last token is in flight already (async scheduling): nothing left to compute.
                req_index += 1
                continue
            drafts = self._drafts_for(request, num_new_tokens, token_budget)
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens + len(drafts))
                if new_block_ids is not None:
                    break
                if drafts:
                    # Drafts are a bet: nobody is preempted to make room for them.
                    drafts = []
                    continue
                # Every request before req_index is scheduled; the victim is always at or after it.
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                break
            self._add_cached(cached_reqs, request, new_block_ids, resumed=False)
            if drafts:
                spec_token_ids[request.request_id] = drafts
                num_new_tokens += len(drafts)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # A step that had to shed load admits nothing new.
        if not preempted:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting.peek()
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                num_new_tokens = min(request.num_tokens - num_computed, token_budget)
                assert num_new_tokens > 0
                if request.encodes_whole_prompt and num_new_tokens < request.num_tokens:
                    # An encoder's prompt is never chunked: it waits for a step with room for all of it.
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks)
                # Head-of-line: nobody behind the head jumps it, which keeps both policies' order strict.
                if new_block_ids is None:
                    break
                self.waiting.pop()
                if request.status == RequestStatus.WAITING:
                    request.num_cached_tokens = num_computed
                    request.first_scheduled_time = time.time()
                    new_reqs.append(request)
                else:
                    resumed_reqs.append(request)
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed
                self._add_running(request)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens

        assert len(self.running) <= self.max_num_seqs
        assert token_budget >= 0
        new_reqs_data = [
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                params=params_to_wire(request.sampling_params),
                block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                second_text_start=request.second_text_start,
            )
            for request in new_reqs
        ]
        for request in resumed_reqs:
            # A resumed request is a diff: its whole new block list, and the tokens the engine kept.
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            self._add_cached(cached_reqs, request, block_ids, resumed=True)
        structured_output_req_ids: list[str] = []
        # Advanced now, not when the output comes back, so the next schedule() can already plan.
        for request_id, num_tokens in num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            num_drafts = len(spec_token_ids.get(request_id, ()))
            # A pooling request samples nothing: once its prompt is computed it waits for its embedding.
            if request.pooling is None and (
                request.num_computed_tokens - num_drafts
                == request.num_tokens + request.num_output_placeholders
            ):
                # This step samples the request's next token.
                request.num_output_placeholders += 1
                if request.samples_under_mask(request.num_output_placeholders - 1):
                    structured_output_req_ids.append(request_id)
            self.known_to_workers.add(request_id)
        finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        preempted_req_ids, self.preempted_req_ids = self.preempted_req_ids, []
        total_num_scheduled_tokens = self.max_num_batched_tokens - token_budget
        if total_num_scheduled_tokens:
            bucket = bisect.bisect_left(ITERATION_TOKENS_BOUNDS, total_num_scheduled_tokens)
            self.iteration_tokens[bucket] += 1
            self.iteration_tokens_sum += total_num_scheduled_tokens
        return SchedulerOutput(
            step_id=next(self._step_ids),
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
            structured_output_req_ids=structured_output_req_ids,
            scheduled_spec_token_ids=spec_token_ids,
        )

    def _drafts_for(self, request: Request, num_new_tokens: int, token_budget: int) -> list[int]:
        """Draft tokens for a request about to compute only its last known token, else none."""
        if self.speculator is None or request.num_output_placeholders or num_new_tokens != 1:
            return []
        if request.num_computed_tokens != request.num_tokens - 1:
            return []
        return self.speculator.drafts_for(request, token_budget)

    def _num_tokens_to_compute(self, request: Request) -> int:
        """The running request's gap: known tokens plus in-flight placeholders, less what is computed."""
        placeholders = request.num_output_placeholders
        params = request.sampling_params
        # Its next mask needs the token in flight: unless the mask is sent once that token is folded
        # in, a structured request waits for it (async scheduling).
        if (
            placeholders
            and request.samples_under_mask(placeholders)
            and not self.masks_follow_tokens_in_flight
        ):
            return 0
        # Its last token is already in flight: scheduling more would compute tokens that get dropped.
        if placeholders and (
            request.num_output_tokens + placeholders >= params.max_tokens
            or request.num_tokens + placeholders >= self.max_model_len
        ):
            return 0
        return request.num_tokens + placeholders - request.num_computed_tokens

    @staticmethod
    def _add_cached(
        cached: CachedRequestData, request: Request, block_ids: list[list[int]], resumed: bool
    ) -> None:
        cached.req_ids.append(request.request_id)
        cached.resumed.append(resumed)
        cached.new_block_ids.append(block_ids)
        cached.num_computed_tokens.append(request.num_computed_tokens)
        cached.num_output_tokens.append(request.num_output_tokens)

    def _add_running(self, request: Request) -> None:
        if self.policy == "priority":
            key = (request.priority, request.arrival_time, next(self._admission_seq))
            self._running_key[request.request_id] = key
            index = bisect.bisect_right(self.running, key, key=lambda r: self._running_key[r.request_id])
            self.running.insert(index, request)
        else:
            self.running.append(request)

    def _remove_running(self, requests: set[str]) -> None:
        self.running = [request for request in self.running if request.request_id not in requests]
        for request_id in requests:
            self._running_key.pop(request_id, None)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop its KV; it resumes from the front of the queue."""
        self._running_key.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token still in flight for it is dropped when it arrives, and recomputed on resumption.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        if request.request_id in self.known_to_workers:
            self.preempted_req_ids.append(request.request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineOutput]:
        """Append the sampled tokens, end the requests that hit a stop, report what changed."""
        outputs: list[EngineOutput] = []
        finished: set[str] = set()
        self.num_eager_fallbacks = model_runner_output.num_eager_fallbacks
        num_rows = len(model_runner_output.req_ids)
        prompt_chunks = model_runner_output.prompt_logprobs or [None] * num_rows
        pooled_rows = model_runner_output.pooled or [None] * num_rows
        for request_id, token_ids, logprobs, prompt_chunk, pooled in zip(
            model_runner_output.req_ids,
            model_runner_output.sampled_token_ids,
            model_runner_output.logprobs,
            prompt_chunks,
            pooled_rows,
            strict=True,
        ):
            request = self.requests.get(request_id)
            # Frames for requests aborted, finished by a stop or preempted since that step are dropped.
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if prompt_chunk is not None:
                request.add_prompt_logprobs(prompt_chunk)
            if pooled is not None:
                outputs.append(self._finish_pooling(request, pooled))
                finished.add(request_id)
                continue
            if not token_ids:
                continue
            assert request_id in scheduler_output.num_scheduled_tokens
            assert request.num_computed_tokens >= request.num_tokens, "sampled before its prompt was in"
            assert request.num_output_placeholders > 0, "a token nobody scheduled"
            request.num_output_placeholders -= 1
            num_drafts = len(scheduler_output.scheduled_spec_token_ids.get(request_id, ()))
            assert 1 <= len(token_ids) <= num_drafts + 1, "the worker keeps a prefix of the drafts plus one"
            if num_drafts:
                assert self.speculator is not None
                self.speculator.record(num_drafts, len(token_ids) - 1)
                # Rejected drafts were computed but are not tokens: the next step overwrites their KV.
                request.num_computed_tokens -= num_drafts + 1 - len(token_ids)
            new_token_ids = []
            for token_id in token_ids:
                if request.grammar is not None and not request.grammar.accept_token(token_id):
                    _fail_unsatisfiable(request, request.grammar.error)
                    break
                if request.thinking is not None and not request.thinking.accept_token(token_id):
                    _fail_unsatisfiable(request, "the end of thinking, forced by its budget, was refused")
                    break
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(request, token_id):
                    break
            if request.is_finished:
                finished.add(request_id)
                self._finish(request)
            outputs.append(
                EngineOutput(
                    request_id=request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=request.first_scheduled_time,
                    prompt_logprobs=request.take_prompt_logprobs(),
                    error=request.error,
                    invalid_param=request.invalid_param,
                )
            )
        if finished:
            self._remove_running(finished)
        return outputs

    def _finish_pooling(self, request: Request, pooled: bytes) -> EngineOutput:
        """End a pooling request whose whole prompt is computed: its output carries the embedding."""
        assert self.pooling_spec is not None and request.pooling is not None, "pooled a generation request"
        assert request.num_computed_tokens == request.num_tokens, "pooled before its prompt was in"
        vector = np.frombuffer(pooled, dtype="<f4")
        embedding = finish_embedding(vector, request.pooling, self.pooling_spec)
        request.status = RequestStatus.FINISHED_STOPPED
        self._finish(request)
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.status.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            first_scheduled_time=request.first_scheduled_time,
            embedding=embedding,
        )

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if request.grammar is not None and request.grammar.is_terminated:
            # The constraint is complete and nothing may follow it.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _finish(self, request: Request) -> None:
        assert request.is_finished
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.request_id in self.known_to_workers:
            self.known_to_workers.discard(request.request_id)
            self.finished_req_ids.append(request.request_id)
            if request.request_id in self.preempted_req_ids:
                self.preempted_req_ids.remove(request.request_id)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        """End the requests now and free their blocks; unknown or already-finished ids are ignored."""
        outputs = []
        aborted_running: set[str] = set()
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                aborted_running.add(request_id)
            else:
                self.waiting.remove(request)
                assert request_id not in self.kv_cache_manager.req_to_blocks
            request.status = RequestStatus.FINISHED_ABORTED
            self._finish(request)
            outputs.append(
                EngineOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason="abort",
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=request.first_scheduled_time,
                )
            )
        if aborted_running:
            self._remove_running(aborted_running)
        return outputs

    def make_stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_eager_fallbacks=self.num_eager_fallbacks,
            # A copy: the engine core compares each step's stats with the last ones it sent.
            iteration_tokens=list(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum,
            spec_decode_num_drafts=0 if self.speculator is None else self.speculator.num_drafts,
            spec_decode_num_draft_tokens=0 if self.speculator is None else self.speculator.num_draft_tokens,
            spec_decode_num_accepted_tokens=0
            if self.speculator is None
            else self.speculator.num_accepted_tokens,
        )


def _fail_unsatisfiable(request: Request, why: str) -> None:
    """End a request whose grammar, or the end of thinking its budget forces, refused the sampled
    token: its masks together left no token to sample (say, allowed_token_ids that the constraint
    never admits, or bad words that ban every token it admits)."""
    params = request.sampling_params
    request.status = RequestStatus.FINISHED_ERROR
    if params.allowed_token_ids is not None:
        request.invalid_param = "allowed_token_ids"
    elif params.bad_words_token_ids:
        request.invalid_param = "bad_words"
    else:
        request.invalid_param = (
            "structured_output" if request.grammar is not None else "thinking_token_budget"
        )
    request.error = (
        "no token satisfies the structured output constraint or thinking budget together with "
        "allowed_token_ids, bad_words and min_tokens (which holds back stop and end-of-sequence "
        f"tokens): {why}"
    )
