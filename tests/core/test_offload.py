"""The KV offloading tiers in the core: prefix blocks evicted from the device pool come back
from the host tier and from disk with their contents, copies pin their blocks, budgets hold,
and the pools come back full, under randomized workloads (``SimulatedCache`` checks that
every stream reads exactly its own tokens, loaded blocks included)."""

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve.core.block_hash import hash_full_blocks
from pagedserve.core.block_pool import BlockPool
from pagedserve.core.host_tier import DiskIndex, HostTier
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.sampling_params import SamplingParams
from tests.core.test_preemption import _req, _Sim
from tests.kv_checks import SimulatedCache, assert_pools_full, check_pools

BLOCK = 4


def _request(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), max_tokens=8)


def _computed(kv: KVCacheManager, cache: SimulatedCache, tokens: list[int]) -> Sequence:
    """A stream whose prompt is computed (through the prefix cache where it can be)."""
    seq = _request(tokens)
    prefix = kv.lookup_prefix(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - len(prefix) * BLOCK, prefix)
    cache.apply(kv.take_block_ops())
    cache.write(seq, kv.block_table(seq), len(prefix) * BLOCK, seq.num_tokens - len(prefix) * BLOCK)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def test_host_tier_evicts_least_recently_used_blocks_it_alone_holds():
    pool = BlockPool(4, enable_caching=False)
    tier = HostTier(pool, num_blocks=3)
    spilled = []
    a, b, c = (tier.insert(h, spilled) for h in (b"a", b"b", b"c"))
    assert tier.lookup(b"a") == a  # now the most recently used
    pool.share(b)  # b is being copied
    d = tier.insert(b"d", spilled)
    assert spilled == [(c, b"c")] and b"c" not in tier and d is not None
    assert len(tier) == 3 and pool.ref_counts[b] == 2
    pool.share(a)
    pool.share(d)
    assert tier.insert(b"e", spilled) is None  # everything is being copied: no room


def test_disk_index_keeps_its_budget_and_forgets_a_rewritten_delete():
    disk = DiskIndex(2, [b"a", b"b"])
    disk.add(b"c")
    assert b"a" not in disk and disk.deleted == [b"a"]
    disk.add(b"a")  # spilled again before the delete went out
    assert disk.take_deleted() == [b"b"] and len(disk) == 2


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host_with_its_contents():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_offload_blocks=4)
    cache = SimulatedCache(kv)
    tokens = list(range(1, 10))  # two full blocks and one token
    first = _computed(kv, cache, tokens)
    kv.free(first)
    other = _computed(kv, cache, [50 + i for i in range(16)])  # takes every device block
    ops_offloaded = len(kv.offload.host)
    assert ops_offloaded == 2 and kv.find_cached_prefix(_request(tokens)) == []
    kv.free(other)
    again = _request(tokens + [99])
    prefix = kv.lookup_prefix(again)
    assert prefix.device == [] and len(prefix.host) == 2
    assert kv.allocate_slots(again, 2, prefix)
    ops = kv.take_block_ops()
    assert [h for h, _ in ops.load] == prefix.host
    cache.apply(ops)
    assert cache.read(kv.block_table(again), 8) == tokens[:8]
    assert kv.offload.stats.host_hits == 2


def test_the_blocks_next_to_be_evicted_are_copied_ahead_and_not_again_at_eviction():
    """A step that evicts two hashed blocks also copies the next two the pool will hand out
    (left in place, cached); the step that evicts those queues no copy of its own, and their
    contents still come back from the host."""
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK, num_offload_blocks=8)
    cache = SimulatedCache(kv)
    first = _computed(kv, cache, list(range(1, 17)))  # four full blocks
    kv.free(first)  # all cached and free, evicted oldest-freed first: its tail first
    evicting = _request([60 + i for i in range(4)])
    assert kv.allocate_slots(evicting, 4 + 2 * BLOCK, kv.lookup_prefix(evicting))
    ops = kv.take_block_ops()  # 2 free blocks, then the first two of the prefix's tail
    ahead = [device for device, _ in ops.offload_ahead]
    assert len(ops.offload) == 1 and len(ahead) == 1  # 3 allocated: 2 free + 1 evicted
    assert ahead == [device for device, _ in kv.pool.next_evicted(1)]
    cache.apply(ops)
    cache.run_step([])  # the step's forward pass: the copies ahead land after it
    second = _request([80 + i for i in range(4)])
    assert kv.allocate_slots(second, BLOCK, kv.lookup_prefix(second))
    ops = kv.take_block_ops()
    assert ops.offload == []  # the block it evicted was on the host already
    cache.apply(ops)
    cache.run_step([])
    kv.free(evicting)
    kv.free(second)
    again = _request(list(range(1, 17)) + [99])
    prefix = kv.lookup_prefix(again)
    assert len(prefix.device) + len(prefix.host) == 4 and len(prefix.host) == 2
    assert kv.allocate_slots(again, 1, prefix)
    cache.apply(kv.take_block_ops())
    assert cache.read(kv.block_table(again), 16) == list(range(1, 17))


