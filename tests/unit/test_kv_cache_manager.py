"""Prefix-cache lookups, shared blocks' ref counts and the order in which freed blocks are evicted."""

from engine.kv_cache_manager import RELEASED_BLOCK_ID, KVCacheManager
from engine.request import Request
from sluice.sampling_params import SamplingParams

BLOCK = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams())


def admit(manager: KVCacheManager, request: Request) -> list[list[int]]:
    """Look up the prefix cache, allocate the rest of the prompt, advance as the scheduler would."""
    computed, num_computed = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_computed, computed)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    return new_ids


def test_shared_prefix_is_served_from_cache_and_ref_counted():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK, enable_caching=True)
    first = make_request("a", list(range(10)))
    second = make_request("b", list(range(8)) + [50, 51, 52])
    admit(manager, first)
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 8
    assert [block.block_id for block in computed[0]] == manager.get_block_ids("a")[0][:2]
    admit(manager, second)
    shared = manager.req_to_blocks["a"][0][:2]
    assert all(block.ref_cnt == 2 for block in shared)
    assert manager.get_block_ids("b")[0][:2] == manager.get_block_ids("a")[0][:2]
    assert manager.prefix_cache_hits == 8 and manager.prefix_cache_queries == 10 + 11
    manager.free(first)
    assert all(block.ref_cnt == 1 for block in shared)
    manager.free(second)
    assert manager.num_free_blocks == 10


def test_cache_salt_shares_blocks_only_between_requests_of_the_same_salt():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK, enable_caching=True)
    tokens = list(range(9))
    admit(manager, make_request("plain", tokens))
    salted = Request("a1", list(tokens), SamplingParams(), cache_salt="tenant-a")
    # Neither the unsalted blocks nor, later, another salt's are hits.
    assert manager.get_computed_blocks(salted)[1] == 0
    admit(manager, salted)
    other = Request("b1", list(tokens), SamplingParams(), cache_salt="tenant-b")
    assert manager.get_computed_blocks(other)[1] == 0
    same = Request("a2", list(tokens), SamplingParams(), cache_salt="tenant-a")
    computed, num_computed = manager.get_computed_blocks(same)
    assert num_computed == 8
    assert [block.block_id for block in computed[0]] == manager.get_block_ids("a1")[0][:2]
    assert manager.get_computed_blocks(make_request("plain2", tokens))[1] == 8
    # Every later block chains from the salted first one.
    assert salted.block_hashes[1] != manager.req_to_blocks["plain"][0][1].block_hash


def test_lookup_never_covers_the_whole_prompt():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK, enable_caching=True)
    admit(manager, make_request("a", list(range(8))))
    # The same 8 tokens: two full cached blocks, but the last token must be recomputed.
    computed, num_computed = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_computed == 4 and len(computed[0]) == 1


def test_freed_cached_blocks_are_hit_after_the_owner_finished():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_caching=True)
    first = make_request("a", list(range(9)))
    admit(manager, first)
    manager.free(first)
    assert manager.num_free_blocks == 6
    second = make_request("b", list(range(9)))
    _, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 8
    admit(manager, second)
    assert manager.num_free_blocks == 3


def test_free_evicts_a_request_tail_first():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_caching=True)
    request = make_request("a", list(range(12)))
    admit(manager, request)
    (block_ids,) = manager.get_block_ids("a")
    manager.free(request)
    free_order = [block.block_id for block in manager.block_pool.free_block_queue.blocks()]
    assert free_order == block_ids[::-1]
    # Reusing one block evicts the tail: the prefix is still a hit.
    other = make_request("x", [99] * 4)
    admit(manager, other)
    _, num_computed = manager.get_computed_blocks(make_request("c", list(range(12))))
    assert num_computed == 8


def test_allocate_returns_none_when_the_pool_is_short_and_changes_nothing():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK, enable_caching=True)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.num_free_blocks == 2 and manager.get_block_ids("a") == [[]]
    assert manager.allocate_slots(request, 8) is not None
    assert manager.num_free_blocks == 0


