"""Which KV blocks each request holds, per group of layers, and the prefix cache lookups that let requests
share them.

A model's layers fall into groups (sluice/kv_cache_groups.py), each with one window and its own block table
per request; all of them draw from one pool. A group of sliding-window layers releases the blocks that no
query of its request can see any more, as vLLM's sliding-window manager does: a query at position p sees
keys p - window + 1 .. p, and the request's next query is at its computed length at least. A released
block stays in the request's table as RELEASED_BLOCK_ID (the attention kernels start at the window and never
read it); it goes back to the pool as any freed block does, its cached hash kept until it is evicted.

Every group advances in step: a request holds the same number of table entries in each, and its blocks
fill and are cached together. A group's cached blocks are keyed by the block hash and the group, so that
a hit hands each group its own layers' KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_pool import BlockHash, BlockPool, KVCacheBlock, cache_salt_root, hash_block_tokens
from engine.request import Request

# What a released block's place in a request's table holds (the workers' block tables too).
RELEASED_BLOCK_ID = -1

# One group's table of a request: its blocks in order, None where one was released.
GroupBlocks = list[KVCacheBlock | None]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        group_windows: Sequence[int] = (0,),
        release_lag: int = 0,
    ) -> None:
        """group_windows: each group's window (KVCacheGroups.windows), 0 where it sees the whole context.
        release_lag: how many tokens a request's computed count may still fall back by (speculative drafts
        that may be rejected): a windowed group keeps that much more behind its window."""
        assert block_size > 0 and group_windows and all(window >= 0 for window in group_windows)
        assert release_lag >= 0
        self.release_lag = release_lag
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # A request's tables, one per group.
        self.req_to_blocks: dict[str, list[GroupBlocks]] = {}
        # How many leading blocks of each request were released, per group.
        self.num_released_blocks: dict[str, list[int]] = {}
        # How many leading blocks of each request went through cache_full_blocks already (every group's).
        self.num_cached_blocks: dict[str, int] = {}
        # In tokens, as vLLM counts them: a query is a scheduled lookup, a hit a token it served.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's table in each group."""
        tables = self.req_to_blocks.get(request_id)
        if tables is None:
            return [[] for _ in self.group_windows]
        return [
            [RELEASED_BLOCK_ID if block is None else block.block_id for block in table] for table in tables
        ]

    def get_computed_blocks(self, request: Request) -> tuple[list[GroupBlocks], int]:
        """Each group's blocks of the longest cached prefix of the request's full blocks, and how many
        tokens it covers. A full-context group needs every block of the prefix; a windowed group only
        those that the first query after it sees (the others stand as None, released)."""
        no_hit: tuple[list[GroupBlocks], int] = ([[] for _ in self.group_windows], 0)
        # Prompt logprobs and mean pooling come from computing the prompt: a cached prefix would skip its positions.
        if not self.enable_caching or request.computes_whole_prompt:
            return no_hit
        assert request.num_computed_tokens == 0 and request.request_id not in self.req_to_blocks
        # The last token is always recomputed: its logits are what the next token is sampled from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_hashes = self._block_hashes(request, max_blocks)[:max_blocks]
        cached = [
            [self.block_pool.get_cached_block(block_hash, group) for block_hash in block_hashes]
            for group in range(len(self.group_windows))
        ]
        num_blocks = max_blocks
        for group, window in enumerate(self.group_windows):
            if window == 0:
                num_blocks = min(
                    num_blocks, next((i for i, b in enumerate(cached[group]) if b is None), num_blocks)
                )
        # A shorter prefix can need blocks a longer one did not: settle until every windowed group is served.
        settled = False
        while not settled and num_blocks:
            settled = True
            for group, window in enumerate(self.group_windows):
                if window == 0:
                    continue
                first = self._first_visible_block(num_blocks * self.block_size, window)
                missing = [i for i in range(first, num_blocks) if cached[group][i] is None]
                if missing:
                    num_blocks, settled = missing[-1], False
                    break
        if not num_blocks:
            return no_hit
        computed: list[GroupBlocks] = []
        for group, window in enumerate(self.group_windows):
            first = self._first_visible_block(num_blocks * self.block_size, window) if window else 0
            computed.append([None] * first + cached[group][first:num_blocks])
        return computed, num_blocks * self.block_size

    def _first_visible_block(self, position: int, window: int) -> int:
        """The first block that a query at `position` sees through `window` (0: the whole context)."""
        return max(0, position - window + 1) // self.block_size if window else 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[GroupBlocks] | None = None,
    ) -> list[list[int]] | None:
        """Give the request room in every group for num_new_tokens more tokens after its computed ones.

        new_computed_blocks (from get_computed_blocks, for a request's first allocation) are
        shared, not copied. Returns each group's newly allocated block ids, or None when the pool
        cannot hold them: running out is an ordinary branch, the scheduler then preempts.
        """
        assert num_new_tokens > 0
        request_id = request.request_id
        num_groups = len(self.group_windows)
        tables = self.req_to_blocks.get(request_id) or [[] for _ in range(num_groups)]
        computed = new_computed_blocks or [[] for _ in range(num_groups)]
        assert len(computed) == len(tables) == num_groups
        num_computed_blocks = len(computed[0])
        assert all(len(group) == num_computed_blocks for group in computed)
        assert not num_computed_blocks or (not tables[0] and request.num_computed_tokens == 0)
        if request_id in self.req_to_blocks:
            # Before counting: what this step's first query no longer sees frees room for its new blocks.
            self._release_out_of_window(request_id, tables, request.num_computed_tokens)
        num_tokens_after = (
            request.num_computed_tokens + num_computed_blocks * self.block_size + num_new_tokens
        )
        num_required = -(-num_tokens_after // self.block_size)
        num_new_blocks = max(0, num_required - len(tables[0]) - num_computed_blocks)
        # A cached block nobody holds sits in the free queue; sharing it takes it out of the free count.
        num_evictable_computed = sum(
            1 for group in computed for block in group if block is not None and block.ref_cnt == 0
        )
        if num_new_blocks * num_groups > self.block_pool.num_free_blocks - num_evictable_computed:
            return None

        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = tables
            self.num_released_blocks[request_id] = [0] * num_groups
        new_ids: list[list[int]] = []
        for table, hits in zip(tables, computed, strict=True):
            # Touch before allocating, or get_new_blocks could evict a block we are about to share.
            self.block_pool.touch(block for block in hits if block is not None)
            table.extend(hits)
        for table in tables:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
            table.extend(new_blocks)
            new_ids.append([block.block_id for block in new_blocks])

        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed_blocks * self.block_size
        if self.enable_caching:
            self._cache_full_blocks(request, tables, num_tokens_after)
        # A hit's blocks before the window were never held (None); this releases nothing else new for a
        # running request, whose release came first.
        self._release_out_of_window(request_id, tables, num_tokens_after - num_new_tokens)
        return new_ids

    def _release_out_of_window(self, request_id: str, tables: list[GroupBlocks], computed: int) -> None:
        """Frees each windowed group's leading blocks whose every key lies before the window of a query at
        `computed`."""
        released_counts = self.num_released_blocks[request_id]
        for group, window in enumerate(self.group_windows):
            if not window:
                continue
            table = tables[group]
            start = released_counts[group]
            end = min(len(table), max(start, self._first_visible_block(computed - self.release_lag, window)))
            if end == start:
                continue
            released = table[start:end]
            table[start:end] = [None] * (end - start)
            released_counts[group] = end
            # Oldest first to the free queue's tail, so the newest of them are evicted last.
            self.block_pool.free_blocks(block for block in released if block is not None)

    def _cache_full_blocks(self, request: Request, tables: list[GroupBlocks], num_tokens_after: int) -> None:
        # Cached now, before the step runs: every layer writes the step's KV before attention reads
        # it, so a request admitted later in this same step may already share these blocks.
        # Only tokens whose ids are known can be hashed.
        num_full = min(num_tokens_after, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        block_hashes = self._block_hashes(request, num_full)
        for group, table in enumerate(tables):
            self.block_pool.cache_full_blocks(table, block_hashes, start, num_full, group)
        self.num_cached_blocks[request.request_id] = num_full

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chained block hashes, extended to cover at least its first num_blocks blocks."""
        block_hashes = request.block_hashes
        assert num_blocks * self.block_size <= request.num_tokens
        if len(block_hashes) >= num_blocks:
            return block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        parent = block_hashes[-1] if block_hashes else cache_salt_root(request.cache_salt)
        for i in range(len(block_hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens[i * size : (i + 1) * size])
            block_hashes.append(parent)
        return block_hashes

    def held_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Every block the request holds, in all its groups (released ones are not held)."""
        return [
            block for table in self.req_to_blocks.get(request_id, ()) for block in table if block is not None
        ]

    def free(self, request: Request) -> None:
        """Release every block the request holds; its tail blocks become the first to be evicted."""
        tables = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_released_blocks.pop(request.request_id, None)
        # Position by position from the tail, every group's block at once: a prefix is served only where
        # each group still has its blocks, so the groups' blocks of one position are evicted together.
        self.block_pool.free_blocks(
            block
            for position in reversed(range(len(tables[0]) if tables else 0))
            for table in tables
            if (block := table[position]) is not None
        )

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
