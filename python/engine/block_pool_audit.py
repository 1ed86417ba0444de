"""A consistency audit of the KV block pool: every block free or held by a live request, nothing leaked.

Run between steps (the `block_pool_audit` utility call), it walks the whole pool once: O(blocks +
held block ids). It reads and never repairs, so a test can corrupt a pool and see the report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager

# The wire carries problems as one string; a broken pool could list thousands.
MAX_PROBLEMS_REPORTED = 20


@dataclass(slots=True)
class BlockPoolAudit:
    num_blocks: int
    num_free_blocks: int = 0
    # Distinct blocks with at least one holder.
    num_held_blocks: int = 0
    num_cached_blocks: int = 0
    num_live_requests: int = 0
    # Requests holding blocks; a finished one among them is a leak.
    num_holding_requests: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def consistent(self) -> bool:
        return not self.problems

    def to_wire(self) -> dict[str, Any]:
        """A scalar map (the utility result's shape): the counts, and the first problems joined."""
        return {
            "consistent": self.consistent,
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_held_blocks": self.num_held_blocks,
            "num_cached_blocks": self.num_cached_blocks,
            "num_live_requests": self.num_live_requests,
            "num_holding_requests": self.num_holding_requests,
            "num_problems": len(self.problems),
            "problems": "; ".join(self.problems[:MAX_PROBLEMS_REPORTED]),
        }


def _walk_free_queue(pool: BlockPool, audit: BlockPoolAudit) -> set[int]:
    """The ids on the free list, head to tail, checking links, duplicates and the free count."""
    queue = pool.free_block_queue
    seen: set[int] = set()
    previous = queue._head
    block = queue._head.next_free
    # A cycle or a duplicate would loop forever; no honest list is longer than the pool.
    for _ in range(pool.num_blocks + 1):
        if block is None:
            audit.problems.append(f"the free list breaks after block {previous.block_id}")
            break
        if block is queue._tail:
            break
        if block.prev_free is not previous:
            audit.problems.append(f"block {block.block_id}'s prev link does not point at its predecessor")
        if not 0 <= block.block_id < pool.num_blocks or pool.blocks[block.block_id] is not block:
            audit.problems.append(f"the free list holds a block not in the pool: {block!r}")
        elif block.block_id in seen:
            audit.problems.append(f"block {block.block_id} is on the free list twice")
            break
        seen.add(block.block_id)
        if block.ref_cnt != 0:
            audit.problems.append(f"block {block.block_id} is on the free list with ref_cnt {block.ref_cnt}")
        previous, block = block, block.next_free
    else:
        audit.problems.append("the free list is longer than the pool (a cycle)")
    if len(seen) != queue.num_free_blocks:
        audit.problems.append(f"the free count says {queue.num_free_blocks}, the free list holds {len(seen)}")
    return seen


def audit_block_pool(manager: KVCacheManager, live_request_ids: Collection[str]) -> BlockPoolAudit:
    """Check the pool against the requests that hold its blocks; `live_request_ids`: the scheduler's."""
    pool = manager.block_pool
    audit = BlockPoolAudit(pool.num_blocks, num_live_requests=len(live_request_ids))
    free_ids = _walk_free_queue(pool, audit)
    audit.num_free_blocks = len(free_ids)

    holders: Counter[int] = Counter()
    audit.num_holding_requests = len(manager.req_to_blocks)
    for request_id in manager.req_to_blocks:
        ids = [block.block_id for block in manager.held_blocks(request_id)]
        if request_id not in live_request_ids:
            audit.problems.append(f"finished request {request_id!r} still holds {len(ids)} blocks")
        if len(set(ids)) != len(ids):
            audit.problems.append(f"request {request_id!r} holds a block twice")
        holders.update(ids)
    for request_id in manager.num_cached_blocks.keys() - manager.req_to_blocks.keys():
        audit.problems.append(f"request {request_id!r} has a cached-block count but holds no blocks")

    for block in pool.blocks:
        expected = holders[block.block_id]
        if block.ref_cnt != expected:
            audit.problems.append(
                f"block {block.block_id} has ref_cnt {block.ref_cnt} but {expected} requests hold it"
            )
        on_free_list = block.block_id in free_ids
        if block.ref_cnt == 0 and not on_free_list:
            audit.problems.append(
                f"block {block.block_id} is held by nobody and not on the free list (leaked)"
            )
        if block.ref_cnt > 0 and on_free_list:
            audit.problems.append(f"block {block.block_id} is held and on the free list")
        if (
            block.block_hash is not None
            and pool.cached_block_hash_to_block.get(block.block_hash) is not block
        ):
            audit.problems.append(
                f"block {block.block_id} has a hash the cached-block map does not map to it"
            )
    audit.num_held_blocks = sum(1 for block in pool.blocks if block.ref_cnt > 0)

    for block_hash, block in pool.cached_block_hash_to_block.items():
        if not pool.enable_caching:
            audit.problems.append("the cached-block map is not empty with prefix caching off")
            break
        if block.block_hash != block_hash:
            audit.problems.append(f"the cached-block map names block {block.block_id} under another hash")
        if not 0 <= block.block_id < pool.num_blocks or pool.blocks[block.block_id] is not block:
            audit.problems.append(f"the cached-block map holds a block not in the pool: {block!r}")
    audit.num_cached_blocks = len(pool.cached_block_hash_to_block)
    return audit
