"""Property tests: random allocate/append/free sequences never double-allocate or leak."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.sequence import Sequence
from pagedserve.sampling_params import SamplingParams

BLOCK = 4


def _request(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), max_tokens=64)


def _check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    holders = [0] * pool.num_blocks
    for table in kv.tables.values():
        for b in table:
            holders[b] += 1
    free = set(pool._free)
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == holders[b], f"block {b} ref count drifted"
        assert (b in free) == (holders[b] == 0), f"block {b} both free and used (or neither)"
    assert pool.num_free + sum(1 for h in holders if h) == pool.num_blocks


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "free"]), st.integers(0, 7),
              st.integers(1, 9), st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_random_operations_keep_ref_counts_exact(ops, caching):
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK, enable_caching=caching)
    live: dict[int, Sequence] = {}
    for op, slot, n, vocab in ops:
        rid = slot
        if op == "new" and rid not in live:
            # Small vocabularies make shared prefixes (prefix-cache hits) common.
            req = _request([(i * 7 + vocab) % (vocab + 1) for i in range(n + 3)])
            cached = kv.find_cached_prefix(req)
            num_cached = len(cached) * BLOCK
            if kv.allocate_slots(req, req.num_tokens - num_cached, cached):
                req.num_computed_tokens = req.num_tokens
                live[rid] = req
            else:
                assert req not in kv.tables
        elif op == "append" and rid in live:
            req = live[rid]
            for _ in range(n):
                req.append_output(slot)
            if kv.allocate_slots(req, n):
                req.num_computed_tokens += n
            else:
                kv.free(live.pop(rid))
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        _check_invariants(kv)
        for req in live.values():
            assert len(kv.block_table(req)) * BLOCK >= req.num_computed_tokens
    for req in live.values():
        kv.free(req)
    _check_invariants(kv)
    assert kv.pool.num_free == kv.pool.num_blocks


def test_prefix_hit_reuses_blocks_and_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    first = _request(list(range(12)))
    assert kv.allocate_slots(first, 12)
    second = _request(list(range(12)))
    cached = kv.find_cached_prefix(second)
    # 12 tokens = 3 full blocks, but the last token must be recomputed: 2 blocks reused.
    assert cached == kv.block_table(first)[:2]
    assert kv.allocate_slots(second, 12 - 8, cached)
    assert kv.block_table(second)[:2] == kv.block_table(first)[:2]
    assert kv.block_table(second)[2] != kv.block_table(first)[2]


def test_differing_prefix_does_not_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK)
    assert kv.allocate_slots(_request(list(range(12))), 12)
    other = _request([99] + list(range(1, 12)))
    assert kv.find_cached_prefix(other) == []


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK)
    req = _request(list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.pool.num_free == 2 and req not in kv.tables
