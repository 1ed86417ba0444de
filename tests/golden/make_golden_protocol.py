"""Write the frontend <-> engine core golden vectors into tests/golden/protocol/.

    .venv/bin/python tests/golden/make_golden_protocol.py

One .msgpack file per message (a few types have variants: defaults, errors), plus index.json,
which lists each file with its type and its decoded value as JSON so that the Rust tests can
compare decoded values without Python. JSON has no integer map keys: a map keyed by token id
(logit_bias) is written there with its keys as decimal strings. The Python and Rust tests both
decode every file and re-encode it to the identical bytes.

Values are chosen to cross msgpack's encoding boundaries (fixint, uint8/16/32, negative fixint
and int8, float64 that is a whole number) and to carry nil fields, logprobs and non-ASCII text.
"""

from __future__ import annotations

import struct
from pathlib import Path

import golden_vectors
from sluice.frontend_seam import (
    Abort,
    AddRequest,
    EngineOutput,
    EngineStats,
    Message,
    Outputs,
    Ready,
    UtilityCall,
    UtilityResult,
    encode,
    kv_cache_to_wire,
    stats_to_wire,
)
from sluice.pooling import PoolingParams
from sluice.sampling_params import SamplingParams, StructuredOutput, ThinkingBudget
from sluice.worker_seam import Logprobs

GOLDEN_DIR = Path(__file__).resolve().parent / "protocol"

_STATS = EngineStats(
    num_running=3,
    num_waiting=1,
    kv_cache_usage=0.375,
    prefix_cache_queries=70000,
    prefix_cache_hits=4096,
    num_preemptions=0,
    num_eager_fallbacks=300,
    # One count per ITERATION_TOKENS_BOUNDS entry, then the steps above them.
    iteration_tokens=[0, 1, 127, 128, 255, 256, 65535, 65536, 0, 0, 0, 0, 0, 2],
    iteration_tokens_sum=70000000,
    spec_decode_num_drafts=127,
    spec_decode_num_draft_tokens=65536,
    spec_decode_num_accepted_tokens=255,
)

