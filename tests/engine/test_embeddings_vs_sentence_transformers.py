"""The pooling runner embeds what sentence-transformers embeds, on tiny random-init base models in the
shape Qwen3-Embedding ships (a Qwen3Model checkpoint with modules.json): last-token, mean and first-token
pooling, with and without normalisation, prompts chunked over several steps, at every CPU kernel tier this
machine runs, at none and on CUDA; and it refuses what it cannot serve."""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from sluice.errors import InvalidConfigError, InvalidRequestError
from sluice.pooling import PoolingParams
from tiers import PLACES
from tiny_models import VOCAB_SIZE, write_tiny_embedding_model, write_tiny_encoder

PROMPTS = 8
# Cosine similarity to sentence-transformers' fp32 embedding (issue 30's bar).
MIN_COSINE = 0.9999


@functools.cache
def embedding_model(pooling_mode: str, normalize: bool, matryoshka: bool = False) -> Path:
    """Written once per test process (the tests of a kind share it), removed at exit."""
    folder = _models_root() / f"{pooling_mode}-{normalize}-{matryoshka}"
    overrides = {"is_matryoshka": True} if matryoshka else None
    return write_tiny_embedding_model("qwen3", folder, pooling_mode, normalize, overrides)


@functools.cache
def encoder_model(model_type: str, pooling_mode: str, normalize: bool) -> Path:
    return write_tiny_encoder(
        model_type, _models_root() / f"{model_type}-{pooling_mode}-{normalize}", pooling_mode, normalize
    )


@functools.cache
def _models_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="sluice-tiny-embedders-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def random_prompts(lowest: int = 0) -> list[list[int]]:
    """Up to 90 tokens: past the step budget of 32 below, so that most prompts are chunked. An
    encoder's prompts leave out ids below `lowest`: RoBERTa numbers no position for its <pad> (id 1),
    which no real text holds."""
    rng = random.Random(1)
    return [
        [rng.randrange(lowest, VOCAB_SIZE - 64) for _ in range(rng.randint(3, 90))] for _ in range(PROMPTS)
    ]


