"""Messages from the engine core to the router (KV-cache events), and their msgpack encoding.

docs/protocol.md ("The engine core → router seam") is the contract; this module is its Python half
(the router's Rust half is router/src/cache_aware/kv_events.rs). One `kv_events` message carries
the changes one engine step made to the prefix cache, in the order they happened, numbered by
`seq` so that a subscriber sees a gap when it lost a message. The encoding rules are the other
seams' (`v` and `type` first, every key present, nil for absent values); a block hash is a
32-byte msgpack bin, and each event is a map whose first key is its `type`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sluice.wire import INT, Codec, Invalid, MessageSet, ProtocolError, Record, list_of, optional

PROTOCOL_VERSION = 1
BLOCK_HASH_BYTES = 32


@dataclass(slots=True)
class BlockStored:
    """A full block was registered in the prefix cache."""

    block_hash: bytes
    # None for a prompt's first block.
    parent_hash: bytes | None


@dataclass(slots=True)
class BlockRemoved:
    """A block's hash left the prefix cache (its block was evicted to be reused)."""

    block_hash: bytes


@dataclass(slots=True)
class AllCleared:
    """Every hash left the prefix cache at once."""


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(slots=True)
class KVEvents:
    # 1, 2, 3... per engine core.
    seq: int
    events: list[KVEvent]


def _check_block_hash(value: Any) -> bytes:
    if type(value) is not bytes:
        raise Invalid(f"expected a bin, got {type(value).__name__}")
    if len(value) != BLOCK_HASH_BYTES:
        raise Invalid(f"expected {BLOCK_HASH_BYTES} bytes, got {len(value)}")
    return value


BLOCK_HASH = Codec(_check_block_hash, _check_block_hash)

_EVENTS: dict[type, tuple[str, Record]] = {
    BlockStored: (
        "block_stored",
        Record(BlockStored, (("block_hash", BLOCK_HASH), ("parent_hash", optional(BLOCK_HASH)))),
    ),
    BlockRemoved: ("block_removed", Record(BlockRemoved, (("block_hash", BLOCK_HASH),))),
    AllCleared: ("all_cleared", Record(AllCleared, ())),
}
_EVENTS_BY_TAG = {tag: record for tag, record in _EVENTS.values()}


def _encode_event(event: Any) -> dict[str, Any]:
    entry = _EVENTS.get(type(event))
    if entry is None:
        raise Invalid(f"not a KV event: {type(event).__name__}")
    tag, record = entry
    return {"type": tag, **record.encode(event)}


def _decode_event(value: Any) -> KVEvent:
    if type(value) is not dict:
        raise Invalid(f"expected a map, got {type(value).__name__}")
    tag = value.get("type")
    record = _EVENTS_BY_TAG.get(tag) if type(tag) is str else None
    if record is None:
        raise Invalid(f"unknown event type {tag!r}")
    return record.decode({key: item for key, item in value.items() if key != "type"})


_MESSAGES = MessageSet(
    PROTOCOL_VERSION,
    {
        KVEvents: (
            "kv_events",
            Record(KVEvents, (("seq", INT), ("events", list_of(Codec(_encode_event, _decode_event))))),
        )
    },
)


def encode(message: KVEvents) -> bytes:
    """The canonical msgpack bytes of `message`; ProtocolError if it breaks the seam's types."""
    return _MESSAGES.encode(message)


def decode(data: bytes) -> KVEvents:
    """The message in `data`; ProtocolError (or a subclass) for anything that is not one."""
    message = _MESSAGES.decode(data)
    if message.seq < 1:
        raise ProtocolError(f"malformed kv_events: seq {message.seq} is not positive")
    return message
