"""The block-pool audit: clean on honest pools, and naming each kind of corruption planted in one."""

from __future__ import annotations

import pytest

from engine.block_pool_audit import MAX_PROBLEMS_REPORTED, audit_block_pool
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from sluice.frontend_seam import UtilityResult, decode, encode
from sluice.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


def admit(manager: KVCacheManager, request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, list(tokens), SamplingParams())
    computed, num_computed = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_computed, computed) is not None
    request.num_computed_tokens = request.num_tokens
    return request


@pytest.fixture
def shared_pool() -> tuple[KVCacheManager, list[Request]]:
    """Two live requests sharing two cached prefix blocks, and one finished and freed."""
    manager = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK, enable_caching=True)
    a = admit(manager, "a", list(range(10)))
    b = admit(manager, "b", [*range(8), 50, 51, 52])
    done = admit(manager, "done", [90, 91, 92, 93, 94])
    manager.free(done)
    return manager, [a, b]


def problems(manager: KVCacheManager, live: list[str]) -> str:
    return "; ".join(audit_block_pool(manager, live).problems)


def test_a_shared_pool_with_live_requests_is_consistent(shared_pool):
    manager, _ = shared_pool
    audit = audit_block_pool(manager, ["a", "b"])
    assert audit.problems == []
    # a: 3 blocks, b: 2 shared + 1 of its own.
    assert (audit.num_held_blocks, audit.num_free_blocks) == (4, NUM_BLOCKS - 4)
    assert audit.num_holding_requests == 2 and audit.num_live_requests == 2
    # a's two full blocks, b's none of its own (its third is partial), done's one full block.
    assert audit.num_cached_blocks == 3


def test_a_drained_pool_is_all_free(shared_pool):
    manager, requests = shared_pool
    for request in requests:
        manager.free(request)
    audit = audit_block_pool(manager, [])
    assert audit.consistent and audit.num_free_blocks == NUM_BLOCKS and audit.num_held_blocks == 0


def test_blocks_of_a_request_the_scheduler_forgot_are_a_leak(shared_pool):
    manager, _ = shared_pool
    assert "finished request 'b' still holds 3 blocks" in problems(manager, ["a"])


def test_a_ref_count_that_disagrees_with_the_holders(shared_pool):
    manager, _ = shared_pool
    manager.req_to_blocks["a"][0][0].ref_cnt += 1
    block_id = manager.req_to_blocks["a"][0][0].block_id
    assert f"block {block_id} has ref_cnt 3 but 2 requests hold it" in problems(manager, ["a", "b"])


def test_a_block_held_by_nobody_and_off_the_free_list_is_leaked(shared_pool):
    manager, _ = shared_pool
    # What a free() that forgot the pool would leave: the request gone, its blocks still counted.
    (blocks,) = manager.req_to_blocks.pop("a")
    for block in blocks:
        block.ref_cnt -= 1
    report = problems(manager, ["b"])
    assert f"block {blocks[2].block_id} is held by nobody and not on the free list (leaked)" in report


def test_a_duplicate_on_the_free_list(shared_pool):
    manager, _ = shared_pool
    queue = manager.block_pool.free_block_queue
    first, last = queue.blocks()[0], queue.blocks()[-1]
    # The tail's next link points back at the head's first block: a loop, each block met twice.
    last.next_free = first
    report = problems(manager, ["a", "b"])
    assert f"block {first.block_id} is on the free list twice" in report


def test_a_held_block_on_the_free_list(shared_pool):
    manager, _ = shared_pool
    held = manager.req_to_blocks["b"][0][2]
    manager.block_pool.free_block_queue.append(held)
    report = problems(manager, ["a", "b"])
    assert f"block {held.block_id} is on the free list with ref_cnt 1" in report
    assert f"block {held.block_id} is held and on the free list" in report


def test_a_free_count_that_disagrees_with_the_list(shared_pool):
    manager, _ = shared_pool
    manager.block_pool.free_block_queue.num_free_blocks += 1
    expected = f"the free count says {NUM_BLOCKS - 3}, the free list holds {NUM_BLOCKS - 4}"
    assert expected in problems(manager, ["a", "b"])


def test_a_cached_block_map_that_lost_or_misnamed_a_block(shared_pool):
    manager, _ = shared_pool
    pool = manager.block_pool
    block_hash, block = next(iter(pool.cached_block_hash_to_block.items()))
    del pool.cached_block_hash_to_block[block_hash]
    pool.cached_block_hash_to_block[b"other"] = block
    report = problems(manager, ["a", "b"])
    assert f"block {block.block_id} has a hash the cached-block map does not map to it" in report
    assert f"the cached-block map names block {block.block_id} under another hash" in report


def test_the_wire_form_is_a_scalar_map_that_round_trips_and_caps_its_problems(shared_pool):
    manager, _ = shared_pool
    for block in manager.block_pool.blocks:
        block.ref_cnt += 5
    audit = audit_block_pool(manager, ["a", "b"])
    assert len(audit.problems) > MAX_PROBLEMS_REPORTED
    wire = audit.to_wire()
    assert wire["consistent"] is False and wire["num_problems"] == len(audit.problems)
    assert wire["problems"].count(";") == MAX_PROBLEMS_REPORTED - 1
    assert decode(encode(UtilityResult(7, wire, None))) == UtilityResult(7, wire, None)
