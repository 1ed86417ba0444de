"""A GGUF file's tensors under their Hugging Face names, dequantized to float32 one at a time (or, for
the integer GEMM, a linear weight converted to its quantized blocks: worker/quantized_weights.py).

llama.cpp's converter renames the tensors (`blk.N.attn_q.weight`) and, for Llama, reorders the
rows of q and k so that rotary pairs are adjacent (GGML rotates interleaved pairs, Hugging Face
rotates halves); `gguf_tensors` undoes both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from sluice.errors import SluiceError
from sluice.gguf_model import ROPE_TENSORS
from worker.gguf_dequantize import dequantize
from worker.quantized_weights import QUANTIZED_TYPES, QuantizedRows, from_gguf

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts: the router, and Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Where a family names a part otherwise: Gemma's four norms a layer, Phi-3's fused q/k/v and gate/up.
_FAMILY_PARTS = {
    "gemma": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Each expert's weights, stacked into one tensor a layer ([experts, rows, K]) by llama.cpp's converter.
_EXPERT_PARTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The GGUF architectures whose q and k rows llama.cpp's converter interleaves.
_ROTARY_PERMUTED = ("llama", "mixtral")
# Gemma's norms scale by (1 + w); llama.cpp's converter stores 1 + w, which loading takes back.
_NORM_SHIFTED = ("gemma2", "gemma3_text")


class GGUFTensorError(SluiceError, ValueError):
    """A tensor in the GGUF file that Sluice has no place for."""


def _family(model_type: str) -> str:
    return "gemma" if model_type in _NORM_SHIFTED else model_type


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """The Hugging Face name of GGUF tensor `gguf_name` in a `model_type` model (config.json's)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = {**_LAYER_PARTS, **_FAMILY_PARTS.get(_family(model_type), {})}
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in parts:
        raise GGUFTensorError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that Sluice loads")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{parts[part]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rows (or bias entries) of q or k."""
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


# The GGUF tensors that are linear weights (and the LM head), which keep_quantized leaves quantized (and
# the stacked experts, which _expert_tensors splits). A router (ffn_gate_inp) stays float, as
# --quantization leaves it.
_LINEAR_PARTS = (
    *("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"),
    *("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),
)


def _checked_reader(gguf_file: Path) -> Any:
    """The gguf package's reader of the file, after checking that every tensor's bytes lie within it: the
    reader views each tensor's bytes as it opens the file, and one cut short would fail there with a
    numpy message that names neither the tensor nor where it is."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                ggml_type = GGMLQuantizationType(int(raw_type[0]))
                block_size, type_size = GGML_QUANT_SIZES[ggml_type]
                start = int(start_offs + offset[0])
                end = start + int(np.prod(dims)) * type_size // block_size
                if end > len(self.data):
                    raise GGUFTensorError(
                        f"{gguf_file.name} is truncated or corrupt: tensor {bytes(name).decode(errors='replace')!r} "
                        f"({ggml_type.name}) spans bytes {start} to {end}, but the file ends at byte {len(self.data)}"
                    )
            super()._build_tensors(start_offs, fields)

    return CheckedReader(str(gguf_file))


def gguf_tensors(
    gguf_file: Path, hf_config: dict[str, Any], show_progress: bool = True, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """(Hugging Face name, float32 tensor) for every tensor of `gguf_file`, in file order; a layer's
    stacked experts come one expert at a time. With keep_quantized, a linear weight of a quantized type
    comes as QuantizedRows instead (never widened), and so does a tied model's LM head (after its
    embedding table, which stays float)."""
    reader = _checked_reader(gguf_file)
    model_type = str(hf_config.get("model_type", "llama"))
    heads = {
        "attn_q": int(hf_config["num_attention_heads"]),
        "attn_k": int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
    }
    permuted = model_type in _ROTARY_PERMUTED
    bar = tqdm(
        reader.tensors,
        desc=f"dequantizing {gguf_file.name}",
        unit="tensor",
        mininterval=0.5,
        disable=not show_progress,
    )
    tied = bool(hf_config.get("tie_word_embeddings", False))
    for tensor in bar:
        if tensor.name in ROPE_TENSORS:
            # Read into config.json's rope scaling (sluice/gguf_model.py), not a weight.
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        type_name = tensor.tensor_type.name
        part = tensor.name.split(".")[-2]
        if part in _EXPERT_PARTS:
            yield from _expert_tensors(tensor, shape, keep_quantized)
            continue
        name = hf_tensor_name(tensor.name, model_type)
        quantized = keep_quantized and type_name in QUANTIZED_TYPES and len(shape) == 2
        if quantized and (part in _LINEAR_PARTS or (tied and tensor.name == "token_embd.weight")):
            rows = from_gguf(tensor.data, type_name, shape)
            if permuted and part in heads:
                order = unpermute_rotary_rows(torch.arange(shape[0]), heads[part])
                rows = rows.rows(order.numpy())
            if part in _LINEAR_PARTS:
                yield name, rows
                continue
            yield "lm_head.weight", rows
        values = dequantize(tensor.data, type_name, shape)
        if permuted and part in heads:
            values = unpermute_rotary_rows(values, heads[part])
        if model_type in _NORM_SHIFTED and name.endswith("norm.weight"):
            values = values - 1.0
        yield name, values


def _expert_tensors(
    tensor: Any, shape: tuple[int, ...], keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Each expert's slice of a stacked [experts, rows, K] tensor, under its checkpoint name."""
    match = _LAYER_TENSOR.fullmatch(tensor.name)
    if match is None or len(shape) != 3:
        raise GGUFTensorError(
            f"GGUF tensor {tensor.name!r} has shape {shape}; stacked experts have three dimensions"
        )
    layer, part, kind = match.groups()
    type_name = tensor.tensor_type.name
    experts, expert_shape = shape[0], shape[1:]
    # Each expert's bytes are one contiguous run: quantization blocks lie within rows.
    per_expert = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(experts, -1)
    for expert in range(experts):
        name = f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_PARTS[part]}.{kind}"
        raw = per_expert[expert]
        if keep_quantized and type_name in QUANTIZED_TYPES:
            yield name, from_gguf(raw, type_name, expert_shape)
        else:
            yield name, dequantize(raw, type_name, expert_shape)
