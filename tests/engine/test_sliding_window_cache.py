"""Sliding windows in the KV cache, through the engine: a request of a model whose every layer is windowed
holds its window's blocks, not its length; a hybrid model's windowed layers (a block table of their own)
hold their window while its full-attention layers hold everything; prefix-cache hits on windowed models
give the tokens that misses give, as does the hybrid cache turned off."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from sluice.frontend_seam import EngineOutput
from tiny_models import VOCAB_SIZE, write_tiny_model

WINDOW = 32
BLOCK = 16


def held_blocks_per_step(llm: LLM) -> list[int]:
    """Records, after each engine step, the most blocks any request holds (released ones not counted)."""
    manager = llm.engine.scheduler.kv_cache_manager
    record: list[int] = []
    step = llm.engine.step

    def recording_step() -> list[EngineOutput]:
        outputs = step()
        held = [sum(block is not None for block in blocks) for blocks in manager.req_to_blocks.values()]
        record.append(max(held, default=0))
        return outputs

    llm.engine.step = recording_step
    return record


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_SIZE - 64) for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        "mistral", tmp_path_factory.mktemp("mistral-w32"), overrides={"sliding_window": WINDOW}
    )


def test_a_windowed_request_holds_at_most_its_window_and_a_block(mistral_window: Path) -> None:
    llm = LLM(model=str(mistral_window), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)
    record = held_blocks_per_step(llm)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts(2, 40, seed=1)], params)
    # Prefill chunks of 64 need the chunk's blocks; every decode step after them holds at most
    # WINDOW + one block of tokens, though the requests grow to 160 tokens (10 blocks).
    decode_steps = record[3:]
    assert len(decode_steps) > 100
    assert max(decode_steps) * BLOCK <= WINDOW + BLOCK


@pytest.mark.parametrize(
    "overrides",
    [
        {"sliding_window": WINDOW},
        # Layer 0 full, layer 1 windowed: a group each, and hits still match.
        {"arch": "qwen2", "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        # Gemma 2: windowed and global layers alternate.
        {"arch": "gemma2", "sliding_window": WINDOW},
    ],
    ids=["every-layer-windowed", "mixed-layers", "gemma2"],
)
def test_prefix_cache_hits_on_windowed_models_give_the_tokens_misses_give(
    overrides: dict, tmp_path: Path
) -> None:
    fields = dict(overrides)
    folder = write_tiny_model(fields.pop("arch", "mistral"), tmp_path, overrides=fields)
    shared = prompts(1, 100, seed=2)[0]
    batch = [shared + tail for tail in prompts(3, 20, seed=3)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)

    def run(caching: bool) -> tuple[list[list[int]], int]:
        llm = LLM(model=str(folder), dtype="float32", block_size=BLOCK, enable_prefix_caching=caching)
        # One at a time, so that every later prompt finds the first's blocks cached.
        tokens = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in batch]
        return tokens, llm.engine.stats().prefix_cache_hits

    misses, no_hits = run(caching=False)
    hits, cached = run(caching=True)
    assert no_hits == 0 and cached >= 2 * (100 // BLOCK) * BLOCK
    assert hits == misses


def test_a_hybrid_model_holds_a_window_in_its_windowed_group_and_answers_as_without_groups(
    tmp_path: Path,
) -> None:
    folder = write_tiny_model(
        "gemma2", tmp_path, overrides={"sliding_window": WINDOW, "num_hidden_layers": 4}
    )
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(2, 60, seed=4)]
    hybrid = LLM(model=str(folder), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64)
    manager = hybrid.engine.scheduler.kv_cache_manager
    # Layers 1 and 3 are global (every second one): they come first, as group 0.
    assert manager.group_windows == (0, WINDOW)
    held: list[tuple[int, int, int]] = []
    step = hybrid.engine.step

    def recording_step() -> list[EngineOutput]:
        outputs = step()
        for request in hybrid.engine.scheduler.running:
            full, windowed = manager.req_to_blocks[request.request_id]
            held.append(
                (
                    request.num_computed_tokens,
                    sum(b is not None for b in full),
                    sum(b is not None for b in windowed),
                )
            )
        return outputs

    hybrid.engine.step = recording_step
    got = [out.outputs[0].token_ids for out in hybrid.generate(batch, params)]
    # The requests grow to 160 tokens (10 blocks): the global group holds them all, the windowed group
    # a window and one block once the prefill's chunks are done.
    decodes = [entry for entry in held if entry[0] > 64]
    assert len(decodes) > 150
    assert all(full == -(-computed // BLOCK) for computed, full, _ in decodes)
    assert max(windowed for _, _, windowed in decodes) == WINDOW // BLOCK + 1
    single = LLM(
        model=str(folder), dtype="float32", block_size=BLOCK, max_num_batched_tokens=64, hybrid_kv_cache=False
    )
    assert single.engine.scheduler.kv_cache_manager.group_windows == (0,)
    assert [out.outputs[0].token_ids for out in single.generate(batch, params)] == got
