"""Forks, copy-on-write and swapping in the KV cache manager, down to the slot contents."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sequence import Sequence
from pagedserve.sampling_params import SamplingParams
from tests.kv_checks import SimulatedCache, assert_pools_full, check_pools

BLOCK = 4


def _request(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), max_tokens=64)


def _compute(kv: KVCacheManager, cache: SimulatedCache, request: Sequence, num: int) -> bool:
    """Allocate, apply the queued block ops, write the tokens: one model step for one stream."""
    if not kv.allocate_slots(request, num):
        return False
    cache.apply(kv.take_block_ops())
    cache.write(request, kv.block_table(request), request.num_computed_tokens, num)
    request.num_computed_tokens += num
    return True


def test_fork_shares_every_block_and_first_writer_copies_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK)
    cache = SimulatedCache(kv)
    parent = _request(list(range(1, 7)))  # 6 tokens: one full block, one half-full
    assert _compute(kv, cache, parent, 6)
    child = parent.fork()
    kv.fork(parent, child)
    assert kv.block_table(child) == kv.block_table(parent)
    assert kv.pool.num_used == 2 and kv.pool.num_shared == 2
    child.append_output(50)
    assert _compute(kv, cache, child, 1)
    # The full block stays shared; the partial one was copied before the child wrote into it.
    assert kv.block_table(child)[0] == kv.block_table(parent)[0]
    assert kv.block_table(child)[1] != kv.block_table(parent)[1]
    parent.append_output(60)
    assert _compute(kv, cache, parent, 1)  # now the only holder: writes in place, no copy
    assert kv.take_block_ops().copies == []
    cache.check_sequence(parent)
    cache.check_sequence(child)
    check_pools(kv)


def test_swap_out_keeps_sharing_and_swap_in_restores_contents():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, num_host_blocks=8)
    cache = SimulatedCache(kv)
    parent = _request(list(range(1, 10)))
    assert _compute(kv, cache, parent, 9)
    child = parent.fork()
    kv.fork(parent, child)
    assert kv.can_swap_out([parent, child])
    kv.swap_out([parent, child])
    cache.apply(kv.take_block_ops())
    assert kv.pool.num_free == 8 and kv.host_pool.num_used == 3  # 3 distinct blocks, not 6
    assert kv.host_tables[parent] == kv.host_tables[child]
    assert kv.can_swap_in([parent, child])
    kv.swap_in([parent, child])
    cache.apply(kv.take_block_ops())
    assert kv.host_pool.num_free == 8 and kv.pool.num_used == 3
    for request in (parent, child):
        cache.check_sequence(request)
    check_pools(kv)


def test_swap_in_makes_full_blocks_findable_again():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK, num_host_blocks=4)
    a = _request(list(range(1, 10)))
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.swap_out([a])
    kv.pool.reset_prefix_cache()  # as if the device blocks were reused meanwhile
    kv.swap_in([a])
    assert kv.find_cached_prefix(_request(list(range(1, 10)))) == kv.block_table(a)[:2]


def test_swap_out_refused_when_the_host_pool_is_full_or_missing():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK, num_host_blocks=1)
    a = _request(list(range(1, 10)))
    assert kv.allocate_slots(a, 9)
    assert not kv.can_swap_out([a])
    assert not KVCacheManager(num_blocks=8, block_size=BLOCK).can_swap_out([a])


class SharingMachine(RuleBasedStateMachine):
    """Allocate, fork, append (copy-on-write), free, swap out and in, in random orders: ref
    counts never go negative, no block is both free and in use, every stream reads back its
    own tokens, and both pools return to full."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=16, block_size=BLOCK, num_host_blocks=12)
        self.cache = SimulatedCache(self.kv)
        self.live: list[Sequence] = []

    def _pick(self, index: int, on_device: bool) -> Sequence | None:
        pool = [r for r in self.live if (r in self.kv.host_tables) != on_device]
        return pool[index % len(pool)] if pool else None

    def _family(self, request: Sequence, tables: dict[Sequence, list[int]]) -> list[Sequence]:
        """Streams sharing blocks with ``request``, transitively: a group swaps as one."""
        family, blocks = [request], set(tables[request])
        for other in self.live:
            if other is not request and blocks & set(tables.get(other, [])):
                family.append(other)
                blocks |= set(tables[other])
        return family

    @rule(length=st.integers(1, 10), vocab=st.integers(1, 3))
    def new(self, length, vocab):
        request = _request([(i * 7 + vocab) % (vocab + 2) for i in range(length)])
        _admit(self.kv, self.cache, self.live, request)

    @rule(index=st.integers(0, 15))
    def fork(self, index):
        parent = self._pick(index, on_device=True)
        if parent is not None:
            child = parent.fork()
            self.kv.fork(parent, child)
            self.live.append(child)

    @rule(index=st.integers(0, 15), num=st.integers(1, 6))
    def append(self, index, num):
        request = self._pick(index, on_device=True)
        if request is None:
            return
        for _ in range(num):
            request.append_output(index + num)
        if not _compute(self.kv, self.cache, request, num):
            self.free(index)

    @rule(index=st.integers(0, 15))
    def free(self, index):
        request = self._pick(index, on_device=True) or self._pick(index, on_device=False)
        if request is not None:
            self.kv.free(request)
            self.live.remove(request)

    @rule(index=st.integers(0, 15))
    def swap_out(self, index):
        request = self._pick(index, on_device=True)
        family = self._family(request, self.kv.tables) if request else []
        if family and self.kv.can_swap_out(family):
            self.kv.swap_out(family)

    @rule(index=st.integers(0, 15))
    def swap_in(self, index):
        request = self._pick(index, on_device=False)
        family = self._family(request, self.kv.host_tables) if request else []
        if family and self.kv.can_swap_in(family):
            self.kv.swap_in(family)

    @invariant()
    def contents_and_counts(self):
        self.cache.apply(self.kv.take_block_ops())
        check_pools(self.kv)
        for request in self.live:
            self.cache.check_sequence(request)

    def teardown(self):
        for request in self.live:
            self.kv.free(request)
        check_pools(self.kv)
        assert_pools_full(self.kv)


SharingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                            deadline=None)
test_random_interleavings_keep_refs_exact_and_contents_intact = SharingMachine.TestCase


def _admit(kv: KVCacheManager, cache: SimulatedCache, live: list[Sequence],
           req: Sequence) -> None:
    cached = kv.find_cached_prefix(req)
    num_cached = len(cached) * BLOCK
    if not kv.allocate_slots(req, req.num_tokens - num_cached, cached):
        assert req not in kv.tables
        return
    cache.apply(kv.take_block_ops())
    cache.write(req, kv.block_table(req), num_cached, req.num_tokens - num_cached)
    req.num_computed_tokens = req.num_tokens
    live.append(req)
