"""The engine core -> router messages: the KV-events golden vectors, the protocol's key order, the block
hash against an independent computation, and hostile bytes."""

from __future__ import annotations

import json

import msgpack
import pytest

from engine.block_pool import cache_salt_root, hash_block_tokens
from make_golden_kv_events import GOLDEN_DIR, GOLDEN_MESSAGES, golden_files, render_index
from sluice.kv_events_seam import decode, encode
from sluice.wire import ProtocolError, UnknownMessageTypeError

# The key order of docs/protocol.md, written out again here so that a reordered codec fails.
EVENT_KEYS = {
    "block_stored": ["type", "block_hash", "parent_hash"],
    "block_removed": ["type", "block_hash"],
    "all_cleared": ["type"],
}


@pytest.mark.parametrize("stem", list(GOLDEN_MESSAGES))
def test_golden_file_decodes_to_its_message_and_reencodes_to_the_same_bytes(stem: str) -> None:
    data = (GOLDEN_DIR / f"{stem}.msgpack").read_bytes()
    message = decode(data)
    assert message == GOLDEN_MESSAGES[stem]
    assert encode(message) == data


def test_golden_files_and_index_are_up_to_date() -> None:
    files = golden_files()
    on_disk = {path.stem for path in GOLDEN_DIR.glob("*.msgpack")}
    assert on_disk == set(files), "run tests/golden/make_golden_kv_events.py"
    assert (GOLDEN_DIR / "index.json").read_text(encoding="utf-8") == render_index(files)


def test_golden_vectors_cover_every_event_type_in_protocol_order() -> None:
    seen = set()
    for stem in GOLDEN_MESSAGES:
        body = msgpack.unpackb((GOLDEN_DIR / f"{stem}.msgpack").read_bytes(), raw=False)
        assert list(body) == ["v", "type", "seq", "events"]
        assert body["v"] == 1 and body["type"] == "kv_events"
        for event in body["events"]:
            assert list(event) == EVENT_KEYS[event["type"]]
            seen.add(event["type"])
    assert seen == set(EVENT_KEYS)


def test_the_engine_hash_matches_the_independent_golden_vector() -> None:
    vector = json.loads((GOLDEN_DIR / "block_hashes.json").read_text())
    size, tokens = vector["block_size"], vector["token_ids"]
    assert size == 16 and len(tokens) % size != 0, "the vector must end with a partial block"
    for salt, expected in (
        (None, vector["block_hashes"]),
        (vector["cache_salt"], vector["salted_block_hashes"]),
    ):
        hashes, parent = [], cache_salt_root(salt)
        for start in range(0, len(tokens) - size + 1, size):
            parent = hash_block_tokens(parent, tokens[start : start + size])
            hashes.append(parent.hex())
        assert hashes == expected, salt
    assert vector["salted_block_hashes"][0] != vector["block_hashes"][0]


@pytest.mark.parametrize(
    "body",
    [
        {"v": 1, "type": "kv_events", "seq": 0, "events": []},
        {
            "v": 1,
            "type": "kv_events",
            "seq": 1,
            "events": [{"type": "block_removed", "block_hash": b"x" * 31}],
        },
        {
            "v": 1,
            "type": "kv_events",
            "seq": 1,
            "events": [{"type": "block_removed", "block_hash": "ab" * 32}],
        },
        {"v": 1, "type": "kv_events", "seq": 1, "events": [{"type": "block_moved", "block_hash": b"x" * 32}]},
        {"v": 1, "type": "kv_events", "seq": 1, "events": [{"type": "all_cleared", "extra": 1}]},
        {
            "v": 1,
            "type": "kv_events",
            "seq": 1,
            "events": [{"type": "block_stored", "block_hash": b"x" * 32}],
        },
    ],
)
def test_malformed_events_are_protocol_errors(body: dict) -> None:
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(body, use_bin_type=True))


def test_an_unknown_message_type_is_a_typed_error() -> None:
    with pytest.raises(UnknownMessageTypeError):
        decode(msgpack.packb({"v": 1, "type": "outputs", "seq": 1, "events": []}))
