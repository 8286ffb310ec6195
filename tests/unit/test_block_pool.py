import pytest

from workers.engine.block_pool import BlockPool, block_hashes


def test_allocate_and_free_round_trip():
    pool = BlockPool(8, 4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free_blocks == 5
    pool.free(ids)
    assert pool.num_free_blocks == 8


def test_over_allocation_and_double_free_are_refused():
    pool = BlockPool(2, 4)
    ids = pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 1 blocks with 0 free"):
        pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(ids[:1])


def test_hashes_chain_on_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # the partial third block is not hashed
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent


def test_cached_block_is_reused_then_evicted_lru():
    pool = BlockPool(3, 2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    ids = pool.allocate(2)
    for block_id, h in zip(ids, hashes):
        pool.cache(block_id, h)
    pool.free(ids)
    assert pool.num_free_blocks == 3 and pool.num_cached_blocks == 2
    hits = pool.lookup(hashes)
    assert hits == ids
    pool.touch(hits)
    assert pool.num_free_blocks == 1 and pool.blocks[ids[0]].ref_count == 1
    pool.free(hits)
    # Three fresh blocks must evict both cached ones.
    pool.allocate(3)
    assert pool.num_cached_blocks == 0 and pool.lookup(hashes) == []


def test_prefix_caching_off_never_hits():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    h = block_hashes([1, 2], 2)
    (b,) = pool.allocate(1)
    pool.cache(b, h[0])
    pool.free([b])
    assert pool.lookup(h) == []


def _cache_all(pool, ids, tokens_from):
    for block_id, h in zip(
        ids, block_hashes(list(range(tokens_from, tokens_from + 2 * len(ids))), 2)
    ):
        pool.cache(block_id, h)


def test_several_blocks_come_as_one_run_evicting_the_least_recently_freed():
    """A prompt's blocks are consecutive ids where the pool has such a run (a KV transfer
    moves a run in place). Of the runs that fit, blocks caching nothing go first, then the
    run whose newest free is oldest, so recently freed prefixes survive."""
    pool = BlockPool(12, 2)
    assert pool.allocate(4) == [0, 1, 2, 3]  # a fresh pool: from the start
    a, b = pool.allocate(4), pool.allocate(4)
    assert (a, b) == ([4, 5, 6, 7], [8, 9, 10, 11])
    _cache_all(pool, a, 100)
    _cache_all(pool, b, 200)
    pool.free(b)  # freed first: the older of the two cached runs
    pool.free(a)
    pool.free([0, 1, 2, 3])  # caches nothing
    assert pool.allocate(4) == [0, 1, 2, 3]
    # Inside b, freed before a; a request's blocks are freed tail first, so b's head stays.
    assert pool.allocate(3) == [9, 10, 11]
    assert pool.num_cached_blocks == 5
    assert pool.lookup(block_hashes(list(range(100, 108)), 2)) == a  # a's prefix survived
    assert pool.lookup(block_hashes(list(range(200, 208)), 2)) == [8]
    # A cache hit taken back out of the free list is held: no run may cross it. Of the
    # runs left, [7, 8] beats [6, 7]: 8 went before a, and a went tail first.
    pool.touch([5])
    assert pool.allocate(2) == [7, 8]
    assert pool.allocate(1) == [6] and pool.num_free_blocks == 1  # one block: LRU


def test_without_a_long_enough_run_the_least_recently_freed_blocks_are_taken_in_id_order():
    pool = BlockPool(8, 2)
    ids = pool.allocate(8)
    pool.free([ids[6], ids[1], ids[4]])  # free, in this order, blocks 6, 1, 4: no run of 3
    assert pool.allocate(3) == [1, 4, 6]
    assert pool.num_free_blocks == 0
