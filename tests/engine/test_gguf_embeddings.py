"""A GGUF embedding model (llama.cpp's converter writes its pooling type, and no LM head) embeds what its
Hugging Face folder embeds when that folder pools the same way; a reranker's file (pooling type rank) is
refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from engine import LLM
from gguf_families import write_family_gguf
from sluice.errors import UnsupportedArchitectureError
from sluice.gguf_model import BASE_ARCHITECTURES
from sluice.model_spec import BASE_ARCHITECTURES as SERVED_BASES
from sluice.model_spec import read_model_spec
from sluice.pooling import write_pooling_modules
from tiny_models import tiny_model_dir

PROMPTS = [{"prompt_token_ids": [5 + i, 40, 41 + 3 * i, 90, 7]} for i in range(4)]


def embeddings(llm: LLM) -> np.ndarray:
    return np.array([r.outputs.embedding for r in llm.embed(PROMPTS)])


@pytest.mark.parametrize(("pooling_type", "st_method"), [(1, "mean"), (2, "cls"), (3, "last")])
def test_a_gguf_embedding_model_pools_as_its_metadata_says(
    pooling_type, st_method, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # The file's folder of text files is written under the cache.
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path / "cache"))
    causal = tiny_model_dir("qwen3")
    path = tmp_path / "embed.gguf"
    write_family_gguf(causal, "qwen3", path, pooling_type=pooling_type)
    spec = read_model_spec(path)
    assert not spec.has_lm_head, "an embedding model's file has no LM head"
    # The reference: the same weights as a folder whose sentence-transformers modules pool that way.
    folder = tmp_path / "folder"
    shutil.copytree(causal, folder)
    write_pooling_modules(folder, spec.hf_config["hidden_size"], st_method, normalize=True)
    ours = LLM(model=str(path), dtype="float32")
    assert ours.engine.runner == "pooling"
    reference = LLM(model=str(folder), dtype="float32")
    np.testing.assert_allclose(embeddings(ours), embeddings(reference), atol=1e-5)


def test_a_reranker_file_is_refused_by_name(tmp_path: Path):
    path = tmp_path / "rank.gguf"
    write_family_gguf(tiny_model_dir("qwen3"), "qwen3", path, pooling_type=4)
    with pytest.raises(UnsupportedArchitectureError, match="reranker"):
        read_model_spec(path)


def test_every_gguf_base_architecture_is_one_sluice_serves():
    assert set(BASE_ARCHITECTURES.values()) <= set(SERVED_BASES)
