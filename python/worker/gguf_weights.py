"""A GGUF file's tensors under their Hugging Face names, dequantized to float32 one at a time.

llama.cpp's converter renames the tensors (`blk.N.attn_q.weight`) and, for Llama, reorders the
rows of q and k so that rotary pairs are adjacent (GGML rotates interleaved pairs, Hugging Face
rotates halves); `gguf_tensors` undoes both.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sluice.errors import SluiceError
from worker.gguf_dequantize import dequantize

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
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# The GGUF architectures whose q and k rows llama.cpp's converter interleaves.
_ROTARY_PERMUTED = ("llama",)


class GGUFTensorError(SluiceError, ValueError):
    """A tensor in the GGUF file that Sluice has no place for."""


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor `gguf_name`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_PARTS:
        raise GGUFTensorError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart that Sluice loads")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rows (or bias entries) of q or k."""
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape)


def gguf_tensors(
    gguf_file: Path, hf_config: dict[str, Any], show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of `gguf_file`, in file order."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    heads = {
        "attn_q": int(hf_config["num_attention_heads"]),
        "attn_k": int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
    }
    permuted = hf_config.get("model_type") in _ROTARY_PERMUTED
    bar = tqdm(
        reader.tensors,
        desc=f"dequantizing {gguf_file.name}",
        unit="tensor",
        mininterval=0.5,
        disable=not show_progress,
    )
    for tensor in bar:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        values = dequantize(tensor.data, tensor.tensor_type.name, shape)
        part = tensor.name.split(".")[-2]
        if permuted and part in heads:
            values = unpermute_rotary_rows(values, heads[part])
        yield hf_tensor_name(tensor.name), values
