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
