import pytest

from pagedserve.core.block_pool import BlockPool, OutOfBlocks


def test_allocate_until_empty_then_release_all():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3]
    assert pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    for b in blocks:
        pool.release(b)
    assert pool.num_free == 4


def test_shared_block_returns_only_after_last_holder():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.share(b)
    pool.release(b)
    assert pool.num_free == 1
    pool.release(b)
    assert pool.num_free == 2
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_cached_block_survives_free_until_evicted_lru():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.register_hash(a, b"ha")
    pool.register_hash(b, b"hb")
    pool.release(a)
    pool.release(b)
    assert pool.lookup(b"ha") == a and pool.lookup(b"hb") == b
    # The never-used block goes first, then the least recently freed cached one (a).
    first, second = pool.allocate(), pool.allocate()
    assert second == a
    assert pool.lookup(b"ha") is None and pool.lookup(b"hb") == b
    assert first not in (a, b)


def test_reviving_a_cached_free_block_removes_it_from_the_free_queue():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.register_hash(a, b"h")
    pool.release(a)
    pool.share(pool.lookup(b"h"))
    assert pool.ref_counts[a] == 1 and pool.num_free == 1
    assert pool.allocate() != a
