"""The engine core's step loop: schedule, run the workers, fold their output back into requests.

With async scheduling the loop is a batch queue two deep: step N+1 is scheduled and submitted
before step N's output is collected, so the scheduler's work (and the frontend's messages) overlap
the forward pass, and the workers never wait for the engine core between steps.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from engine.block_pool import is_group_zero_key
from engine.block_pool_audit import BlockPoolAudit, audit_block_pool
from engine.executor import make_executor
from engine.kv_events_publisher import KVEventPublisher
from engine.request import Request
from engine.request_validation import validate_request
from engine.scheduler import Scheduler
from engine.structured_output import GrammarTokenizer, batch_bitmask, mask_words
from engine.thinking_budget import ThinkingBudgetState
from sluice.config import SluiceConfig, steps_in_flight
from sluice.config_checks import check_engine_config
from sluice.errors import InvalidRequestError, WorkerDiedError
from sluice.frontend_seam import EngineOutput, EngineStats
from sluice.kv_cache_groups import model_kv_cache_groups
from sluice.model_spec import model_pooling, read_model_spec, resolve_max_model_len, resolve_runner
from sluice.pooling import (
    PoolingParams,
    PoolingSpec,
    check_pooling_params,
    check_second_text_start,
    runner_mismatch,
)
from sluice.sampling_params import SamplingParams
from sluice.step_timing import PhaseTimes
from sluice.worker_seam import GrammarBitmask, SchedulerOutput


class EngineCore:
    def __init__(self, config: SluiceConfig) -> None:
        self.config = config
        self.spec = read_model_spec(config.model.path)
        self.max_model_len = resolve_max_model_len(self.spec, config.model.max_model_len)
        self.vocab_size = int(self.spec.hf_config["vocab_size"])
        self.runner = resolve_runner(self.spec, config.model.runner)
        # What Ready tells the frontend of the model.
        self.cross_encoder = self.spec.is_cross_encoder
        self.eos_token_ids = self.spec.eos_token_ids
        # A cross-encoder's "embedding" is its one score.
        self.embedding_size = 1 if self.cross_encoder else int(self.spec.hf_config["hidden_size"])
        self.pooling_spec: PoolingSpec | None = model_pooling(self.spec) if self.runner == "pooling" else None
        # Every option is checked, and the KV pool sized, before any worker process starts.
        self.num_kv_blocks = check_engine_config(config, self.spec)
        self.executor = make_executor(config, self.spec)
        try:
            self.executor.initialize_kv_cache(self.num_kv_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            self.num_kv_blocks,
            self.max_model_len,
            config.speculative,
            model_kv_cache_groups(self.spec, self.max_model_len, config.cache.hybrid_kv_cache).windows,
            self.pooling_spec,
        )
        self.kv_events: KVEventPublisher | None = None
        if config.cache.kv_events_port is not None:
            try:
                self.kv_events = KVEventPublisher(config.cache.kv_events_host, config.cache.kv_events_port)
            except BaseException:
                self.executor.shutdown()
                raise
            self.scheduler.kv_cache_manager.block_pool.kv_events = self.kv_events.pending
        # Steps submitted to the workers whose outputs have not been collected, oldest first.
        self.batch_queue: deque[SchedulerOutput] = deque()
        self.max_in_flight = steps_in_flight(config)
        self.timer = PhaseTimes("engine core")
        self.grammar_tokenizer = GrammarTokenizer(config.model.path, self.vocab_size, self.spec.eos_token_ids)
        self.structured_output_overlap = config.scheduler.structured_output_overlap
        # The step submitted last, when its bitmask needs the tokens of the step before it.
        self.step_awaiting_bitmask: SchedulerOutput | None = None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        second_text_start: int | None = None,
    ) -> None:
        """Validate, then queue. Raises InvalidRequestError and queues nothing on bad input.

        With `pooling` the request is a pooling one: it finishes with its prompt's embedding (a
        cross-encoder's: its score, of the pair of texts that second_text_start splits)."""
        self.check_request(prompt_token_ids, params, cache_salt, pooling, second_text_start)
        # Compiled before it is queued: a constraint that does not compile rejects the request.
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammar_tokenizer.compile(params.structured_output)
        thinking = None if params.thinking_budget is None else ThinkingBudgetState(params.thinking_budget)
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                eos_token_ids=self.spec.eos_token_ids,
                grammar=grammar,
                thinking=thinking,
                pooling=pooling,
                pools_every_position=pooling is not None
                and self.pooling_spec is not None
                and self.pooling_spec.method != "last",
                encodes_whole_prompt=self.spec.is_encoder,
                second_text_start=second_text_start,
            )
        )

    def check_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        pooling: PoolingParams | None = None,
        second_text_start: int | None = None,
    ) -> None:
        validate_request(
            prompt_token_ids, params, self.max_model_len, self.vocab_size, self.spec.eos_token_ids, cache_salt
        )
        if (pooling is not None) != (self.runner == "pooling"):
            raise InvalidRequestError(runner_mismatch(self.runner, self.cross_encoder), param="model")
        if pooling is not None:
            assert self.pooling_spec is not None
            check_pooling_params(pooling, self.pooling_spec, self.embedding_size)
        check_second_text_start(second_text_start, len(prompt_token_ids), self.pooling_spec)

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """Ready's: None when `dimensions` is refused, [] for any size, else the sizes allowed."""
        spec = self.pooling_spec
        return (
            None if spec is None or spec.matryoshka_dimensions is None else list(spec.matryoshka_dimensions)
        )

    def abort_requests(self, request_ids: list[str]) -> list[EngineOutput]:
        """End the requests now and free their blocks; one "abort" output per request that was live."""
        return self.scheduler.abort_requests(request_ids)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def has_request(self, request_id: str) -> bool:
        return self.scheduler.get_request(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step in flight whose output must still be collected."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> list[EngineOutput]:
        """Fill the batch queue, then collect the oldest step and fold its tokens into the requests."""
        timer = self.timer
        while len(self.batch_queue) < self.max_in_flight:
            since = timer.start()
            scheduler_output = self.scheduler.schedule()
            has_news = scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids
            since = timer.lap("schedule", since)
            if scheduler_output.total_num_scheduled_tokens == 0 and not has_news:
                break
            if not scheduler_output.structured_output_req_ids:
                self.executor.submit(scheduler_output)
            elif not self.structured_output_overlap:
                bitmask = self._grammar_bitmask(scheduler_output)
                self.executor.submit(scheduler_output)
                self.executor.submit_bitmask(bitmask)
            else:
                # The workers run the forward meanwhile; they need the mask only to sample.
                self.executor.submit(scheduler_output)
                if self.batch_queue:
                    # The step in flight may carry these requests' last tokens: the masks follow
                    # once it is folded in (below).
                    assert self.step_awaiting_bitmask is None, "one step in flight before this one"
                    self.step_awaiting_bitmask = scheduler_output
                else:
                    self.executor.submit_bitmask(self._grammar_bitmask(scheduler_output))
            timer.lap("submit", since)
            self.batch_queue.append(scheduler_output)
        if self.kv_events is not None:
            # Scheduling is what stores and evicts blocks: this step's changes are all known now.
            self.kv_events.publish()
        if not self.batch_queue:
            return []
        scheduler_output = self.batch_queue.popleft()
        assert scheduler_output is not self.step_awaiting_bitmask, "its bitmask was never sent"
        since = timer.start()
        try:
            runner_output = self.executor.collect()
        except WorkerDiedError:
            # The other ranks cannot go on without it: stop them now rather than leave them waiting.
            self.executor.shutdown()
            raise
        since = timer.lap("wait_for_workers", since)
        assert runner_output.step_id == scheduler_output.step_id, "steps come back in order"
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.step_awaiting_bitmask is not None:
            self.executor.submit_bitmask(self._grammar_bitmask(self.step_awaiting_bitmask))
            self.step_awaiting_bitmask = None
        timer.lap("update", since)
        timer.count_step()
        return outputs

    def _grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask:
        requests = self.scheduler.requests
        # A request that ended (a stop, an abort) after the step was planned has no mask: its
        # token is dropped, and a row that allows every token keeps the sampler's input finite.
        masks = [
            request.next_token_mask() if (request := requests.get(rid)) is not None else None
            for rid in scheduler_output.structured_output_req_ids
        ]
        bitmask = batch_bitmask(masks, mask_words(self.vocab_size))
        return GrammarBitmask(step_id=scheduler_output.step_id, bitmask=bitmask)

    def sentinels(self) -> list[int]:
        """File descriptors that turn readable when a worker dies."""
        return self.executor.sentinels()

    def check_workers(self) -> None:
        """Raise WorkerDiedError if a worker has exited."""
        self.executor.check_workers()

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        self.executor.shutdown()

    def kv_cache(self) -> dict[str, Any]:
        """What the prefix cache holds now, and the seq of the last KV-events message that covers it."""
        if self.kv_events is not None:
            # Pending changes are sent first, so that seq accounts for every hash listed.
            self.kv_events.publish()
        pool = self.scheduler.kv_cache_manager.block_pool
        return {
            "seq": 0 if self.kv_events is None else self.kv_events.seq,
            "block_size": self.config.cache.block_size,
            "kv_events_port": self.config.cache.kv_events_port,
            # Group 0's: those the KV events name (engine/block_pool.py's group_cache_key).
            "block_hashes": sorted(
                key.hex() for key in pool.cached_block_hash_to_block if is_group_zero_key(key)
            ),
        }

    def audit_block_pool(self) -> BlockPoolAudit:
        """Every KV block free or held by a live request, ref counts, free list and cached-block map agreeing."""
        return audit_block_pool(self.scheduler.kv_cache_manager, self.scheduler.requests.keys())

    def stats(self) -> EngineStats:
        return self.scheduler.make_stats()
