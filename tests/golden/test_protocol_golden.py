"""The frontend <-> engine core messages: golden vectors, canonical encoding, and hostile bytes."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from make_golden_protocol import GOLDEN_DIR, GOLDEN_MESSAGES, golden_files, render_index
from sluice.errors import SluiceError
from sluice.frontend_seam import (
    ITERATION_TOKENS_BOUNDS,
    Abort,
    AddRequest,
    EngineOutput,
    EngineStats,
    Outputs,
    Ready,
    UtilityCall,
    UtilityResult,
    decode,
    encode,
)
from sluice.sampling_params import SamplingParams, params_from_wire, params_to_wire
from sluice.wire import ProtocolError, UnknownMessageTypeError, UnknownVersionError
from sluice.worker_seam import Logprobs

# The key order of docs/protocol.md, written out again here so that a reordered codec fails.
PROTOCOL_KEYS = {
    "add_request": [
        "v",
        "type",
        "request_id",
        "prompt_token_ids",
        "params",
        "arrival_time",
        "priority",
        "cache_salt",
        "pooling",
        "second_text_start",
    ],
    "abort": ["v", "type", "request_ids"],
    "utility": ["v", "type", "call_id", "method"],
    "ready": [
        "v",
        "type",
        "max_model_len",
        "num_kv_blocks",
        "block_size",
        "runner",
        "embedding_size",
        "matryoshka_dimensions",
        "cross_encoder",
        "eos_token_ids",
    ],
    "outputs": ["v", "type", "outputs", "stats", "timestamp"],
    "utility_result": ["v", "type", "call_id", "result", "error"],
}
PARAMS_KEYS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
    "logprobs",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "structured_output",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words_token_ids",
    "thinking_budget",
]
OUTPUT_KEYS = [
    "request_id",
    "new_token_ids",
    "new_logprobs",
    "finish_reason",
    "stop_reason",
    "num_cached_tokens",
    "error",
    "first_scheduled_time",
    "invalid_param",
    "prompt_logprobs",
    "embedding",
]
STATS_KEYS = [
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "num_eager_fallbacks",
    "iteration_tokens",
    "iteration_tokens_sum",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
]


def _raw(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@pytest.mark.parametrize("stem", list(GOLDEN_MESSAGES))
def test_golden_file_decodes_to_its_message_and_reencodes_to_the_same_bytes(stem):
    data = (GOLDEN_DIR / f"{stem}.msgpack").read_bytes()
    message = decode(data)
    assert message == GOLDEN_MESSAGES[stem]
    assert encode(message) == data


def test_golden_files_and_index_are_up_to_date():
    files = golden_files()
    on_disk = {path.stem for path in GOLDEN_DIR.glob("*.msgpack")}
    assert on_disk == set(files), "run tests/golden/make_golden_protocol.py"
    assert (GOLDEN_DIR / "index.json").read_text(encoding="utf-8") == render_index(files)


def test_every_message_type_has_a_golden_vector():
    index = json.loads((GOLDEN_DIR / "index.json").read_text(encoding="utf-8"))
    assert {entry["type"] for entry in index["vectors"]} == set(PROTOCOL_KEYS)


@pytest.mark.parametrize("stem", list(GOLDEN_MESSAGES))
def test_keys_follow_the_protocol_order(stem):
    body = _raw((GOLDEN_DIR / f"{stem}.msgpack").read_bytes())
    assert list(body) == PROTOCOL_KEYS[body["type"]]
    assert body["v"] == 1
    if body["type"] == "add_request":
        assert list(body["params"]) == PARAMS_KEYS
    if body["type"] == "outputs":
        assert list(body["stats"]) == STATS_KEYS
        for entry in body["outputs"]:
            assert list(entry) == OUTPUT_KEYS
            for logprobs in entry["new_logprobs"] or []:
                assert list(logprobs) == ["token_ids", "logprobs", "sampled_rank"]


def test_logit_bias_keys_are_ascending_and_floats_are_float64():
    data = encode(
        AddRequest("r", [1], SamplingParams(temperature=1, logit_bias={9: 1, 3: -2, 7: 0.5}), arrival_time=5)
    )
    params = _raw(data)["params"]
    assert list(params["logit_bias"]) == [3, 7, 9]
    # An int given for a float field still goes out as float64 (0xcb), never as an int.
    assert data.count(b"\xcb") == 6 + 3 + 1


def test_n_is_not_on_the_wire():
    with pytest.raises(ProtocolError, match="n is not on the wire"):
        encode(AddRequest("r", [1], SamplingParams(n=2), arrival_time=0.0))
    with pytest.raises(ProtocolError):
        params_to_wire(SamplingParams(n=3))
    params = SamplingParams(temperature=0.5, seed=3, stop_token_ids=[4], logit_bias={1: 2.0})
    assert params_from_wire(params_to_wire(params)) == params


def test_unknown_version_is_a_typed_error():
    body = _raw(encode(Abort(["a"])))
    for version in (2, 0, None, "1", True, 1.0):
        with pytest.raises(UnknownVersionError):
            decode(msgpack.packb({**body, "v": version}))
    with pytest.raises(UnknownVersionError):
        decode(msgpack.packb({"type": "abort", "request_ids": []}))


def test_unknown_type_is_a_typed_error():
    for tag in ("shutdown", "", None, 3, b"abort"):
        with pytest.raises(UnknownMessageTypeError):
            decode(msgpack.packb({"v": 1, "type": tag, "request_ids": []}))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\xff\xfe\xfd",
        b"\x92\x01\x02",
        b"\x81\xa1v",
        b"\xdd\xff\xff\xff\xff",
        msgpack.packb([{"v": 1}]),
        msgpack.packb({"v": 1, "type": "abort", "request_ids": ["a"]}) + b"\x00",
        msgpack.packb({"v": 1, "type": "abort", "request_ids": "a"}),
        msgpack.packb({"v": 1, "type": "abort", "request_ids": ["a"], "extra": 1}),
        msgpack.packb({"v": 1, "type": "ready", "max_model_len": 1, "num_kv_blocks": 2}),
        msgpack.packb({"v": 1, "type": "ready", "max_model_len": 1.0, "num_kv_blocks": 2, "block_size": 3}),
        msgpack.packb({"v": 1, "type": "utility", "call_id": True, "method": "health"}),
        b"\x83\xa1v\x01\xa4type\xa5abort\xabrequest_ids\x91\xa2\xff\xfe",
        b"\x93" * 100000,
    ],
)
def test_garbage_is_a_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_a_malformed_add_request_names_its_request():
    body = _raw(encode(GOLDEN_MESSAGES["add_request"]))
    body["params"]["temperature"] = "hot"
    with pytest.raises(ProtocolError, match=r"params\.temperature") as info:
        decode(msgpack.packb(body))
    assert info.value.request_id == "cmpl-8f14e45f-0"
    assert isinstance(info.value, SluiceError)


def test_a_bad_finish_reason_is_rejected():
    body = _raw(encode(GOLDEN_MESSAGES["outputs"]))
    body["outputs"][0]["finish_reason"] = "done"
    with pytest.raises(ProtocolError, match="finish_reason"):
        decode(msgpack.packb(body))


# Hypothesis: random messages round-trip, and nothing but ProtocolError ever comes out of decode.

_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_small = st.integers(min_value=-(2**31), max_value=2**31)
_floats = st.floats(allow_nan=False)
_text = st.text(max_size=20)
_tokens = st.lists(st.integers(min_value=0, max_value=2**32), max_size=8)

_params = st.builds(
    SamplingParams,
    n=st.just(1),
    max_tokens=_small,
    temperature=_floats,
    top_p=_floats,
    top_k=_small,
    min_p=_floats,
    repetition_penalty=_floats,
    presence_penalty=_floats,
    frequency_penalty=_floats,
    logit_bias=st.none() | st.dictionaries(_ints, _floats, max_size=5),
    seed=st.none() | _ints,
    logprobs=st.none() | _small,
    stop_token_ids=_tokens,
    ignore_eos=st.booleans(),
    min_tokens=_small,
    prompt_logprobs=st.none() | _small,
    allowed_token_ids=st.none() | _tokens,
    bad_words_token_ids=st.none() | st.lists(_tokens, max_size=3),
)
_logprobs = st.builds(
    Logprobs, token_ids=_tokens, logprobs=st.lists(_floats, max_size=4), sampled_rank=_small
)
_stats = st.builds(
    EngineStats,
    _small,
    _small,
    _floats,
    _ints,
    _ints,
    _ints,
    _ints,
    st.lists(_small, min_size=len(ITERATION_TOKENS_BOUNDS) + 1, max_size=len(ITERATION_TOKENS_BOUNDS) + 1),
    _ints,
)
_output = st.builds(
    EngineOutput,
    request_id=_text,
    new_token_ids=_tokens,
    new_logprobs=st.none() | st.lists(_logprobs, max_size=3),
    finish_reason=st.none() | st.sampled_from(["stop", "length", "abort", "error"]),
    stop_reason=st.none() | _ints,
    num_cached_tokens=_small,
    error=st.none() | _text,
    first_scheduled_time=st.none() | _floats,
    prompt_logprobs=st.none() | st.lists(_logprobs, max_size=3),
)
_scalar = st.none() | st.booleans() | _ints | _floats | _text
_messages = st.one_of(
    st.builds(AddRequest, _text, _tokens, _params, _floats, _ints),
    st.builds(Abort, st.lists(_text, max_size=4)),
    st.builds(UtilityCall, _ints, _text),
    st.builds(Ready, _ints, _ints, _ints),
    st.builds(Outputs, st.lists(_output, max_size=4), _stats, _floats),
    st.builds(
        UtilityResult, _ints, st.none() | st.dictionaries(_text, _scalar, max_size=4), st.none() | _text
    ),
)


@settings(max_examples=300, deadline=None)
@given(_messages)
def test_random_messages_round_trip_to_identical_bytes(message):
    data = encode(message)
    decoded = decode(data)
    assert decoded == message
    assert encode(decoded) == data
    assert list(_raw(data))[:2] == ["v", "type"]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_escape_as_anything_but_a_protocol_error(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(_messages, st.data())
def test_corrupted_messages_never_escape_as_anything_but_a_protocol_error(message, data):
    raw = bytearray(encode(message))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        raw[data.draw(st.integers(min_value=0, max_value=len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(raw))
    except ProtocolError:
        pass
