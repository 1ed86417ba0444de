"""Builds the MoE bench model: a Qwen3-MoE of 1.9B parameters of which 0.4B run per token (48 experts,
each an MLP of 3 x 512 x 1024 weights, in each of 24 layers; 8 chosen per token), with seeded random bf16 weights.

It is Qwen3-30B-A3B's design at about a sixteenth of its size (that one: 128 experts, 8 chosen, 48
layers, hidden 2048), so one decode stream reads about 0.8 GB of weights per token, and a batch reads the
experts its tokens chose. The routing of random weights is near uniform, which a trained router's is
not; the bytes each token reads are the same. Idempotent, as make_w4_model.py.

  python bench/make_moe_model.py [OUT_DIR]   (default: <sluice cache>/models/moe-qwen3-1.9b-a0.4b-random)
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3MoeConfig

from make_w4_model import attention_shapes, build_from_command_line, mlp_shapes
from sluice.config import sluice_cache_dir


def moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=512,
        num_experts=48,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
        architectures=["Qwen3MoeForCausalLM"],
    )


def default_moe_dir() -> Path:
    return sluice_cache_dir() / "models" / "moe-qwen3-1.9b-a0.4b-random"


def tensor_shapes(config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a tied-embedding Qwen3-MoE whose every layer has experts, as the Hub names them."""
    hidden, head_dim = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= attention_shapes(config, layer)
        shapes[f"{layer}.self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{layer}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{layer}.mlp.gate.weight"] = (config.num_experts, hidden)
        for e in range(config.num_experts):
            shapes |= mlp_shapes(f"{layer}.mlp.experts.{e}", hidden, config.moe_intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def main() -> None:
    config = moe_config()
    build_from_command_line(__doc__ or "", default_moe_dir(), config, tensor_shapes(config))


if __name__ == "__main__":
    main()
