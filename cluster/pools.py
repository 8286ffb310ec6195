"""The prefill and decode pools: named, detached Ray actors with declared resources, started,
scaled, drained, replaced and stopped here. This is the router's WorkerDirectory.

- Names are stable and never reused (`prefill-0`, `decode-1`, ...), so the Ray dashboard
  tells the pools and their members apart, and a replacement is a new name.
- Actors are detached: they outlive the process that started them, so a router's death
  leaves every request running. `stop_all` is what stops them.
- Each pool has a target size. `heal` (run by the controller router) starts a replacement
  for every dead member; a router that is not the controller `refresh`es its view from the
  named actors the controller started. Targets and restart counts live in the store, so a
  new controller carries on from them and every router shows the same.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import ray

from cluster.actors import PoolSpec, create_actor, resources_free
from router.fleet.directory import Listener, PoolEvent, PoolRefusal, WorkerRef
from workers.messages import Pool, PoolStatus, Status, TokenLog, WorkerInfo
from workers.metrics import PoolEvents

log = logging.getLogger(__name__)
NAMESPACE = "tandem"
POOLS_KEY = "pools"  # in the store: {"targets": {pool: n}, "restarts": {pool: n}}
_NAME = re.compile(r"^(prefill|decode)-(\d+)$")
_RETRY_SPAWN_S = 5.0


class PoolManager:
    def __init__(
        self,
        specs: dict[Pool, PoolSpec],
        token_log: TokenLog | None,
        transfer_host: str = "127.0.0.1",
        transfer_timeout_s: float = 10.0,
        start_timeout_s: float = 300.0,
        namespace: str = NAMESPACE,
        store=None,
        pending_ok: bool = False,
    ) -> None:
        """`pending_ok`: a worker may wait for Ray to offer its resources (up to
        start_timeout_s), as on a cluster whose autoscaler adds nodes for pending actors;
        otherwise a start without the resources free fails at once, naming the shortfall."""
        self.specs = specs
        self.pending_ok = pending_ok
        self.store = store  # where targets and restarts are shared (cluster.state.RedisStore)
        # What every worker is made with, beside its name and engine.
        self.worker_args = {
            "token_log": token_log,
            "transfer_host": transfer_host,
            "transfer_timeout_s": transfer_timeout_s,
        }
        self.start_timeout_s = start_timeout_s
        self.namespace = namespace
        self.workers: dict[Pool, dict[str, WorkerRef]] = {p: {} for p in Pool}
        self.targets = {p: s.replicas for p, s in specs.items()}
        self.restarts = {p: 0 for p in Pool}
        self._starting = {p: 0 for p in Pool}
        self._next_index = {p: 0 for p in Pool}
        self._spawn_failed_at = {p: 0.0 for p in Pool}
        self._listeners: list[Listener] = []
        self._discovering: set[str] = set()  # named actors found, not yet answering
        self.control = False  # may stop workers: once this router's controller holds the lease
        self.autoscale_notes: dict[Pool, str] = {}  # each pool's last autoscaling decision
        # One change of a pool at a time: a scale, a drain or a healing round.
        self._locks = {p: asyncio.Lock() for p in Pool}
        self.events = PoolEvents()
        self._tasks: set[asyncio.Task] = set()

    # -- the directory ----------------------------------------------------------------------
    def members(self, pool: Pool, include_dead: bool = False) -> list[WorkerRef]:
        return [w for w in self.workers[pool].values() if include_dead or w.alive]

    def get(self, name: str) -> WorkerRef | None:
        for pool in Pool:
            if name in self.workers[pool]:
                return self.workers[pool][name]
        return None

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _notify(self, event: PoolEvent, w: WorkerRef) -> None:
        for fn in self._listeners:
            fn(event, w)

    def changing(self, pool: Pool) -> bool:
        """A scale, drain or healing round is changing the pool now."""
        return self._locks[pool].locked()

    def starting(self, pool: Pool) -> int:
        """Workers being started here, or found starting (another router's, not answering
        yet): a new controller does not start their like again."""
        found = sum(1 for n in self._discovering if n.startswith(pool.value + "-"))
        return self._starting[pool] + found

    def pool_status(self) -> list[PoolStatus]:
        return [
            PoolStatus(
                p,
                self.targets.get(p, 0),
                len(self.members(p)),
                self.starting(p),
                self.restarts[p],
                self.autoscale_notes.get(p, ""),
            )
            for p in Pool
        ]

    def mark_dead(self, name: str, why: str) -> None:
        w = self.get(name)
        if w is None or not w.alive:
            return
        w.alive = False
        log.warning("%s is dead: %s", name, why)
        self._notify(PoolEvent.DEAD, w)
        self._forget_peer(w)
        if not self.control:
            return
        self.events.count(w.pool.value, "dead")  # once: by the controller
        try:  # a hung actor must not come back as a zombie
            ray.kill(w.handle, no_restart=True)
        except Exception as e:  # already gone
            log.debug("kill of %s: %s", name, e)

    def set_control(self, control: bool) -> None:
        self.control = control

    def _forget_peer(self, w: WorkerRef) -> None:
        """Tell the other pool to close its KV pairs with a worker that is gone."""
        other, method = (
            (Pool.PREFILL, "forget_decode")
            if w.pool is Pool.DECODE
            else (Pool.DECODE, "forget_prefill")
        )
        for peer in self.members(other):
            getattr(peer.handle, method).remote(w.name)

    # -- starting workers -------------------------------------------------------------------
    def _new_name(self, pool: Pool) -> str:
        taken = {int(_NAME.match(n).group(2)) for n in self.workers[pool]}
        i = max([self._next_index[pool] - 1, *taken], default=-1) + 1
        self._next_index[pool] = i + 1
        return f"{pool.value}-{i}"

    async def spawn(self, pool: Pool) -> WorkerRef:
        spec = self.specs[pool]
        self._starting[pool] += 1
        try:
            wait_s = 0.0 if self.pending_ok else 5.0
            if not await resources_free(spec, self.pending_ok, wait_s):
                log.warning(
                    "a new %s worker waits for Ray to offer its resources (up to %.0f s)",
                    pool.value,
                    self.start_timeout_s,
                )
            for _ in range(8):  # a name still held by a dead actor: take the next
                name = self._new_name(pool)
                try:
                    actor = create_actor(pool, name, spec, self.namespace, **self.worker_args)
                    break
                except ValueError as e:
                    if "already" not in str(e):
                        raise
            else:
                raise RuntimeError(f"no free name for a new {pool.value} worker")
            try:
                info = await asyncio.wait_for(actor.info.remote(), self.start_timeout_s)
            except BaseException:  # failed, timed out or cancelled: no detached leftover
                ray.kill(actor, no_restart=True)
                raise
        finally:
            self._starting[pool] -= 1
        ref = WorkerRef(name, pool, actor, info)
        self.workers[pool][name] = ref
        self.events.count(pool.value, "started")
        log.info("started %s (pid %d on %s)", name, info.pid, info.node)
        self._notify(PoolEvent.ADDED, ref)
        return ref

    # -- keeping pools at their size --------------------------------------------------------
    async def heal(self) -> None:
        """Start a replacement for each missing member; returns once they are started (or
        failed: then a later round tries again)."""
        jobs = [
            self._heal_pool(pool)
            for pool in self.targets
            if not self._locks[pool].locked()  # a scale or drain is changing it
            and time.monotonic() - self._spawn_failed_at[pool] >= _RETRY_SPAWN_S
        ]
        if jobs:
            await asyncio.gather(*jobs)

    async def _heal_pool(self, pool: Pool) -> None:
        async with self._locks[pool]:  # counted under the lock: a scale may have just run
            target = self.targets.get(pool, 0)
            missing = target - len(self.members(pool)) - self.starting(pool)
            if missing <= 0:
                return
            dead = [w for w in self.members(pool, include_dead=True) if not w.alive]
            log.warning(
                "%s pool has %d of %d workers; starting %d",
                pool.value,
                len(self.members(pool)),
                target,
                missing,
            )
            await asyncio.gather(
                *(self._replace(pool, dead[i] if i < len(dead) else None) for i in range(missing))
            )

    async def _replace(self, pool: Pool, dead: WorkerRef | None) -> None:
        try:
            ref = await self.spawn(pool)
        except Exception as e:
            self._spawn_failed_at[pool] = time.monotonic()
            log.error("could not start a %s worker: %s", pool.value, e)
            return
        if dead is not None:
            self.restarts[pool] += 1
            await self.save()
            self.workers[pool].pop(dead.name, None)
            log.warning(
                "%s replaces %s (%d restarts in the %s pool)",
                ref.name,
                dead.name,
                self.restarts[pool],
                pool.value,
            )

    async def save(self) -> None:
        """Share targets and restart counts through the store (best effort)."""
        if self.store is None:
            return
        state = {
            "targets": {p.value: n for p, n in self.targets.items()},
            "restarts": {p.value: n for p, n in self.restarts.items()},
            "autoscale": {p.value: note for p, note in self.autoscale_notes.items()},
        }
        try:
            await asyncio.wait_for(self.store.put_json(POOLS_KEY, state), 5)
        except Exception as e:  # the store is away: the next change writes it again
            log.warning("could not save the pools' targets: %s", e)

    async def load(self) -> None:
        """Take the targets and restart counts the controller shared."""
        if self.store is None:
            return
        try:
            state = await asyncio.wait_for(self.store.get_json(POOLS_KEY), 5)
        except Exception as e:
            log.debug("could not read the pools' targets: %s", e)
            return
        for p in Pool:
            if state and p.value in state.get("targets", {}) and p in self.targets:
                self.targets[p] = self._within_limit(p, state["targets"][p.value])
            if state and p.value in state.get("restarts", {}):
                self.restarts[p] = int(state["restarts"][p.value])
            if state and p.value in state.get("autoscale", {}) and not self.control:
                self.autoscale_notes[p] = state["autoscale"][p.value]

    def _within_limit(self, pool: Pool, stored) -> int:
        """A target read from the store, cut to the pool's limit (whoever wrote it)."""
        try:
            target = int(stored)
        except (TypeError, ValueError):
            log.warning("%s pool: stored target %r is not a number; kept %d", pool.value,
                        stored, self.targets[pool])  # fmt: skip
            return self.targets[pool]
        limit = self.specs[pool].max_replicas
        if not 0 <= target <= limit:
            log.warning("%s pool: stored target %d cut to [0, max_replicas=%d]", pool.value,
                        target, limit)  # fmt: skip
        return min(max(target, 0), limit)

    async def refresh(self) -> None:
        """Learn of workers another router's pool manager started, of ones now gone, and of
        the targets and restarts it shared."""
        await self.load()
        named = {
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == self.namespace and _NAME.match(a["name"])
        }
        for pool in Pool:
            for w in self.members(pool):
                if w.name not in named:
                    self.mark_dead(w.name, "it is no longer a live named actor")
        for name in named - {n for p in Pool for n in self.workers[p]} - self._discovering:
            self._discovering.add(name)
            asyncio.get_running_loop().create_task(self._discover(name))

    async def _discover(self, name: str) -> None:
        try:
            handle = ray.get_actor(name, namespace=self.namespace)
            info: WorkerInfo = await asyncio.wait_for(handle.info.remote(), self.start_timeout_s)
        except Exception as e:
            log.info("could not reach %s yet: %s", name, e)
            return
        finally:
            self._discovering.discard(name)
        pool = info.pool
        if name in self.workers[pool]:
            return
        index = int(_NAME.match(name).group(2))
        self._next_index[pool] = max(self._next_index[pool], index + 1)
        ref = WorkerRef(name, pool, handle, info)
        self.workers[pool][name] = ref
        log.info("found %s (pid %d on %s)", name, info.pid, info.node)
        self._notify(PoolEvent.ADDED, ref)

    # -- operator actions -------------------------------------------------------------------
    async def scale(self, pool: Pool, replicas: int, drain_timeout_s: float = 60.0) -> list[str]:
        limit = self.specs[pool].max_replicas
        if not 0 <= replicas <= limit:
            raise PoolRefusal(
                Status.INVALID_ARGUMENT,
                f"replicas={replicas}: the {pool.value} pool takes 0..{limit} workers "
                f"({pool.value}.max_replicas)",
            )
        async with self._locks[pool]:
            before = self.targets.get(pool, 0)
            self.targets[pool] = replicas
            live = self.members(pool)
            try:
                await self.save()
                dead = [w for w in self.members(pool, include_dead=True) if not w.alive]
                for w in dead:  # a scale is a fresh start: dead members are not shown any more
                    self.workers[pool].pop(w.name, None)
                grow = replicas - len(live) - self.starting(pool)
                if grow > 0:
                    started = await asyncio.gather(
                        *(self.spawn(pool) for _ in range(grow)), return_exceptions=True
                    )
                    failed = [e for e in started if isinstance(e, BaseException)]
                    if failed:
                        raise ValueError(
                            f"{len(failed)} of {grow} workers did not start: {failed[0]}"
                        )
                shrink = sorted(live, key=lambda w: w.name, reverse=True)
                for w in shrink[: max(0, len(live) - replicas)]:
                    await self._drain(w.name, drain_timeout_s)
            except BaseException:
                # Cut short (a worker did not start, a drain was cancelled): the target says
                # what serves, never less than was asked of a pool that could not grow.
                serving = len([w for w in self.members(pool) if not w.draining])
                grew = replicas >= len(live)
                self.targets[pool] = min(replicas, max(before, serving)) if grew else serving
                self._background(self.save())
                raise
            return [w.name for w in self.members(pool)]

    async def drain(self, name: str, timeout_s: float) -> tuple[bool, str]:
        """Stop routing to a worker, wait for its requests to end, then stop it."""
        w = self.get(name)
        if w is None:
            return False, f"no worker named {name}"
        async with self._locks[w.pool]:
            return await self._drain(name, timeout_s)

    async def _drain(self, name: str, timeout_s: float) -> tuple[bool, str]:
        w = self.get(name)
        if w is None:
            return False, f"no worker named {name}"
        before = self.targets.get(w.pool, 0)
        others = [m for m in self.members(w.pool) if m is not w and not m.draining]
        if not others and w.alive and not w.draining:
            raise PoolRefusal(
                Status.FAILED_PRECONDITION,
                f"{name} is the {w.pool.value} pool's last live worker: draining it would "
                "leave no worker to serve (scale the pool up first)",
            )
        w.draining = True
        self.targets[w.pool] = min(before, len(others))  # it shrinks
        try:
            await self.save()
            await w.handle.set_draining.remote(True)
            deadline = time.monotonic() + timeout_s
            idle, s = False, None
            while time.monotonic() < deadline:
                try:
                    s = await asyncio.wait_for(w.handle.status.remote(), 30)
                except TimeoutError:  # busy: look again until the deadline
                    continue
                if s.idle:
                    idle = True
                    break
                await asyncio.sleep(0.2)
        except BaseException:  # cancelled or failed while the worker still runs: it serves
            w.draining = False
            self.targets[w.pool] = before
            self._background(self._undrain(w))
            raise
        if not idle and s is not None:
            log.warning(
                "%s: drain timed out after %.0f s holding %d requests, %d reservations and %d "
                "of %d KV blocks; they are replayed elsewhere",
                name,
                timeout_s,
                s.running + s.waiting,
                s.reserved,
                s.kv_blocks_total - s.kv_blocks_free,
                s.kv_blocks_total,
            )
        await self.remove(name)
        return (
            idle,
            "drained" if idle else f"stopped with requests still running after {timeout_s}s",
        )

    def _background(self, coro) -> None:
        """Run a coroutine to its end even if its caller is cancelled (kept referenced)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _undrain(self, w: WorkerRef) -> None:
        await self.save()
        try:
            await asyncio.wait_for(w.handle.set_draining.remote(False), 10)
            log.warning("%s: drain interrupted; it takes requests again", w.name)
        except Exception as e:
            log.warning("%s: drain interrupted, and it did not answer (%s)", w.name, e)

    async def remove(self, name: str) -> None:
        w = self.get(name)
        if w is None:
            return
        was_alive = w.alive
        w.alive = False
        del self.workers[w.pool][name]
        self.events.count(w.pool.value, "removed")
        if was_alive:
            self._notify(PoolEvent.REMOVED, w)
            self._forget_peer(w)
        try:
            await asyncio.wait_for(w.handle.shutdown.remote(), 10)
        except Exception as e:  # dead or hung: killed below either way
            log.debug("shutdown of %s: %s", name, e)
        ray.kill(w.handle, no_restart=True)

    async def stop_all(self) -> None:
        self.targets = {p: 0 for p in Pool}
        for pool in Pool:
            for name in list(self.workers[pool]):
                await self.remove(name)
