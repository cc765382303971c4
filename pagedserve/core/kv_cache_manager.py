"""Maps each request's logical KV blocks to physical blocks of the pool.

A request's block table grows as its tokens are scheduled: ``allocate_slots`` reserves room for
the next ``k`` tokens before the step that computes them, and ``free`` returns every block the
moment the request finishes, is aborted or is preempted. Full blocks are hashed as soon as
their tokens are scheduled, so later requests with the same prefix reuse them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_hash import BlockHash, hash_full_blocks
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.request import Request


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading blocks of ``request`` already in the cache. At least one token is always
        left to compute, since the step must produce logits for the next token."""
        if not self.enable_caching:
            return []
        blocks = []
        for block_hash in hash_full_blocks(request.all_token_ids[:-1], self.block_size):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] = (),
        reserve_blocks: int = 0,
    ) -> bool:
        """Reserve room for ``num_new_tokens`` after the request's computed (and newly cached)
        tokens. Returns False, changing nothing, if that would leave fewer than
        ``reserve_blocks`` free."""
        table = self.tables.setdefault(request.request_id, [])
        num_tokens = (request.num_computed_tokens + len(cached_blocks) * self.block_size
                      + num_new_tokens)
        new_blocks = self.blocks_for(num_tokens) - len(table) - len(cached_blocks)
        # Cached blocks with no holder sit in the free queue: taking them costs free blocks too.
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if new_blocks + revived + reserve_blocks > self.pool.num_free:
            if not table:
                del self.tables[request.request_id]
            return False
        for block in cached_blocks:
            self.pool.share(block)
            table.append(block)
        for _ in range(new_blocks):
            table.append(self.pool.allocate())
        self._hash_full_blocks(request, table, num_tokens)
        return True

    def _hash_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = num_tokens // self.block_size
        if num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else None
        known = request.all_token_ids[:num_full * self.block_size]
        for i, block_hash in enumerate(
            hash_full_blocks(known, self.block_size, len(hashes), parent), start=len(hashes)
        ):
            hashes.append(block_hash)
            self.pool.register_hash(table[i], block_hash)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queried_tokens += num_prompt_tokens
        self.prefix_stats.hit_tokens += num_hit_tokens

    def free(self, request_id: str) -> None:
        """Return a request's blocks. Tail blocks are released first so they are evicted
        before the prefix blocks other requests are likelier to share."""
        for block in reversed(self.tables.pop(request_id, [])):
            self.pool.release(block)
        self._hashes.pop(request_id, None)

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks
