"""The engine core -> router seam at work: the block pool's events, a real engine publishing over a real
ZeroMQ PUB socket whose events rebuild its cache exactly, and a served model's /sluice/kv_cache.
tests/golden/test_kv_events_seam.py checks the messages themselves against the golden vectors."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engine.block_pool import BlockPool, hash_block_tokens
from engine.llm import LLM
from serve_fixtures import free_port, running_server
from sluice.errors import InvalidConfigError
from sluice.kv_events_seam import AllCleared, BlockRemoved, BlockStored, KVEvents, decode
from sluice.sampling_params import SamplingParams
from tiny_models import VOCAB_SIZE, tiny_model_dir


def _hashes(count: int) -> list[bytes]:
    out, parent = [], None
    for i in range(count):
        parent = hash_block_tokens(parent, [i] * 4)
        out.append(parent)
    return out


def test_the_block_pool_reports_stores_with_parents_evictions_and_resets() -> None:
    pool = BlockPool(3, enable_caching=True)
    events: list = []
    pool.kv_events = events
    hashes = _hashes(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.cache_full_blocks(blocks, hashes, 2, 3)
    assert events == [
        BlockStored(hashes[0], None),
        BlockStored(hashes[1], hashes[0]),
        BlockStored(hashes[2], hashes[1]),
    ]
    events.clear()
    # Freed blocks keep their hashes: nothing is removed until a block is taken for reuse.
    pool.free_blocks(reversed(blocks))
    assert events == []
    pool.get_new_blocks(1)
    assert events == [BlockRemoved(hashes[2])]
    events.clear()
    pool.reset_prefix_cache()
    assert events == [AllCleared()]


def test_a_duplicate_block_is_not_reported_twice() -> None:
    pool = BlockPool(2, enable_caching=True)
    pool.kv_events = []
    (h,) = _hashes(1)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [h], 0, 1)
    pool.cache_full_blocks([second], [h], 0, 1)
    assert pool.kv_events == [BlockStored(h, None)]
    # The duplicate was never cached, so reusing it removes nothing.
    pool.free_blocks([second, first])
    pool.get_new_blocks(1)
    assert pool.kv_events == [BlockStored(h, None)]


class Subscriber:
    """The router's half, as simply as it can be: SUB to everything, fold events into a set."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.linger = 0
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.hashes: set[str] = set()
        self.seqs: list[int] = []
        self.num_removed = 0

    def drain(self, timeout_s: float = 0.5) -> None:
        while self.socket.poll(int(timeout_s * 1000)):
            self.apply(decode(self.socket.recv()))

    def apply(self, message: KVEvents) -> None:
        self.seqs.append(message.seq)
        for event in message.events:
            if isinstance(event, BlockStored):
                assert event.parent_hash is None or event.parent_hash.hex() in self.hashes, "orphan block"
                self.hashes.add(event.block_hash.hex())
            elif isinstance(event, BlockRemoved):
                assert event.block_hash.hex() in self.hashes, "removed a hash never stored"
                self.hashes.remove(event.block_hash.hex())
                self.num_removed += 1
            else:
                self.hashes.clear()

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@pytest.fixture
def subscriber_port() -> Iterator[int]:
    yield free_port()


def test_a_real_engine_publishes_events_that_rebuild_its_cache_exactly(subscriber_port: int) -> None:
    llm = LLM(
        model=str(tiny_model_dir("llama")),
        dtype="float32",
        executor="inproc",
        num_kv_blocks=24,
        max_num_seqs=4,
        kv_events_port=subscriber_port,
    )
    subscriber = Subscriber(subscriber_port)
    try:
        # A subscription reaches the PUB socket a moment after connect; the router handles that with
        # a snapshot, this test by waiting, so that it can insist on seq 1, 2, 3... with no gap.
        time.sleep(0.5)
        assert llm.engine.kv_cache() == {
            "seq": 0,
            "block_size": 16,
            "kv_events_port": subscriber_port,
            "block_hashes": [],
        }
        params = SamplingParams(max_tokens=3, temperature=0.0)
        # 8 prefixes of 3 blocks, each asked for twice with different tails, through a 24-block pool.
        for round_ in range(3):
            prompts = [
                {"prompt_token_ids": [(p * 37 + i) % VOCAB_SIZE for i in range(48)] + [round_, p, 5, 9, 11]}
                for p in range(8)
            ]
            llm.generate(prompts, params)
            snapshot = llm.engine.kv_cache()
            subscriber.drain()
            assert subscriber.seqs == list(range(1, len(subscriber.seqs) + 1)), "seq must count 1, 2, 3..."
            assert snapshot["seq"] == subscriber.seqs[-1]
            assert sorted(subscriber.hashes) == snapshot["block_hashes"]
        assert subscriber.num_removed > 0, "the run must evict, or removal is not tested"
        assert llm.engine.scheduler.kv_cache_manager.block_pool.num_evictions > 0
    finally:
        subscriber.close()
        llm.engine.shutdown()


