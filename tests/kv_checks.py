"""Checks shared by the KV-sharing tests: pool bookkeeping, and a model-free KV cache.

``SimulatedCache`` stores token ids where the real cache stores keys and values, and applies a
step's ``BlockOps`` in the runner's order (disk writes, device to host, disk reads, host to
device, copies); its disk is a dict of block files, read back when the test says. A stream
whose context slots hold exactly its own tokens would attend over the right keys, so reading
them back checks forks, copy-on-write, swaps, the prefix cache and its tiers end to end.
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import BlockOps, KVCacheManager
from pagedserve.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from pagedserve.core.sequence import Sequence, SequenceStatus


def check_pool(pool: BlockPool | None, tables: dict[Sequence, list[int]],
               other_holds: list[int] = ()) -> None:
    """Ref counts equal table references plus ``other_holds`` (one entry per hold: queued
    copies, the host tier, disk reads); a block is free exactly when nobody holds it."""
    if pool is None:
        assert not any(tables.values())
        return
    holders = [0] * pool.num_blocks
    for table in tables.values():
        for block in table:
            holders[block] += 1
    for block in other_holds:
        holders[block] += 1
    free = set(pool._free)
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == holders[block] >= 0, f"block {block} count drifted"
        assert (block in free) == (holders[block] == 0), f"block {block} free and in use"
    assert pool.num_shared == sum(1 for h in holders if h > 1)


def _tier_holds(kv: KVCacheManager) -> list[int]:
    """The host tier's hold on each block it indexes, and each disk read's."""
    if kv.offload is None:
        return []
    tier = kv.offload.host
    return list(tier.blocks()) + [tier.block_of(h) for h in tier.loading]


def sample_without_model(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Finish a step as the engine would with a model that samples ``token`` everywhere:
    advance, append a token per sampling stream, finish those at their max_tokens."""
    sched.advance(out)
    for item in out.scheduled:
        if item.num_sample_positions:
            item.seq.append_output(token)
            if item.seq.num_output_tokens >= item.seq.max_tokens:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)


def check_pools(kv: KVCacheManager) -> None:
    pinned = {id(kv.pool): [], id(kv.host_pool): []}
    for pool, block in kv._pinned:
        pinned[id(pool)].append(block)
    check_pool(kv.pool, kv.tables, pinned[id(kv.pool)])
    check_pool(kv.host_pool, kv.host_tables, pinned[id(kv.host_pool)] + _tier_holds(kv))
    if kv.offload is not None:
        assert len(kv.offload.host) <= kv.offload.host.num_blocks, "host tier over budget"
        disk = kv.offload.disk
        assert disk is None or len(disk) <= disk.num_blocks, "disk tier over budget"


def assert_pools_full(kv: KVCacheManager) -> None:
    """Every block is back: free, or (host) held by the host tier alone."""
    assert not kv._pinned
    assert kv.pool.num_free == kv.pool.num_blocks
    if kv.host_pool is not None:
        tier = len(kv.offload.host) if kv.offload is not None else 0
        assert kv.host_pool.num_free + tier == kv.host_pool.num_blocks


class SimulatedCache:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        bs = kv.block_size
        self.device = [[None] * bs for _ in range(kv.pool.num_blocks)]
        num_host = kv.host_pool.num_blocks if kv.host_pool else 0
        self.host = [[None] * bs for _ in range(num_host)]
        self.disk: dict[bytes, list] = {}
        self.reads: list[tuple[bytes, int, list | None]] = []  # under way: what they will read
        # A step's copies ahead of eviction run while its forward pass does: copied here after
        # the step's writes, so a block the step wrote would reach the host changed.
        self.ahead: list[tuple[int, int]] = []

    def apply(self, ops: BlockOps) -> None:
        self._copy_ahead()
        for host, block_hash in ops.disk.spill:
            self.disk[block_hash] = list(self.host[host])
        for device, host in ops.swap_out + ops.offload:
            self.host[host] = list(self.device[device])
        for block_hash, host in ops.disk.read:
            self.reads.append((block_hash, host, self.disk.get(block_hash)))
        for block_hash in ops.disk.delete:
            del self.disk[block_hash]
        for host, device in ops.swap_in + ops.load:
            self.device[device] = list(self.host[host])
        # One gather, then one scatter, like the batched tensor copy.
        rows = [list(self.device[src]) for src, _ in ops.copies]
        for (_, dst), row in zip(ops.copies, rows):
            self.device[dst] = row
        self.ahead = list(ops.offload_ahead)

    def _copy_ahead(self) -> None:
        for device, host in self.ahead:
            self.host[host] = list(self.device[device])
        self.ahead = []

    def finish_reads(self, corrupt: bool = False) -> list[tuple[bytes, bool]]:
        """Land the disk reads under way, or with ``corrupt`` fail them all (bad files)."""
        results = []
        for block_hash, host, data in self.reads:
            ok = data is not None and not corrupt
            if ok:
                self.host[host] = list(data)
            results.append((block_hash, ok))
        self.reads = []
        return results

    def write(self, seq: Sequence, table: list[int], start: int, num: int) -> None:
        bs = self.kv.block_size
        for pos in range(start, start + num):
            self.device[table[pos // bs]][pos % bs] = seq.all_token_ids[pos]

    def read(self, table: list[int], num: int, host: bool = False) -> list[int | None]:
        blocks = self.host if host else self.device
        bs = self.kv.block_size
        return [blocks[table[pos // bs]][pos % bs] for pos in range(num)]

    def run_step(self, scheduled: list[ScheduledSequence]) -> None:
        """Write every chunk's tokens, then check each stream sees its whole prefix; no two
        streams may write the same slot."""
        bs = self.kv.block_size
        slots = [(item.block_ids[pos // bs], pos % bs) for item in scheduled
                 for pos in range(item.num_computed_tokens,
                                  item.num_computed_tokens + item.num_new_tokens)]
        assert len(slots) == len(set(slots)), "two streams wrote the same slot"
        for item in scheduled:
            self.write(item.seq, item.block_ids, item.num_computed_tokens,
                       item.num_new_tokens)
        self._copy_ahead()
        for item in scheduled:
            end = item.num_computed_tokens + item.num_new_tokens
            assert self.read(item.block_ids, end) == item.seq.all_token_ids[:end]

    def check_sequence(self, seq: Sequence) -> None:
        """A resting sequence's computed tokens are where its table says, in either pool."""
        n = seq.num_computed_tokens
        if seq in self.kv.host_tables:
            got = self.read(self.kv.host_tables[seq], n, host=True)
        else:
            got = self.read(self.kv.tables.get(seq, []), n)
        assert got == seq.all_token_ids[:n], f"{seq} lost its cached tokens"


def run_checked(engine, prompts, params_list) -> list:
    """Run an engine's requests to completion one step at a time, checking the pools after
    every step and that they come back full; the finished outputs, in request order."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = out
        check_pools(engine.kv)
    assert_pools_full(engine.kv)
    return [done[i] for i in ids]

