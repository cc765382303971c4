"""Physical KV blocks of one pool (the device pool or the host swap pool): ref counts, the free
queue, and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice


class OutOfBlocks(RuntimeError):
    """Raised by ``allocate`` when no block is free; callers check ``num_free`` first."""


class BlockPool:
    """Owns ``num_blocks`` block ids and who holds them.

    Invariants:
      * a block's ref count is the number of block tables holding it, never negative;
      * a block is in ``_free`` exactly when its ref count is 0;
      * ``num_shared`` counts blocks whose ref count is above 1;
      * ``_free`` is in eviction order: blocks freed earlier are reused first (LRU), so a cached
        block keeps its contents until the pool truly needs it;
      * a block with a hash is findable through ``lookup`` until it is reallocated or its last
        holder is about to write into it again (``forget_hash``), at which point its hash is
        dropped. Only full blocks get hashes, and a hashed block is never written again, so
        sharing it needs no copy.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_shared = 0
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # (block, hash) of each hashed block ``allocate`` handed out again, while a lower
        # tier wants to keep its contents (``offload``); None: not recorded.
        self.evictions: list[tuple[int, bytes]] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def allocate(self) -> int:
        """Take the least recently freed block; its old hash (if any) is forgotten."""
        if not self._free:
            raise OutOfBlocks("KV cache pool is exhausted")
        block, _ = self._free.popitem(last=False)
        if self.evictions is not None and block in self._hash_of:
            self.evictions.append((block, self._hash_of[block]))
        self.forget_hash(block)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """Add a holder; a cached block sitting in the free queue comes back into use."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        elif self.ref_counts[block] == 1:
            self.num_shared += 1
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        count = self.ref_counts[block]
        if count <= 0:
            raise RuntimeError(f"block {block} released more times than it was held")
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None
        elif count == 2:
            self.num_shared -= 1

    def register_hash(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by ``lookup``; the first block with a hash wins."""
        if not self.enable_caching or block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def forget_hash(self, block: int) -> None:
        """Stop ``lookup`` from finding ``block``, whose contents are about to change."""
        old = self._hash_of.pop(block, None)
        if old is not None:
            del self._block_of[old]

    def next_evicted(self, n: int) -> list[tuple[int, bytes]]:
        """(block, hash) of the hashed blocks among the next ``n`` that ``allocate`` hands
        out, in that order."""
        return [(b, self._hash_of[b]) for b in islice(self._free, n) if b in self._hash_of]

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def reset_prefix_cache(self) -> None:
        self._hash_of.clear()
        self._block_of.clear()
