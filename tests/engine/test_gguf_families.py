"""GGUF files of the newer families (tests/support/gguf_families.py writes them as llama.cpp's converter
does) load as the tiny folders they come from and generate what those folders generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from gguf_families import FAMILIES, write_family_gguf
from sluice.gguf_model import gguf_model_folder, hf_config_from_metadata
from tiny_models import write_tiny_model
from worker.gguf_weights import gguf_tensors
from worker.quantized_weights import QuantizedRows


@pytest.fixture(scope="module")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict]]:
    """Per family: its folder, its GGUF and what the GGUF's tensors should load as."""
    files = {}
    for family, (arch, overrides) in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        folder = write_tiny_model(family, root / "folder", overrides=overrides)
        expected = write_family_gguf(folder, arch, root / f"{family}.gguf")
        files[family] = (folder, root / f"{family}.gguf", expected)
    return files


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_describes_and_holds_its_folder(family: str, family_files, tmp_path: Path) -> None:
    folder, path, expected = family_files[family]
    config = json.loads((gguf_model_folder(path, cache_dir=tmp_path) / "config.json").read_text())
    source = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == source["architectures"]
    keys = [
        *(
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
        ),
        *("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"),
        *("layer_types", "hidden_activation", "tie_word_embeddings", "vocab_size", "head_dim"),
    ]
    for key in keys:
        # A Qwen MoE's window settings are off (use_sliding_window false), and llama.cpp writes none; a key
        # the GGUF's config leaves out is None (and so is one the folder's config sets to None).
        if source.get(key) is not None and not (
            key in ("layer_types", "sliding_window") and family.startswith("qwen")
        ):
            assert config.get(key) == source[key], key

    def num_experts(cfg: dict) -> int:
        return cfg.get("num_experts") or cfg.get("num_local_experts") or 0

    assert num_experts(config) == num_experts(source)
    loaded = dict(gguf_tensors(path, config, show_progress=False))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_generates_what_its_folder_generates(family: str, family_files) -> None:
    folder, path, _ = family_files[family]
    prompts = [[5, 17, 99, 3, 42, 250, 7] * 9, [100, 101, 102], list(range(30, 90))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def greedy(model: Path) -> list[list[int]]:
        llm = LLM(model=str(model), dtype="float32", executor="inproc")
        return [
            r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]

    assert greedy(path) == greedy(folder)


def test_quantized_experts_load_as_quantized_rows(family_files, tmp_path: Path) -> None:
    """Q8_0 experts stay quantized, one expert's rows at a time, holding the file's values."""
    folder, _, _ = family_files["qwen3_moe"]
    path = tmp_path / "q8-experts.gguf"
    expected = write_family_gguf(folder, "qwen3moe", path, expert_type="Q8_0")
    config = json.loads((gguf_model_folder(path, cache_dir=tmp_path) / "config.json").read_text())
    experts = {
        name: tensor
        for name, tensor in gguf_tensors(path, config, show_progress=False, keep_quantized=True)
        if ".experts." in name
    }
    # Three layers of 8 experts, three weights each.
    assert len(experts) == 3 * 8 * 3
    for name, rows in experts.items():
        # gate_proj and up_proj (K = hidden 64) are Q8_0; down_proj (K = 48) stays float.
        assert isinstance(rows, QuantizedRows) == (".down_proj." not in name), name
        assert tuple(rows.shape) == tuple(expected[name].shape), name
    widened = dict(gguf_tensors(path, config, show_progress=False))
    for name in experts:
        assert torch.equal(widened[name], expected[name]), name


def _gemma_metadata(arch: str, layers: int, **extra: object) -> dict:
    return {
        "general.architecture": arch,
        f"{arch}.attention.head_count": 8,
        f"{arch}.attention.key_length": 128,
        f"{arch}.embedding_length": 1536,
        f"{arch}.feed_forward_length": 4096,
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 8192,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a"] * 16,
        **{f"{arch}.{key}": value for key, value in extra.items()},
    }


def test_gemma_settings_the_file_leaves_out_are_read_as_llama_cpp_reads_them() -> None:
    """Queries scale by the head's width but for the 27Bs (46 and 62 layers: hidden / heads), and a global layer
    comes every 2 (Gemma 2) or 6 (Gemma 3) layers unless the file gives a pattern, as a count or per layer."""
    gemma2 = hf_config_from_metadata(_gemma_metadata("gemma2", 4), {})
    assert gemma2["query_pre_attn_scalar"] == 128
    assert gemma2["sliding_window"] == 4096  # Gemma 2's own, where the file says none
    assert gemma2["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert hf_config_from_metadata(_gemma_metadata("gemma2", 46), {})["query_pre_attn_scalar"] == 1536 // 8
    assert hf_config_from_metadata(_gemma_metadata("gemma3", 62), {})["query_pre_attn_scalar"] == 1536 // 8
    windowed = {"attention.sliding_window": 512}
    gemma3 = hf_config_from_metadata(_gemma_metadata("gemma3", 7, **windowed), {})
    assert gemma3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    every_third = hf_config_from_metadata(
        _gemma_metadata("gemma3", 3, **windowed, **{"attention.sliding_window_pattern": 3}), {}
    )
    assert every_third["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    listed = hf_config_from_metadata(
        _gemma_metadata("gemma3", 3, **windowed, **{"attention.sliding_window_pattern": [False, True, True]}),
        {},
    )
    assert listed["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    # A Gemma 3 file without a window has only global layers.
    assert hf_config_from_metadata(_gemma_metadata("gemma3", 2), {})["layer_types"] == ["full_attention"] * 2
