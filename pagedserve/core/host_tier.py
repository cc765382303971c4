"""The prefix cache's tiers below the device pool: host blocks (``HostTier``) and files on disk
(``DiskIndex``), both indexed by the device cache's block hashes (``block_hash``). Plain data:
which hash sits in which host block, in LRU order, on budgets of their own; the worker moves
the bytes (``worker/kv_cache.py``, ``worker/disk_tier.py``).

When a block reaches the host: on eviction from the device pool (write-on-eviction)
    A hashed device block whose last holder left stays findable in the device pool until the
    pool hands it out again; only then is it copied to the host (``BlockPool.evictions``), in
    the same step's ops, ahead of every write into the device pool. The alternative,
    write-through (copy each block to the host as soon as it is committed), copies every
    committed block once whether or not it is ever evicted, and churns the host tier's LRU
    with blocks the device still holds. Write-on-eviction copies exactly the blocks that
    leave the device, each once: on the multi-turn CPU bench (``pagedserve bench
    kv-offload``, ``benchmarks/results/issue29/kv_offload_cpu.json``) it copied 118 blocks
    where write-through would have copied all 324 committed ones (``offloaded_blocks``,
    ``write_through_blocks``), for the same hits. Its cost is that the copy of an evicted block
    sits in the step that reuses the block, before that step's forward pass; on GPUs it runs
    on the copy stream, and the forward pass waits only for that stream, not the device.

Who holds a host block
    The host pool is one ``BlockPool`` shared by swap and this tier: a swapped-out stream's
    table holds its blocks as before, and the tier holds one ref on each block it indexes.
    A block being copied (host to device, device to host, or from disk) holds one more ref
    for the copy, so the tier evicts only blocks it alone holds: a block being copied is
    never handed out, and never spilled before its contents have landed. The tier never
    holds more than ``num_blocks`` blocks; the pool is sized for swap's share plus that, so
    the tier can always make room for itself by evicting its own least recently used block.

Disk
    A host block the tier evicts is spilled to a file (``spill`` op) when a disk tier is set;
    ``DiskIndex`` is the set of hashes on disk, LRU on its own budget, filled at start from the
    files a previous engine of the same model left. A block read back from disk first lands in
    a host block held by the read (``loading``), and becomes a host hit once the worker reports
    that its file checked out; a file that did not is dropped from the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedserve.core.block_hash import BlockHash
from pagedserve.core.block_pool import BlockPool


class HostTier:
    """Host blocks of evicted prefix blocks, ``hash -> host block``, least recently used first.

    Invariants: every indexed block has ref count >= 1 in ``pool``, one of them the tier's; at
    most ``num_blocks`` are indexed; a block in ``loading`` is indexed but not findable until
    ``finish_load``; a block that came from disk stays in ``from_disk`` until its first hit.
    """

    def __init__(self, pool: BlockPool, num_blocks: int) -> None:
        self.pool = pool
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[BlockHash, int] = OrderedDict()
        self.loading: set[BlockHash] = set()
        self.from_disk: set[BlockHash] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host block holding ``block_hash``, now the most recently used; None if absent
        or still loading."""
        block = self._blocks.get(block_hash)
        if block is None or block_hash in self.loading:
            return None
        self._blocks.move_to_end(block_hash)
        return block

    def insert(self, block_hash: BlockHash, spilled: list[tuple[int, BlockHash]]
               ) -> int | None:
        """A host block for ``block_hash`` (held by the tier), evicting least recently used
        blocks the tier alone holds for room; each evicted (block, hash) is appended to
        ``spilled``, its contents still intact until the step's ops are applied. None when
        no room can be made."""
        while len(self._blocks) >= self.num_blocks or self.pool.num_free == 0:
            victim = self._evictable()
            if victim is None:
                return None
            spilled.append((self._blocks[victim], victim))
            self.drop(victim)
        block = self.pool.allocate()
        self._blocks[block_hash] = block
        return block

    def _evictable(self) -> BlockHash | None:
        for block_hash, block in self._blocks.items():
            if self.pool.ref_counts[block] == 1:
                return block_hash
        return None

    def drop(self, block_hash: BlockHash) -> None:
        """Forget ``block_hash`` and release the tier's hold on its block."""
        self.pool.release(self._blocks.pop(block_hash))
        self.loading.discard(block_hash)
        self.from_disk.discard(block_hash)

    def finish_load(self, block_hash: BlockHash) -> None:
        self.loading.discard(block_hash)
        self.from_disk.add(block_hash)

    def block_of(self, block_hash: BlockHash) -> int:
        return self._blocks[block_hash]

    def blocks(self) -> Iterable[int]:
        return self._blocks.values()


class DiskIndex:
    """Hashes stored as files, least recently used first, at most ``num_blocks`` of them."""

    def __init__(self, num_blocks: int, stored: Iterable[BlockHash] = ()) -> None:
        self.num_blocks = num_blocks
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()
        self.deleted: list[BlockHash] = []  # evicted since the last ``take_deleted``
        for block_hash in stored:
            self.add(block_hash)

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hashes

    def add(self, block_hash: BlockHash) -> None:
        """A file for ``block_hash`` is being written (again): it is no longer to delete."""
        if block_hash in self.deleted:
            self.deleted.remove(block_hash)
        self._hashes[block_hash] = None
        self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.num_blocks:
            self.deleted.append(self._hashes.popitem(last=False)[0])

    def touch(self, block_hash: BlockHash) -> None:
        self._hashes.move_to_end(block_hash)

    def discard(self, block_hash: BlockHash) -> None:
        self._hashes.pop(block_hash, None)

    def take_deleted(self) -> list[BlockHash]:
        deleted, self.deleted = self.deleted, []
        return deleted
