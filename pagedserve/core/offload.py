"""The KV cache manager's offloading tiers (``--kv-offloading-size``, ``--kv-offloading-disk``):
the host tier and the disk index (``host_tier``), the block moves they queue, and their
counters. ``KVCacheManager`` owns one and calls it at four points: a prefix lookup that
missed the device (``lookup``), an allocation taking host hits (``load``), the end of a
step's scheduling (``take``: evicted device blocks go to the host, evicted host blocks to
disk), and the worker's report of finished disk reads (``finish_disk_reads``).

Disk reads
    ``fetch_from_disk`` starts the reads of the disk blocks that continue a waiting request's
    cached prefix and says whether any are still under way; the scheduler passes the request
    over until they land (others are admitted meanwhile), so a request never waits on a read
    it does not need and its first computed token always comes after its loaded blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.core.block_hash import BlockHash
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.host_tier import DiskIndex, HostTier


@dataclass
class OffloadStats:
    """Counters since start, in blocks (times the block's bytes gives bytes)."""

    host_hits: int = 0  # prefix blocks found in the host tier after a device miss
    host_misses: int = 0  # lookups that went past the device and found no host block
    disk_hits: int = 0  # host hits on blocks read back from disk
    disk_misses: int = 0  # host misses the disk did not hold either, and bad files
    blocks_to_host: int = 0  # device -> host copies: offloads and swap-outs
    blocks_to_device: int = 0  # host -> device copies: tier loads and swap-ins
    blocks_to_disk: int = 0
    blocks_from_disk: int = 0  # reads that checked out
    committed_blocks: int = 0  # blocks made findable: what write-through would have copied
    offloaded_blocks: int = 0  # device -> host copies of evicted prefix blocks


@dataclass
class DiskOps:
    """The disk's share of a step's ops, applied in this order: writes (the host blocks' bytes
    are taken before anything overwrites them), reads, deletes."""

    spill: list[tuple[int, BlockHash]] = field(default_factory=list)  # (host block, hash)
    read: list[tuple[BlockHash, int]] = field(default_factory=list)  # (hash, host block)
    delete: list[BlockHash] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.spill or self.read or self.delete)


class OffloadTiers:
    def __init__(self, host_pool: BlockPool, num_host_blocks: int, num_disk_blocks: int = 0,
                 disk_hashes: Iterable[BlockHash] = ()) -> None:
        self.host_pool = host_pool
        self.host = HostTier(host_pool, num_host_blocks)
        self.disk = DiskIndex(num_disk_blocks, disk_hashes) if num_disk_blocks else None
        self.stats = OffloadStats()
        self.disk_ops = DiskOps()

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """Host blocks holding ``hashes`` from the first on, up to the first miss."""
        blocks = []
        for block_hash in hashes:
            block = self.host.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, hashes: list[BlockHash], num_hits: int) -> None:
        """Count one admitted request's walk of the tiers past the device: ``num_hits`` host
        hits among ``hashes`` (the prefix blocks the device missed)."""
        self.stats.host_hits += num_hits
        disk_origin = [h for h in hashes[:num_hits] if h in self.host.from_disk]
        self.stats.disk_hits += len(disk_origin)
        self.host.from_disk.difference_update(disk_origin)
        if num_hits < len(hashes):
            self.stats.host_misses += 1
            if self.disk is not None and hashes[num_hits] not in self.disk:
                self.stats.disk_misses += 1

    def offload(self, block_hash: BlockHash) -> int | None:
        """The host block an evicted device block with ``block_hash`` is copied to, or None
        when the host already holds it or has no room."""
        if block_hash in self.host:
            self.host.lookup(block_hash)  # the most recently used again
            return None
        block = self._insert(block_hash)
        if block is not None:
            self.stats.offloaded_blocks += 1
        return block

    def _insert(self, block_hash: BlockHash) -> int | None:
        spilled: list[tuple[int, BlockHash]] = []
        block = self.host.insert(block_hash, spilled)
        for host_block, spilled_hash in spilled:
            self._spill(host_block, spilled_hash)
        return block

    def _spill(self, host_block: int, block_hash: BlockHash) -> None:
        if self.disk is None:
            return
        if block_hash in self.disk:
            self.disk.touch(block_hash)
            return
        self.disk.add(block_hash)
        self.disk_ops.spill.append((host_block, block_hash))
        self.stats.blocks_to_disk += 1

    def fetch_from_disk(self, hashes: list[BlockHash], host_hits: list[int]) -> bool:
        """Start reading the disk blocks among ``hashes`` (the prefix blocks past the device
        and the ``host_hits``), up to the first the disk does not hold or the host has no
        room for; True while any is loading. The request's own host hits are held meanwhile,
        so that its reads never evict them (and it never waits for blocks it pushed out)."""
        if self.disk is None:
            return False
        for block in host_hits:
            self.host_pool.share(block)
        loading = self._start_reads(hashes)
        for block in host_hits:
            self.host_pool.release(block)
        return loading

    def _start_reads(self, hashes: list[BlockHash]) -> bool:
        loading = False
        for block_hash in hashes:
            if block_hash in self.host.loading:
                loading = True
                continue
            if block_hash in self.host or block_hash not in self.disk:
                break
            # Most recent first: the host block the insert evicts spills to disk, and that
            # spill must not evict the very file this read is about to open.
            self.disk.touch(block_hash)
            block = self._insert(block_hash)
            if block is None:
                break
            self.host_pool.share(block)  # the read's hold, until it is reported
            self.host.loading.add(block_hash)
            self.disk_ops.read.append((block_hash, block))
            loading = True
        return loading

    def finish_disk_reads(self, results: Iterable[tuple[BlockHash, bool]]) -> None:
        """The worker's report: each read's hash, and whether its file checked out (else the
        hash leaves both tiers and a lookup misses it)."""
        for block_hash, ok in results:
            if block_hash not in self.host.loading:
                continue
            self.host_pool.release(self.host.block_of(block_hash))
            if ok:
                self.host.finish_load(block_hash)
                self.stats.blocks_from_disk += 1
            else:
                self.host.drop(block_hash)
                self.disk.discard(block_hash)
                self.stats.disk_misses += 1

    @property
    def num_loading(self) -> int:
        return len(self.host.loading)

    def take_disk_ops(self) -> DiskOps:
        ops, self.disk_ops = self.disk_ops, DiskOps()
        if self.disk is not None:
            ops.delete = self.disk.take_deleted()
        return ops
