"""The free queue's linked-list semantics and the block pool's ref counts, caching and eviction."""

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue.blocks()) == [0, 1, 3, 4]
    assert len(queue) == 4 and not queue.contains(blocks[2])
    queue.append(blocks[2])
    assert ids(queue.blocks()) == [0, 1, 3, 4, 2]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[4])
    queue.remove(blocks[2])
    assert ids(queue.blocks()) == [1, 3]
    assert [queue.popleft().block_id, queue.popleft().block_id] == [1, 3]
    assert len(queue) == 0
    with pytest.raises(AssertionError):
        queue.popleft()


def test_free_queue_rejects_double_insert_and_foreign_removal():
    blocks = [KVCacheBlock(i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(AssertionError):
        queue.append(blocks[0])
    queue.remove(blocks[0])
    with pytest.raises(AssertionError):
        queue.remove(blocks[0])


def test_touch_and_free_count_holders():
    pool = BlockPool(4, enable_caching=True)
    [block] = pool.get_new_blocks(1)
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    block_hash = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks(blocks, [block_hash], 0, 1)
    pool.free_blocks(blocks)
    assert pool.get_cached_block(block_hash) is blocks[0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and ids(pool.free_block_queue.blocks()) == [1, 2]
    assert pool.usage == pytest.approx(1 / 3)


def test_reusing_a_free_cached_block_evicts_its_hash():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [7]), hash_block_tokens(None, [8])]
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(blocks)
    # A freed block keeps its hash until it is evicted.
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    [reused] = pool.get_new_blocks(1)
    assert reused is blocks[0] and reused.block_hash is None
    assert pool.get_cached_block(hashes[0]) is None
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.num_evictions == 1


def test_duplicate_hash_keeps_the_first_cached_copy():
    pool = BlockPool(2, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [3, 3])
    pool.cache_full_blocks([first], [block_hash], 0, 1)
    pool.cache_full_blocks([second], [block_hash], 0, 1)
    assert pool.get_cached_block(block_hash) is first and second.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(None, [1])], 0, 1)
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block


def test_block_hash_chains_on_the_parent():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, [3, 4])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
