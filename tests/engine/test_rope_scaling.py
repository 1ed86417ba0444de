"""Every RoPE scaling in use (linear, dynamic, yarn, llama3, longrope) against transformers' own rotary, at
positions beyond the original context, and tiny models that use them generating what transformers generates."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, load_hf_model
from paged_sequences import PagedSequences
from sluice.errors import InvalidRequestError, UnsupportedArchitectureError
from sluice.gguf_model import (
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS_TENSOR,
    hf_config_from_metadata,
)
from sluice.model_spec import read_model_spec, resolve_max_model_len
from sluice.rope_parameters import rope_parameters_of
from tiers import ALL_TIERS
from tiny_models import VOCAB_SIZE, write_tiny_model
from worker.attention.torch_backend import TorchAttentionBackend
from worker.model_loader import load_model
from worker.models.rotary import RotaryEmbedding, rotary_frequencies

HEAD_DIM = 16
ORIGINAL = 64
SERVED = 256
_RNG = random.Random(5)
LONG_FACTOR = [round(1.0 + 3.0 * _RNG.random(), 3) for _ in range(HEAD_DIM // 2)]
SHORT_FACTOR = [round(1.0 + 0.2 * _RNG.random(), 3) for _ in range(HEAD_DIM // 2)]

# Each scaling as a config gives it; max_position_embeddings is ORIGINAL where the scaling stretches it
# (linear, dynamic) and SERVED where the config states the extended context (yarn, llama3, longrope).
SCALINGS: dict[str, tuple[int, dict[str, Any]]] = {
    "linear": (ORIGINAL, {"rope_type": "linear", "factor": 4.0}),
    "dynamic": (ORIGINAL, {"rope_type": "dynamic", "factor": 4.0}),
    "yarn": (SERVED, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    "yarn_mscale": (
        SERVED,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
            "mscale": 0.707,
            "mscale_all_dim": 0.707 * 2,
            "beta_fast": 16,
            "beta_slow": 2,
            "truncate": False,
        },
    ),
    "llama3": (
        SERVED,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "longrope": (
        SERVED,
        {
            "rope_type": "longrope",
            "long_factor": LONG_FACTOR,
            "short_factor": SHORT_FACTOR,
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
}


def _hf_config(name: str, max_positions: int | None = None) -> Any:
    from transformers import LlamaConfig

    trained, scaling = SCALINGS[name]
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=max_positions or trained,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )


def _transformers_tables(config: Any, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin from transformers' LlamaRotaryEmbedding for one sequence of `length` tokens."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, length, HEAD_DIM)
    cos, sin = rotary(x, torch.arange(length)[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_tables_match_transformers_beyond_the_original_context(name: str) -> None:
    config = _hf_config(name)
    rope = rope_parameters_of(config.to_dict())
    assert rope.max_context() == SERVED
    inv_freq, attention_factor = rotary_frequencies(rope, HEAD_DIM, SERVED)
    ours = RotaryEmbedding(inv_freq, SERVED, torch.float32, attention_factor)
    cos, sin = _transformers_tables(config, SERVED)
    half = HEAD_DIM // 2
    torch.testing.assert_close(ours.cos, cos)
    torch.testing.assert_close(torch.cat((-ours.sin_signed[:, :half], ours.sin_signed[:, half:]), -1), sin)
    # The scaling changes the table past the original context: a plain RoPE would not pass.
    plain = RotaryEmbedding(
        1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), SERVED, torch.float32
    )
    assert not torch.allclose(plain.cos[ORIGINAL:], cos[ORIGINAL:], atol=1e-3)


def test_yarn_and_longrope_scale_cos_and_sin_as_transformers_does() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, expected_type in (("yarn", "yarn"), ("yarn_mscale", "yarn"), ("longrope", "longrope")):
        config = _hf_config(name)
        _, reference = ROPE_INIT_FUNCTIONS[expected_type](config, "cpu", seq_len=SERVED)
        _, ours = rotary_frequencies(rope_parameters_of(config.to_dict()), HEAD_DIM, SERVED)
        assert ours == pytest.approx(reference, rel=1e-12), name
        assert ours != 1.0


def test_longrope_takes_its_short_factors_within_the_original_context() -> None:
    config = _hf_config("longrope")
    rope = rope_parameters_of(config.to_dict())
    short, _ = rotary_frequencies(rope, HEAD_DIM, ORIGINAL)
    cos, _ = _transformers_tables(config, ORIGINAL)
    torch.testing.assert_close(
        RotaryEmbedding(short, ORIGINAL, torch.float32, 1.0).cos * _factor(config), cos
    )
    assert not torch.equal(short, rotary_frequencies(rope, HEAD_DIM, SERVED)[0])


def _factor(config: Any) -> float:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=ORIGINAL)[1]


def test_settings_read_from_either_config_layout() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    a, _ = rotary_frequencies(rope_parameters_of(new), 64, 256)
    b, _ = rotary_frequencies(rope_parameters_of(old), 64, 256)
    plain, _ = rotary_frequencies(rope_parameters_of({"rope_theta": 500000.0}), 64, 256)
    assert torch.equal(a, b)
    assert not torch.equal(a, plain)
    assert torch.equal(a[:3], plain[:3])
    # Phi-3 keeps the original context at the top level of its config.
    phi = {"original_max_position_embeddings": 4096, "rope_scaling": {"type": "su"}}
    assert rope_parameters_of(phi).original_max_position_embeddings == 4096
    assert rope_parameters_of(phi).rope_type == "longrope"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"rope_scaling": {"rope_type": "mrope"}}, "rope_type 'mrope'"),
        ({"rope_scaling": {"type": "2d"}}, "rope_type '2d'"),
        ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor 1.5 must be in \(0, 1\]"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.0}},
            "partial_rotary_factor",
        ),
    ],
)
def test_what_is_not_implemented_is_refused_by_name(config: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=field):
        rope_parameters_of(config)


def test_linear_and_dynamic_serve_their_stretched_context(tmp_path: Path) -> None:
    folder = write_tiny_model(
        "llama",
        tmp_path,
        overrides={
            "max_position_embeddings": ORIGINAL,
            "rope_parameters": {"rope_theta": 10000.0, **SCALINGS["dynamic"][1]},
        },
    )
    spec = read_model_spec(folder)
    assert spec.max_context == 4 * ORIGINAL
    assert resolve_max_model_len(spec, None) == 4 * ORIGINAL
    with pytest.raises(InvalidRequestError, match=r"must be in \[1, 256\]"):
        resolve_max_model_len(spec, 4 * ORIGINAL + 1)


@pytest.mark.parametrize("name", ["linear", "yarn", "llama3", "longrope"])
def test_tiny_models_generate_what_transformers_generates_past_the_original_context(
    name: str, tmp_path: Path
) -> None:
    """Prompts of 70 to 150 tokens and 48 new ones, all past the original 64 positions (so that longrope
    runs on its long factors in transformers throughout). dynamic is left out: transformers recomputes its
    frequencies at every step while the keys it cached keep theirs, which no cached engine reproduces."""
    trained, scaling = SCALINGS[name]
    overrides = {"max_position_embeddings": trained, "rope_parameters": {"rope_theta": 10000.0, **scaling}}
    folder = write_tiny_model("llama", tmp_path, overrides=overrides)
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB_SIZE - 64) for _ in range(rng.randint(70, 150))] for _ in range(8)]
    model = load_hf_model(folder, torch.float32)
    reference = [hf_greedy(model, p, 48).token_ids for p in prompts]
    llm = LLM(model=str(folder), dtype="float32", max_model_len=SERVED, executor="inproc")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.outputs[0].token_ids for r in results] == reference


def _gguf_metadata(arch: str = "llama", **rope: Any) -> dict[str, Any]:
    base = {
        "general.architecture": arch,
        f"{arch}.attention.head_count": 4,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.block_count": 2,
        f"{arch}.context_length": SERVED,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.tokens": ["a"] * VOCAB_SIZE,
    }
    return {**base, **{f"{arch}.rope.scaling.{key}": value for key, value in rope.items()}}


def test_a_gguf_files_rope_scaling_reaches_the_config() -> None:
    yarn = hf_config_from_metadata(
        _gguf_metadata(type="yarn", factor=4.0, original_context_length=ORIGINAL), {}
    )
    rope = rope_parameters_of(yarn)
    assert (rope.rope_type, rope.scaling["factor"], rope.original_max_position_embeddings) == (
        "yarn",
        4.0,
        ORIGINAL,
    )
    linear = rope_parameters_of(hf_config_from_metadata(_gguf_metadata(type="linear", factor=2.0), {}))
    assert (linear.rope_type, linear.max_context()) == ("linear", 2 * SERVED)
    assert rope_parameters_of(hf_config_from_metadata(_gguf_metadata(type="none"), {})).rope_type == "default"
    with pytest.raises(UnsupportedArchitectureError, match="'longrope' \\(llama.rope.scaling.type\\)"):
        hf_config_from_metadata(_gguf_metadata(type="longrope"), {})
    with pytest.raises(UnsupportedArchitectureError, match="llama.rope.scaling.original_context_length"):
        hf_config_from_metadata(_gguf_metadata(type="yarn", factor=4.0), {})


def test_a_served_context_within_the_original_one_runs_longrope_on_its_short_factors(tmp_path: Path) -> None:
    """As transformers does for every sequence that fits the original context: the logits of a batch
    served at max_model_len 64 are transformers' own, and those of the same model served at 256 are not."""
    trained, scaling = SCALINGS["longrope"]
    folder = write_tiny_model(
        "llama",
        tmp_path,
        overrides={"max_position_embeddings": trained, "rope_parameters": {"rope_theta": 10000.0, **scaling}},
    )
    rng = random.Random(2)
    seqs = [[rng.randrange(VOCAB_SIZE - 64) for _ in range(n)] for n in (60, 33, 9)]
    hf = load_hf_model(folder, torch.float32)
    with torch.inference_mode():
        reference = torch.cat([hf(torch.tensor([s])).logits[0].float() for s in seqs])
    spec = read_model_spec(folder)

    def served_logits(max_model_len: int) -> torch.Tensor:
        model = load_model(spec, torch.float32, torch.device("cpu"), TorchAttentionBackend(), max_model_len)
        return PagedSequences(model, seqs).step([len(s) for s in seqs])

    short = served_logits(ORIGINAL)
    assert (short - reference).abs().max().item() <= 2e-5 * max(reference.abs().max().item(), 1.0)
    assert (served_logits(SERVED) - reference).abs().max().item() > 1e-3


