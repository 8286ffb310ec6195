"""Fixed-size KV blocks: a free list, reference counts, and a prefix cache.

A full block is identified by a chained hash: SHA-256 over its parent's hash and its own token
ids, so equal hashes mean equal token prefixes (exact token identity, not a lossy Python hash).
A block whose last holder lets go keeps its hash and sits at the tail of the free list; it is
reused by a later prompt with the same prefix, or evicted, least recently freed first, when a
fresh block is needed.

Several blocks at once (a prompt, a chunk, a KV transfer's reservation) are taken as one run
of consecutive ids where the pool has one: a transfer moves a run in place, in one message
per layer, where scattered blocks each need a copy through a staging buffer. Of the runs
that fit, the pool takes the one whose most recently freed block was freed longest ago
(blocks that cache nothing count as the oldest), so eviction stays close to LRU.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT_HASH = b""


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `token_ids`, each chained to the one before."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Owns every block id in [0, num_blocks). Callers hold blocks through `allocate`/`touch`
    and give them back with `free`; a block is free exactly when its ref_count is 0."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_prefix_hits = 0  # blocks served from the cache, for metrics
        # Per block: when it was last freed (a count of frees), -1 if it caches nothing, or
        # +inf while held. Runs are chosen by it.
        self._freed_at = np.full(num_blocks, -1.0)
        self._frees = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, including cached ones that can be evicted."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        start = self._oldest_run(n) if n > 1 else None
        if start is not None:
            ids = list(range(start, start + n))
            for block_id in ids:
                del self._free[block_id]
        else:  # no run of n free blocks: the least recently freed, in id order (some runs)
            ids = sorted(self._free.popitem(last=False)[0] for _ in range(n))
        for block_id in ids:
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
        self._freed_at[ids] = np.inf
        return ids

    def _oldest_run(self, n: int) -> int | None:
        """The first id of the run of n free blocks whose newest free is the oldest, or None
        if no n consecutive blocks are free."""
        age = self._freed_at
        if n > len(age):
            return None
        # Window maxima by doubling: after it, top[i] = max(age[i : i + width]).
        top, width = age, 1
        while width * 2 <= n:
            top = np.maximum(top[:-width], top[width:])
            width *= 2
        starts = len(age) - n + 1
        window = np.maximum(top[:starts], top[n - width : n - width + starts])
        best = int(np.argmin(window))
        return best if np.isfinite(window[best]) else None

    def free(self, block_ids: Sequence[int]) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so they
        # should be evicted before its head.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._frees += 1
                self._freed_at[block_id] = self._frees if block.block_hash is not None else -1

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids caching the longest prefix of `hashes`; holds nothing (see `touch`)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in hashes:
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cache hits, pulling any unheld ones out of the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self._freed_at[block_id] = np.inf
            block.ref_count += 1
        self.num_prefix_hits += len(block_ids)

    def hold(self, block_ids: Sequence[int]) -> None:
        """Take an extra reference on blocks someone already holds (e.g. while their KV is
        being sent); give it back with `free`."""
        for block_id in block_ids:
            if self.blocks[block_id].ref_count <= 0:
                raise RuntimeError(f"block {block_id} is free; hold only held blocks")
            self.blocks[block_id].ref_count += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full, computed block under its chained hash."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return  # already published, or an identical block already is
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
