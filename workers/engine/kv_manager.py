"""Per-request block tables on top of the block pool: reserve slots, publish full blocks to the
prefix cache, release everything when a request ends or is preempted.

Parallel sampling (n > 1) forks a table: the new sequence holds a reference on every block
of its parent's. A sequence about to write into a block that others also hold (the shared,
partly filled last block of a fork) first takes a fresh block and has the shared one copied
into it (copy-on-write; the copies go out with the step, see `take_copies`)."""

from __future__ import annotations

from workers.engine.block_pool import BlockPool, chain_hash
from workers.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, watermark_blocks: int = 0) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        # Admission leaves this many blocks free so running sequences can grow a little
        # before anything has to be preempted.
        self.watermark_blocks = watermark_blocks
        self.tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._published: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []
        self.reserved: set[str] = set()  # ids holding blocks for a KV transfer not yet admitted

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cache hits for a request about to start from scratch. At least one token is always
        left to compute, since its logits are needed to sample."""
        tokens = req.all_token_ids
        hashes = self._hashes_for(req, (len(tokens) - 1) // self.block_size)
        return self.pool.lookup(hashes)

    def can_allocate(
        self, req: Request, num_new_tokens: int, cached: list[int] = (), admitting: bool = False
    ) -> bool:
        return (
            self._cost(req, num_new_tokens, cached) + (self.watermark_blocks if admitting else 0)
            <= self.pool.num_free_blocks
        )

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> None:
        """Reserve blocks so that tokens up to num_computed + cached + new have a slot."""
        table = self.tables.setdefault(req.request_id, [])
        if cached:
            assert not table, "prefix hits apply only to a request starting from scratch"
            self.pool.touch(cached)
            table.extend(cached)
            self._published[req.request_id] = len(cached)
        start = req.num_computed_tokens + len(cached) * self.block_size
        total = start + num_new_tokens
        shared = self._shared_tail(req.request_id, start)
        if shared is not None:
            fresh = self.pool.allocate(1)[0]
            self._copies.append((table[shared], fresh))
            self.pool.free([table[shared]])  # the others still hold it: nothing is freed
            table[shared] = fresh
        missing = self.blocks_needed(total) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's table, every block shared (one more reference each)."""
        table = list(self.tables[parent_id])
        self.pool.hold(table)
        self.tables[child_id] = table
        published = self._published[child_id] = self._published.get(parent_id, 0)
        self._hashes[child_id] = self._hashes.get(parent_id, [])[:published]  # a copy

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies made since the last call, for the step about to run. (A
        copy whose destination was freed again by a preemption in the same schedule is
        harmless: a block is only ever read where it has been written.)"""
        copies, self._copies = self._copies, []
        return copies

    def _shared_tail(self, request_id: str, position: int) -> int | None:
        """The index in its table of the block that token `position` goes into, if others
        hold that block too."""
        table = self.tables.get(request_id)
        if not table:
            return None
        i = position // self.block_size
        if i < len(table) and self.pool.blocks[table[i]].ref_count > 1:
            return i
        return None

    def publish(self, req: Request) -> None:
        """Offer every full block whose tokens are all computed to the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        done = self._published.get(req.request_id, 0)
        if full <= done:
            return
        hashes = self._hashes_for(req, full)
        table = self.tables[req.request_id]
        for i in range(done, full):
            self.pool.cache(table[i], hashes[i])
        self._published[req.request_id] = full

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Hold blocks for tokens whose KV will be written from outside (a KV transfer);
        None when they do not fit now."""
        n = self.blocks_needed(num_tokens)
        if n + self.watermark_blocks > self.pool.num_free_blocks:
            return None
        self.tables[request_id] = self.pool.allocate(n)
        self.reserved.add(request_id)
        return list(self.tables[request_id])

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """The blocks a reservation holds, in order; None if there is no such reservation."""
        return list(self.block_table(request_id)) if request_id in self.reserved else None

    def release(self, request_id: str) -> bool:
        """Give back a reservation whose transfer failed or was cancelled."""
        if request_id not in self.reserved:
            return False
        self.reserved.discard(request_id)
        self.free_id(request_id)
        return True

    def claim(self, request_id: str) -> list[int]:
        """A reservation's blocks become its request's, admitted (KeyError: none)."""
        self.reserved.remove(request_id)
        return self.tables[request_id]

    def free(self, req: Request) -> None:
        self.free_id(req.request_id)

    def free_id(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.free(table)
        self._published.pop(request_id, None)
        self._hashes.pop(request_id, None)

    def _cost(self, req: Request, num_new_tokens: int, cached: list[int]) -> int:
        table = self.tables.get(req.request_id, [])
        start = req.num_computed_tokens + len(cached) * self.block_size
        fresh = max(0, self.blocks_needed(start + num_new_tokens) - len(table) - len(cached))
        fresh += self._shared_tail(req.request_id, start) is not None  # a copy-on-write block
        # A hit that nobody holds sits in the free list, so holding it uses free capacity too.
        idle_hits = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        return fresh + idle_hits

    def _hashes_for(self, req: Request, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < num_blocks:
            tokens = req.all_token_ids
            parent = hashes[-1] if hashes else b""
            for i in range(len(hashes), num_blocks):
                parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
                hashes.append(parent)
        return hashes[:num_blocks]
