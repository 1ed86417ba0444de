"""Builds the W4/W5 model: a 1.1B-parameter Llama in TinyLlama's shape, seeded random bf16 weights.

The weights carry no knowledge: the model exists to time a size people serve, where one decode
stream reads about 2.2 GB of weights per token. It is an ordinary Hugging Face folder, with the
default model's tokenizer, so Sluice and vLLM load it alike. Idempotent: a complete folder built
with the same shape and seed is left as it is.

  python bench/make_w4_model.py [OUT_DIR]   (default: <sluice cache>/models/w4-llama-1.1b-random)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, PretrainedConfig

from sluice.config import sluice_cache_dir
from sluice.default_model import prepare_default_model

SEED = 0
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
# Written last, so its presence says the folder is complete; it records what was built.
STAMP = "w4_model.json"


def w4_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
    )


def default_w4_dir() -> Path:
    return sluice_cache_dir() / "models" / "w4-llama-1.1b-random"


def attention_shapes(config: PretrainedConfig, layer: str) -> dict[str, tuple[int, ...]]:
    """A layer's norms and attention projections, as the Hugging Face checkpoint names them."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        f"{layer}.input_layernorm.weight": (hidden,),
        f"{layer}.self_attn.q_proj.weight": (q, hidden),
        f"{layer}.self_attn.k_proj.weight": (kv, hidden),
        f"{layer}.self_attn.v_proj.weight": (kv, hidden),
        f"{layer}.self_attn.o_proj.weight": (hidden, q),
        f"{layer}.post_attention_layernorm.weight": (hidden,),
    }


def mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inner, hidden),
        f"{prefix}.up_proj.weight": (inner, hidden),
        f"{prefix}.down_proj.weight": (hidden, inner),
    }


def tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a tied-embedding Llama, as the Hugging Face checkpoint names it."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= attention_shapes(config, layer) | mlp_shapes(
            f"{layer}.mlp", hidden, config.intermediate_size
        )
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def random_weights(shapes: dict[str, tuple[int, ...]], std: float, seed: int) -> dict[str, torch.Tensor]:
    """Norms at one, every matrix N(0, std), drawn in name order from one generator."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            values = torch.randn(shape, generator=generator) * std
            weights[name] = values.to(torch.bfloat16)
    return weights


def is_built(out: Path, stamp: dict[str, object]) -> bool:
    path = out / STAMP
    return path.is_file() and json.loads(path.read_text()) == stamp


def build(
    out: Path, tokenizer_dir: Path, config: PretrainedConfig, shapes: dict[str, tuple[int, ...]]
) -> Path:
    """A folder of `config` with seeded random weights of `shapes` (checkpoint names) and the tokenizer."""
    # Through JSON, so it compares equal to the stamp read back from disk.
    stamp = json.loads(json.dumps({"config": config.to_dict(), "seed": SEED}))
    if is_built(out, stamp):
        print(f"{out} is already built", file=sys.stderr)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and move it in whole, so an interrupted build leaves nothing half-made.
    with tempfile.TemporaryDirectory(
        dir=out.parent, prefix=f".{out.name}-", ignore_cleanup_errors=True
    ) as tmp:
        staging = Path(tmp)
        # mkdtemp makes the folder private; a model folder is as readable as any other.
        staging.chmod(0o755)
        weights = random_weights(shapes, config.initializer_range, SEED)
        params = sum(t.numel() for t in weights.values())
        print(f"{params / 1e9:.2f}B parameters, {2 * params / 1e9:.2f} GB in bf16", file=sys.stderr)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(staging)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, staging / name)
        (staging / STAMP).write_text(json.dumps(stamp, indent=1))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out


def build_from_command_line(
    description: str, default_out: Path, config: PretrainedConfig, shapes: dict[str, tuple[int, ...]]
) -> None:
    """A model script's main: [OUT_DIR] and --tokenizer-from, then build."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", type=Path, default=None, help="output folder")
    parser.add_argument(
        "--tokenizer-from", type=Path, default=None, help="folder with the tokenizer files (default model's)"
    )
    args = parser.parse_args()
    tokenizer_dir = args.tokenizer_from or prepare_default_model()
    print(build(args.out or default_out, tokenizer_dir, config, shapes))


def main() -> None:
    config = w4_config()
    build_from_command_line(__doc__ or "", default_w4_dir(), config, tensor_shapes(config))


if __name__ == "__main__":
    main()
