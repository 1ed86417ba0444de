"""Tiny random-init Qwen2, Qwen3, Mistral, Llama and Phi-3 models, and the mixtures of experts Qwen3-MoE,
Qwen2-MoE and Mixtral, generate what transformers generates, at every CPU kernel tier this machine runs and
at none; so do sliding windows shorter than the prompts."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, load_hf_model
from tiers import ALL_TIERS
from tiny_models import VOCAB_SIZE, tiny_model_dir, write_tiny_model

NEW_TOKENS = 24


def random_prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB_SIZE - 64) for _ in range(rng.randint(3, 90))] for _ in range(count)]


# Windows of 20 keys under prompts of up to 90 tokens: Mistral's on every layer, Qwen2's on layer 1 alone.
WINDOWED = {
    "mistral": {"sliding_window": 20},
    "qwen2": {"use_sliding_window": True, "sliding_window": 20, "max_window_layers": 1},
}


def assert_greedy_matches_transformers(folder, cpu_isa) -> int:
    """Returns how often the engine preempted a request for want of KV blocks."""
    prompts = random_prompts(6)
    model = load_hf_model(folder, torch.float32)
    reference = [hf_greedy(model, p, NEW_TOKENS).token_ids for p in prompts]
    # A small budget and pool make this batch chunk its prompts and preempt as well.
    llm = LLM(
        model=str(folder), dtype="float32", max_num_batched_tokens=32, num_kv_blocks=16, cpu_isa=cpu_isa
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.outputs[0].token_ids for r in results] == reference
    return llm.engine.stats().num_preemptions


@pytest.mark.parametrize("cpu_isa", ALL_TIERS)
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
def test_tiny_model_greedy_matches_transformers(arch, cpu_isa):
    assert assert_greedy_matches_transformers(tiny_model_dir(arch), cpu_isa) > 0


@pytest.mark.parametrize("cpu_isa", ALL_TIERS)
@pytest.mark.parametrize("arch", WINDOWED)
def test_sliding_windows_match_transformers(arch, cpu_isa, tmp_path_factory):
    folder = write_tiny_model(arch, tmp_path_factory.mktemp(f"{arch}-window"), overrides=WINDOWED[arch])
    preemptions = assert_greedy_matches_transformers(folder, cpu_isa)
    if arch == "mistral":
        # Every layer windowed: each request keeps the blocks of its last 20 keys at most, so the 16 blocks
        # that full attention runs out of (test_tiny_model_greedy_matches_transformers) hold every request.
        assert preemptions == 0
    else:
        # Layer 0 sees the whole context, so every block is kept.
        assert preemptions > 0


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_experts_run_one_by_one_with_fused_moe_off(arch):
    """--no-fused-moe (the off switch of the MoE kernel) runs the same experts through torch_moe."""
    folder = tiny_model_dir(arch)
    prompts = random_prompts(3)
    model = load_hf_model(folder, torch.float32)
    reference = [hf_greedy(model, p, NEW_TOKENS).token_ids for p in prompts]
    llm = LLM(model=str(folder), dtype="float32", fused_moe=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.outputs[0].token_ids for r in results] == reference
