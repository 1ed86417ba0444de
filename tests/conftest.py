"""Fixtures shared across the suite: the default model folder and transformers references."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from sluice.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def w1_prompts() -> list[list[int]]:
    return json.loads((SHARED_BENCH / "w1_prompts.json").read_text())["prompts"]
