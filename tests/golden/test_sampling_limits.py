"""The engine's request validation against the golden table of sampling limits, which the frontend's
validation (frontend/src/api/validate.rs) runs too: the two rule sets cannot drift apart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from engine.request_validation import validate_request
from sluice.errors import InvalidRequestError
from sluice.sampling_params import SamplingParams

GOLDEN = json.loads((Path(__file__).parent / "sampling_limits.json").read_text())
VOCAB_SIZE: int = GOLDEN["vocab_size"]
CASES: list[dict[str, Any]] = GOLDEN["cases"]


def _engine_value(value: Any) -> Any:
    """A golden value as msgpack would bring it: "inf", "-inf" and "nan" are those floats."""
    if value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {int(key): _engine_value(item) for key, item in value.items()}
    return value


def _case_id(case: dict[str, Any]) -> str:
    return json.dumps(case["params"], separators=(",", ":"))


def test_the_table_has_both_accepted_and_refused_cases_for_every_float_field() -> None:
    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        verdicts = {"param" in case for case in CASES if field in case["params"]}
        assert verdicts == {True, False}, field
    assert math.isinf(_engine_value("inf")) and math.isnan(_engine_value("nan"))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_engine_validation_follows_the_golden_table(case: dict[str, Any]) -> None:
    fields = {field: _engine_value(value) for field, value in case["params"].items()}
    # A request's field beside its sampling parameters, on the wire as in HTTP.
    cache_salt = fields.pop("cache_salt", None)
    params = SamplingParams(**fields)
    if "param" not in case:
        validate_request([1, 2, 3], params, max_model_len=4096, vocab_size=VOCAB_SIZE, cache_salt=cache_salt)
        return
    with pytest.raises(InvalidRequestError) as refused:
        validate_request([1, 2, 3], params, max_model_len=4096, vocab_size=VOCAB_SIZE, cache_salt=cache_salt)
    assert refused.value.param == case["param"], str(refused.value)


def test_allowed_token_ids_of_only_stop_or_eos_tokens_are_refused_under_min_tokens() -> None:
    eos = (2,)

    def check(**fields: Any) -> None:
        validate_request(
            [1], SamplingParams(**fields), max_model_len=64, vocab_size=VOCAB_SIZE, eos_token_ids=eos
        )

    with pytest.raises(InvalidRequestError) as refused:
        check(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=1)
    assert refused.value.param == "allowed_token_ids"
    # Any other allowed token, no min_tokens, or EOS not suppressed (ignore_eos) leaves something to sample.
    check(allowed_token_ids=[2, 9, 10], stop_token_ids=[9], min_tokens=1)
    check(allowed_token_ids=[2], min_tokens=0)
    check(allowed_token_ids=[2], min_tokens=1, ignore_eos=True)
