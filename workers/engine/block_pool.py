"""Fixed-size KV blocks: a free list, reference counts, and a prefix cache.

A full block is identified by a chained hash: SHA-256 over its parent's hash and its own token
ids, so equal hashes mean equal token prefixes (exact token identity, not a lossy Python hash).
A block whose last holder lets go keeps its hash and sits at the tail of the free list; it is
reused by a later prompt with the same prefix, or evicted, least recently freed first, when a
fresh block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

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
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

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
