"""Cross-encoders (rerankers) score what sentence-transformers' CrossEncoder scores, on tiny random-init
BertForSequenceClassification and XLMRobertaForSequenceClassification models whose tokenizers type a
pair as their families do, at every CPU kernel tier this machine runs, at none and on CUDA; and what a
cross-encoder cannot serve is refused."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from engine import LLM
from sluice.errors import InvalidRequestError, UnsupportedArchitectureError
from sluice.model_spec import read_model_spec
from sluice.pooling import PoolingParams, second_text_start_of
from tiers import PLACES
from tiny_models import CROSS_ENCODER_DOCUMENTS, CROSS_ENCODER_QUERY, write_tiny_cross_encoder

QUERY = CROSS_ENCODER_QUERY
DOCUMENTS = [*CROSS_ENCODER_DOCUMENTS, "A long document " * 4]


@functools.cache
def cross_encoder(model_type: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix="sluice-tiny-cross-encoders-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return write_tiny_cross_encoder(model_type, root / model_type)


def reference_scores(folder: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    # One pair at a time: the tiny tokenizer's pad token is not the model's padding index.
    return np.asarray(CrossEncoder(str(folder), device="cpu").predict(pairs, batch_size=1), dtype=np.float64)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_scores_match_sentence_transformers(place, model_type):
    folder = cross_encoder(model_type)
    llm = LLM(model=str(folder), dtype="float32", max_num_batched_tokens=256, max_model_len=128, **place)
    assert llm.engine.runner == "pooling" and llm.engine.embedding_size == 1
    got = np.array([r.outputs.score for r in llm.score(QUERY, DOCUMENTS)])
    want = reference_scores(folder, [(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose(got, want, atol=1e-5)
    # A one-label head through a sigmoid: probabilities, and random weights spread them.
    assert ((0 < got) & (got < 1)).all() and np.ptp(got) > 1e-3
    # Pairs one to one give the same scores.
    again = llm.score([QUERY] * 2, DOCUMENTS[:2])
    np.testing.assert_allclose([r.outputs.score for r in again], got[:2], atol=1e-6)


def test_the_second_text_is_typed_one_for_bert():
    """BERT's pair template types the second text 1, and the token type embedding moves the score: scoring
    the same ids as one text (all type 0) gives another score."""
    folder = cross_encoder("bert")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128)
    encoded = llm.tokenizer(QUERY, DOCUMENTS[0], return_token_type_ids=True)
    start = second_text_start_of(list(encoded["token_type_ids"]))
    assert start is not None and encoded["token_type_ids"][start - 1] == 0
    paired = llm.score(QUERY, DOCUMENTS[0])[0].outputs.score
    (flat,) = llm._pool([llm._tokenize({"prompt_token_ids": encoded["input_ids"]})], PoolingParams())
    assert abs(flat.outputs.embedding[0] - paired) > 1e-4


def test_what_a_cross_encoder_cannot_serve_is_refused(tmp_path):
    folder = cross_encoder("bert")
    llm = LLM(model=str(folder), dtype="float32", max_model_len=128)
    with pytest.raises(InvalidRequestError, match="cross-encoder"):
        llm.embed("a text")
    with pytest.raises(InvalidRequestError, match="normalize"):
        llm.score(QUERY, DOCUMENTS[0], PoolingParams(normalize=True))
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.score(QUERY, DOCUMENTS[0], PoolingParams(dimensions=1))
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.score({"prompt_token_ids": [5, 6]}, DOCUMENTS[0])
    with pytest.raises(InvalidRequestError, match="second_text_start"):
        llm.engine.check_request([5, 6, 7], llm_sampling(), None, PoolingParams(), 3)
    # A head of two labels is not a relevance score.
    two = tmp_path / "two-labels"
    shutil.copytree(folder, two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "no", "1": "yes"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="2 labels"):
        read_model_spec(two)


def llm_sampling():
    from sluice.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1)


@pytest.mark.parametrize(("types", "start"), [([0, 0, 0, 1, 1], 3), ([0, 0, 0], None), ([0, 1], 1)])
def test_the_pair_boundary_is_the_first_token_of_type_one(types, start):
    assert second_text_start_of(types) == start


def test_types_in_another_pattern_are_refused():
    with pytest.raises(InvalidRequestError, match="pair template"):
        second_text_start_of([0, 1, 1, 0])


def test_two_tensor_parallel_ranks_score_what_one_does():
    folder = cross_encoder("bert")
    one = LLM(model=str(folder), dtype="float32", max_model_len=128).score(QUERY, DOCUMENTS)
    two = LLM(model=str(folder), dtype="float32", max_model_len=128, tensor_parallel_size=2).score(
        QUERY, DOCUMENTS
    )
    np.testing.assert_allclose([r.outputs.score for r in two], [r.outputs.score for r in one], atol=1e-6)