def test_a_block_being_loaded_is_never_handed_out_and_an_abort_returns_everything():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_offload_blocks=2)
    cache = SimulatedCache(kv)
    tokens = list(range(1, 10))
    kv.free(_computed(kv, cache, tokens))
    kv.free(_computed(kv, cache, [50 + i for i in range(16)]))
    seq = _request(tokens + [99])
    prefix = kv.lookup_prefix(seq)
    assert kv.allocate_slots(seq, 2, prefix)
    loading = set(prefix.host)
    assert all(kv.host_pool.ref_counts[b] == 2 for b in loading)  # the tier's and the copy's
    kv.free(seq)  # aborted before its step ran: the copy keeps its blocks until then
    check_pools(kv)
    assert kv.pool.num_free == 2  # the two device blocks being loaded are not handed out
    assert not kv.allocate_slots(_request([70 + i for i in range(16)]), 16)
    # This allocation evicts two hashed device blocks, whose offload needs host room: the
    # blocks being loaded are not it.
    late = _request([70 + i for i in range(8)])
    assert kv.allocate_slots(late, 8)
    ops = kv.take_block_ops()
    assert ops.offload == [] and len(ops.load) == 2
    assert set(kv.offload.host.blocks()) == loading
    kv.free(late)
    check_pools(kv)
    assert_pools_full(kv)


def test_host_blocks_a_swap_in_frees_are_not_offloaded_into_in_the_same_step():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_host_blocks=2,
                        num_offload_blocks=1)
    cache = SimulatedCache(kv)
    swapped = _computed(kv, cache, list(range(1, 9)))
    kv.swap_out([swapped])
    cache.apply(kv.take_block_ops())
    kv.free(_computed(kv, cache, [50 + i for i in range(16)]))  # the host pool is now full
    assert kv.host_pool.num_free == 0
    kv.swap_in([swapped])  # evicts two hashed device blocks: their offload needs a host block
    ops = kv.take_block_ops()
    assert len(ops.offload) == 1 and not {h for h, _ in ops.swap_in} & {h for _, h in ops.offload}
    cache.apply(ops)
    cache.check_sequence(swapped)
    kv.free(swapped)
    check_pools(kv)
    assert_pools_full(kv)


class OffloadMachine(RuleBasedStateMachine):
    """Requests over a few shared prefixes run through the scheduler on a pool too small to
    keep them, with a host tier and a disk tier of their own budgets; streams are aborted,
    disk reads land or fail (bad files) at random times."""

    PREFIXES = [[p * 10 + i for i in range(1, 11)] for p in range(3)]

    def __init__(self) -> None:
        super().__init__()
        kv = KVCacheManager(12, BLOCK, num_host_blocks=8, num_offload_blocks=5,
                            num_disk_blocks=9)
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                              enable_chunked_prefill=True, preemption_mode="auto",
                              watermark=0.0)
        self.sim = _Sim(Scheduler(cfg, kv))
        self.kv = kv
        self.names = itertools.count()

    @rule(prefix=st.integers(0, 2), suffix=st.integers(0, 6), width=st.integers(1, 2),
          max_tokens=st.integers(1, 5))
    def add(self, prefix, suffix, width, max_tokens):
        name = f"r{next(self.names)}"
        prompt = self.PREFIXES[prefix] + [90 + i for i in range(suffix)]
        root = _req(name, prompt, max_tokens)
        forks = [_req(f"{name}#1", prompt, max_tokens)] if width == 2 else []
        self.sim.add(SequenceGroup(name, [root], width=width, pending_forks=forks))

    @rule()
    def step(self):
        self.sim.step()

    @rule(corrupt=st.booleans())
    def reads_land(self, corrupt):
        self.kv.finish_disk_reads(self.sim.cache.finish_reads(corrupt))

    @rule(index=st.integers(0, 20))
    def abort(self, index):
        sched = self.sim.sched
        groups = list(sched.running) + list(sched.waiting) + list(sched.swapped)
        if groups:
            _abort(sched, groups[index % len(groups)])

    @invariant()
    def counts_and_budgets(self):
        check_pools(self.kv)

    def teardown(self):
        sched = self.sim.sched
        for group in list(sched.running) + list(sched.waiting) + list(sched.swapped):
            _abort(sched, group)
        self.kv.finish_disk_reads(self.sim.cache.finish_reads())
        self.sim.cache.apply(self.kv.take_block_ops())
        check_pools(self.kv)
        assert_pools_full(self.kv)


