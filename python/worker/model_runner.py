"""Runs one scheduled step: apply the schedule's deltas, build inputs on the device, forward, sample.

The forward runs in the mode the graph dispatcher picks for the batch: captured CUDA graphs, the
CPU's C++ step, or op by op. Its inputs always come from the static input buffers. The sampled
ids go straight into the persistent batch's device token table, where the next step reads them;
the host copy that the engine core needs is taken last (StepResult.output), so a step that is
already queued can be launched before this one's tokens reach the host.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from sluice.config import GraphConfig, SluiceConfig
from sluice.kv_cache_groups import model_kv_cache_groups
from sluice.kv_cache_layout import kv_heads_per_rank
from sluice.model_spec import ModelSpec, model_pooling, resolve_max_model_len, resolve_runner
from sluice.pooling import PoolingSpec, ScoreActivation
from sluice.sampling_params import params_from_wire
from sluice.step_timing import PhaseTimes
from sluice.worker_seam import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from worker.attention.kv_cache_format import cache_dtype, cache_shape
from worker.attention.selector import select_attention_backend
from worker.cpu_model_step import CpuStepRunner, cpu_model_step_for
from worker.distributed import tensor_parallel_group
from worker.draft_verifier import accept_drafts, draft_rows, verify_logits_indices
from worker.grammar_bitmask import apply_grammar_bitmask
from worker.graphs.dispatcher import build_dispatcher
from worker.graphs.graph_runner import StepExecutor
from worker.graphs.input_buffers import StaticInputBuffers
from worker.input_batch import InputBatch
from worker.model_loader import load_encoder, load_model
from worker.models.bert import BertEncoder, pack_token_types
from worker.models.llama import LlamaForCausalLM
from worker.native_ops import cpu_kernels, use_cpu_isa
from worker.pooler import Pooler
from worker.prompt_logprobs import StepPromptLogprobs, step_prompt_logprobs
from worker.request_state import RequestState
from worker.sampler import Sampler, SamplerOutput, native_argmax, torch_argmax
from worker.sampling_state import SamplingState
from worker.step_inputs import StepInputBuilder

logger = logging.getLogger("sluice.worker")

# Waits for the GrammarBitmask of the step with this id (it follows the step on the worker's input).
ReceiveBitmask = Callable[[int], GrammarBitmask]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(slots=True)
class StepResult:
    """A step whose forward and sampling were launched; output() brings its tokens to the host."""

    step_id: int
    req_ids: list[str]
    # Per row: whether it sampled (False while its prompt is still being chunked in).
    sampled_rows: list[bool]
    sampler_output: SamplerOutput | None
    states: list[RequestState]
    # The runner's eager fallbacks once this step was dispatched (ModelRunnerOutput.num_eager_fallbacks).
    num_eager_fallbacks: int
    # None when no row asked for prompt logprobs or predicted a prompt token this step.
    prompt_logprobs: StepPromptLogprobs | None = None
    # Rows that verified drafts -> the tokens they keep (known on the host already).
    kept_drafts: dict[int, list[int]] | None = None
    # The pooling runner's steps: per row, its pooled vector once its prompt is in (Pooler.pool).
    pooled: list[bytes | None] | None = None

    def output(self) -> ModelRunnerOutput:
        sampled_lists: list[list[int]] = []
        logprobs = []
        if self.pooled is not None:
            num_rows = len(self.req_ids)
            return ModelRunnerOutput(
                self.step_id,
                self.req_ids,
                [[] for _ in range(num_rows)],
                [None] * num_rows,
                self.num_eager_fallbacks,
                pooled=self.pooled,
            )
        if self.sampler_output is None:
            return ModelRunnerOutput(self.step_id, [], [], [], self.num_eager_fallbacks)
        token_ids = self.sampler_output.token_ids.tolist()
        kept_drafts = self.kept_drafts or {}
        for row, state in enumerate(self.states):
            if row in kept_drafts:
                state.output_token_ids.extend(kept_drafts[row])
                sampled_lists.append(kept_drafts[row])
                logprobs.append(None)
            elif self.sampled_rows[row]:
                state.output_token_ids.append(token_ids[row])
                sampled_lists.append([token_ids[row]])
                logprobs.append(self.sampler_output.logprobs[row])
            else:
                sampled_lists.append([])
                logprobs.append(None)
        prompt_logprobs = None if self.prompt_logprobs is None else self.prompt_logprobs.to_wire()
        return ModelRunnerOutput(
            self.step_id, self.req_ids, sampled_lists, logprobs, self.num_eager_fallbacks, prompt_logprobs
        )


class ModelRunner:
    def __init__(self, config: SluiceConfig, spec: ModelSpec, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.max_model_len = resolve_max_model_len(spec, config.model.max_model_len)
        # The pooling runner pools hidden states and samples nothing.
        pooling = model_pooling(spec) if resolve_runner(spec, config.model.runner) == "pooling" else None
        kernel = config.kernel
        if device.type == "cpu":
            # Before anything is built: the model's ops, its attention and its step take this tier's kernels.
            use_cpu_isa(kernel.cpu_isa)
        attention = select_attention_backend(
            device, block_size=self.block_size, dtype=self.dtype, kernel=kernel
        )
        self.model: LlamaForCausalLM | BertEncoder = (
            load_encoder(
                spec,
                self.dtype,
                device,
                kernel.packed_linear,
                kernel.gemm_k_blocks,
                kernel.quantization,
                kernel.cpu_encoder_kernels,
            )
            if spec.is_encoder
            else load_model(
                spec,
                self.dtype,
                device,
                attention,
                max_model_len=self.max_model_len,
                packed_linear=kernel.packed_linear,
                fused_gate_up=kernel.fused_gate_up,
                gemm_k_blocks=kernel.gemm_k_blocks,
                gguf_dequantize=kernel.gguf_dequantize,
                quantization=kernel.quantization,
                fused_moe=kernel.fused_moe,
                needs_lm_head=pooling is None,
                hybrid_kv_cache=config.cache.hybrid_kv_cache,
            )
        )
        # The engine core's groups: it sized the pool and plans each group's block table by them.
        self.kv_cache_groups = self.model.kv_cache_groups
        assert self.kv_cache_groups == model_kv_cache_groups(
            spec, self.max_model_len, config.cache.hybrid_kv_cache
        ), "the engine core and the model disagree on the KV cache groups"
        num_groups = self.kv_cache_groups.num_groups
        self.pooler = None if pooling is None else Pooler(pooling.method, self._score_head(pooling))
        # This rank's share of the KV heads: the engine core sized the pool for the same count.
        assert self.model.num_kv_heads == kv_heads_per_rank(spec, config.parallel.tensor_parallel_size)
        self.num_kv_heads = self.model.num_kv_heads
        self.head_dim = self.model.head_dim
        scheduler = config.scheduler
        max_rows = scheduler.max_num_seqs
        vocab_size = int(spec.hf_config["vocab_size"])
        self.sampling_state = SamplingState(max_rows, vocab_size, device, spec.eos_token_ids)
        self.batch = InputBatch(
            max_rows, self.max_model_len, self.block_size, self.sampling_state, device, num_groups
        )
        self.buffers = StaticInputBuffers(
            scheduler.max_num_batched_tokens,
            max_rows,
            -(-self.max_model_len // self.block_size),
            device,
            num_groups,
        )
        self.inputs = StepInputBuilder(self.buffers, self.block_size)
        tp_size = config.parallel.tensor_parallel_size
        # The CPU's fast path, built once the weights are in their final form; None on CUDA and with
        # --enforce-eager.
        self.cpu_step = (
            cpu_model_step_for(self.model, config.graph, scheduler.max_num_batched_tokens, tp_size)
            if device.type == "cpu"
            else None
        )
        supports_full = (
            self.cpu_step is not None and self.cpu_step.supports_full
            if device.type == "cpu"
            else attention.supports_full_graph
        )
        graph = config.graph
        if device.type == "cuda":
            graph = _cuda_graphs_for(graph, self.model, kernel.fused_moe, spec.architecture)
        self.dispatcher = build_dispatcher(graph, scheduler, device.type, supports_full)
        # Collective: every rank gets the same generator, so every rank samples the same tokens.
        kernels = cpu_kernels() if device.type == "cpu" else None
        argmax = native_argmax(kernels) if kernels is not None and kernel.native_argmax else torch_argmax
        self.sampler = Sampler(tensor_parallel_group().shared_generator(), argmax)
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.step_executor: StepExecutor | None = None
        self.timer = PhaseTimes("worker")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        kv_cache_dtype = self.config.cache.kv_cache_dtype
        shape = cache_shape(kv_cache_dtype, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        dtype = cache_dtype(kv_cache_dtype, self.dtype)
        # One pair of tensors a slot; a layer reads its slot's through its group's block table, so layers
        # of different groups share a pair (sluice/kv_cache_groups.py).
        slots = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(self.kv_cache_groups.num_slots)
        ]
        self.kv_caches = [slots[slot] for slot in self.kv_cache_groups.layer_slot]
        self.step_executor = make_step_executor(self)
        self.step_executor.capture(self.buffers)

    @property
    def num_eager_fallbacks(self) -> int:
        return self.dispatcher.num_fallbacks

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove(req_id)
        if self.pooler is not None:
            self.pooler.forget(out.finished_req_ids)
        for req_id in out.preempted_req_ids:
            # Its tokens stay: a resumption is sent as a diff, not a full re-send.
            for block_ids in self.requests[req_id].block_ids:
                block_ids.clear()
            batch.remove(req_id)
        # Running requests the scheduler skipped this step leave the batch but keep their state.
        for req_id in [r for r in batch.req_id_to_row if r not in out.num_scheduled_tokens]:
            batch.remove(req_id)
        for new in out.scheduled_new_reqs:
            state = RequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=[],
                sampling_params=params_from_wire(new.params),
                block_ids=[list(block_ids) for block_ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
                second_text_start=new.second_text_start,
            )
            self.requests[new.req_id] = state
            batch.add(state)
        cached = out.scheduled_cached_reqs
        for req_id, resumed, new_blocks, num_computed, num_outputs in cached.rows():
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            if resumed:
                # Tokens sampled while its preemption was in flight were dropped by the engine core.
                assert len(state.output_token_ids) >= num_outputs
                del state.output_token_ids[num_outputs:]
                state.block_ids[:] = [list(block_ids) for block_ids in new_blocks]
            else:
                for block_ids, new_ids in zip(state.block_ids, new_blocks, strict=True):
                    block_ids.extend(new_ids)
            row = batch.req_id_to_row.get(req_id)
            if row is None:
                batch.add(state)
            else:
                for table, new_ids in zip(batch.block_tables, new_blocks, strict=True):
                    table.append_to_row(row, new_ids)
                batch.num_computed_tokens[row] = num_computed
        batch.condense()

    @torch.inference_mode()
    def execute_model(
        self, out: SchedulerOutput, receive_bitmask: ReceiveBitmask | None = None
    ) -> StepResult:
        timer = self.timer
        since = timer.start()
        self._update_states(out)
        batch = self.batch
        drafts = draft_rows(batch, out.scheduled_spec_token_ids)
        num_rows = batch.num_rows
        if out.total_num_scheduled_tokens == 0:
            return StepResult(out.step_id, [], [], None, [], self.num_eager_fallbacks)
        assert self.step_executor is not None, "initialize_kv_cache before the first step"
        req_ids: list[str] = batch.row_req_ids[:num_rows]  # type: ignore[assignment]
        num_scheduled = np.fromiter(
            (out.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=num_rows
        )
        shape = self.inputs.build(batch, num_scheduled)
        if isinstance(self.model, BertEncoder):
            self._pack_token_types(req_ids, num_scheduled)
        since = timer.lap("prepare_inputs", since)
        mode, padded = self.dispatcher.dispatch(shape.batch_descriptor())
        hidden = self.step_executor.run(mode, padded, self.buffers)
        if self.pooler is not None:
            return self._finish_pooling_step(out.step_id, hidden, req_ids, num_scheduled)
        logits_indices = self.buffers.logits_indices[:num_rows]
        if drafts is not None:
            verify_indices = torch.from_numpy(verify_logits_indices(drafts, num_scheduled)).to(self.device)
            logits_indices = torch.cat([logits_indices, verify_indices])
        logits = self.model.compute_logits(hidden[logits_indices])
        states = [self.requests[req_id] for req_id in req_ids]
        # From the hidden states before the next step overwrites them; only rows that asked pay for it.
        prompt_logprobs = step_prompt_logprobs(
            self.model.compute_logits, hidden, states, batch.num_computed_tokens[:num_rows], num_scheduled
        )
        since = timer.lap("forward", since)
        if out.structured_output_req_ids:
            assert receive_bitmask is not None, "a structured step needs its bitmask"
            bitmask = receive_bitmask(out.step_id)
            since = timer.lap("wait_for_bitmask", since)
            rows = [batch.req_id_to_row[req_id] for req_id in out.structured_output_req_ids]
            apply_grammar_bitmask(logits, rows, bitmask)
        sampler_output = self.sampler.sample(logits[:num_rows], self.sampling_state.metadata(num_rows))
        kept_drafts = None
        if drafts is not None:
            kept_drafts = accept_drafts(self.sampler, logits[num_rows:], drafts, sampler_output.token_ids)
        since = timer.lap("sample", since)
        # Rows still chunking their prompt sampled from a partial context: their tokens are dropped.
        seq_lens = batch.num_computed_tokens[:num_rows] + num_scheduled
        sampled = seq_lens >= batch.num_tokens[:num_rows]
        if kept_drafts is not None:
            for row, tokens in kept_drafts.items():
                # Rejected drafts are not computed tokens: the next step overwrites their KV slots.
                seq_lens[row] -= int(num_scheduled[row]) - len(tokens)
                batch.append_token_list(row, tokens)
                sampled[row] = False
        batch.num_computed_tokens[:num_rows] = seq_lens
        for state, seq_len in zip(states, seq_lens.tolist(), strict=True):
            state.num_computed_tokens = seq_len
        rows = np.flatnonzero(sampled).tolist()
        if rows:
            token_ids = sampler_output.token_ids
            batch.append_sampled(rows, token_ids if len(rows) == num_rows else token_ids[rows])
        timer.lap("bookkeeping", since)
        timer.count_step()
        return StepResult(
            out.step_id,
            list(req_ids),
            sampled.tolist(),
            sampler_output,
            states,
            self.num_eager_fallbacks,
            prompt_logprobs=prompt_logprobs,
            kept_drafts=kept_drafts,
        )

    def _score_head(self, pooling: PoolingSpec) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """A cross-encoder's head over its pooled first token; None for an embedding model."""
        if pooling.score_activation is None:
            return None
        assert isinstance(self.model, BertEncoder), "only encoders have a classification head"
        return cross_encoder_head(self.model, pooling.score_activation)

    def _pack_token_types(self, req_ids: list[str], num_scheduled: np.ndarray) -> None:
        """Type 1 into the ids of each pair's second text (an encoder computes a prompt whole, in one step)."""
        starts = [self.requests[req_id].second_text_start for req_id in req_ids]
        if all(start is None for start in starts):
            return
        assert not self.batch.num_computed_tokens[: len(req_ids)].any(), "an encoder's prompt in parts"
        types = np.zeros(int(num_scheduled.sum()), dtype=np.int64)
        offset = 0
        for start, count in zip(starts, num_scheduled.tolist(), strict=True):
            if start is not None:
                types[offset + start : offset + count] = 1
            offset += count
        ids = self.buffers.input_ids[: len(types)]
        pack_token_types(ids, torch.from_numpy(types).to(ids.device))

    def _finish_pooling_step(
        self, step_id: int, hidden: torch.Tensor, req_ids: list[str], num_scheduled: np.ndarray
    ) -> StepResult:
        """A pooling runner's step after its forward: pool the rows whose prompts are in, advance the rest."""
        assert self.pooler is not None
        batch = self.batch
        num_rows = len(req_ids)
        states = [self.requests[req_id] for req_id in req_ids]
        num_computed = batch.num_computed_tokens[:num_rows]
        pooled = self.pooler.pool(hidden, states, num_computed, num_scheduled)
        seq_lens = num_computed + num_scheduled
        batch.num_computed_tokens[:num_rows] = seq_lens
        for state, seq_len in zip(states, seq_lens.tolist(), strict=True):
            state.num_computed_tokens = seq_len
        self.timer.count_step()
        return StepResult(
            step_id,
            list(req_ids),
            [False] * num_rows,
            None,
            states,
            self.num_eager_fallbacks,
            pooled=pooled,
        )


