"""Our Llama-family model against transformers on the same folders, over a paged KV cache, with the
layer ops of every CPU kernel tier this machine runs and of none (torch's own ops)."""

from __future__ import annotations

import functools
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import load_hf_model
from paged_sequences import PagedSequences
from sluice.errors import UnsupportedArchitectureError
from sluice.model_spec import read_model_spec
from tiers import ALL_TIERS
from tiny_models import tiny_model_dir
from worker.attention.torch_backend import TorchAttentionBackend
from worker.model_loader import WeightLoadError, load_model
from worker.models.llama import LlamaForCausalLM
from worker.native_ops import use_cpu_isa

# Logits, not only tokens: Gemma 2's final soft-capping and the experts' weighted sums show here.
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "qwen2_moe", "default"]


def _ours(folder: Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(read_model_spec(folder), dtype, torch.device("cpu"), TorchAttentionBackend())


# transformers' model of a folder, loaded once for every tier that compares with it.
_transformers_model = functools.cache(load_hf_model)


def _reference_logits(
    folder: Path, seqs: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    hf = _transformers_model(folder, dtype)
    with torch.inference_mode():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]


def _random_sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 2e-5 * max(scale, 1.0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(scope="module", params=ALL_TIERS)
def models(
    request: pytest.FixtureRequest, default_model_path: Path
) -> Iterator[dict[str, tuple[Path, LlamaForCausalLM]]]:
    use_cpu_isa(request.param)
    loaded = {}
    for arch in ARCHS:
        folder = default_model_path if arch == "default" else tiny_model_dir(arch)
        loaded[arch] = (folder, _ours(folder))
    yield loaded
    use_cpu_isa("auto")


@pytest.mark.parametrize("arch", ARCHS)
def test_flattened_batch_matches_transformers(arch: str, models: dict) -> None:
    folder, model = models[arch]
    seqs = _random_sequences(model.embed_tokens.weight.shape[0], [5, 40, 17], seed=1)
    logits = PagedSequences(model, seqs).step([len(s) for s in seqs])
    reference = _reference_logits(folder, seqs)
    _assert_close(logits, torch.cat(reference))


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_reads_prefilled_cache(arch: str, models: dict) -> None:
    folder, model = models[arch]
    seqs = _random_sequences(model.embed_tokens.weight.shape[0], [33, 16, 9], seed=2)
    batch = PagedSequences(model, seqs, seed=3)
    batch.step([32, 15, 5])
    # A mixed step: two single-token decodes around a 4-token prefill chunk.
    logits = batch.step([1, 1, 4])
    reference = _reference_logits(folder, seqs)
    _assert_close(logits, torch.cat([reference[0][-1:], reference[1][-1:], reference[2][-4:]]))


def test_bfloat16_tracks_transformers() -> None:
    folder = tiny_model_dir("qwen3", "bfloat16")
    seqs = _random_sequences(320, [24, 7], seed=4)
    logits = PagedSequences(_ours(folder, torch.bfloat16), seqs).step([24, 7])
    reference = torch.cat(_reference_logits(folder, seqs, torch.bfloat16))
    assert (logits - reference).abs().max().item() <= 0.02 * reference.abs().max().item()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


def test_sharded_checkpoint_loads_the_same(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("qwen2")
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()
    seqs = _random_sequences(320, [10], seed=5)
    sharded = PagedSequences(_ours(tmp_path), seqs).step([10])
    assert torch.equal(sharded, PagedSequences(_ours(folder), seqs).step([10]))


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir("mistral"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        _ours(tmp_path)


def test_a_misshapen_fused_tensor_is_named_with_its_parts(tmp_path: Path) -> None:
    shutil.copytree(tiny_model_dir("phi3"), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    # 4 heads of 16, and 2 KV heads for k and v: 128 rows, of which 112 remain.
    with pytest.raises(
        WeightLoadError, match=r"qkv_proj\.weight' has shape \(112, 64\).* 128 rows \(64 \+ 32 \+ 32"
    ):
        _ours(tmp_path)


@pytest.mark.parametrize(
    ("field", "value"),
    [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("logits_scaling", 8.0)],
)
def test_a_field_that_changes_the_maths_unimplemented_is_refused_by_name(
    field: str, value: float, tmp_path: Path
) -> None:
    shutil.copytree(tiny_model_dir("qwen2"), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=f"sets {field} = {value}"):
        _ours(tmp_path)


@pytest.mark.parametrize(
    ("architecture", "fields", "max_model_len", "windows"),
    [
        ("MistralForCausalLM", {"sliding_window": 64}, 256, [64, 64, 64, 64]),
        # A window as long as the context served is no window.
        ("MistralForCausalLM", {"sliding_window": 256}, 256, [0, 0, 0, 0]),
        ("Phi3ForCausalLM", {"sliding_window": 47}, 256, [47, 47, 47, 47]),
        # Qwen's window is off unless use_sliding_window; then layers from max_window_layers on.
        ("Qwen2ForCausalLM", {"sliding_window": 64, "max_window_layers": 2}, 256, [0, 0, 0, 0]),
        (
            "Qwen2ForCausalLM",
            {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
            256,
            [0, 0, 64, 64],
        ),
        (
            "Qwen2MoeForCausalLM",
            {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 3},
            256,
            [64, 0, 64, 0],
        ),
        # A config's own layer_types win.
        (
            "Qwen3ForCausalLM",
            {
                "sliding_window": 8,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            256,
            [0, 8, 0, 8],
        ),
        # Gemma 3's Hub configs: every sliding_window_pattern-th layer is global.
        ("Gemma3ForCausalLM", {"sliding_window": 8, "sliding_window_pattern": 2}, 256, [8, 0, 8, 0]),
        # Llama's layers attend to everything, whatever the config says.
        ("LlamaForCausalLM", {"sliding_window": 64}, 256, [0, 0, 0, 0]),
    ],
)
def test_each_layer_gets_the_window_its_family_trains_it_with(
    architecture: str, fields: dict, max_model_len: int, windows: list[int]
) -> None:
    from sluice.sliding_windows import sliding_windows

    assert sliding_windows({"num_hidden_layers": 4, **fields}, architecture, max_model_len) == windows


@pytest.mark.parametrize(
    ("arch", "name", "shape", "named"),
    [
        # Qwen's expert layout, and Mixtral's own names for it, each in the message as the file has it.
        ("qwen3_moe", "model.layers.0.mlp.experts.5.down_proj.weight", None, r"experts\.5\.down_proj"),
        ("qwen3_moe", "model.layers.2.mlp.experts.1.up_proj.weight", (47, 64), r"experts\.1\.up_proj"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight", None, r"experts\.3\.down_proj"),
        ("qwen2_moe", "model.layers.1.mlp.gate.weight", (5, 64), r"mlp\.gate\.weight"),
    ],
)
def test_a_missing_or_misshapen_expert_tensor_is_named(
    arch: str, name: str, shape: tuple[int, ...] | None, named: str, tmp_path: Path
) -> None:
    shutil.copytree(tiny_model_dir(arch), tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    if shape is None:
        del tensors[name]
    else:
        tensors[name] = torch.zeros(shape)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=named):
        _ours(tmp_path)


@pytest.mark.parametrize(
    ("arch", "field", "value", "named"),
    [
        ("llama", "hidden_act", "relu2", "hidden_act 'relu2' is not supported"),
        # GELU is Gemma's; Llama's layers and the experts' kernels gate with SiLU.
        ("llama", "hidden_act", "gelu_pytorch_tanh", "its MLP runs silu"),
        ("qwen3_moe", "hidden_act", "gelu_pytorch_tanh", "its experts run silu"),
        ("gemma2", "hidden_activation", "swish", "hidden_act 'swish' is not supported"),
        ("gemma3_text", "hidden_activation", "silu", "its MLP runs gelu_pytorch_tanh"),
    ],
)
def test_an_activation_the_family_does_not_run_is_refused_by_name(
    arch: str, field: str, value: str, named: str, tmp_path: Path
) -> None:
    shutil.copytree(tiny_model_dir(arch), tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=named):
        _ours(tmp_path)
