"""Which KV blocks each request holds, and the prefix cache lookups that let requests share them.

Under a sliding window that every layer shares (sluice/sliding_windows.py), a running request releases the
blocks that no query of its can see any more, as vLLM's sliding-window manager does: a query at position p
sees keys p - window + 1 .. p, and the request's next query is at its computed length at least. A released
block stays in the request's table as RELEASED_BLOCK_ID (the attention kernels start at the window and never
read it); it goes back to the pool as any freed block does, its cached hash kept until it is evicted.
"""

from __future__ import annotations

from engine.block_pool import BlockHash, BlockPool, KVCacheBlock, cache_salt_root, hash_block_tokens
from engine.request import Request

# What a released block's place in a request's table holds (the workers' block tables too).
RELEASED_BLOCK_ID = -1


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool, sliding_window: int = 0
    ) -> None:
        assert block_size > 0 and sliding_window >= 0
        self.block_size = block_size
        self.enable_caching = enable_caching
        # uniform_window's: 0 where some layer sees the whole context, and no block is ever released early.
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # A request's blocks in order; None where a block was released (out of every query's window).
        self.req_to_blocks: dict[str, list[KVCacheBlock | None]] = {}
        # How many leading blocks of each request were released.
        self.num_released_blocks: dict[str, int] = {}
        # How many leading blocks of each request went through cache_full_blocks already.
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

    def get_block_ids(self, request_id: str) -> list[int]:
        return [
            RELEASED_BLOCK_ID if block is None else block.block_id
            for block in self.req_to_blocks.get(request_id, ())
        ]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and how many tokens it covers."""
        # Prompt logprobs and mean pooling come from computing the prompt: a cached prefix would skip its positions.
        if not self.enable_caching or request.computes_whole_prompt:
            return [], 0
        assert request.num_computed_tokens == 0 and request.request_id not in self.req_to_blocks
        # The last token is always recomputed: its logits are what the next token is sampled from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_hashes = self._block_hashes(request, max_blocks)
        computed = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Give the request room for num_new_tokens more tokens after its computed ones.

        new_computed_blocks (from get_computed_blocks, for a request's first allocation) are
        shared, not copied. Returns the ids of the newly allocated blocks, or None when the pool
        cannot hold them: running out is an ordinary branch, the scheduler then preempts.
        """
        assert num_new_tokens > 0
        request_id = request.request_id
        computed = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request_id, [])
        assert not computed or (not blocks and request.num_computed_tokens == 0)
        num_tokens_after = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_required = -(-num_tokens_after // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(computed))
        # A cached block nobody holds sits in the free queue; sharing it takes it out of the free count.
        num_evictable_computed = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_computed:
            return None

        if request_id not in self.req_to_blocks:
            self.req_to_blocks[request_id] = blocks
        if computed:
            # Touch before allocating, or get_new_blocks could evict a block we are about to share.
            self.block_pool.touch(computed)
            blocks.extend(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        blocks.extend(new_blocks)

        if new_computed_blocks is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_tokens_after)
        if self.sliding_window:
            self._release_out_of_window(request_id, blocks, num_tokens_after - num_new_tokens)
        return [block.block_id for block in new_blocks]

    def _release_out_of_window(
        self, request_id: str, blocks: list[KVCacheBlock | None], computed: int
    ) -> None:
        """Frees the leading blocks whose every key lies before the window of a query at `computed`."""
        first_visible = computed - self.sliding_window + 1
        start = self.num_released_blocks.get(request_id, 0)
        end = max(start, first_visible // self.block_size)
        if end == start:
            return
        released = blocks[start:end]
        blocks[start:end] = [None] * (end - start)
        self.num_released_blocks[request_id] = end
        # Oldest first to the free queue's tail, so the newest of them are evicted last.
        self.block_pool.free_blocks(block for block in released if block is not None)

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock | None], num_tokens_after: int
    ) -> None:
        # Cached now, before the step runs: every layer writes the step's KV before attention reads
        # it, so a request admitted later in this same step may already share these blocks.
        # Only tokens whose ids are known can be hashed.
        num_full = min(num_tokens_after, request.num_tokens) // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        block_hashes = self._block_hashes(request, num_full)
        self.block_pool.cache_full_blocks(blocks, block_hashes, start, num_full)
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

    def free(self, request: Request) -> None:
        """Release every block the request holds; its tail blocks become the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_released_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(block for block in reversed(blocks) if block is not None)

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
