"""Fixtures shared across the suite: the default model folder and transformers references."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORKLOADS = Path(__file__).resolve().parents[1] / "bench" / "workloads"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from sluice.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def w1_prompts() -> list[list[int]]:
    return json.loads((WORKLOADS / "w1_prompts.json").read_text())["prompts"]