def test_without_a_port_no_event_is_built_and_the_snapshot_still_lists_the_cache() -> None:
    llm = LLM(model=str(tiny_model_dir("llama")), dtype="float32", executor="inproc", num_kv_blocks=24)
    try:
        assert llm.engine.kv_events is None
        assert llm.engine.scheduler.kv_cache_manager.block_pool.kv_events is None
        tokens = [(i * 5) % VOCAB_SIZE for i in range(40)]
        llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=2, temperature=0.0))
        expected = [hash_block_tokens(None, tokens[:16])]
        expected.append(hash_block_tokens(expected[0], tokens[16:32]))
        snapshot = llm.engine.kv_cache()
        assert snapshot["seq"] == 0 and snapshot["kv_events_port"] is None
        assert set(snapshot["block_hashes"]) >= {h.hex() for h in expected}
    finally:
        llm.engine.shutdown()


def test_kv_events_need_prefix_caching() -> None:
    with pytest.raises(InvalidConfigError, match="prefix"):
        LLM(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            executor="inproc",
            enable_prefix_caching=False,
            kv_events_port=free_port(),
        )


def _listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses on which some socket listens on TCP `port`, read from the kernel's table."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, local_port = local.split(":")
        if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
            addresses.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return addresses


@pytest.mark.parametrize(("host", "expected"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_the_events_socket_binds_loopback_unless_widened(host: str | None, expected: str) -> None:
    port = free_port()
    widened = {} if host is None else {"kv_events_host": host}
    llm = LLM(
        model=str(tiny_model_dir("llama")), dtype="float32", executor="inproc", kv_events_port=port, **widened
    )
    try:
        assert _listening_addresses(port) == {expected}
    finally:
        llm.engine.shutdown()


def test_a_host_that_cannot_be_bound_is_a_clear_error() -> None:
    with pytest.raises(InvalidConfigError, match="--kv-events-host 192.0.2.1 --kv-events-port"):
        LLM(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            executor="inproc",
            kv_events_port=free_port(),
            kv_events_host="192.0.2.1",
        )


def test_a_port_in_use_is_a_clear_error() -> None:
    with zmq.Context() as context, context.socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://0.0.0.0")
        with pytest.raises(InvalidConfigError, match=f"--kv-events-port {port}"):
            LLM(model=str(tiny_model_dir("llama")), dtype="float32", executor="inproc", kv_events_port=port)


def test_served_kv_cache_endpoint_matches_the_published_events(tmp_path, default_model_path) -> None:
    events_port = free_port()
    args = ["--max-model-len", "512", "--kv-cache-memory", "0.25", "--kv-events-port", str(events_port)]
    with running_server(args, tmp_path / "serve.log") as server:
        subscriber = Subscriber(events_port)
        try:
            time.sleep(0.5)
            prompt = "The quick brown fox jumps over the lazy dog. " * 8
            tokens = server.request("POST", "/tokenize", {"prompt": prompt}).body["tokens"]
            assert len(tokens) >= 32
            done = server.request(
                "POST",
                "/v1/completions",
                {"model": default_model_path.name, "prompt": prompt, "max_tokens": 2, "temperature": 0.0},
            )
            assert done.status == 200, done
            snapshot = server.request("GET", "/sluice/kv_cache", api_key=None)
            assert snapshot.status == 200, snapshot
            body = snapshot.body
            assert list(body) == ["seq", "block_size", "kv_events_port", "block_hashes"]
            assert body["block_size"] == 16 and body["kv_events_port"] == events_port and body["seq"] >= 1
            parent, prompt_hashes = None, []
            for start in range(0, len(tokens) - 16 + 1, 16):
                parent = hash_block_tokens(parent, tokens[start : start + 16])
                prompt_hashes.append(parent.hex())
            assert set(prompt_hashes) <= set(body["block_hashes"])
            subscriber.drain()
            assert subscriber.seqs[-1] == body["seq"]
            assert sorted(subscriber.hashes) == body["block_hashes"]
        finally:
            subscriber.close()
