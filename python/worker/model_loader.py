"""Build a Llama-family model from a Hugging Face folder's safetensors, fusing q/k/v and gate/up."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from sluice.errors import SluiceError
from sluice.model_spec import ModelSpec
from worker.attention.backend import AttentionBackend
from worker.models.llama import LlamaForCausalLM

# Which checkpoint tensors are stacked, in order, into one fused parameter.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightLoadError(SluiceError, ValueError):
    """The folder's tensors do not match what the model's config.json describes."""


def load_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(spec.hf_config, dtype, attention, max_model_len=max_model_len)
    targets = _checkpoint_targets(model)
    loaded: set[str] = set()
    for file in weight_files(spec.path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.tie_word_embeddings:
                    continue
                if name not in targets:
                    raise WeightLoadError(
                        f"{file.name} holds tensor {name!r}, which {spec.architecture} with this "
                        "config.json does not have"
                    )
                _copy_into(targets[name], reader.get_tensor(name), name)
                loaded.add(name)
    missing = [name for name in targets if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightLoadError(f"model folder {str(spec.path)!r} lacks tensor(s) {shown}")
    model.prepare_linear_weights()
    return model.eval()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files to read: those the shard index names, else every one in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return sorted(folder.glob("*.safetensors"))


def _checkpoint_targets(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Map each Hugging Face tensor name to the slice of our parameter it fills."""
    targets: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        module_path, _, _ = name.rpartition(".")
        owner, _, fused = module_path.rpartition(".")
        if fused not in _FUSED:
            targets[hf_name] = param.data
            continue
        sizes = getattr(model.get_submodule(owner), fused.removesuffix("_proj") + "_shards")
        offset = 0
        for part, size in zip(_FUSED[fused], sizes, strict=True):
            targets[hf_name.replace(f".{fused}.", f".{part}.")] = param.data[offset : offset + size]
            offset += size
    return targets


def _copy_into(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.shape != tensor.shape:
        raise WeightLoadError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies {tuple(target.shape)}"
        )
    target.copy_(tensor)