# file stem -> message; the order here is the order of index.json.
GOLDEN_MESSAGES: dict[str, Message] = {
    "add_request": AddRequest(
        request_id="cmpl-8f14e45f-0",
        prompt_token_ids=[1, 127, 128, 255, 256, 65535, 65536, 49151],
        params=SamplingParams(
            max_tokens=128,
            temperature=0.7,
            top_p=0.95,
            top_k=50,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=-0.5,
            frequency_penalty=0.25,
            # Given out of order: the encoding sorts the keys.
            logit_bias={49151: -100.0, 2: 5.0, 300: 0.5, 0: -1.0},
            seed=1234567890123,
            logprobs=5,
            stop_token_ids=[2, 49152],
            ignore_eos=False,
            min_tokens=4,
            structured_output=StructuredOutput(
                kind="json_schema", spec='{"type":"object","title":"Größe"}', after="</think>"
            ),
            prompt_logprobs=3,
            allowed_token_ids=[2, 127, 49151],
            bad_words_token_ids=[[9906], [3658, 27, 12455]],
            thinking_budget=ThinkingBudget(max_tokens=1024, start_token_ids=[], end_token_ids=[1718, 37, 29]),
        ),
        arrival_time=1732190000.125,
        priority=-33,
        cache_salt="tenant-ä",
    ),
    "add_request_defaults": AddRequest(
        request_id="cmpl-c9f0f895-1",
        prompt_token_ids=[1],
        params=SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True),
        arrival_time=1732190001.0,
        priority=0,
    ),
    # A pooling request: the engine computes the prompt and answers with its embedding.
    "add_request_embedding": AddRequest(
        request_id="embd-a87ff679-2",
        prompt_token_ids=[1, 9906, 2],
        params=SamplingParams(max_tokens=1),
        arrival_time=1732190001.5,
        priority=3,
        pooling=PoolingParams(dimensions=256, normalize=None),
    ),
    # A cross-encoder's pair: [CLS] query [SEP] document [SEP], the document typed 1 from position 4.
    "add_request_pair": AddRequest(
        request_id="score-e4da3b7f-0",
        prompt_token_ids=[101, 2054, 2003, 102, 1037, 3899, 102],
        params=SamplingParams(max_tokens=1),
        arrival_time=1732190002.0,
        priority=0,
        pooling=PoolingParams(dimensions=None, normalize=None),
        second_text_start=4,
    ),
    "abort": Abort(request_ids=["cmpl-8f14e45f-0", "cmpl-8f14e45f-1"]),
    "utility": UtilityCall(call_id=300, method="stats"),
    "ready": Ready(
        max_model_len=8192,
        num_kv_blocks=14563,
        block_size=16,
        runner="generate",
        embedding_size=576,
        matryoshka_dimensions=None,
        eos_token_ids=[2, 49152],
    ),
    "ready_pooling": Ready(
        max_model_len=32768,
        num_kv_blocks=900,
        block_size=16,
        runner="pooling",
        embedding_size=1024,
        matryoshka_dimensions=[32, 64, 128, 256, 512, 768, 1024],
    ),
    "ready_cross_encoder": Ready(
        max_model_len=512,
        num_kv_blocks=64,
        block_size=16,
        runner="pooling",
        embedding_size=1,
        matryoshka_dimensions=None,
        cross_encoder=True,
    ),
    "outputs": Outputs(
        outputs=[
            EngineOutput(
                request_id="cmpl-8f14e45f-0",
                new_token_ids=[28705],
                new_logprobs=[
                    Logprobs(token_ids=[28705, 28723, 13], logprobs=[-0.25, -0.125, -3.5], sampled_rank=2)
                ],
                finish_reason=None,
                stop_reason=None,
                num_cached_tokens=64,
                error=None,
                first_scheduled_time=1732190000.5,
                prompt_logprobs=[
                    Logprobs(token_ids=[127, 2, 13], logprobs=[-7.5, -0.5, -1.25], sampled_rank=70000),
                    Logprobs(token_ids=[128], logprobs=[-0.015625], sampled_rank=1),
                ],
            ),
            EngineOutput(
                request_id="cmpl-8f14e45f-1",
                new_token_ids=[49152],
                finish_reason="stop",
                stop_reason=49152,
                num_cached_tokens=0,
                first_scheduled_time=1732190001.0,
            ),
            EngineOutput(
                request_id="cmpl-45c48cce-0",
                new_token_ids=[],
                finish_reason="error",
                error="the regex constraint does not compile: unclosed group",
                invalid_param="structured_output",
            ),
            EngineOutput(
                request_id="cmpl-c9f0f895-1", new_token_ids=[], finish_reason="length", num_cached_tokens=16
            ),
            EngineOutput(request_id="cmpl-45c48cce-0", new_token_ids=[], finish_reason="abort"),
            EngineOutput(
                request_id="cmpl-d3d94468-0",
                new_token_ids=[],
                finish_reason="error",
                error="prompt token id 70000 is outside the vocabulary [0, 49152) — «ошибка» 錯誤 🚫",
            ),
        ],
        stats=_STATS,
        timestamp=1732190002.5,
    ),
    "outputs_embedding": Outputs(
        outputs=[
            EngineOutput(
                request_id="embd-a87ff679-2",
                new_token_ids=[],
                finish_reason="stop",
                num_cached_tokens=0,
                first_scheduled_time=1732190001.75,
                # float32 little-endian: 1.0, -0.5, 0.25, the largest finite float32.
                embedding=struct.pack("<4f", 1.0, -0.5, 0.25, 3.4028234663852886e38),
            ),
        ],
        stats=_STATS,
        timestamp=1732190002.0,
    ),
    "outputs_empty": Outputs(
        outputs=[],
        stats=EngineStats(
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=2,
            num_eager_fallbacks=0,
        ),
        timestamp=1732190003.0,
    ),
    "utility_result": UtilityResult(call_id=0, result={"ok": True}, error=None),
    "utility_result_stats": UtilityResult(call_id=300, result=stats_to_wire(_STATS), error=None),
    "utility_kv_cache": UtilityCall(call_id=301, method="kv_cache"),
    "utility_result_kv_cache": UtilityResult(
        call_id=301,
        result=kv_cache_to_wire(
            {
                "seq": 70000,
                "block_size": 16,
                "kv_events_port": 5557,
                "block_hashes": [
                    "3f1c4a0e2b9d8c7f6e5d4c3b2a1908f7e6d5c4b3a29180f7e6d5c4b3a2918070",
                    "0000000000000000000000000000000000000000000000000000000000000001",
                ],
            }
        ),
        error=None,
    ),
    "utility_result_kv_cache_off": UtilityResult(
        call_id=302,
        result=kv_cache_to_wire({"seq": 0, "block_size": 16, "kv_events_port": None, "block_hashes": []}),
        error=None,
    ),
    "utility_result_error": UtilityResult(call_id=7, result=None, error="unknown utility method 'nöpe' ✗"),
}


def render_index(files: dict[str, bytes]) -> str:
    return golden_vectors.render_index(files, 1, "docs/protocol.md")


def golden_files() -> dict[str, bytes]:
    return {stem: encode(message) for stem, message in GOLDEN_MESSAGES.items()}


def main() -> None:
    files = golden_files()
    golden_vectors.write_vectors(GOLDEN_DIR, files, render_index(files))


if __name__ == "__main__":
    main()
