"""The router's request path, independent of gRPC:

    admit (queue bound) -> record QUEUED in the store -> a RequestDriver runs the attempts
    (router/driver.py) -> its stream's chunks go to the caller -> final state in the store

Cancellation, a client that goes away, or a deadline all end in the same place: the driver
is cancelled, the request is cancelled on its workers and its blocks are freed at once.

The router also keeps the view of the workers the drivers choose from: their loads (from
status calls), their liveness (a failed call or a missed heartbeat marks one dead and fails
the attempts on it), and one long-poll per decode worker that brings its token events.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import ray

from router.config import RouterConfig
from router.directory import PoolEvent, WorkerDirectory, WorkerRef
from router.driver import AttemptFailed, RequestDriver, SharedStart, WorkerLost
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.records import Records
from router.resume import from_stream, tail_log
from router.routing import RoutingPolicy, WorkerLoad
from router.store import RecordState, RequestRecord, RequestStore
from router.stream import Chunk, RequestStream, follow_all
from router.validation import Admission
from workers.engine.request import choice_id
from workers.messages import Pool, RequestSpec, Status, TokenEvent

log = logging.getLogger(__name__)


@dataclass
class RouterStats:
    replays_started: int = 0
    replays_recovered: int = 0
    recovery_s: list[float] = field(default_factory=list)  # failure seen -> next token

    def recovered(self, seconds: float) -> None:
        self.replays_recovered += 1
        self.recovery_s.append(seconds)
        del self.recovery_s[:-1000]


class Router:
    def __init__(
        self,
        directory: WorkerDirectory,
        tokenizer,
        block_size: int,
        store: RequestStore | None = None,
        config: RouterConfig | None = None,
        mode: str = "disaggregated",
        router_id: str | None = None,
    ) -> None:
        self.id = router_id or uuid.uuid4().hex[:12]
        self.directory = directory
        self.mode = mode
        self.tokenizer = tokenizer
        self.config = config = config or RouterConfig()
        self.records = Records(store, config.rpc_timeout_s)
        self.records.snapshots = self._snapshots
        self.policy = RoutingPolicy(block_size)
        self.loads: dict[str, WorkerLoad] = {}
        self.drivers: dict[str, RequestDriver] = {}  # by request id (a choice's own id)
        self.groups: dict[str, SharedStart] = {}  # n > 1 requests, by the request's id
        self.stats = RouterStats()
        self.metrics = RouterMetrics(self.id)
        self.slots = asyncio.Semaphore(config.max_in_flight)
        self.queue_depth = 0
        # Decode room: counts the times a decode worker's free blocks were seen to rise, and
        # wakes the requests waiting for room (see RequestDriver._reserve).
        self.decode_progress = 0
        self._room = asyncio.Event()
        self._pollers: dict[str, asyncio.Task] = {}
        self._tasks: list[asyncio.Task] = []
        self._releases: set[asyncio.Task] = set()  # see release_when_made
        self.leaving = False
        directory.subscribe(self._on_pool_event)

    @property
    def store(self) -> RequestStore | None:
        return self.records.store

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        for pool in (Pool.DECODE, Pool.PREFILL):
            for w in self.directory.members(pool):
                self._on_pool_event(PoolEvent.ADDED, w)
        await self.records.check()
        await self.refresh_loads()
        loop = asyncio.get_running_loop()
        self._tasks += [
            loop.create_task(self._refresh_forever()),
            loop.create_task(self._probe_forever()),
            loop.create_task(self.records.watch_forever()),
            loop.create_task(self.records.write_forever()),
        ]

    def add_task(self, coro) -> None:
        """Run a coroutine for as long as the router runs."""
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    def leave(self) -> None:
        """Stop following requests without cancelling them (another router takes them over):
        for a router that stops while the cluster goes on."""
        self.leaving = True
        for d in list(self.drivers.values()):
            d.abandon()

    async def stop(self) -> None:
        """Stop: the requests still running here are cancelled, unless `leave` came first."""
        for d in list(self.drivers.values()):
            if d.task is not None:
                d.task.cancel()
        for t in [*self._pollers.values(), *self._tasks]:
            t.cancel()

    # -- the workers ------------------------------------------------------------------------
    def _on_pool_event(self, event: PoolEvent, w: WorkerRef) -> None:
        if event is PoolEvent.ADDED:
            self.loads[w.name] = WorkerLoad(w.name)
            if w.pool is Pool.DECODE and w.name not in self._pollers:
                self._pollers[w.name] = asyncio.get_event_loop().create_task(self._poll(w))
            return
        self.loads.pop(w.name, None)
        task = self._pollers.pop(w.name, None)
        if task is not None:
            task.cancel()
        for d in list(self.drivers.values()):
            if w.name in (d.decode, d.prefill):
                d.deliver(WorkerLost(w.name))

    async def _poll(self, w: WorkerRef) -> None:
        """Relays one decode worker's token events to the drivers they belong to."""
        while True:
            try:
                events = await w.handle.poll.remote(self.id, 1.0)
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

    def _deliver(self, e: TokenEvent) -> None:
        d = self.drivers.get(e.request_id)
        if d is not None:
            d.deliver(e)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            self.metrics.queue(self.queue_depth, len(self.drivers))
            try:
                await self.refresh_loads()
            except Exception:
                log.exception("status refresh failed")

    async def refresh_loads(self) -> None:
        """Every worker's load, and its liveness: a worker whose status call says it is dead,
        that misses three calls in a row, or whose engine step has run for stall_timeout_s
        (hung) is marked dead."""
        workers = [*self.directory.members(Pool.PREFILL), *self.directory.members(Pool.DECODE)]
        results = await asyncio.gather(
            *(self._status_of(w) for w in workers), return_exceptions=True
        )
        for w, s in zip(workers, results):
            if isinstance(s, ray.exceptions.RayActorError):
                self.directory.mark_dead(w.name, f"its status call failed: {s}")
                continue
            if isinstance(s, BaseException):
                w.missed_heartbeats += 1
                if w.missed_heartbeats >= _HEARTBEAT_MISSES:
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
            workers = [*self.directory.members(Pool.PREFILL), *self.directory.members(Pool.DECODE)]
            gone = await asyncio.gather(*(_refused(w) for w in workers))
            for w, why in zip(workers, gone):
                if why:
                    self.directory.mark_dead(w.name, why)

    async def _status_of(self, w: WorkerRef):
        return await asyncio.wait_for(w.handle.status.remote(), _HEARTBEAT_TIMEOUT_S)

    # -- what drivers use -----------------------------------------------------------------
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
        need = -(-num_tokens // self.policy.block_size)
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

    def reserved(self, name: str, num_blocks: int, sign: int = 1) -> None:
        """Count a request, and its blocks, against a worker's load until its next status
        says what it holds."""
        load = self.loads.get(name)
        if load is not None:
            if load.kv_blocks_free is not None:
                load.kv_blocks_free -= sign * num_blocks
            load.running = max(0, load.running + sign)

    def unreserved(self, name: str, num_blocks: int) -> None:
        """Take back `reserved`: the worker did not take the request."""
        self.reserved(name, num_blocks, sign=-1)

    def queue_prefill(self, name: str, tokens: int) -> None:
        load = self.loads.get(name)
        if load is not None:
            load.queued_tokens += tokens

    async def call(self, w: WorkerRef, ref, timeout_s: float | None = None):
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

    def release_when_made(
        self,
        w: WorkerRef,
        ref,
        request_id: str | list[str],
        wanted=lambda: False,
        attempt: int | None = None,
    ) -> None:
        """A reservation (or colocated submission) that its request gave up on while the call
        was out (the request ended, or the call timed out and it went elsewhere): once the
        call lands, cancel what it holds on that worker (else a reservation would stay until
        its TTL, a submission generate to its end), unless `wanted()` says the request has
        since got that worker after all; with `attempt`, only that attempt (or an older one)
        is cancelled there, never a newer one sent meanwhile."""

        async def release() -> None:
            try:
                held = bool(await asyncio.wait_for(ref, self.config.rpc_timeout_s))
            except Exception:  # unknown: cancel anyway
                held = True
            if held and not wanted():
                await self.cancel_on([w.name], request_id, attempt=attempt)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

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
            try:
                await asyncio.wait_for(
                    asyncio.gather(*calls, return_exceptions=True), self.config.rpc_timeout_s
                )
            except TimeoutError:
                log.warning("request %s: cancel on %s timed out", ids[0], names)

    def record_attempt(self, rid: str, attempt: int, prefill: str, decode: str, cause: str) -> None:
        store = self.store
        self.records.write(
            f"{rid} attempt {attempt}",
            lambda: store.begin_attempt(rid, attempt, self.id, prefill, decode, cause),
        )

    def record_end(self, d: RequestDriver, state: RecordState, reason: str, error: str) -> None:
        rec = self._record_of(d, state, reason, error)
        tokens = list(d.stream.tokens)
        self.records.ended(rec, tokens)
        store = self.store
        self.records.write(f"{d.request_id} end", lambda: store.end(rec, tokens))

    async def read_record(self, rid: str) -> RequestRecord | None:
        return await self.records.read(lambda: self.store.get(rid))

    async def read_tokens(self, rid: str, start: int = 0) -> list[int]:
        return await self.records.read(lambda: self.store.tokens(rid, start))

    @staticmethod
    def spec_of(rec: RequestRecord) -> RequestSpec:
        """The request a record describes, for its next attempt."""
        return RequestSpec(
            rec.request_id, rec.prompt_ids, rec.sampling, rec.attempt + 1, priority=rec.priority
        )

    def forget(self, d: RequestDriver) -> None:
        if self.drivers.get(d.request_id) is d:
            del self.drivers[d.request_id]

    def _record_of(
        self,
        d: RequestDriver,
        state: RecordState = RecordState.RUNNING,
        reason: str = "",
        error: str = "",
    ) -> RequestRecord:
        status = d.stream.chunks[-1].status if d.stream.finished else Status.OK
        return RequestRecord(
            d.request_id,
            d.spec.prompt_ids,
            d.spec.sampling,
            d.spec.priority,
            d.tenant,
            state,
            self.id,
            max(d.attempt, 0),
            d.prefill or "",
            d.decode or "",
            reason,
            status,
            error,
            tuple(d.failures),
            d.choices,
        )

    def _snapshots(self) -> list[tuple[RequestRecord, list[int]]]:
        return [(self._record_of(d), list(d.stream.tokens)) for d in self.drivers.values()]

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, adm: Admission) -> AsyncIterator[Chunk]:
        """The request's chunks to its end; with n > 1, every choice's, each tagged with its
        index, and the stream ends once all have ended."""
        rid, spec = adm.request_id, adm.spec
        n = spec.choices
        specs = [spec.choice(i) for i in range(n)] if n > 1 else [spec]
        if rid in self.drivers or rid in self.groups:
            raise RouterError(Status.ALREADY_EXISTS, f"request {rid} is already running")
        if self.queue_depth >= self.config.max_queue:
            raise RouterError(
                Status.RESOURCE_EXHAUSTED,
                f"the admission queue is full ({self.queue_depth} waiting); retry later",
            )
        self._check_pools()
        timer = self.metrics.stream()  # from admission: time in the queue counts
        self.queue_depth += 1
        self.metrics.queue(self.queue_depth, len(self.drivers))
        try:
            await self.slots.acquire()
        finally:
            self.queue_depth -= 1
        drivers: list[RequestDriver] = []
        shared = SharedStart(self, spec) if n > 1 else None
        try:
            await self._create_records(specs, adm.tenant)
            for i, c in enumerate(specs):
                stream = RequestStream.open(c.request_id, self.tokenizer, c.sampling.stop, index=i)
                driver = RequestDriver(self, c, stream, shared)
                driver.tenant, driver.choices = adm.tenant, n
                self.drivers[c.request_id] = driver
                drivers.append(driver)
            if shared is not None:
                shared.drivers = drivers
                self.groups[rid] = shared
            for driver in drivers:
                driver.start()
            self.metrics.queue(self.queue_depth, len(self.drivers))
            async for chunk in follow_all([d.stream for d in drivers]):
                status = chunk.finish_reason if chunk.status is Status.OK else chunk.status.value
                timer.chunk(chunk.index, len(chunk.token_ids), chunk.finished, status or "")
                yield chunk
        finally:
            self.slots.release()
            if not self.leaving:
                for driver in drivers:
                    if not driver.stream.finished and driver.task is not None:
                        driver.task.cancel()  # the caller went away: cancel, free the blocks
            if shared is not None:
                shared.cancel()
                if self.groups.get(rid) is shared:
                    del self.groups[rid]

    async def _create_records(self, specs: list[RequestSpec], tenant: str) -> None:
        """One record per choice (one for a plain request). Should one fail, those written
        before it are ended FAILED: no router ever runs a request its client was refused."""
        made: list[RequestRecord] = []
        for c in specs:
            rec = RequestRecord(
                c.request_id,
                c.prompt_ids,
                c.sampling,
                c.priority,
                tenant,
                owner=self.id,
                choices=len(specs),
            )
            try:
                await self.records.create(rec)
            except BaseException as e:  # refused, or the caller went away meanwhile
                status, why = (
                    (e.status, e.message) if isinstance(e, RouterError) else (Status.CANCELLED, "")
                )
                for m in made:
                    ended = replace(
                        m,
                        state=RecordState.FAILED if why else RecordState.CANCELLED,
                        status=status if why else Status.OK,
                        finish_reason="error" if why else "cancelled",
                        error=why,
                    )
                    self.records.write(
                        f"{m.request_id} not started", lambda r=ended: self.store.end(r, [])
                    )
                raise
            made.append(rec)

    def _check_pools(self) -> None:
        pools = [Pool.DECODE] if self.mode == "colocated" else [Pool.PREFILL, Pool.DECODE]
        for pool in pools:
            if not self.expects(pool):
                raise RouterError(
                    Status.UNAVAILABLE,
                    f"the {pool.value} pool is empty and set to stay so; scale it "
                    f"(tandem scale --{pool.value} N)",
                    final=False,
                )

    def expects(self, pool: Pool) -> bool:
        """Whether the pool has, or will have, a worker: a live one, one starting, or a
        target above zero (the controller heals it)."""
        if self.directory.members(pool) or self.directory.starting(pool):
            return True
        return any(p.pool is pool and p.target > 0 for p in self.directory.pool_status())

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request, every choice of it, wherever it runs."""
        group = self.groups.get(request_id)
        if group is not None:
            group.cancel()
            for d in group.drivers:
                if d.task is not None:
                    d.task.cancel()
            return True
        d = self.drivers.get(request_id)
        if d is not None:
            choices = d.choices
        else:
            rec = await self.read_record(request_id)
            if rec is None:
                return False
            choices = rec.choices
        found = False
        for i in range(choices):
            found |= await self._cancel_one(choice_id(request_id, i))
        return found

    async def _cancel_one(self, rid: str) -> bool:
        d = self.drivers.get(rid)
        if d is not None and not d.watching:
            if d.task is not None:
                d.task.cancel()
            return True
        # Driven by another router (or adopted and watched): cancel where it runs; its
        # decode worker tells whoever follows it, and the record ends CANCELLED.
        rec = await self.read_record(rid)
        if rec is None or rec.state.terminal:
            return False
        await self.cancel_on([n for n in (rec.prefill, rec.decode) if n], rid, notify=True)
        ended = replace(rec, state=RecordState.CANCELLED, finish_reason="cancelled")
        tokens = await self.read_tokens(rid)
        self.records.write(f"{rid} cancel", lambda: self.store.end(ended, tokens))
        return True

    async def resume(self, request_id: str, offset: int, index: int = 0) -> AsyncIterator[Chunk]:
        """A request's tokens (choice `index`'s, for n > 1) from `offset` on, then its end:
        from this router's own stream if it drives the request, else from the store's log,
        followed until it ends."""
        rid = choice_id(request_id, index)
        d = self.drivers.get(rid)
        if d is not None and not d.watching:
            stops = d.spec.sampling.stop
            async for c in from_stream(d.stream, offset, self.tokenizer, stops, index):
                yield c
            return
        rec = await self.read_record(rid)
        if rec is None:
            which = f"request {request_id}" + (f" choice {index}" if index else "")
            raise RouterError(Status.NOT_FOUND, f"no {which} (or it expired)")
        async for c in tail_log(self, rec, offset, index):
            yield c


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


_HEARTBEAT_TIMEOUT_S = 5.0
_HEARTBEAT_MISSES = 3