def _abort(sched: Scheduler, group: SequenceGroup) -> None:
    """As the engine aborts a request: every stream, the forks not yet made first."""
    for seq in list(group.pending_forks) + list(group.seqs):
        sched.finish(seq, SequenceStatus.FINISHED_ABORTED)


OffloadMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40,
                                            deadline=None)
test_random_workloads_keep_contents_refs_and_budgets = OffloadMachine.TestCase


def test_a_workload_that_left_the_device_hits_host_and_disk():
    """The machine's workload, in a fixed order that must reach both tiers."""
    kv = KVCacheManager(5, BLOCK, num_offload_blocks=2, num_disk_blocks=20)
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                          enable_chunked_prefill=True, preemption_mode="recompute",
                          watermark=0.0)
    sim = _Sim(Scheduler(cfg, kv))
    for turn in range(3):
        for p, prefix in enumerate(OffloadMachine.PREFIXES):
            sim.add(SequenceGroup(f"{turn}.{p}", [_req(f"{turn}.{p}", prefix + [7], 2)]))
            for _ in range(50):
                kv.finish_disk_reads(sim.cache.finish_reads())
                if not sim.sched.has_unfinished:
                    break
                sim.step()
    stats = kv.offload.stats
    assert stats.host_hits > 0 and stats.disk_hits > 0 and stats.blocks_from_disk > 0
    assert_pools_full(kv)


@pytest.mark.parametrize("tier_blocks, from_disk", [(2, 0), (4, 2)])
def test_a_prefix_longer_than_the_host_tier_comes_back_partly_and_never_waits_forever(
        tier_blocks, from_disk):
    """Two prefix blocks in the host tier, three more on disk: reads never evict the request's
    own host hits, so it starts with what fits (and computes the rest) instead of loading
    and evicting its prefix in turn forever."""
    tokens = list(range(1, 22))  # five full blocks
    hashes = hash_full_blocks(tokens[:-1], BLOCK)
    kv = KVCacheManager(8, BLOCK, num_offload_blocks=tier_blocks, num_disk_blocks=20,
                        disk_hashes=hashes[2:])
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128,
                          enable_chunked_prefill=True, preemption_mode="recompute",
                          watermark=0.0)
    sim = _Sim(Scheduler(cfg, kv))
    for i, block_hash in enumerate(hashes):
        content = tokens[i * BLOCK:(i + 1) * BLOCK]
        if i < 2:
            sim.cache.host[kv.offload.host.insert(block_hash, [])] = content
        else:
            sim.cache.disk[block_hash] = content
    sim.add(SequenceGroup("r", [_req("r", tokens, 2)]))
    for _ in range(20):
        kv.finish_disk_reads(sim.cache.finish_reads())
        if not sim.sched.has_unfinished:
            break
        sim.step()
    assert not sim.sched.has_unfinished, "the request never started"
    stats = kv.offload.stats
    assert stats.host_hits == 2 + from_disk and stats.blocks_from_disk == from_disk


def test_a_disk_read_whose_insert_spills_the_last_host_block_keeps_its_own_file():
    """One host block (holding A) and room for one file on disk (B): reading B back evicts A
    from the host, and A's spill to disk evicts the oldest file. The read must not be that
    file's victim before it starts (it was: a KeyError left the pools miscounted); the read
    is queued before the spill's delete, so B's bytes are read, then A's file replaces B's."""
    from pagedserve.core.block_pool import BlockPool
    from pagedserve.core.offload import OffloadTiers

    a, b = b"A" * 16, b"B" * 16
    pool = BlockPool(1)
    tiers = OffloadTiers(pool, num_host_blocks=1, num_disk_blocks=1, disk_hashes=[b])
    assert tiers.offload(a) == 0
    assert tiers.fetch_from_disk([b], []) is True
    assert tiers.disk_ops.spill == [(0, a)] and tiers.disk_ops.read == [(b, 0)]
    assert pool.ref_counts[0] == 2  # the tier's hold and the read's
    tiers.finish_disk_reads([(b, True)])
    assert tiers.lookup([b]) == [0] and pool.ref_counts[0] == 1
