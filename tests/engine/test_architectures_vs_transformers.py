"""Tiny random-init Qwen2, Qwen3, Mistral, Llama, Phi-3, Gemma 2 and Gemma 3 models, and the mixtures of
experts Qwen3-MoE, Qwen2-MoE and Mixtral, generate what transformers generates (8 prompts, 48 tokens each),
at every CPU kernel tier this machine runs, at none, and on CUDA where there is a device; so do windows of
32 keys under prompts and outputs past 100 tokens."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, load_hf_model
from sluice.kv_cache_groups import model_kv_cache_groups
from sluice.model_spec import read_model_spec, resolve_max_model_len
from tiers import PLACES
from tiny_models import VOCAB_SIZE, tiny_model_dir, write_tiny_model

NEW_TOKENS = 48
PROMPTS = 8


def random_prompts(shortest: int, longest: int) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(VOCAB_SIZE - 64) for _ in range(rng.randint(shortest, longest))]
        for _ in range(PROMPTS)
    ]


# Windows of 32 keys: Mistral's on every layer, Qwen2's on layer 1 alone.
WINDOWED = {
    "mistral": {"sliding_window": 32},
    "qwen2": {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
}


@functools.cache
def reference_tokens(folder: Path, shortest: int, longest: int) -> list[list[int]]:
    """transformers' greedy tokens for the prompts, once per folder for every tier that compares with them."""
    model = load_hf_model(folder, torch.float32)
    return [hf_greedy(model, p, NEW_TOKENS).token_ids for p in random_prompts(shortest, longest)]


def assert_greedy_matches_transformers(folder, place: dict, shortest: int = 3, longest: int = 90) -> int:
    """Returns how often the engine preempted a request for want of KV blocks."""
    prompts = random_prompts(shortest, longest)
    reference = reference_tokens(folder, shortest, longest)
    # A small budget and pool make this batch chunk its prompts and preempt as well: 16 blocks a KV cache
    # group (a hybrid model's windowed and global layers draw on one pool, each a table of its own).
    spec = read_model_spec(folder)
    groups = model_kv_cache_groups(spec, resolve_max_model_len(spec, None), hybrid=True).num_groups
    llm = LLM(
        model=str(folder), dtype="float32", max_num_batched_tokens=32, num_kv_blocks=16 * groups, **place
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.outputs[0].token_ids for r in results] == reference
    return llm.engine.stats().num_preemptions


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    "arch",
    [
        "qwen2",
        "qwen3",
        "mistral",
        "llama",
        "phi3",
        "gemma2",
        "gemma3_text",
        "qwen3_moe",
        "qwen2_moe",
        "mixtral",
    ],
)
def test_tiny_model_greedy_matches_transformers(arch, place):
    assert assert_greedy_matches_transformers(tiny_model_dir(arch), place) > 0


@pytest.fixture(scope="module")
def windowed_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: write_tiny_model(arch, tmp_path_factory.mktemp(f"{arch}-window"), overrides=overrides)
        for arch, overrides in WINDOWED.items()
    }


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_windows_match_transformers(arch, place, windowed_folders):
    # Prompts of 60 to 110 tokens and 48 new: every query past 100 positions sees a window of 32.
    assert_greedy_matches_transformers(windowed_folders[arch], place, shortest=60, longest=110)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_experts_run_one_by_one_with_fused_moe_off(arch):
    """--no-fused-moe (the off switch of the MoE kernel) runs the same experts through torch_moe."""
    folder = tiny_model_dir(arch)
    prompts = random_prompts(3, 90)
    reference = reference_tokens(folder, 3, 90)
    llm = LLM(model=str(folder), dtype="float32", fused_moe=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.outputs[0].token_ids for r in results] == reference
