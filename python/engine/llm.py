"""The offline API: `LLM(model=...).generate(prompts, params)`, tokenizing in Python."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TypedDict

from engine.engine_core import EngineCore
from engine.engine_core_output import EngineCoreOutput
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.config import (
    CacheConfig,
    DeviceConfig,
    DType,
    GraphConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SluiceConfig,
    SpeculativeConfig,
)
from sluice.errors import InvalidRequestError
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import Logprobs


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | TokensPrompt


@dataclass(slots=True)
class _Child:
    """One of a request's n samples, tracked until it finishes."""

    output: CompletionOutput
    parent: RequestOutput


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: DType = "bfloat16",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        kv_cache_memory: float = 2.0,
        block_size: int = 16,
        scheduling_policy: str = "fcfs",
        device: str = "cpu",
        num_threads: int | None = None,
        num_kv_blocks: int | None = None,
        tensor_parallel_size: int = 1,
        async_scheduling: bool = True,
        executor: str = "mp",
        enforce_eager: bool = False,
        graph_mode: str = "full_and_piecewise",
        capture_sizes: tuple[int, ...] | None = None,
        cpu_bind: str = "auto",
        kv_events_port: int | None = None,
        speculative_config: dict[str, Any] | None = None,
    ) -> None:
        if model is None:
            from sluice.default_model import prepare_default_model

            model = str(prepare_default_model())
        config = SluiceConfig(
            model=ModelConfig(path=model, dtype=dtype, max_model_len=max_model_len),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                policy=scheduling_policy,  # type: ignore[arg-type]
                async_scheduling=async_scheduling,
            ),
            cache=CacheConfig(
                block_size=block_size,
                kv_cache_memory_gib=kv_cache_memory,
                enable_prefix_caching=enable_prefix_caching,
                num_gpu_blocks_override=num_kv_blocks,
                kv_events_port=kv_events_port,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=tensor_parallel_size,
                executor=executor,  # type: ignore[arg-type]
            ),
            graph=GraphConfig(
                enforce_eager=enforce_eager,
                mode=graph_mode,  # type: ignore[arg-type]
                capture_sizes=None if capture_sizes is None else tuple(capture_sizes),
            ),
            device=DeviceConfig(device=device, num_threads=num_threads, cpu_bind=cpu_bind),  # type: ignore[arg-type]
            # vLLM's shape: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, ...}.
            speculative=SpeculativeConfig(**(speculative_config or {})),
        )
        self._start(config)

    @classmethod
    def from_config(cls, config: SluiceConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: SluiceConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order.

        Every prompt is validated before any is queued, so a bad one queues nothing.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = params or SamplingParams()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise InvalidRequestError("generate() needs one SamplingParams per prompt, or one for all")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        requests = [self._tokenize(p) for p in prompt_list]
        for (_, token_ids), p in zip(requests, param_list):
            self.engine.check_request(token_ids, p)
        results: list[RequestOutput] = []
        children: dict[str, _Child] = {}
        now = time.monotonic()
        for (text, token_ids), p, prio in zip(requests, param_list, priorities):
            parent = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=token_ids)
            results.append(parent)
            for index in range(p.n):
                child_params = replace(p, n=1, seed=None if p.seed is None else p.seed + index)
                child_id = f"{parent.request_id}-{index}"
                out = CompletionOutput(
                    index=index,
                    text="",
                    token_ids=[],
                    logprobs=[] if p.logprobs is not None else None,
                    finish_reason=None,
                )
                parent.outputs.append(out)
                children[child_id] = _Child(out, parent)
                self.engine.add_request(child_id, token_ids, child_params, now, prio)
        while self.engine.has_unfinished_requests():
            for core_output in self.engine.step():
                self._absorb(children[core_output.request_id], core_output)
        for parent in results:
            for out in parent.outputs:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return results

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, [int(t) for t in prompt["prompt_token_ids"]]
        raise InvalidRequestError("a prompt must be a string or {'prompt_token_ids': [...]}", param="prompt")

    def _absorb(self, child: _Child, core_output: EngineCoreOutput) -> None:
        out = child.output
        out.token_ids.extend(core_output.new_token_ids)
        if out.logprobs is not None and core_output.new_logprobs:
            for entry in core_output.new_logprobs:
                out.logprobs.append(self._logprob_dict(entry))
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + entry.logprobs[0]
        child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, core_output.num_cached_tokens)
        if core_output.finish_reason is not None:
            out.finish_reason = core_output.finish_reason
            out.stop_reason = core_output.stop_reason

    def _logprob_dict(self, entry: Logprobs) -> dict[int, Logprob]:
        ranked = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.sampled_rank)}
        for rank, (token_id, logprob) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            ranked.setdefault(token_id, Logprob(logprob, rank))
        for token_id, lp in ranked.items():
            lp.decoded_token = self.tokenizer.decode([token_id])
        return ranked