def test_evictable_cache_hits_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_caching=True)
    first = make_request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)
    # A hit on a free cached block uses that block up: 1 hit + 2 new blocks > 3 free - 1 hit.
    second = make_request("b", list(range(4)) + [70] * 9)
    computed, num_computed = manager.get_computed_blocks(second)
    assert num_computed == 4
    assert manager.allocate_slots(second, 9, computed) is None
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert manager.allocate_slots(second, 8, computed) is not None


def test_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK, enable_caching=False)
    admit(manager, make_request("a", list(range(9))))
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([[]], 0)
    assert manager.prefix_cache_queries == 0


def test_decode_allocates_a_block_only_when_the_last_one_fills():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    request = make_request("a", list(range(3)))
    admit(manager, request)
    request.append_output_token(5)
    assert manager.allocate_slots(request, 1) == [[]]
    request.num_computed_tokens += 1
    request.append_output_token(6)
    new_ids = manager.allocate_slots(request, 1)
    assert new_ids is not None and len(new_ids[0]) == 1
    # The first block filled with prompt + output tokens and is now cached.
    assert manager.req_to_blocks["a"][0][0].block_hash == request.block_hashes[0]


def decode(manager: KVCacheManager, request: Request, token: int) -> list[list[int]] | None:
    """One decode step as the scheduler runs it: room for the new token, then the token counted computed."""
    request.append_output_token(token)
    new_ids = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    return new_ids


def test_a_window_every_layer_shares_releases_the_blocks_no_query_can_see():
    # Window 6: a query at position p sees p - 5 .. p; blocks of 4 tokens.
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True, group_windows=[6])
    request = make_request("a", list(range(11)))
    admit(manager, request)
    # The next query is at 11 and sees 6 .. 11: block 0 (tokens 0-3) is out of every window.
    assert decode(manager, request, 100) == [[]]
    (ids,) = manager.get_block_ids("a")
    assert ids[0] == RELEASED_BLOCK_ID and all(i >= 0 for i in ids[1:])
    assert manager.num_free_blocks == 2
    # Thirty more tokens in a pool of 4 blocks: old blocks go back as new ones are needed.
    for token in range(30):
        assert decode(manager, request, token) is not None
    held = [i for i in manager.get_block_ids("a")[0] if i != RELEASED_BLOCK_ID]
    assert len(held) <= 3
    manager.free(request)
    assert manager.num_free_blocks == 4


def test_released_blocks_stay_cached_until_evicted_and_a_full_window_model_keeps_every_block():
    windowed = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True, group_windows=[4])
    first = make_request("a", list(range(13)))
    admit(windowed, first)
    decode(windowed, first, 7)
    assert windowed.get_block_ids("a")[0][:2] == [RELEASED_BLOCK_ID] * 2
    # A released block keeps its hash in the pool: the same prompt is still a prefix-cache hit.
    computed, num_computed = windowed.get_computed_blocks(make_request("b", list(range(13))))
    # The query at 12 sees 9 .. 12: only the third block is handed over, the first two stand released.
    assert num_computed == 12 and computed[0][:2] == [None, None]
    assert computed[0][2] is windowed.block_pool.blocks[windowed.get_block_ids("a")[0][2]]
    full = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True)
    second = make_request("c", list(range(13)))
    admit(full, second)
    decode(full, second, 7)
    assert RELEASED_BLOCK_ID not in full.get_block_ids("c")[0]


