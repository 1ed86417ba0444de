"""sluice.pooling: what a folder declares, the `dimensions` rules, and the finished vector's bytes."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from sluice.errors import InvalidRequestError, ModelNotFoundError
from sluice.pooling import PoolingParams, PoolingSpec, check_pooling_params, finish_embedding, pooling_spec_of


def write_modules(folder, pooling: dict, normalize: bool) -> None:
    modules = [{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_a_sentence_transformers_folder_says_how_it_pools(tmp_path):
    write_modules(
        tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, normalize=False
    )
    assert pooling_spec_of(tmp_path, {"matryoshka_dimensions": [8, 16]}, "last") == PoolingSpec(
        "mean", False, (8, 16)
    )


def test_a_generative_folder_pools_its_last_token_normalised(tmp_path):
    assert pooling_spec_of(tmp_path, {}, "last") == PoolingSpec("last", True, None)
    assert pooling_spec_of(tmp_path, {"is_matryoshka": True}, "cls").matryoshka_dimensions == ()


@pytest.mark.parametrize(
    "pooling",
    [
        {"pooling_mode_max_tokens": True},
        {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
        {},
    ],
)
def test_pooling_modes_sluice_lacks_are_refused_by_name(tmp_path, pooling):
    write_modules(tmp_path, pooling, normalize=True)
    with pytest.raises(ModelNotFoundError, match="pooling_mode_lasttoken"):
        pooling_spec_of(tmp_path, {}, "last")


def test_dimensions_rules():
    any_size = PoolingSpec("last", True, ())
    listed = PoolingSpec("last", True, (32, 64))
    check_pooling_params(PoolingParams(dimensions=7), any_size, 64)
    check_pooling_params(PoolingParams(dimensions=32), listed, 64)
    check_pooling_params(PoolingParams(), PoolingSpec("last", True, None), 64)
    for params, spec, message in [
        (PoolingParams(dimensions=65), any_size, "1 to 64"),
        (PoolingParams(dimensions=0), any_size, "1 to 64"),
        (PoolingParams(dimensions=48), listed, "32, 64"),
        (PoolingParams(dimensions=8), PoolingSpec("last", True, None), "not a Matryoshka model"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as refused:
            check_pooling_params(params, spec, 64)
        assert refused.value.param == "dimensions"


def test_the_embedding_is_truncated_then_normalised_as_little_endian_float32():
    pooled = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    spec = PoolingSpec("last", True, ())
    assert finish_embedding(pooled, PoolingParams(dimensions=2), spec) == struct.pack("<2f", 0.6, 0.8)
    assert finish_embedding(pooled, PoolingParams(normalize=False), spec) == struct.pack(
        "<3f", 3.0, 4.0, 12.0
    )
    unnormalised = PoolingSpec("mean", False, None)
    assert finish_embedding(pooled, PoolingParams(normalize=True), unnormalised) == struct.pack(
        "<3f", 3 / 13, 4 / 13, 12 / 13
    )
    # A zero vector stays zero rather than turning into NaNs.
    assert finish_embedding(np.zeros(2, np.float32), PoolingParams(), spec) == struct.pack("<2f", 0.0, 0.0)
