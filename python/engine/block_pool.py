"""The one pool of KV blocks: a free queue in eviction order and a map of cached full blocks.

Every block id in [0, num_blocks) is usable; no block is reserved as a null block. A worker that
pads a batch must point the padding at a slot of its own, never at block 0.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

from sluice.kv_events_seam import AllCleared, BlockRemoved, BlockStored, KVEvent

BlockHash = bytes
HASH_BYTES = hashlib.sha256().digest_size


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: it names the block's tokens and every token before them."""
    # sha256 rather than Python's tuple hash: a collision would silently serve another prompt's KV,
    # and the 64-bit tuple hash of ints can be inverted to craft one; one digest per block is cheap.
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def cache_salt_root(cache_salt: str | None) -> BlockHash | None:
    """What a request's first block hash chains from: nothing, or its cache_salt (vLLM's), so that
    requests with different salts never share cached blocks.

    It cannot equal a block hash: those digest int64 token ids, and the 8 bytes "cache_sa" read as
    an int64 are far beyond any vocabulary."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"cache_salt:" + cache_salt.encode()).digest()


def group_cache_key(block_hash: BlockHash, group: int) -> BlockHash:
    """What the prefix cache files a block of `group` (sluice/kv_cache_groups.py) under: group 0's blocks
    under their hash, which the routers' KV events name; another group's under the hash and the group,
    which no block hash equals (a hash is HASH_BYTES long)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def is_group_zero_key(key: BlockHash) -> bool:
    return len(key) == HASH_BYTES


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is full and registered in the prefix cache; kept after it is freed.
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """A doubly linked list of free blocks: the head is evicted first.

    A prefix-cache hit on a freed block takes it out of the middle, which a Python list
    cannot do in O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        # Sentinels spare every operation the empty-list and end-of-list branches.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already in the free queue"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def contains(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (next to be evicted) to tail; O(n), for tests and debugging."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Cached blocks whose hash was dropped to reuse them.
        self.num_evictions = 0
        # Where the prefix cache's changes go for the routers (the KV events publisher's pending
        # list); None when nobody subscribes, so that no event is ever built.
        self.kv_events: list[KVEvent] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue, evicting whatever they cached."""
        assert num_blocks <= self.num_free_blocks, f"asked for {num_blocks}, {self.num_free_blocks} free"
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"{block} was in the free queue"
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.kv_events is not None and is_group_zero_key(block.block_hash):
                self.kv_events.append(BlockRemoved(block.block_hash))
        block.block_hash = None
        self.num_evictions += 1

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(group_cache_key(block_hash, group))

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock | None],
        block_hashes: Sequence[BlockHash],
        start: int,
        end: int,
        group: int = 0,
    ) -> None:
        """Register blocks[start:end] of one group's table, full of the tokens block_hashes[start:end] name.
        A block is cached when it fills, before it can leave a window: a None among them is a window's
        block before a prefix-cache hit, which the request never held."""
        if not self.enable_caching:
            return
        assert end <= len(blocks) and end <= len(block_hashes)
        for i in range(start, end):
            block = blocks[i]
            if block is None:
                continue
            block_hash = group_cache_key(block_hashes[i], group)
            if block.block_hash is not None:
                # A prefix-cache hit: the block is registered already.
                assert block.block_hash == block_hash
                continue
            # Two requests computed the same block at once: the first stays the cached copy.
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if self.kv_events is not None and group == 0:
                self.kv_events.append(BlockStored(block_hash, block_hashes[i - 1] if i else None))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block, pulling a free cached block back out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a holder from each block; blocks nobody holds join the free queue's tail in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than it was held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their KV but are no longer shared."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllCleared())