def test_a_hybrid_model_holds_its_window_in_the_windowed_group_and_everything_in_the_full_one():
    # Group 0 sees the whole context, group 1 a window of 6; blocks of 4 tokens from one pool.
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK, enable_caching=True, group_windows=[0, 6])
    request = make_request("a", list(range(11)))
    assert admit(manager, request) == [[0, 1, 2], [3, 4, 5]]
    for token in range(30):
        assert decode(manager, request, token) is not None
        full, windowed = manager.get_block_ids("a")
        # 41 tokens: every block in the full group; the window and one block in the windowed one.
        assert RELEASED_BLOCK_ID not in full and len(full) == -(-request.num_tokens // BLOCK)
        held = [i for i in windowed if i != RELEASED_BLOCK_ID]
        # Six tokens can straddle two blocks' edges: ceil(6 / 4) blocks and one more.
        assert len(held) <= -(-6 // BLOCK) + 1
    assert manager.num_free_blocks == 20 - len(full) - len(held)
    manager.free(request)
    assert manager.num_free_blocks == 20


def test_a_hybrid_allocation_needs_room_in_every_group():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK, enable_caching=True, group_windows=[0, 4])
    request = make_request("a", list(range(12)))
    # Three blocks a group, six in all: more than the pool.
    assert manager.allocate_slots(request, 12) is None
    assert manager.num_free_blocks == 5 and manager.get_block_ids("a") == [[], []]
    assert manager.allocate_slots(request, 8) is not None
    assert manager.num_free_blocks == 1


def test_a_hybrid_hit_needs_the_whole_prefix_in_full_groups_and_the_window_in_windowed_ones():
    manager = KVCacheManager(num_blocks=40, block_size=BLOCK, enable_caching=True, group_windows=[0, 4])
    first = make_request("a", list(range(17)))
    admit(manager, first)
    full, windowed = (list(table) for table in manager.req_to_blocks["a"])
    decode(manager, first, 7)
    assert manager.req_to_blocks["a"][1][:3] == [None] * 3
    manager.free(first)
    # 17 tokens again: a hit of 16, whose next query (at 16) sees 13 .. 16, the windowed group's block 3.
    computed, num_computed = manager.get_computed_blocks(make_request("b", list(range(17))))
    assert num_computed == 16
    assert computed[0] == full[:4] and computed[1] == [None, None, None, windowed[3]]
    # Evict the windowed group's block 3 (the cached map forgets it): the hit falls back to where the
    # windowed group still has its window, 12 tokens, whose query sees 9 .. 12 (block 2, also released
    # and still cached).
    manager.block_pool._evict(windowed[3])
    computed, num_computed = manager.get_computed_blocks(make_request("c", list(range(17))))
    assert num_computed == 12 and computed[1] == [None, None, windowed[2]]
    # A full group's block gone ends the prefix there.
    manager.block_pool._evict(full[1])
    assert manager.get_computed_blocks(make_request("d", list(range(17))))[1] == 4


def test_a_window_keeps_what_rejected_drafts_may_still_need():
    # Window 6, and up to 3 drafts that may be rejected: a query may fall back from 11 to 8, which sees 3 .. 8.
    lagging = KVCacheManager(
        num_blocks=8, block_size=BLOCK, enable_caching=True, group_windows=[6], release_lag=3
    )
    plain = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True, group_windows=[6])
    for manager in (lagging, plain):
        request = make_request("a", list(range(11)))
        admit(manager, request)
        decode(manager, request, 100)
    assert plain.get_block_ids("a")[0][0] == RELEASED_BLOCK_ID
    assert RELEASED_BLOCK_ID not in lagging.get_block_ids("a")[0]


def test_a_hit_ends_at_the_first_block_any_full_group_lost():
    # Two full groups (more full layers than a group holds) and a windowed one.
    manager = KVCacheManager(num_blocks=40, block_size=BLOCK, enable_caching=True, group_windows=[0, 0, 4])
    first = make_request("a", list(range(17)))
    admit(manager, first)
    first_group, second_group, _ = (list(table) for table in manager.req_to_blocks["a"])
    manager.free(first)
    manager.block_pool._evict(first_group[1])
    manager.block_pool._evict(second_group[3])
    computed, num_computed = manager.get_computed_blocks(make_request("b", list(range(17))))
    assert num_computed == 4 and computed[0] == first_group[:1] and computed[1] == second_group[:1]
