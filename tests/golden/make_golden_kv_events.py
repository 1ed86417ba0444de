"""Write the engine core -> router golden vectors into tests/golden/kv_events/.

    .venv/bin/python tests/golden/make_golden_kv_events.py

One .msgpack file per `kv_events` message plus index.json (as for the other seams: each file with
its type and its decoded value as JSON, bins as hex strings), and block_hashes.json: token ids,
a block size and the chained hash of each full block, computed here with hashlib and struct alone
(not with the engine's hash_block_tokens) so that the engine and the router are both checked
against an independent computation.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import golden_vectors
from sluice.kv_events_seam import PROTOCOL_VERSION, AllCleared, BlockRemoved, BlockStored, KVEvents, encode

GOLDEN_DIR = Path(__file__).resolve().parent / "kv_events"
BLOCK_SIZE = 16

# Ids that cross every byte boundary of a little-endian int64 that a u32 id can reach (2**31 and
# 2**32 - 1 catch a sign-extending hasher), then a pseudo-random tail; 40 tokens are two full
# blocks and a partial one, which is never hashed.
HASHED_TOKEN_IDS = [
    0,
    1,
    127,
    128,
    255,
    256,
    65535,
    65536,
    49151,
    2**31 - 1,
    2**31,
    2**32 - 1,
    7,
    2,
    3,
    4,
] + [(i * 7919 + 13) % 49152 for i in range(24)]


# vLLM's cache_salt, with a character outside ASCII: hashed as UTF-8.
CACHE_SALT = "tenant-ä"


def chained_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """sha256(parent digest, then the block's ids as little-endian int64); the first block's parent
    is nothing, or sha256("cache_salt:" + the salt) with a salt."""
    root = (
        b"" if cache_salt is None else hashlib.sha256(("cache_salt:" + cache_salt).encode("utf-8")).digest()
    )
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        payload = (hashes[-1] if hashes else root) + struct.pack(f"<{len(block)}q", *block)
        hashes.append(hashlib.sha256(payload).digest())
    return hashes


_HASHES = chained_block_hashes(HASHED_TOKEN_IDS, BLOCK_SIZE)

# file stem -> message; the order here is the order of index.json.
GOLDEN_MESSAGES: dict[str, KVEvents] = {
    "kv_events": KVEvents(
        seq=1,
        events=[
            BlockStored(block_hash=_HASHES[0], parent_hash=None),
            BlockStored(block_hash=_HASHES[1], parent_hash=_HASHES[0]),
        ],
    ),
    "kv_events_removed": KVEvents(
        seq=70000,
        events=[
            BlockRemoved(block_hash=_HASHES[1]),
            BlockStored(block_hash=_HASHES[1], parent_hash=_HASHES[0]),
        ],
    ),
    "kv_events_cleared": KVEvents(
        seq=2**32, events=[AllCleared(), BlockStored(block_hash=_HASHES[0], parent_hash=None)]
    ),
}


def golden_files() -> dict[str, bytes]:
    return {stem: encode(message) for stem, message in GOLDEN_MESSAGES.items()}


def render_index(files: dict[str, bytes]) -> str:
    return golden_vectors.render_index(
        files,
        PROTOCOL_VERSION,
        "docs/protocol.md#the-engine-core--router-seam-kv-events",
        "; bins are hex strings",
    )


def render_block_hashes() -> str:
    vector = {
        "note": "sha256 over (parent hash bytes, then the block's token ids as little-endian int64); "
        "only full blocks are hashed; the first block's parent is nothing, or with cache_salt "
        "sha256(UTF-8 of 'cache_salt:' + cache_salt)",
        "block_size": BLOCK_SIZE,
        "token_ids": HASHED_TOKEN_IDS,
        "block_hashes": [block_hash.hex() for block_hash in _HASHES],
        "cache_salt": CACHE_SALT,
        "salted_block_hashes": [
            block_hash.hex() for block_hash in chained_block_hashes(HASHED_TOKEN_IDS, BLOCK_SIZE, CACHE_SALT)
        ],
    }
    return json.dumps(vector, indent=2) + "\n"


def main() -> None:
    files = golden_files()
    golden_vectors.write_vectors(GOLDEN_DIR, files, render_index(files))
    (GOLDEN_DIR / "block_hashes.json").write_text(render_block_hashes(), encoding="utf-8")
    print(f"wrote block_hashes.json to {GOLDEN_DIR}", file=sys.stderr)


if __name__ == "__main__":
    main()
