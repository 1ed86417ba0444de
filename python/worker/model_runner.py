"""Runs one scheduled step: apply the schedule's deltas, build inputs, forward, sample."""

from __future__ import annotations

import numpy as np
import torch

from sluice.config import SluiceConfig
from sluice.kv_cache_layout import kv_heads_per_rank
from sluice.model_spec import ModelSpec, resolve_max_model_len
from sluice.sampling_params import params_from_wire
from sluice.worker_seam import ModelRunnerOutput, SchedulerOutput
from worker.attention.backend import AttentionMetadata
from worker.attention.selector import select_attention_backend
from worker.input_batch import InputBatch
from worker.model_loader import load_model
from worker.request_state import RequestState
from worker.sampler import Sampler
from worker.sampling_state import SamplingState
from worker.step_inputs import build_step_inputs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ModelRunner:
    def __init__(self, config: SluiceConfig, spec: ModelSpec, device: torch.device) -> None:
        self.device = device
        self.dtype = DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.max_model_len = resolve_max_model_len(spec, config.model.max_model_len)
        hf = spec.hf_config
        self.num_layers = spec.num_layers
        self.num_kv_heads = kv_heads_per_rank(spec, config.parallel.tensor_parallel_size)
        self.head_dim = spec.head_dim
        self.model = load_model(
            spec, self.dtype, device, select_attention_backend(device), max_model_len=self.max_model_len
        )
        max_rows = config.scheduler.max_num_seqs
        self.sampling_state = SamplingState(max_rows, int(hf["vocab_size"]), device, spec.eos_token_ids)
        self.batch = InputBatch(max_rows, self.max_model_len, self.block_size, self.sampling_state)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove(req_id)
        for req_id in out.preempted_req_ids:
            # Its tokens stay: a resumption is sent as a diff, not a full re-send.
            self.requests[req_id].block_ids.clear()
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
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            self.requests[new.req_id] = state
            batch.add(state)
        cached = out.scheduled_cached_reqs
        for req_id, resumed, new_blocks, num_computed, num_outputs in zip(
            cached.req_ids,
            cached.resumed,
            cached.new_block_ids,
            cached.num_computed_tokens,
            cached.num_output_tokens,
            strict=True,
        ):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            if resumed:
                # Tokens sampled while its preemption was in flight were dropped by the engine core.
                assert len(state.output_token_ids) >= num_outputs
                del state.output_token_ids[num_outputs:]
                state.block_ids[:] = new_blocks
            else:
                state.block_ids.extend(new_blocks)
            row = batch.req_id_to_row.get(req_id)
            if row is None:
                batch.add(state)
            else:
                batch.block_table.append_to_row(row, new_blocks)
                batch.num_computed_tokens[row] = num_computed
        batch.condense()

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        batch = self.batch
        num_rows = batch.num_rows
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(step_id=out.step_id, req_ids=[], sampled_token_ids=[], logprobs=[])
        req_ids: list[str] = batch.row_req_ids[:num_rows]  # type: ignore[assignment]
        num_scheduled = np.fromiter(
            (out.num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=num_rows
        )
        inputs = build_step_inputs(batch, num_scheduled)
        device = self.device
        metadata = AttentionMetadata(
            num_tokens=len(inputs.input_ids),
            num_seqs=num_rows,
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(device, non_blocking=True),
            query_start_loc=torch.from_numpy(inputs.query_start_loc).to(device, non_blocking=True),
            seq_lens=torch.from_numpy(inputs.seq_lens).to(device, non_blocking=True),
            block_table=torch.from_numpy(batch.block_table.table[:num_rows]).to(device, non_blocking=True),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
        )
        hidden = self.model(
            torch.from_numpy(inputs.input_ids).to(device, non_blocking=True),
            torch.from_numpy(inputs.positions).to(device, non_blocking=True),
            self.kv_caches,
            metadata,
        )
        logits_indices = torch.from_numpy(inputs.logits_indices).to(device, non_blocking=True)
        logits = self.model.compute_logits(hidden[logits_indices])
        sampled = self.sampler.sample(logits, self.sampling_state.metadata(num_rows))
        token_ids = sampled.token_ids
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        # Rows still chunking their prompt sampled from a partial context: drop those tokens.
        done = inputs.seq_lens >= batch.num_tokens[:num_rows]
        batch.num_computed_tokens[:num_rows] = inputs.seq_lens
        sampled_lists: list[list[int]] = []
        logprobs = []
        for row, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = int(inputs.seq_lens[row])
            if done[row]:
                token = token_ids[row]
                state.output_token_ids.append(token)
                batch.append_token(row, token)
                sampled_lists.append([token])
                logprobs.append(sampled.logprobs[row])
            else:
                sampled_lists.append([])
                logprobs.append(None)
        return ModelRunnerOutput(
            step_id=out.step_id, req_ids=list(req_ids), sampled_token_ids=sampled_lists, logprobs=logprobs
        )
