"""Write the engine core <-> worker golden vectors into tests/golden/worker/.

    .venv/bin/python tests/golden/make_golden_worker_seam.py

One .msgpack file per message (scheduler_output has a first-step and a steady-state variant),
plus index.json (see golden_vectors.py). tests/golden/test_worker_seam.py decodes every file and
re-encodes it to the identical bytes. Values cross msgpack's integer encoding boundaries and
carry a preempted request's resumption, finished ids, logprobs and non-ASCII ids.
"""

from __future__ import annotations

import struct
from pathlib import Path

import golden_vectors
from sluice.sampling_params import SamplingParams, params_to_wire
from sluice.worker_seam import (
    PROTOCOL_VERSION,
    CachedRequestData,
    GrammarBitmask,
    InitKVCache,
    KVCacheReady,
    Logprobs,
    Message,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
    Shutdown,
    WorkerError,
    WorkerReady,
    encode,
)

GOLDEN_DIR = Path(__file__).resolve().parent / "worker"

GOLDEN_MESSAGES: dict[str, Message] = {
    "worker_ready": WorkerReady(rank=2),
    "init_kv_cache": InitKVCache(num_blocks=14563),
    "kv_cache_ready": KVCacheReady(rank=0),
    "scheduler_output_first_step": SchedulerOutput(
        step_id=0,
        scheduled_new_reqs=[
            NewRequestData(
                req_id="cmpl-8f14e45f-0",
                prompt_token_ids=[1, 127, 128, 255, 256, 65535, 65536, 49151],
                params=params_to_wire(
                    SamplingParams(
                        max_tokens=128,
                        temperature=0.7,
                        top_p=0.95,
                        top_k=50,
                        logit_bias={49151: -100.0, 2: 5.0},
                        seed=1234567890123,
                        logprobs=5,
                        stop_token_ids=[2],
                        min_tokens=4,
                        prompt_logprobs=0,
                        allowed_token_ids=[2, 127, 49151],
                        bad_words_token_ids=[[9906], [3658, 27, 12455]],
                    )
                ),
                block_ids=[[0, 1], [4, 5]],
                num_computed_tokens=0,
            ),
            NewRequestData(
                req_id="cmpl-c9f0f895-1 ✓",
                prompt_token_ids=[1] * 20,
                params=params_to_wire(SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
                block_ids=[[0, 2], [-1, 3]],
                num_computed_tokens=16,
                second_text_start=7,
            ),
        ],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"cmpl-8f14e45f-0": 8, "cmpl-c9f0f895-1 ✓": 4},
        total_num_scheduled_tokens=12,
        finished_req_ids=[],
        preempted_req_ids=[],
    ),
    "scheduler_output": SchedulerOutput(
        step_id=70000,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=["cmpl-8f14e45f-0", "cmpl-45c48cce-0"],
            resumed=[False, True],
            new_block_ids=[[[], []], [[9, 300, 70000], [-1, 12, 13]]],
            num_computed_tokens=[300, 32],
            num_output_tokens=[172, 3],
        ),
        num_scheduled_tokens={"cmpl-8f14e45f-0": 4, "cmpl-45c48cce-0": 7},
        total_num_scheduled_tokens=11,
        finished_req_ids=["cmpl-c9f0f895-1 ✓"],
        preempted_req_ids=["cmpl-d3d94468-0"],
        structured_output_req_ids=["cmpl-8f14e45f-0"],
        scheduled_spec_token_ids={"cmpl-45c48cce-0": [28705, 13, 65536]},
    ),
    # Two rows of a 40-token vocabulary (two words each); the bytes include a NUL and 0xff.
    "grammar_bitmask": GrammarBitmask(
        step_id=70000, bitmask=bytes([0xFF, 0x00, 0x00, 0x80, 0x01, 0x00, 0x00, 0x00]) * 2
    ),
    "model_runner_output": ModelRunnerOutput(
        step_id=70000,
        req_ids=["cmpl-8f14e45f-0", "cmpl-45c48cce-0"],
        sampled_token_ids=[[28705], []],
        logprobs=[
            Logprobs(token_ids=[28705, 28723, 13], logprobs=[-0.25, -0.125, -3.5], sampled_rank=2),
            None,
        ],
        num_eager_fallbacks=65536,
        prompt_logprobs=[
            None,
            PromptLogprobs(
                start=25, logprobs=[Logprobs(token_ids=[300, 9], logprobs=[-2.5, -0.75], sampled_rank=4)]
            ),
        ],
    ),
    # A pooling runner's step: one request's prompt is in, the other's is still chunking.
    "model_runner_output_pooled": ModelRunnerOutput(
        step_id=12,
        req_ids=["embd-a87ff679-2", "embd-e4da3b7f-0"],
        sampled_token_ids=[[], []],
        logprobs=[None, None],
        num_eager_fallbacks=0,
        prompt_logprobs=None,
        pooled=[struct.pack("<3f", 0.5, -1.25, 1e-30), None],
    ),
    "shutdown": Shutdown(),
    "worker_error": WorkerError(rank=1, message="RuntimeError: gloo all_reduce failed — «соединение» 🚫"),
}


def render_index(files: dict[str, bytes]) -> str:
    return golden_vectors.render_index(
        files, PROTOCOL_VERSION, "docs/protocol.md#the-engine-core--worker-seam"
    )


def golden_files() -> dict[str, bytes]:
    return {stem: encode(message) for stem, message in GOLDEN_MESSAGES.items()}


def main() -> None:
    files = golden_files()
    golden_vectors.write_vectors(GOLDEN_DIR, files, render_index(files))


if __name__ == "__main__":
    main()
