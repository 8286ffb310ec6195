"""Routing policy: which decode worker holds a request, which prefill worker builds it.

- decode: the most free KV blocks, less a penalty per running sequence;
- prefill: the fewest queued prefill tokens, except that a prompt whose first block was
  recently sent to a worker goes there again (its blocks are likely in that prefix cache)
  unless that worker is far behind the least loaded one.

Loads are the router's own counts, refreshed from worker status between requests, so a
burst of arrivals spreads out instead of piling onto one stale "least loaded" worker.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class WorkerLoad:
    name: str
    kv_blocks_free: int | None = None  # None: not reported yet (the worker just joined)
    kv_blocks_total: int | None = None
    kv_blocks_reservable: int | None = None  # the most one request can ever hold
    running: int = 0
    queued_tokens: int = 0  # prefill: prompt tokens sent and not yet prefilled
    alive: bool = True
    draining: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return self.alive and not self.draining


class RoutingPolicy:
    def __init__(
        self,
        block_size: int,
        affinity_slack_tokens: int = 2048,
        running_penalty_blocks: int = 4,
        affinity_entries: int = 4096,
    ) -> None:
        self.block_size = block_size
        self.affinity_slack = affinity_slack_tokens
        self.running_penalty = running_penalty_blocks
        self._affinity: OrderedDict[bytes, str] = OrderedDict()
        self._affinity_entries = affinity_entries

    def decode_candidates(self, loads: list[WorkerLoad]) -> list[WorkerLoad]:
        """Available decode workers, best first. One that has not reported its room yet
        counts as the roomiest: it refuses what it cannot hold, and left at zero a new
        worker would be passed over for a whole burst of arrivals."""
        ok = [w for w in loads if w.available]
        known = [w.kv_blocks_free for w in ok if w.kv_blocks_free is not None]
        roomiest = max(known, default=0)

        def score(w: WorkerLoad) -> int:
            free = roomiest if w.kv_blocks_free is None else w.kv_blocks_free
            return free - self.running_penalty * w.running

        return sorted(ok, key=score, reverse=True)

    def pick_prefill(self, loads: list[WorkerLoad], prompt_ids: list[int]) -> WorkerLoad | None:
        ok = [w for w in loads if w.available]
        if not ok:
            return None
        least = min(ok, key=lambda w: w.queued_tokens)
        key = self._prefix_key(prompt_ids)
        if key is not None and key in self._affinity:
            name = self._affinity[key]
            match = next((w for w in ok if w.name == name), None)
            if match and match.queued_tokens - least.queued_tokens <= self.affinity_slack:
                self._remember(key, match.name)
                return match
        if key is not None:
            self._remember(key, least.name)
        return least

    def _prefix_key(self, prompt_ids: list[int]) -> bytes | None:
        n = (len(prompt_ids) - 1) // self.block_size * self.block_size
        if n <= 0:
            return None
        # The longest full-block prefix but at most 4 blocks: long shared system prompts and
        # templates group together, distinct user turns still spread.
        n = min(n, 4 * self.block_size)
        return hashlib.sha256(str(prompt_ids[:n]).encode()).digest()

    def _remember(self, key: bytes, name: str) -> None:
        self._affinity[key] = name
        self._affinity.move_to_end(key)
        while len(self._affinity) > self._affinity_entries:
            self._affinity.popitem(last=False)