def test_a_gguf_rope_freqs_tensor_becomes_per_frequency_divisors() -> None:
    divisors = [1.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    rope = rope_parameters_of(hf_config_from_metadata(_gguf_metadata(), {}, {ROPE_FREQS_TENSOR: divisors}))
    inv_freq, attention_factor = rotary_frequencies(rope, HEAD_DIM, SERVED)
    plain = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    torch.testing.assert_close(inv_freq, plain / torch.tensor(divisors))
    assert attention_factor == 1.0
    with pytest.raises(
        UnsupportedArchitectureError, match="both llama.rope.scaling.type 'linear' and rope_freqs"
    ):
        hf_config_from_metadata(_gguf_metadata(type="linear", factor=2.0), {}, {ROPE_FREQS_TENSOR: divisors})
    with pytest.raises(
        UnsupportedArchitectureError, match="rope_freqs.weight has 3 values; 16 rotary dimensions need 8"
    ):
        hf_config_from_metadata(_gguf_metadata(), {}, {ROPE_FREQS_TENSOR: [1.0, 2.0, 3.0]})


def test_a_phi3_ggufs_rope_factors_become_its_longrope() -> None:
    """llama.cpp writes Phi-3's LongRoPE as two tensors and the original context as metadata."""
    short, long = [1.0 + i / 10 for i in range(8)], [2.0 + i for i in range(8)]
    metadata = _gguf_metadata("phi3", original_context_length=ORIGINAL, attn_factor=1.19)
    tensors = {ROPE_FACTORS_SHORT: short, ROPE_FACTORS_LONG: long}
    rope = rope_parameters_of(hf_config_from_metadata(metadata, {}, tensors))
    assert (rope.rope_type, rope.original_max_position_embeddings) == ("longrope", ORIGINAL)
    assert (rope.scaling["short_factor"], rope.scaling["long_factor"]) == (short, long)
    assert rope.scaling["attention_factor"] == pytest.approx(1.19)
    with pytest.raises(UnsupportedArchitectureError, match="only one of rope_factors_long.weight"):
        hf_config_from_metadata(metadata, {}, {ROPE_FACTORS_LONG: long})
    with pytest.raises(UnsupportedArchitectureError, match="rope_factors_short.weight has 3 values"):
        hf_config_from_metadata(metadata, {}, {ROPE_FACTORS_SHORT: short[:3], ROPE_FACTORS_LONG: long})


def test_a_partial_rotary_turns_its_share_of_each_head_as_phi4_mini_does(tmp_path: Path) -> None:
    """Phi-4-mini's partial_rotary_factor 0.75 (with LongRoPE factors for the 12 turning dimensions of a
    16-wide head): generates what transformers generates at every tier; Llama's layers refuse it."""
    long_factors = [1.0 + 0.25 * i for i in range(6)]
    overrides = {
        "partial_rotary_factor": 0.75,
        "max_position_embeddings": 4 * ORIGINAL,
        "original_max_position_embeddings": ORIGINAL,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 6,
            "long_factor": long_factors,
        },
    }
    folder = write_tiny_model("phi3", tmp_path / "phi4-mini-like", overrides=overrides)
    spec = read_model_spec(folder)
    model = load_model(spec, torch.float32, torch.device("cpu"), TorchAttentionBackend())
    assert model.rotary.cos.shape[1] == 12
    prompts = [[3 + (7 * i + j) % 250 for j in range(70 + 20 * i)] for i in range(3)]
    reference_model = load_hf_model(folder, torch.float32)
    reference = [hf_greedy(reference_model, p, 24).token_ids for p in prompts]
    for cpu_isa in ALL_TIERS:
        llm = LLM(model=str(folder), dtype="float32", cpu_isa=cpu_isa)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [r.outputs[0].token_ids for r in results] == reference, cpu_isa
    llama = write_tiny_model("llama", tmp_path / "llama", overrides={"partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedArchitectureError, match="partial_rotary_factor 0.5"):
        load_model(read_model_spec(llama), torch.float32, torch.device("cpu"), TorchAttentionBackend())
