"""The engine core's step loop: schedule, run the workers, fold their output back into requests."""

from __future__ import annotations

from engine.engine_core_output import EngineCoreOutput
from engine.executor import InProcessExecutor
from engine.request import Request
from engine.request_validation import validate_request
from engine.scheduler import Scheduler, SchedulerStats
from sluice.config import SluiceConfig
from sluice.model_spec import read_model_spec, resolve_max_model_len
from sluice.sampling_params import SamplingParams


class EngineCore:
    def __init__(self, config: SluiceConfig) -> None:
        self.config = config
        self.spec = read_model_spec(config.model.path)
        self.max_model_len = resolve_max_model_len(self.spec, config.model.max_model_len)
        self.vocab_size = int(self.spec.hf_config["vocab_size"])
        self.executor = InProcessExecutor(config, self.spec)
        self.num_kv_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_kv_cache(self.num_kv_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_kv_blocks, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> None:
        """Validate, then queue. Raises InvalidRequestError and queues nothing on bad input."""
        self.check_request(prompt_token_ids, params)
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                arrival_time=arrival_time,
                priority=priority,
                eos_token_ids=self.spec.eos_token_ids,
            )
        )

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """End the requests now and free their blocks; one "abort" output per request that was live."""
        return self.scheduler.abort_requests(request_ids)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def has_request(self, request_id: str) -> bool:
        return self.scheduler.get_request(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