def reference_embeddings(folder: Path, prompts: list[list[int]]) -> np.ndarray:
    """sentence-transformers' fp32 embeddings, one prompt at a time (the tiny tokenizer has no pad token)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    rows = []
    for prompt in prompts:
        features = {
            "input_ids": torch.tensor([prompt]),
            "attention_mask": torch.ones(1, len(prompt), dtype=torch.long),
        }
        with torch.no_grad():
            rows.append(model(features)["sentence_embedding"][0].numpy())
    return np.stack(rows)


def engine_embeddings(llm: LLM, prompts: list[list[int]], params: PoolingParams | None = None) -> np.ndarray:
    results = llm.embed([{"prompt_token_ids": p} for p in prompts], params)
    return np.array([r.outputs.embedding for r in results], dtype=np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def tiny_llm(folder: Path, **options) -> LLM:
    # A small budget and pool: prompts are chunked over several steps.
    return LLM(model=str(folder), dtype="float32", max_num_batched_tokens=32, num_kv_blocks=24, **options)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize(
    ("pooling_mode", "normalize"), [("lasttoken", True), ("mean_tokens", False), ("cls_token", True)]
)
def test_embeddings_match_sentence_transformers(place, pooling_mode, normalize):
    folder = embedding_model(pooling_mode, normalize)
    prompts = random_prompts()
    reference = reference_embeddings(folder, prompts)
    llm = tiny_llm(folder, **place)
    assert llm.engine.runner == "pooling", "a sentence-transformers base model is served for embeddings"
    got = engine_embeddings(llm, prompts)
    assert got.shape == reference.shape == (PROMPTS, 64)
    assert cosines(got, reference).min() >= MIN_COSINE
    # The magnitudes too: normalised exactly when the model's modules say so.
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-3)


# With the encoder's own kernels off (torch's SDPA per sequence and GELU beside the tier's GEMMs) too.
@pytest.mark.parametrize(
    "place", [*PLACES, pytest.param({"cpu_encoder_kernels": False}, id="no-encoder-kernels")]
)
@pytest.mark.parametrize(
    ("model_type", "pooling_mode", "normalize"),
    [("bert", "mean_tokens", True), ("bert", "cls_token", False), ("xlm-roberta", "mean_tokens", True)],
)
def test_encoders_match_sentence_transformers(place, model_type, pooling_mode, normalize):
    folder = encoder_model(model_type, pooling_mode, normalize)
    prompts = random_prompts(lowest=4)
    reference = reference_embeddings(folder, prompts)
    # A budget of 96 holds any of these prompts whole, but not all of them: the batch spans several steps.
    llm = LLM(model=str(folder), dtype="float32", max_num_batched_tokens=256, max_model_len=96, **place)
    assert llm.engine.runner == "pooling"
    got = engine_embeddings(llm, prompts)
    assert cosines(got, reference).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-3)
    # Bidirectional attention: the same prompt again reuses no cached prefix and gives the same vector.
    again = llm.embed({"prompt_token_ids": prompts[0]})[0]
    assert again.num_cached_tokens == 0
    np.testing.assert_allclose(again.outputs.embedding, got[0], atol=1e-5)


def test_an_encoder_needs_a_step_budget_that_holds_a_whole_prompt():
    folder = encoder_model("bert", "mean_tokens", True)
    with pytest.raises(InvalidConfigError, match="encodes each prompt whole"):
        LLM(model=str(folder), dtype="float32", max_num_batched_tokens=64)


def test_normalize_and_dimensions_per_request():
    folder = embedding_model("lasttoken", True, matryoshka=True)
    prompts = random_prompts()[:3]
    reference = reference_embeddings(folder, prompts)
    llm = tiny_llm(folder)
    truncated = engine_embeddings(llm, prompts, PoolingParams(dimensions=16))
    assert truncated.shape == (3, 16)
    # Truncated first, then normalised: the prefix of the model's vector, as a unit vector.
    expected = reference[:, :16] / np.linalg.norm(reference[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(truncated, expected, atol=2e-4)
    raw = engine_embeddings(llm, prompts, PoolingParams(normalize=False))
    assert np.linalg.norm(raw, axis=1).min() > 1.5, "the raw hidden states of this model are not unit vectors"
    assert cosines(raw, reference).min() >= MIN_COSINE
    with pytest.raises(InvalidRequestError, match="dimensions") as refused:
        llm.embed("ab", PoolingParams(dimensions=65))
    assert refused.value.param == "dimensions"


def test_dimensions_need_a_matryoshka_model():
    llm = tiny_llm(embedding_model("lasttoken", True))
    with pytest.raises(InvalidRequestError, match="not a Matryoshka model"):
        llm.embed("abc", PoolingParams(dimensions=16))


def test_last_token_pooling_reuses_the_prefix_cache():
    llm = tiny_llm(embedding_model("lasttoken", True))
    prompt = random_prompts()[0][:3] * 20
    first, again = (llm.embed({"prompt_token_ids": prompt})[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    # Whole blocks of 16 but the last token, which is always computed.
    assert again.num_cached_tokens == 48
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-5)


def test_mean_pooling_computes_every_position_even_when_cached():
    llm = tiny_llm(embedding_model("mean_tokens", False))
    prompt = random_prompts()[0][:3] * 20
    first, again = (llm.embed({"prompt_token_ids": prompt})[0] for _ in range(2))
    assert again.num_cached_tokens == 0
    np.testing.assert_allclose(again.outputs.embedding, first.outputs.embedding, atol=1e-5)


def test_runner_mismatches_are_refused_with_the_routes_each_serves():
    folder = embedding_model("lasttoken", True)
    llm = tiny_llm(folder)
    with pytest.raises(InvalidRequestError, match="embedding model") as refused:
        llm.generate("abc")
    assert refused.value.param == "model"
    with pytest.raises(InvalidRequestError, match="base model with no LM head"):
        tiny_llm(folder, runner="generate")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]


def test_score_is_the_cosine_of_sentence_transformers_embeddings():
    folder = embedding_model("mean_tokens", False)
    prompts = random_prompts()[:4]
    reference = reference_embeddings(folder, prompts)
    expected = cosines(np.repeat(reference[:1], 3, axis=0), reference[1:])
    llm = tiny_llm(folder)
    one_to_many = llm.score({"prompt_token_ids": prompts[0]}, [{"prompt_token_ids": p} for p in prompts[1:]])
    np.testing.assert_allclose([r.outputs.score for r in one_to_many], expected, atol=1e-4)
    pairwise = llm.score(
        [{"prompt_token_ids": p} for p in prompts[2:]], [{"prompt_token_ids": p} for p in prompts[:2]]
    )
    np.testing.assert_allclose(
        [r.outputs.score for r in pairwise], cosines(reference[2:], reference[:2]), atol=1e-4
    )
    with pytest.raises(InvalidRequestError, match="one to one") as refused:
        llm.score(["ab", "cd"], ["ef", "gh", "ij"])
    assert refused.value.param == "data_2"


def test_two_tensor_parallel_ranks_embed_what_one_does():
    folder = embedding_model("mean_tokens", False)
    prompts = random_prompts()[:4]
    one = engine_embeddings(tiny_llm(folder), prompts)
    two = engine_embeddings(tiny_llm(folder, tensor_parallel_size=2), prompts)
    np.testing.assert_allclose(two, one, atol=1e-4)


@pytest.mark.parametrize(("quantization", "min_cosine"), [("int8", 0.999), ("int4", 0.98)])
def test_an_encoder_quantized_at_load_embeds_close_to_its_float_weights(quantization, min_cosine):
    """--quantization runs an encoder's linears on the integer GEMM: close to sentence-transformers' float
    vectors, and not the same (the weights did change)."""
    folder = encoder_model("bert", "mean_tokens", True)
    prompts = random_prompts(lowest=4)
    reference = reference_embeddings(folder, prompts)
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_num_batched_tokens=256,
        max_model_len=96,
        quantization=quantization,
    )
    got = engine_embeddings(llm, prompts)
    assert cosines(got, reference).min() >= min_cosine
    # The float GEMM matches the reference to 1e-5 (test_encoders_match_sentence_transformers).
    assert np.abs(got - reference).max() > 1e-4


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_two_tensor_parallel_ranks_encode_what_one_does(model_type):
    folder = encoder_model(model_type, "mean_tokens", True)
    prompts = random_prompts(lowest=4)[:4]
    options = {"dtype": "float32", "max_num_batched_tokens": 256, "max_model_len": 96}
    one = engine_embeddings(LLM(model=str(folder), **options), prompts)
    two = engine_embeddings(LLM(model=str(folder), tensor_parallel_size=2, **options), prompts)
    np.testing.assert_allclose(two, one, atol=1e-5)
