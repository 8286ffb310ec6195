"""Autoscaling of the prefill and decode pools, each on its own signal (see AutoscaleConfig).

Only the controller router acts (the one holding the lease), once a second:

    prefill: queued_prefill_tokens  prompt tokens accepted and not yet computed, per worker
             ttft_p90               this router's time to first token, p90 over the last minute
    decode:  kv_blocks_used         fraction of the KV cache in use, mean over workers
             tpot_p90               this router's time per output token, p90 over the last minute

    wanted = ceil(workers x signal / target), within [min_replicas, max_replicas]

A change is made once CONFIRM readings in a row (a second apart) call for it, so one long
prompt does not resize a pool. A pool grows to `wanted` at once and shrinks by one worker at a
time, drained within drain_timeout_s (what is left is replayed, nothing lost); it is left alone
while a change or any other scale, drain or healing is under way, and for cooldown_s after one
ends or after this controller took over. A manual `tandem scale` beyond the bounds is brought
back within them. Each decision is logged with its reason, counted in
tandem_scale_events_total once applied, and shown by `tandem status` under its pool.

The latency signals are those of the controller router's own streams: with several routers
behind a load balancer, prefer queued_prefill_tokens and kv_blocks_used, which every worker
reports.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from workers.messages import Pool

if TYPE_CHECKING:
    from cluster.config import AutoscaleConfig
    from cluster.pools import PoolManager
    from router.fleet.routing import WorkerLoad
    from router.metrics import RouterMetrics

log = logging.getLogger(__name__)
CONFIRM = 3


class Autoscaler:
    def __init__(
        self,
        loads: dict[str, WorkerLoad],
        metrics: RouterMetrics,
        pools: PoolManager,
        configs: dict[Pool, AutoscaleConfig],
        is_controller: Callable[[], bool],
        interval_s: float = 1.0,
    ) -> None:
        """`loads`: the router's view of each worker's load (live); `metrics`: its latency
        percentiles."""
        self.loads, self.metrics, self.pools = loads, metrics, pools
        self.configs = {p: c for p, c in configs.items() if c.enabled}
        self.is_controller = is_controller
        self.interval_s = interval_s
        self.changed_at: dict[Pool, float] = {}
        self.busy: dict[Pool, asyncio.Task] = {}
        self.leading_since: float | None = None
        self.calls: dict[Pool, tuple[int, int]] = {}  # pool -> (wanted, readings in a row)

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.is_controller():
                self.leading_since = None
                self.calls.clear()  # readings count again from the next takeover
                continue
            if self.leading_since is None:  # new in the role: a cool-down before acting
                self.leading_since = time.monotonic()
                self.changed_at = {p: self.leading_since for p in self.configs}
            try:
                self.tick()
            except Exception:
                log.exception("autoscaling round failed")

    def signal(self, pool: Pool, name: str) -> float | None:
        """The pool's signal now; None when there is nothing to read yet."""
        members = [w.name for w in self.pools.members(pool)]
        loads = [self.loads[n] for n in members if n in self.loads]
        if name == "queued_prefill_tokens":
            return sum(w.queued_tokens for w in loads) / max(len(members), 1)
        if name == "kv_blocks_used":
            used = [
                1 - w.kv_blocks_free / w.kv_blocks_total
                for w in loads
                if w.kv_blocks_total and w.kv_blocks_free is not None
            ]
            return sum(used) / len(used) if used else None
        p90 = self.metrics.p90("ttft" if name == "ttft_p90" else "tpot")
        return 0.0 if p90 is None else p90  # no traffic in the last minute: nothing to serve

    def tick(self) -> None:
        now = time.monotonic()
        for pool, cfg in self.configs.items():
            task = self.busy.get(pool)
            if (
                (task is not None and not task.done())
                or now - self.changed_at.get(pool, -math.inf) < cfg.cooldown_s
                or self.pools.changing(pool)
                or self.pools.starting(pool)
                or any(w.draining for w in self.pools.members(pool))
            ):
                self.calls.pop(pool, None)  # readings before a change do not count after it
                continue
            name, target = cfg.resolved(pool)
            value = self.signal(pool, name)
            if value is None:
                continue
            live = len(self.pools.members(pool))
            wanted = math.ceil(live * value / target) if live else cfg.min_replicas
            wanted = min(max(wanted, cfg.min_replicas), cfg.max_replicas)
            if wanted < live:
                wanted = live - 1  # shrink gently: one drained worker at a time
            if wanted == live:
                self.calls.pop(pool, None)
                continue
            before, count = self.calls.get(pool, (wanted, 0))
            count = count + 1 if before == wanted else 1
            self.calls[pool] = (wanted, count)
            if count < CONFIRM:
                continue
            del self.calls[pool]
            reason = f"{name} {value:.3g} vs target {target:g}"
            self._change(pool, live, wanted, reason, cfg.drain_timeout_s)

    def _change(self, pool: Pool, live: int, wanted: int, reason: str, drain_s: float) -> None:
        up = wanted > live
        note = f"{pool.value} pool {'grows' if up else 'shrinks'} {live} -> {wanted}: {reason}"
        log.warning("autoscale: %s", note)
        self.pools.autoscale_notes[pool] = f"{time.strftime('%H:%M:%S')} {note}"

        async def apply() -> None:
            try:
                await self.pools.scale(pool, wanted, drain_timeout_s=drain_s)
                self.pools.events.count(pool.value, "autoscale_up" if up else "autoscale_down")
            except Exception as e:  # e.g. not enough Ray resources: said, tried again later
                log.error("autoscale: %s pool to %d failed: %s", pool.value, wanted, e)
                self.pools.autoscale_notes[pool] += f" (failed: {e})"
                await self.pools.save()
            finally:
                self.changed_at[pool] = time.monotonic()  # the cool-down starts at the end

        self.changed_at[pool] = time.monotonic()
        self.busy[pool] = asyncio.get_running_loop().create_task(apply())
