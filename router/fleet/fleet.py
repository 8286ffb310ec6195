"""The router's view of the workers, and every call a request makes to one.

- Who is there: the pool manager's members (router/fleet/directory.py), and their liveness: a
  failed call, three status calls in a row unanswered, a refused liveness port, or an engine
  step running past stall_timeout_s marks a worker dead (and its requests replay).
- How loaded each is: a status call to every worker every status_interval_s, plus the
  requests this router sent since (counted when a call goes out, not when it is granted, so
  the requests of a burst see each other). Its last answer is kept for `tandem status`.
- Where to place a request: decode candidates by room and load, a prefill worker by queue and
  prefix affinity (router/fleet/routing.py), and waiting for decode room when there is none.
- The calls: reserve and submit (a yes that lands after the request gave up on it is
  cancelled once it lands), prefill, phase and cancel. A worker's death, a timeout or a Ray
  error fail the call as UNAVAILABLE (`AttemptFailed`); an error the worker raised, as
  INTERNAL or RESOURCE_EXHAUSTED.
- One long poll per decode worker brings its token events, handed to `deliver`; a worker
  leaving the pool is handed to `lost`.

Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import ray

from router.config import RouterConfig
from router.errors import AttemptFailed
from router.fleet.directory import PoolEvent, WorkerDirectory, WorkerRef
from router.fleet.routing import RoutingPolicy, WorkerLoad
from workers.messages import (
    Phase,
    Pool,
    PrefillJob,
    PrefillResult,
    RequestSpec,
    Reservation,
    Status,
    TokenEvent,
    WorkerStatus,
)

log = logging.getLogger(__name__)
HEARTBEAT_TIMEOUT_S = 5.0
HEARTBEAT_MISSES = 3


class Fleet:
    def __init__(
        self,
        directory: WorkerDirectory,
        block_size: int,
        config: RouterConfig,
        router_id: str,
        deliver: Callable[[TokenEvent], None],
        lost: Callable[[str], None],
    ) -> None:
        """`deliver(event)`: a decode worker's token event; `lost(name)`: a worker is gone
        (dead or removed), and the attempts on it fail."""
        self.directory = directory
        self.config = config
        self.router_id = router_id
        self.policy = RoutingPolicy(block_size)
        self.loads: dict[str, WorkerLoad] = {}
        # Each worker's last status answer, and when it came (monotonic).
        self.statuses: dict[str, tuple[WorkerStatus, float]] = {}
        self.joined: dict[str, float] = {}
        # Decode room: counts the times a decode worker's free blocks were seen to rise, and
        # wakes the requests waiting for room.
        self.decode_progress = 0
        self._room = asyncio.Event()
        self._deliver, self._lost = deliver, lost
        self._pollers: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._releases: set[asyncio.Task] = set()
        directory.subscribe(self._on_pool_event)

    @property
    def block_size(self) -> int:
        return self.policy.block_size

    async def start(self) -> None:
        for pool in (Pool.DECODE, Pool.PREFILL):
            for w in self.directory.members(pool):
                self._on_pool_event(PoolEvent.ADDED, w)
        await self.refresh_loads()
        loop = asyncio.get_running_loop()
        self._tasks += [
            loop.create_task(self._refresh_forever()),
            loop.create_task(self._probe_forever()),
        ]

    def stop(self) -> None:
        for t in [*self._pollers.values(), *self._tasks]:
            t.cancel()

    # -- membership and liveness ------------------------------------------------------------
    def _on_pool_event(self, event: PoolEvent, w: WorkerRef) -> None:
        if event is PoolEvent.ADDED:
            self.loads[w.name] = WorkerLoad(w.name)
            self.joined.setdefault(w.name, time.monotonic())
            if w.pool is Pool.DECODE and w.name not in self._pollers:
                self._pollers[w.name] = asyncio.get_event_loop().create_task(self._poll(w))
            return
        self.loads.pop(w.name, None)
        self.statuses.pop(w.name, None)
        self.joined.pop(w.name, None)
        task = self._pollers.pop(w.name, None)
        if task is not None:
            task.cancel()
        self._lost(w.name)

    async def _poll(self, w: WorkerRef) -> None:
        """Relays one decode worker's token events."""
        while True:
            try:
                events = await w.handle.poll.remote(self.router_id, 1.0)
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayActorError as e:
                self.directory.mark_dead(w.name, f"polling it failed: {e}")
                return
            except Exception as e:  # a transient Ray error: back off, do not drop the worker
                log.warning("polling %s failed: %s", w.name, e)
                await asyncio.sleep(0.5)
                continue
            for e in events:
                self._deliver(e)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            try:
                await self.refresh_loads()
            except Exception:
                log.exception("status refresh failed")

    async def refresh_loads(self) -> None:
        """Every worker's load, and its liveness: a worker whose status call says it is dead,
        that misses three calls in a row, or whose engine step has run for stall_timeout_s
        (hung) is marked dead."""
        workers = self.workers()
        results = await asyncio.gather(
            *(self._status_of(w, HEARTBEAT_TIMEOUT_S) for w in workers), return_exceptions=True
        )
        for w, s in zip(workers, results):
            if isinstance(s, ray.exceptions.RayActorError):
                self.directory.mark_dead(w.name, f"its status call failed: {s}")
                continue
            if isinstance(s, BaseException):
                w.missed_heartbeats += 1
                if w.missed_heartbeats >= HEARTBEAT_MISSES:
                    self.directory.mark_dead(
                        w.name, f"{w.missed_heartbeats} status calls in a row failed ({s!r})"
                    )
                continue
            w.missed_heartbeats = 0
            if s.stalled_s > self.config.stall_timeout_s:
                self.directory.mark_dead(
                    w.name, f"its engine step has been running for {s.stalled_s:.0f} s (hung)"
                )
                continue
            self._note(w, s)

    def _note(self, w: WorkerRef, s: WorkerStatus) -> None:
        self.statuses[w.name] = (s, time.monotonic())
        load = self.loads.setdefault(w.name, WorkerLoad(w.name))
        if w.pool is Pool.DECODE and s.kv_blocks_free > (load.kv_blocks_free or 0):
            self.room_freed()
        load.kv_blocks_free, load.kv_blocks_total = s.kv_blocks_free, s.kv_blocks_total
        load.kv_blocks_reservable = s.kv_blocks_reservable
        load.running = s.running + s.waiting + s.reserved
        load.draining = s.draining or w.draining
        load.queued_tokens = s.queued_prefill_tokens

    async def _probe_forever(self, interval_s: float = 0.25) -> None:
        """Connects to every worker's liveness port: a refused connection means its process
        is gone, seen well before Ray reports the actor's death."""
        while True:
            await asyncio.sleep(interval_s)
            workers = self.workers()
            gone = await asyncio.gather(*(_refused(w) for w in workers))
            for w, why in zip(workers, gone):
                if why:
                    self.directory.mark_dead(w.name, why)

    async def _status_of(self, w: WorkerRef, timeout_s: float) -> WorkerStatus:
        return await asyncio.wait_for(w.handle.status.remote(), timeout_s)

    def workers(self, include_dead: bool = False) -> list[WorkerRef]:
        return [
            *self.directory.members(Pool.PREFILL, include_dead),
            *self.directory.members(Pool.DECODE, include_dead),
        ]

    async def snapshot(self, timeout_s: float) -> list[WorkerStatus]:
        """Every worker's status now, answered within timeout_s whatever a worker does: one
        that does not answer in time shows its last answer, marked unresponsive for as long as
        it has been silent (a stopped or hung worker is what an SRE looks for)."""
        workers = self.workers(include_dead=True)
        live = [w for w in workers if w.alive]
        answers = await asyncio.gather(
            *(self._status_of(w, timeout_s) for w in live), return_exceptions=True
        )
        now = time.monotonic()
        got = dict(zip((w.name for w in live), answers))
        out = []
        for w in workers:
            s = got.get(w.name)
            if not w.alive or isinstance(s, ray.exceptions.RayActorError):  # dead, or dying
                out.append(WorkerStatus(w.name, w.pool, w.info.pid, w.info.node, alive=False))
            elif isinstance(s, WorkerStatus):
                out.append(s)
            else:
                last, at = self.statuses.get(w.name, (None, self.joined.get(w.name, now)))
                if last is None:
                    last = WorkerStatus(w.name, w.pool, w.info.pid, w.info.node)
                out.append(_unresponsive(last, now - at))
        return out

    # -- placement --------------------------------------------------------------------------
    def candidates(self, pool: Pool) -> list[WorkerRef]:
        """Live workers of a pool that take work, best first (decode: by room and load)."""
        members = {w.name: w for w in self.directory.members(pool) if not w.draining}
        loads = [self.loads[n] for n in members if n in self.loads]
        if pool is Pool.DECODE:
            return [members[w.name] for w in self.policy.decode_candidates(loads)]
        return [members[w.name] for w in loads if w.available]

    def pick_prefill(self, candidates: list[WorkerRef], spec: RequestSpec) -> WorkerRef:
        loads = [self.loads[w.name] for w in candidates if w.name in self.loads]
        choice = self.policy.pick_prefill(loads, list(spec.prompt_ids))
        by_name = {w.name: w for w in candidates}
        return by_name[choice.name] if choice is not None else candidates[0]

    def expects(self, pool: Pool) -> bool:
        """Whether the pool has, or will have, a worker: a live one, one starting, or a
        target above zero (the controller heals it)."""
        if self.directory.members(pool) or self.directory.starting(pool):
            return True
        return any(p.pool is pool and p.target > 0 for p in self.directory.pool_status())

    def room_freed(self) -> None:
        """The decode pool moved: wake the requests waiting for room."""
        self.decode_progress += 1
        self._room.set()
        self._room = asyncio.Event()

    def fits_no_decode_worker(self, num_tokens: int) -> str | None:
        """Why no decode worker could ever hold this many tokens' KV (each can reserve fewer
        blocks in all), or None: a request that waits for room must be able to get it."""
        most = [
            load.kv_blocks_reservable
            for w in self.directory.members(Pool.DECODE)
            if (load := self.loads.get(w.name)) is not None and load.kv_blocks_reservable
        ]
        need = -(-num_tokens // self.block_size)
        if most and need > max(most):
            return (
                f"its {num_tokens} tokens need {need} KV blocks, and the largest decode worker "
                f"can hold {max(most)} for one request"
            )
        return None

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until the decode pool next moves, or timeout_s."""
        try:
            await asyncio.wait_for(self._room.wait(), timeout_s)
        except TimeoutError:
            pass

    # -- calls ------------------------------------------------------------------------------
    async def reserve(
        self, w: WorkerRef, spec: RequestSpec, ttl_s: float, wanted: Callable[[], bool]
    ) -> Reservation | None:
        """Blocks on decode worker w for the request's KV (every choice's id, for an n > 1
        request's shared attempt), or None if w has no room, failed or was too slow."""
        blocks = -(-spec.num_tokens // self.block_size)
        send = lambda: w.handle.reserve.remote(  # noqa: E731
            spec.request_id, spec.attempt, spec.num_tokens, self.router_id, ttl_s
        )
        return await self._claim(w, send, spec.held_ids, blocks, spec.attempt, wanted)

    async def submit(self, w: WorkerRef, spec: RequestSpec, wanted: Callable[[], bool]) -> bool:
        """The whole request to decode worker w, which prefills it too; False if w did not
        take it (a newer attempt is there, it failed, or it was too slow)."""
        send = lambda: w.handle.submit.remote(spec)  # noqa: E731
        return bool(await self._claim(w, send, spec.request_id, 0, spec.attempt, wanted))

    async def _claim(self, w: WorkerRef, send, ids, blocks: int, attempt: int, wanted):
        """One reserve or submit: its answer, or None where w failed or was too slow. The
        request and its blocks count against w's room from the moment the call goes, not
        once granted, so that the other requests of a burst, choosing while it is out, see
        it; until w's next status, or taken back if w says no. A yes that comes too late is
        cancelled once it lands, unless `wanted()` says the request got w after all."""
        self._count(w.name, blocks, +1)
        ref = send()
        try:
            res = await self._call(w, ref)
        except AttemptFailed:  # gone or slow: the caller tries the next
            self._count(w.name, blocks, -1)
            self._release_when_made(w, ref, ids, wanted, attempt)
            return None
        except asyncio.CancelledError:  # the request ended with the call out
            self._count(w.name, blocks, -1)
            self._release_when_made(w, ref, ids, lambda: False)
            raise
        if not res:
            self._count(w.name, blocks, -1)
        return res

    def _count(self, name: str, blocks: int, sign: int) -> None:
        """Count a request, and its blocks, against a worker's load (or take it back) until
        its next status says what it holds."""
        load = self.loads.get(name)
        if load is not None:
            if load.kv_blocks_free is not None:
                load.kv_blocks_free -= sign * blocks
            load.running = max(0, load.running + sign)

    async def prefill(self, p: WorkerRef, job: PrefillJob, timeout_s: float) -> PrefillResult:
        """The prompt prefilled on p; returns once its first token is sampled."""
        tokens = job.spec.num_tokens
        load = self.loads.get(p.name)
        if load is not None:
            load.queued_tokens += tokens
        try:
            return await self._call(p, p.handle.prefill.remote(job, timeout_s), timeout_s + 10)
        finally:
            if (load := self.loads.get(p.name)) is not None:
                load.queued_tokens -= tokens

    async def phase(self, name: str, rid: str, attempt: int) -> Phase:
        """Where this attempt of rid stands on the named worker (absent if it is gone)."""
        w = self.directory.get(name) if name else None
        if w is None or not w.alive:
            return Phase.ABSENT
        try:
            return await self._call(w, w.handle.phase.remote(rid, attempt))
        except AttemptFailed:
            return Phase.ABSENT

    async def cancel_on(
        self,
        names: list[str],
        request_id: str | list[str],
        notify: bool = False,
        attempt: int | None = None,
    ) -> None:
        """Cancel a request (or each of several ids: an n > 1 request's choices) on the
        named workers. `notify`: a client's cancel, told to the router following it."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        calls = []
        for name in names:
            w = self.directory.get(name)
            if w is not None and w.alive:
                calls += [w.handle.cancel.remote(rid, notify, attempt) for rid in ids]
        if calls:
            answers = asyncio.gather(*calls, return_exceptions=True)
            # Cut short (a timeout, this task cancelled), the gathering ends in an error that
            # nobody awaits: taken here, not logged as "never retrieved" at every shutdown.
            answers.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                await asyncio.wait_for(answers, self.config.rpc_timeout_s)
            except TimeoutError:
                log.warning("request %s: cancel on %s timed out", ids[0], names)

    async def _call(self, w: WorkerRef, ref, timeout_s: float | None = None):
        """Await one call to a worker. Its death marks it dead; it, a timeout or a Ray error
        fail the attempt as UNAVAILABLE; an error the method raised fails it as INTERNAL."""
        timeout_s = timeout_s or self.config.rpc_timeout_s
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except ray.exceptions.RayActorError as e:
            self.directory.mark_dead(w.name, f"a call failed: {e}")
            raise AttemptFailed(Status.UNAVAILABLE, f"{w.name} died") from None
        except TimeoutError:
            raise AttemptFailed(
                Status.UNAVAILABLE, f"{w.name} did not answer within {timeout_s:.0f} s"
            ) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, TimeoutError):  # the worker is alive but busy or stuck
                status = Status.UNAVAILABLE
            elif isinstance(cause, ValueError):  # it refused the request itself
                status = Status.RESOURCE_EXHAUSTED
            else:
                status = Status.INTERNAL
            raise AttemptFailed(status, f"{w.name}: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayError as e:
            raise AttemptFailed(Status.UNAVAILABLE, f"{w.name}: {e}") from None

    def _release_when_made(self, w: WorkerRef, ref, ids, wanted, attempt: int | None = None):
        """A reservation (or colocated submission) that its request gave up on while the call
        was out: once the call lands, cancel what it holds on that worker (else a reservation
        would stay until its TTL, a submission generate to its end), unless `wanted()` says
        the request has since got that worker after all; with `attempt`, only that attempt
        (or an older one) is cancelled there, never a newer one sent meanwhile."""

        async def release() -> None:
            try:
                held = bool(await asyncio.wait_for(ref, self.config.rpc_timeout_s))
            except Exception:  # unknown: cancel anyway
                held = True
            if held and not wanted():
                await self.cancel_on([w.name], ids, attempt=attempt)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


def _unresponsive(s: WorkerStatus, silent_s: float) -> WorkerStatus:
    return replace(s, unresponsive_s=max(silent_s, 1e-3))


async def _refused(w: WorkerRef) -> str | None:
    """Why the worker's process is surely gone, or None if it may be alive."""
    host, port = w.info.host, w.info.liveness_port
    if not port:
        return None
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
    except (ConnectionRefusedError, ConnectionResetError):
        return f"its process is gone (connection to {host}:{port} refused)"
    except (OSError, TimeoutError):
        return None  # unreachable for now: the heartbeat decides
    writer.close()
    return None
