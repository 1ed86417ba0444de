"""The engine core <-> worker messages: golden vectors, the protocol's key order, and hostile bytes."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from make_golden_worker_seam import GOLDEN_DIR, GOLDEN_MESSAGES, golden_files, render_index
from sluice.sampling_params import SamplingParams, params_from_wire
from sluice.wire import ProtocolError, UnknownMessageTypeError, UnknownVersionError
from sluice.worker_seam import CachedRequestData, SchedulerOutput, Shutdown, decode, encode

# The key order of docs/protocol.md, written out again here so that a reordered codec fails.
PROTOCOL_KEYS = {
    "worker_ready": ["v", "type", "rank"],
    "init_kv_cache": ["v", "type", "num_blocks"],
    "kv_cache_ready": ["v", "type", "rank"],
    "scheduler_output": [
        "v",
        "type",
        "step_id",
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "total_num_scheduled_tokens",
        "finished_req_ids",
        "preempted_req_ids",
        "structured_output_req_ids",
        "scheduled_spec_token_ids",
    ],
    "grammar_bitmask": ["v", "type", "step_id", "bitmask"],
    "model_runner_output": [
        "v",
        "type",
        "step_id",
        "req_ids",
        "sampled_token_ids",
        "logprobs",
        "num_eager_fallbacks",
        "prompt_logprobs",
        "pooled",
    ],
    "shutdown": ["v", "type"],
    "worker_error": ["v", "type", "rank", "message"],
}
NEW_REQUEST_KEYS = [
    "req_id",
    "prompt_token_ids",
    "params",
    "block_ids",
    "num_computed_tokens",
    "second_text_start",
]
CACHED_KEYS = ["req_ids", "resumed", "new_block_ids", "num_computed_tokens", "num_output_tokens"]
# bytes: msgpack bin, for the grammar bitmask.
PLAIN_TYPES = (int, float, str, bool, type(None), bytes)


def _raw(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(item) for item in value)
    return isinstance(value, PLAIN_TYPES)


@pytest.mark.parametrize("stem", list(GOLDEN_MESSAGES))
def test_golden_file_decodes_to_its_message_and_reencodes_to_the_same_bytes(stem):
    data = (GOLDEN_DIR / f"{stem}.msgpack").read_bytes()
    message = decode(data)
    assert message == GOLDEN_MESSAGES[stem]
    assert encode(message) == data


def test_golden_files_and_index_are_up_to_date():
    files = golden_files()
    assert {path.stem for path in GOLDEN_DIR.glob("*.msgpack")} == set(files), (
        "run make_golden_worker_seam.py"
    )
    assert (GOLDEN_DIR / "index.json").read_text(encoding="utf-8") == render_index(files)


def test_every_message_type_has_a_golden_vector():
    index = json.loads((GOLDEN_DIR / "index.json").read_text(encoding="utf-8"))
    assert {entry["type"] for entry in index["vectors"]} == set(PROTOCOL_KEYS)


@pytest.mark.parametrize("stem", list(GOLDEN_MESSAGES))
def test_keys_follow_the_protocol_order_and_values_are_plain(stem):
    body = _raw((GOLDEN_DIR / f"{stem}.msgpack").read_bytes())
    assert list(body) == PROTOCOL_KEYS[body["type"]] and body["v"] == 1
    assert _plain(body), "only msgpack's plain types cross the seam"
    if body["type"] == "scheduler_output":
        for new in body["scheduled_new_reqs"]:
            assert list(new) == NEW_REQUEST_KEYS
        assert list(body["scheduled_cached_reqs"]) == CACHED_KEYS


def test_sampling_params_travel_as_the_params_map():
    [new, _] = GOLDEN_MESSAGES["scheduler_output_first_step"].scheduled_new_reqs
    assert isinstance(new.params, dict)
    params = params_from_wire(new.params)
    assert params == SamplingParams(
        max_tokens=128,
        temperature=0.7,
        top_p=0.95,
        top_k=50,
        logit_bias={2: 5.0, 49151: -100.0},
        seed=1234567890123,
        logprobs=5,
        stop_token_ids=[2],
        min_tokens=4,
        prompt_logprobs=0,
        allowed_token_ids=[2, 127, 49151],
        bad_words_token_ids=[[9906], [3658, 27, 12455]],
    )


def test_a_set_or_an_object_is_refused_on_encode():
    bad = SchedulerOutput(0, [], CachedRequestData(), {}, 0, {"a"}, [])  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="finished_req_ids"):
        encode(bad)
    with pytest.raises(ProtocolError, match="not a protocol message"):
        encode(SamplingParams())  # type: ignore[arg-type]


def test_unknown_version_and_type_are_typed_errors():
    body = _raw(encode(Shutdown()))
    with pytest.raises(UnknownVersionError):
        decode(msgpack.packb({**body, "v": 2}))
    with pytest.raises(UnknownMessageTypeError):
        decode(msgpack.packb({**body, "type": "add_request"}))


def test_a_malformed_field_names_its_path():
    body = _raw((GOLDEN_DIR / "scheduler_output.msgpack").read_bytes())
    body["scheduled_cached_reqs"]["new_block_ids"][1][0][2] = "x"
    with pytest.raises(ProtocolError, match=r"scheduled_cached_reqs\.new_block_ids\[1\]\[0\]\[2\]"):
        decode(msgpack.packb(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_protocol_errors_only(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_golden_messages_give_protocol_errors_only(data):
    stem = data.draw(st.sampled_from(list(GOLDEN_MESSAGES)))
    raw = bytearray((GOLDEN_DIR / f"{stem}.msgpack").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(raw))
    except ProtocolError:
        pass
