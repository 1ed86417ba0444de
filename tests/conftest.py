"""Fixtures shared across the suite: the default model folder, transformers references, and the CPU
kernel library of each tier this machine runs (every kernel test runs at each of them). Each test is
marked with its layer, the folder it sits in (tests/README.md), so that `-m unit` runs tests/unit/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiers import KERNEL_TIERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TESTS = Path(__file__).resolve().parent
WORKLOADS = TESTS.parent / "bench" / "workloads"
# The folders of tests/, one a layer, each its marker (registered in pyproject.toml).
LAYERS = ("unit", "kernels", "engine", "e2e", "golden")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        layer = item.path.relative_to(TESTS).parts[0]
        if layer not in LAYERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of the layers' folders {LAYERS}")
        item.add_marker(layer)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from sluice.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def w1_prompts() -> list[list[int]]:
    return json.loads((WORKLOADS / "w1_prompts.json").read_text())["prompts"]


@pytest.fixture(scope="session")
def mixed_prompts(w1_prompts: list[list[int]]) -> list[list[int]]:
    from hf_reference import mixed_length_prompts

    return mixed_length_prompts(w1_prompts)


@pytest.fixture(scope="session")
def fp32_mixed_reference(default_model_path: Path, mixed_prompts: list[list[int]]):
    """transformers' fp32 greedy generations of the 16 mixed-length prompts, one prompt at a time,
    computed once for every module that compares with them (about a minute on two cores)."""
    import torch

    from hf_reference import MIXED_REFERENCE_TOKENS, hf_greedy, load_hf_model

    model = load_hf_model(default_model_path, torch.float32)
    return [hf_greedy(model, p, MIXED_REFERENCE_TOKENS) for p in mixed_prompts]


@pytest.fixture(scope="module", params=KERNEL_TIERS)
def native(request: pytest.FixtureRequest):
    """The kernel library of each tier this CPU runs, in turn; meanwhile also the process's tier, so that
    models built in the test (load_model, LlamaForCausalLM) run on it."""
    from worker.native_ops import use_cpu_isa

    yield use_cpu_isa(request.param)
    use_cpu_isa("auto")
