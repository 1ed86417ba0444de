"""GGUF files of the newer families, written here as llama.cpp's convert_hf_to_gguf.py writes them (each
layer's experts stacked into one tensor, Gemma's norms stored as 1 + w, Phi-3's fused q/k/v and gate/up,
Mixtral as "llama" with its q and k rows interleaved). The writer mirrors what the real converter (llama.cpp,
from the llama-cpp-python 0.3.36 sdist) wrote for the same tiny models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as reference_dequantize
from safetensors.torch import load_file

# Tiny folder -> GGUF architecture, and what makes the folder expressible as a GGUF: llama.cpp's Qwen MoE
# graphs make every layer sparse; its Gemma reads no query_pre_attn_scalar (the head's width, but for the
# 27Bs) and no Gemma 3 layer types (5 sliding in 6: both of 2 layers); Phi-3 files say 0 for no window.
FAMILIES = {
    "qwen3_moe": ("qwen3moe", {"mlp_only_layers": [], "decoder_sparse_step": 1}),
    "qwen2_moe": ("qwen2moe", {"mlp_only_layers": [], "decoder_sparse_step": 1}),
    "mixtral": ("llama", {}),
    "gemma2": (
        "gemma2",
        {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma3_text": (
        "gemma3",
        {"query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "sliding_attention"]},
    ),
    "phi3": ("phi3", {"sliding_window": 48}),
}
# llama.cpp's name for each part of a layer (Gemma's and Phi-3's where they differ).
PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
GEMMA_PARTS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
MIXTRAL_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _ours(name: str) -> str:
    """Sluice's name for a checkpoint tensor: Mixtral's block_sparse_moe.experts.E.w1 is mlp.experts.E.gate_proj."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for theirs, ours in MIXTRAL_EXPERT_PARTS.items():
        name = name.replace(f".{theirs}.", f".{ours}.")
    return name


def gguf_name(hf_name: str, gemma: bool = False) -> str:
    """llama.cpp's name for a Hugging Face tensor name (written out here, apart from the loader's map)."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{({**PARTS, **GEMMA_PARTS} if gemma else PARTS)[module]}.{kind}"


def write_byte_level_vocabulary(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The tiny folder's tokenizer as a "gpt2" GGUF vocabulary: its 256 byte tokens, <s> and </s>, and
    unused tokens up to the embedding's rows."""
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get) + ["<s>", "</s>"]
    tokens += [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3] + [5] * (len(tokens) - 258))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)


def write_family_gguf(
    folder: Path,
    arch: str,
    path: Path,
    expert_type: str = "F32",
    sentencepiece: dict[str, Any] | None = None,
    pooling_type: int | None = None,
) -> dict[str, torch.Tensor]:
    """The GGUF of `folder` (float32 but the experts, in `expert_type`), with the folder's byte-level
    vocabulary or a `sentencepiece` one (sentencepiece_vocab.gguf_metadata); returns each tensor's values
    as Sluice should load them, by Sluice's name. With a `pooling_type` it is an embedding model's file,
    as llama.cpp's converter writes one: the pooling type in its metadata, and no LM head."""
    config = json.loads((folder / "config.json").read_text())
    gemma = arch.startswith("gemma")
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for key, value in {
        "block_count": config["num_hidden_layers"],
        "context_length": config["max_position_embeddings"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": config["num_attention_heads"],
        "attention.head_count_kv": config["num_key_value_heads"],
        "attention.key_length": head_dim,
        "rope.dimension_count": head_dim,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("full_attention", rope)["rope_theta"])
    if "num_experts" in config or "num_local_experts" in config:
        writer.add_uint32(f"{arch}.expert_count", config.get("num_experts") or config["num_local_experts"])
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_uint32(
                f"{arch}.expert_shared_feed_forward_length", config["shared_expert_intermediate_size"]
            )
    if gemma or arch == "phi3":
        writer.add_uint32(f"{arch}.attention.sliding_window", config.get("sliding_window") or 0)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            writer.add_float32(f"{arch}.{key}", config[key])
    if arch == "gemma3":
        writer.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
        writer.add_string(f"{arch}.rope.scaling.type", rope["full_attention"]["rope_type"])
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["full_attention"]["factor"])
    if pooling_type is not None:
        writer.add_uint32(f"{arch}.pooling_type", pooling_type)
    if sentencepiece is None:
        write_byte_level_vocabulary(writer, folder, config["vocab_size"])
    else:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(sentencepiece["tokenizer.ggml.tokens"])
        writer.add_token_scores(sentencepiece["tokenizer.ggml.scores"])
        writer.add_token_types(sentencepiece["tokenizer.ggml.token_type"])
        writer.add_bos_token_id(sentencepiece["tokenizer.ggml.bos_token_id"])
        writer.add_eos_token_id(sentencepiece["tokenizer.ggml.eos_token_id"])
        writer.add_unk_token_id(sentencepiece["tokenizer.ggml.unknown_token_id"])
        writer.add_add_space_prefix(sentencepiece["tokenizer.ggml.add_space_prefix"])

    expected: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, weight in load_file(str(folder / "model.safetensors")).items():
        if pooling_type is not None and name == "lm_head.weight":
            continue
        ours, values = _ours(name), weight.to(torch.float32).numpy()
        if ".experts." in ours:
            _, _, layer, _, _, expert, part, _ = ours.split(".")
            experts.setdefault((layer, part), {})[int(expert)] = values
            continue
        expected[ours] = torch.from_numpy(values.copy())
        stored = values
        if gemma and name.endswith("norm.weight"):
            stored = values + np.float32(1.0)
            # Stored as 1 + w in float32, and loaded as that less 1.
            expected[ours] = torch.from_numpy(stored) - 1.0
        part = name.split(".")[-2]
        if arch == "llama" and part in ("q_proj", "k_proj"):
            # convert_hf_to_gguf.py's LlamaModel.permute.
            n = config["num_attention_heads" if part == "q_proj" else "num_key_value_heads"]
            stored = values.reshape(n, 2, values.shape[0] // n // 2, *values.shape[1:])
            stored = stored.swapaxes(1, 2).reshape(values.shape)
        writer.add_tensor(gguf_name(name, gemma), np.ascontiguousarray(stored))
    for (layer, part), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        # Blocks of 32 along each row: a narrower K stays float, as the converter leaves it.
        qtype = gguf.GGMLQuantizationType[expert_type if stacked.shape[-1] % 32 == 0 else "F32"]
        raw = gguf.quants.quantize(stacked, qtype)
        writer.add_tensor(f"blk.{layer}.{EXPERT_PARTS[part]}.weight", raw, raw_dtype=qtype)
        widened = np.array(reference_dequantize(raw, qtype)).reshape(stacked.shape)
        for expert in by_expert:
            expected[f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"] = torch.from_numpy(
                widened[expert].astype(np.float32)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
