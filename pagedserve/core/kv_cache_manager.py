"""Maps each stream's logical KV blocks to physical blocks: in the device pool, or in the host
swap pool while its request is swapped out.

A stream's block table grows as its tokens are scheduled: ``allocate_slots`` reserves room for
the next ``k`` tokens before the step that computes them, ``trim`` takes back the last slots
(rejected draft tokens), and ``free`` returns every block the moment the stream finishes, is
aborted or is preempted.

The prefix cache holds committed tokens only
    A full block becomes findable (``cache_full_blocks``) once all its tokens are accepted,
    that is in ``Sequence.all_token_ids``, and a step at or before the one being scheduled
    computes them. So a draft token, or a sample still in flight under async scheduling, never
    makes its block findable; once appended, its block is committed by the stream's next
    allocation that reaches the end of a block, or an explicit call. A block computed by the step
    being scheduled is findable within that step (vLLM V1 caches at the same point, capped at
    the accepted tokens): a request admitted behind another one with the same prompt shares
    its blocks at once, since attention writes every slot of a step before it reads any.

Sharing and the copy-on-write rule
    A block may sit in several tables: full blocks through the prefix cache (matched by content
    hash), and any block, the partly filled last one included, after ``fork``. Its ref count is
    the number of tables holding it. Tokens are only written at positions at or after a stream's
    ``num_computed_tokens``, so a full block is never written again and prefix sharing never
    copies. Before a step writes into a block that another table also holds, ``allocate_slots``
    gives the writer a fresh block and queues the copy (src, dst) in ``BlockOps.copies``.

Swap protocol
    ``swap_out`` moves streams to the host pool: each distinct device block gets one host block,
    so sharing survives with the same ref counts; the device refs are released and the (device,
    host) pairs are queued. ``swap_in`` is the reverse, and re-registers full blocks' hashes.
    The runner applies a step's ops before its forward pass in the order swap-outs, swap-ins,
    copies. That order is safe because the scheduler never swaps in during a step that
    preempts: a block freed by a swap-out is read before a copy or a new token overwrites it,
    and a block brought back by a swap-in is written before a copy reads it.

Offloading tiers (``core/offload.py``)
    With a host tier, a prefix lookup walks the device pool, then the host tier
    (``lookup_prefix``): host hits get fresh device blocks and a (host, device) pair in
    ``BlockOps.load``, so they land before the step's forward pass computes the stream's first
    token. A hashed device block the pool hands out again is copied to the host first
    (``BlockOps.offload``, queued by ``take_block_ops``). Every block a queued copy reads or
    writes holds one more ref until ``take_block_ops`` has queued the whole step (``_pin``):
    none is handed out, evicted or spilled within the step, and an abort returns the stream's
    own refs at once and the copy's with the step. The runner applies the ops as disk writes,
    device to host (swap-outs with offloads), disk reads, host to device (swap-ins with loads),
    copies: each block is read before anything later in the step overwrites it, since host
    blocks a swap-in frees stay pinned through the step.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from pagedserve.core.block_hash import BlockHash, hash_full_blocks
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.offload import DiskOps, OffloadTiers
from pagedserve.core.sequence import Sequence

BlockPairs = list[tuple[int, int]]


@dataclass
class BlockOps:
    """Block moves the runner applies before a step's forward pass (order: see module doc)."""

    swap_out: BlockPairs = field(default_factory=list)  # (device block, host block)
    swap_in: BlockPairs = field(default_factory=list)  # (host block, device block)
    copies: BlockPairs = field(default_factory=list)  # (src, dst), both in the device pool
    num_host_blocks: int = 0  # size of the host pool (swap and tier) the host blocks index
    offload: BlockPairs = field(default_factory=list)  # (device block, host block)
    # (device block, host block): copies of blocks the pool may hand out next step, which
    # this step leaves in place, so its forward pass need not wait for them (the next does).
    offload_ahead: BlockPairs = field(default_factory=list)
    load: BlockPairs = field(default_factory=list)  # (host block, device block)
    disk: DiskOps = field(default_factory=DiskOps)

    @property
    def is_empty(self) -> bool:
        return not (self.swap_out or self.swap_in or self.copies or self.offload
                    or self.offload_ahead or self.load or self.disk)