def make_step_executor(runner: ModelRunner) -> StepExecutor:
    """What runs each dispatched step: captured CUDA graphs, or on CPU the C++ model step."""
    if runner.device.type == "cuda":
        from worker.graphs.cuda_graphs import CudaGraphRecorder
        from worker.graphs.graph_runner import GraphRunner

        return GraphRunner(
            runner.model,
            runner.kv_caches,
            runner.dispatcher,
            CudaGraphRecorder(runner.device),
            runner.max_model_len,
        )
    return CpuStepRunner(runner.model, runner.kv_caches, runner.cpu_step)


def _cuda_graphs_for(
    graph: GraphConfig, model: LlamaForCausalLM | BertEncoder, fused_moe: bool, architecture: str
) -> GraphConfig:
    """The graph modes a model can be captured in on CUDA. The graph pieces hold Llama's dense layers,
    so a model with other layers (a Gemma, an encoder) runs eagerly, and one with experts is captured
    only whole (FULL): worker/moe_triton.py's MoE keeps its routing on the device, while torch_moe
    (--no-fused-moe) picks its experts on the host and runs eagerly."""
    if not model.runs_llama_layers or (model.has_experts and not fused_moe):
        logger.warning("%s runs eagerly on CUDA: its layers are not graph-captured", architecture)
        return dataclasses.replace(graph, enforce_eager=True)
    if model.has_experts and graph.mode != "full":
        logger.warning(
            "%s: on CUDA only FULL graphs capture its experts; other steps run eagerly", architecture
        )
        return dataclasses.replace(graph, mode="full" if graph.mode == "full_and_piecewise" else "none")
    return graph


def cross_encoder_head(
    model: BertEncoder, activation: ScoreActivation
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A cross-encoder's score from its pooled first token: the head's logit, through the activation
    that sentence-transformers' CrossEncoder applies (sluice.pooling.cross_encoder_pooling)."""
    if activation == "sigmoid":
        return lambda first_token: torch.sigmoid(model.score_logit(first_token))
    return model.score_logit
