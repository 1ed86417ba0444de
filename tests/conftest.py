"""Fixtures shared across the suite: the default model folder, transformers references, and the CPU
kernel tiers this machine runs (every kernel test runs at each of them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sluice.cpu_tiers import NO_TIER, cpu_flags, host_arch, runnable_tiers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORKLOADS = Path(__file__).resolve().parents[1] / "bench" / "workloads"

# The kernel tiers this CPU executes, best first (sluice/cpu_tiers.py): an AVX-512 BF16 machine runs
# avx512bf16, avx512 and avx2; a Zen 3 avx2 alone. "none" (torch's own ops) runs everywhere.
KERNEL_TIERS = [tier.name for tier in runnable_tiers(host_arch(), cpu_flags())]
ALL_TIERS = [*KERNEL_TIERS, NO_TIER]


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from sluice.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def w1_prompts() -> list[list[int]]:
    return json.loads((WORKLOADS / "w1_prompts.json").read_text())["prompts"]


# New tokens in fp32_mixed_reference: a test that needs fewer compares a prefix (greedy tokens do not
# depend on how many follow).
MIXED_REFERENCE_TOKENS = 32


@pytest.fixture(scope="session")
def mixed_prompts(w1_prompts: list[list[int]]) -> list[list[int]]:
    from hf_reference import mixed_length_prompts

    return mixed_length_prompts(w1_prompts)


@pytest.fixture(scope="session")
def fp32_mixed_reference(default_model_path: Path, mixed_prompts: list[list[int]]):
    """transformers' fp32 greedy generations of the 16 mixed-length prompts, one prompt at a time,
    computed once for every module that compares with them (about a minute on two cores)."""
    import torch

    from hf_reference import hf_greedy, load_hf_model

    model = load_hf_model(default_model_path, torch.float32)
    return [hf_greedy(model, p, MIXED_REFERENCE_TOKENS) for p in mixed_prompts]


@pytest.fixture(scope="module", params=KERNEL_TIERS)
def native(request: pytest.FixtureRequest):
    """The kernel library of each tier this CPU runs, in turn; meanwhile also the process's tier, so that
    models built in the test (load_model, LlamaForCausalLM) run on it."""
    from worker.native_ops import use_cpu_isa

    yield use_cpu_isa(request.param)
    use_cpu_isa("auto")