@dataclass(frozen=True)
class CachedPrefix:
    """A stream's cached leading blocks: ``device`` blocks, then ``host`` blocks continuing
    them, loaded to the device before its first computed token. ``past_device``: the prefix
    hashes the device missed, which the host tier was asked for."""

    device: list[int]
    host: list[int] = field(default_factory=list)
    past_device: list[BlockHash] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.device) + len(self.host)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """``num_host_blocks`` host blocks for swap; ``num_offload_blocks`` more for the host tier
    (one host pool), whose spills go to a disk tier of ``num_disk_blocks`` files holding
    ``disk_hashes`` at start."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, num_offload_blocks: int = 0,
                 num_disk_blocks: int = 0, disk_hashes: Collection[BlockHash] = ()) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        total_host = num_host_blocks + num_offload_blocks
        self.host_pool = BlockPool(total_host, enable_caching=False) if total_host else None
        self.enable_caching = enable_caching
        self.tables: dict[Sequence, list[int]] = {}
        self.host_tables: dict[Sequence, list[int]] = {}
        self._hashes: dict[Sequence, list[BlockHash]] = {}
        self._ops = BlockOps(num_host_blocks=total_host)
        self.prefix_stats = PrefixCacheStats()
        self.offload: OffloadTiers | None = None
        if num_offload_blocks and enable_caching:
            self.offload = OffloadTiers(self.host_pool, num_offload_blocks, num_disk_blocks,
                                        disk_hashes)
            self.pool.evictions = []
        self._pinned: list[tuple[BlockPool, int]] = []  # held by this step's copies

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables.get(seq, [])

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Leading blocks of ``seq`` already in the cache. At least one token is always
        left to compute, since the step must produce logits for the next token."""
        if not self.enable_caching:
            return []
        return self._device_run(self._prefix_hashes(seq))

    def lookup_prefix(self, seq: Sequence) -> CachedPrefix:
        """``find_cached_prefix`` continued in the host tier, when there is one."""
        if not self.enable_caching:
            return CachedPrefix([])
        hashes = self._prefix_hashes(seq)
        device = self._device_run(hashes)
        if self.offload is None:
            return CachedPrefix(device)
        past_device = hashes[len(device):]
        return CachedPrefix(device, self.offload.lookup(past_device), past_device)

    def _prefix_hashes(self, seq: Sequence) -> list[BlockHash]:
        return hash_full_blocks(seq.all_token_ids[:-1], self.block_size,
                                extra_key=seq.block_key)

    def _device_run(self, hashes: list[BlockHash]) -> list[int]:
        blocks = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int,
                      cached_blocks: Collection[int] | CachedPrefix = ()) -> int:
        """Free blocks that scheduling ``num_new_tokens`` more tokens takes: fresh blocks,
        private copies of shared blocks the tokens go into, cached blocks that must come back
        out of the free queue, and a device block for each host hit."""
        prefix = _as_prefix(cached_blocks)
        table = self.tables.get(seq, [])
        num_tokens = (seq.num_computed_tokens + len(prefix) * self.block_size
                      + num_new_tokens)
        fresh = self.blocks_for(num_tokens) - len(table) - len(prefix)
        copies = len(self._shared_write_targets(seq, table, num_new_tokens))
        revived = sum(1 for b in prefix.device if self.pool.ref_counts[b] == 0)
        return fresh + copies + revived + len(prefix.host)

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int,
        cached_blocks: Collection[int] | CachedPrefix = (), reserve_blocks: int = 0,
    ) -> bool:
        """Reserve room for ``num_new_tokens`` after the sequence's computed (and newly cached)
        tokens, copying shared blocks they go into and loading host hits. Returns False,
        changing nothing, if that would leave fewer than ``reserve_blocks`` free."""
        if not cached_blocks and self.fits_in_last_block(seq, num_new_tokens):
            return True
        prefix = _as_prefix(cached_blocks)
        needed = self.blocks_needed(seq, num_new_tokens, prefix)
        if needed + reserve_blocks > self.pool.num_free:
            return False
        table = self.tables.setdefault(seq, [])
        self._copy_on_write(seq, table, num_new_tokens)
        for block in prefix.device:
            self.pool.share(block)
            table.append(block)
        if prefix.past_device:
            self._load_host_hits(seq, table, prefix)
        num_tokens = (seq.num_computed_tokens + len(prefix) * self.block_size
                      + num_new_tokens)
        while len(table) < self.blocks_for(num_tokens):
            table.append(self.pool.allocate())
        self.cache_full_blocks(seq, num_tokens)
        return True

    def _load_host_hits(self, seq: Sequence, table: list[int], prefix: CachedPrefix) -> None:
        """Give each host hit a device block, to be loaded by the step's ops."""
        for host_block in prefix.host:
            block = self.pool.allocate()
            table.append(block)
            self._ops.load.append((host_block, block))
            self._pin(self.host_pool, host_block)
            self._pin(self.pool, block)
        if seq.num_preemptions == 0:  # counted where the prefix stats count it
            self.offload.record_lookup(prefix.past_device, len(prefix.host))

    def _pin(self, pool: BlockPool, block: int) -> None:
        pool.share(block)
        self._pinned.append((pool, block))

    def fits_in_last_block(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The common decode case, decided without building lists: the tokens land in a block
        the sequence alone holds and do not fill it (so nothing to copy, allocate or hash)."""
        return self.table_if_it_fits(seq, num_new_tokens) is not None

    def table_if_it_fits(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """``seq``'s block table if ``fits_in_last_block``, else None: the scheduler's decode
        fast path reads both with one lookup."""
        table = self.tables.get(seq)
        start = seq.num_computed_tokens
        block = start // self.block_size
        if (table is not None and block < len(table)
                and (start + num_new_tokens) // self.block_size == block
                and self.pool.ref_counts[table[block]] == 1):
            return table
        return None

    def _shared_write_targets(self, seq: Sequence, table: list[int],
                              num_new_tokens: int) -> list[int]:
        """Indices of the blocks the next tokens go into that another table also holds."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(table), self.blocks_for(seq.num_computed_tokens + num_new_tokens))
        return [i for i in range(first, last) if self.pool.ref_counts[table[i]] > 1]

    def _copy_on_write(self, seq: Sequence, table: list[int], num_new_tokens: int) -> None:
        for i in self._shared_write_targets(seq, table, num_new_tokens):
            shared = table[i]
            table[i] = self.pool.allocate()
            self.pool.release(shared)
            self._ops.copies.append((shared, table[i]))

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Commit the full blocks among ``seq``'s first ``num_tokens`` slots to the prefix
        cache, counting only accepted tokens (see the module doc): the caller vouches that a
        step at or before the one being scheduled computes them."""
        if not self.enable_caching:
            return
        table = self.tables.get(seq, [])
        hashes = self._hashes.setdefault(seq, [])
        num_full = min(num_tokens, seq.num_tokens, len(table) * self.block_size) \
            // self.block_size
        if num_full <= len(hashes):
            return
        parent = hashes[-1] if hashes else None
        num_cached = self.pool.num_cached
        accepted = seq.all_token_ids[:num_full * self.block_size]
        for i, block_hash in enumerate(
            hash_full_blocks(accepted, self.block_size, len(hashes), parent, seq.block_key),
            start=len(hashes)
        ):
            hashes.append(block_hash)
            self.pool.register_hash(table[i], block_hash)
        if self.offload is not None:
            self.offload.stats.committed_blocks += self.pool.num_cached - num_cached

    def trim(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Take back ``seq``'s slots from ``num_tokens`` on (rejected draft tokens), between
        steps; the caller lowers ``num_computed_tokens`` to match. Returns the blocks that
        left the table, in table order.

        Invariant: the table keeps exactly ``blocks_for(num_tokens)`` blocks. Each block that
        leaves loses this holder, joins the free queue if it has no other, and keeps any hash
        it had (a hashed block holds accepted tokens and is never written again). The last
        kept block, when ``num_tokens`` ends inside it, is partly filled again: this stream
        will write into it, so if no other table holds it, it is no longer findable; if one
        does, it stays full and findable for that holder and this stream copies it before
        writing. The stream's hashes cover its full kept blocks only, so a later swap-in or
        allocation never re-registers a block past ``num_tokens``."""
        table = self.tables.get(seq, [])
        if not 0 <= num_tokens <= len(table) * self.block_size:
            raise ValueError(f"cannot trim a stream of {len(table)} blocks to {num_tokens} "
                             "tokens")
        keep = self.blocks_for(num_tokens)
        removed = table[keep:]
        del table[keep:]
        for block in reversed(removed):  # tail first, as in ``free``
            self.pool.release(block)
        if num_tokens % self.block_size and self.pool.ref_counts[table[-1]] == 1:
            self.pool.forget_hash(table[-1])
        del self._hashes.get(seq, [])[num_tokens // self.block_size:]
        return removed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the parent's whole table, last partial block included: every block
        gains a holder, and whichever stream writes into a shared block first copies it."""
        table = self.tables.get(parent, [])
        for block in table:
            self.pool.share(block)
        self.tables[child] = list(table)
        if parent in self._hashes:
            self._hashes[child] = list(self._hashes[parent])

    # ---- swapping -----------------------------------------------------------------------
    def can_swap_out(self, seqs: Collection[Sequence]) -> bool:
        if self.host_pool is None:
            return False
        return len(_distinct_blocks(self.tables, seqs)) <= self.host_pool.num_free

    def can_swap_in(self, seqs: Collection[Sequence], reserve_blocks: int = 0) -> bool:
        needed = len(_distinct_blocks(self.host_tables, seqs))
        return needed + reserve_blocks <= self.pool.num_free

    def swap_out(self, seqs: Collection[Sequence]) -> None:
        """Move the streams' blocks to the host pool; call ``can_swap_out`` first."""
        self._ops.swap_out += _move_tables(
            seqs, self.tables, self.pool, self.host_tables, self.host_pool)

    def swap_in(self, seqs: Collection[Sequence]) -> None:
        """Bring the streams' blocks back from the host pool; call ``can_swap_in`` first.
        The host blocks stay pinned through the step, whose offloads must not reuse them."""
        for block in _distinct_blocks(self.host_tables, seqs):
            self._pin(self.host_pool, block)
        self._ops.swap_in += _move_tables(
            seqs, self.host_tables, self.host_pool, self.tables, self.pool)
        for seq in seqs:
            table = self.tables[seq]
            for block, block_hash in zip(table, self._hashes.get(seq, [])):
                self.pool.register_hash(block, block_hash)

    def take_block_ops(self) -> BlockOps:
        """The block moves queued since the last call, for the coming step; the blocks they
        copy are unpinned, since later steps' moves and writes come after them."""
        if self.offload is not None:
            num_evicted = len(self.pool.evictions)
            self._offload_evicted()
            self._offload_ahead(num_evicted)
            self._ops.disk = self.offload.take_disk_ops()
            stats = self.offload.stats
            stats.blocks_to_host += (len(self._ops.swap_out) + len(self._ops.offload)
                                     + len(self._ops.offload_ahead))
            stats.blocks_to_device += len(self._ops.swap_in) + len(self._ops.load)
        for pool, block in self._pinned:
            pool.release(block)
        self._pinned = []
        ops, self._ops = self._ops, BlockOps(num_host_blocks=self._ops.num_host_blocks)
        return ops

    # ---- offloading tiers ---------------------------------------------------------------
    def _offload_evicted(self) -> None:
        """Copy each hashed block the device pool handed out this step to the host tier.
        Streams release their blocks tail first, so the pool evicts a prefix's tail first:
        taken in reverse, the blocks nearer a prefix's start (which every later lookup of it
        needs, a lookup stopping at its first miss) get the host's room first."""
        for block, block_hash in reversed(self.pool.evictions):
            host_block = self.offload.offload(block_hash)
            if host_block is not None:
                self._ops.offload.append((block, host_block))
                self._pin(self.host_pool, host_block)
        self.pool.evictions = []

    def _offload_ahead(self, num_blocks: int) -> None:
        """Copy the hashed blocks among the next ``num_blocks`` the pool will hand out (as
        many as this step evicted: the next step likely evicts as many) to the host tier now,
        so that when the pool does hand them out their contents are already there and the
        step that reuses them waits for no copy. The device blocks stay cached and in
        eviction order (they are not pinned: a pin would requeue them last); nothing in this
        step writes them, as every allocation of the step came before this call."""
        for block, block_hash in self.pool.next_evicted(num_blocks):
            host_block = self.offload.offload(block_hash)
            if host_block is not None:
                self._ops.offload_ahead.append((block, host_block))
                self._pin(self.host_pool, host_block)

    def fetch_from_disk(self, seq: Sequence) -> bool:
        """Start reading the disk blocks that continue ``seq``'s cached prefix (see
        ``core/offload.py``); True while any of them is still loading."""
        if self.offload is None or self.offload.disk is None:
            return False
        prefix = self.lookup_prefix(seq)
        return self.offload.fetch_from_disk(prefix.past_device[len(prefix.host):], prefix.host)

    def finish_disk_reads(self, results: Collection[tuple[BlockHash, bool]]) -> None:
        if results:
            self.offload.finish_disk_reads(results)

    # ---- release and stats --------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block's hash, so that no later lookup finds a block computed
        before (new weights, or a KV pool allocated again). Refused (False) while any block
        is held, or with an offloading tier, whose host and disk blocks it would not drop."""
        if self.pool.num_used or self.offload is not None:
            return False
        self.pool.reset_prefix_cache()
        return True

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queried_tokens += num_prompt_tokens
        self.prefix_stats.hit_tokens += num_hit_tokens

    def free(self, seq: Sequence) -> None:
        """Return a stream's blocks, wherever they are. Tail blocks are released first so they
        are evicted before the prefix blocks other seqs are likelier to share."""
        for block in reversed(self.tables.pop(seq, [])):
            self.pool.release(block)
        for block in reversed(self.host_tables.pop(seq, [])):
            self.host_pool.release(block)
        self._hashes.pop(seq, None)

    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks


def _as_prefix(cached_blocks: Collection[int] | CachedPrefix) -> CachedPrefix:
    if isinstance(cached_blocks, CachedPrefix):
        return cached_blocks
    return CachedPrefix(list(cached_blocks))


def _distinct_blocks(tables: dict[Sequence, list[int]], seqs: Collection[Sequence]) -> set[int]:
    return {b for s in seqs for b in tables.get(s, [])}


def _move_tables(seqs: Collection[Sequence], src_tables: dict[Sequence, list[int]],
                 src_pool: BlockPool, dst_tables: dict[Sequence, list[int]],
                 dst_pool: BlockPool) -> BlockPairs:
    """Re-home the streams' tables in the other pool, one block there per distinct block here,
    and return the (src, dst) pairs whose contents must move."""
    moved: dict[int, int] = {}
    for seq in seqs:
        table = src_tables.pop(seq, [])
        for block in table:
            if block in moved:
                dst_pool.share(moved[block])
            else:
                moved[block] = dst_pool.allocate()
        for block in reversed(table):
            src_pool.release(block)
        dst_tables[seq] = [moved[b] for b in table]
    return list(moved.items())
