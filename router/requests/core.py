"""The router's request path, independent of gRPC and HTTP:

    admit (queue bound, the tenant's quota) -> wait for slots in fair order
    (router/admission/fair.py) -> record QUEUED in the store -> a RequestDriver runs the
    attempts (router/requests/driver.py) -> its stream's chunks go to the caller -> final
    state in the store

The Router owns the table of requests it drives and runs each through admission control
(router/admission/control.py: tenants, quotas, predictions, fair order); the workers are the
Fleet's (router/fleet/fleet.py), the store's records the Records' (router/records/
records.py). Drivers see neither the Router nor those classes, only the narrow interfaces of
router/requests/driving.py.

Cancellation, a client that goes away, or a deadline all end in the same place: the driver
is cancelled, the request is cancelled on its workers and its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from router.admission.control import AdmissionControl
from router.admission.fair import Shed
from router.admission.request import Admission
from router.config import Mode, RouterConfig
from router.errors import RouterError
from router.fleet.directory import WorkerDirectory
from router.fleet.fleet import Fleet
from router.metrics import RouterMetrics
from router.records.records import Records
from router.records.store import RecordState, RequestRecord, RequestStore
from router.requests.driver import RequestDriver, WorkerLost
from router.requests.driving import DriverEnv, Replays
from router.requests.resume import from_stream, tail_log
from router.requests.shared_start import SharedStart
from router.requests.stream import Chunk, RequestStream, follow_all
from workers.engine.request import FinishReason, choice_id, choice_index
from workers.messages import Pool, RequestSpec, Status, TokenEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterStatus:
    """This router's own state, for `tandem status`."""

    queue_depth: int
    in_flight: int
    replays_in_flight: int
    replays_total: int
    replays_recovered: int
    recovery_p50_s: float
    recovery_max_s: float
    store_available: bool


class Router:
    """Runs on the router's event loop (the gRPC and HTTP handlers, the drivers' tasks)."""

    def __init__(
        self,
        directory: WorkerDirectory,
        tokenizer,
        block_size: int,
        store: RequestStore | None = None,
        config: RouterConfig | None = None,
        mode: Mode | str = Mode.DISAGGREGATED,
        router_id: str | None = None,
    ) -> None:
        self.id = router_id or uuid.uuid4().hex[:12]
        config = config or RouterConfig()
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics(self.id)
        self.records = Records(store, config.rpc_timeout_s, self._snapshots)
        self.fleet = Fleet(directory, block_size, config, self.id, self._deliver, self._lost)
        self._env = DriverEnv(
            self.id,
            Mode(mode),
            config,
            tokenizer,
            self.fleet,
            self.records,
            Replays(on_start=self.metrics.replayed),
            done=self._forget,
            leaving=lambda: self._leaving,
        )
        self._drivers: dict[str, RequestDriver] = {}  # by request id (a choice's own id)
        self._groups: dict[str, SharedStart] = {}  # n > 1 requests, by the request's id
        self.admission = AdmissionControl(config, self.metrics)
        self._queue_depth = 0
        self._resumes = 0  # Resume streams open now
        self._tasks: list[asyncio.Task] = []
        self._leaving = False

    @property
    def config(self) -> RouterConfig:
        return self._env.config

    @config.setter
    def config(self, config: RouterConfig) -> None:
        """Its timeouts, limits, replay and retry settings take effect for every request from
        its next wait or attempt on, its admission order from the next slot freed;
        max_in_flight alone (the slots) is fixed at start, and the tenants are changed
        through `admission.tenants` (router/admission/tenants.py)."""
        self._env.config = self.fleet.config = config
        self.admission.configure(config)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.records.check()
        await self.fleet.start()
        loop = asyncio.get_running_loop()
        self._tasks += [
            loop.create_task(self.records.watch_forever()),
            loop.create_task(self.records.write_forever()),
            loop.create_task(self._report_forever()),
        ]

    def leave(self) -> None:
        """Hand the requests running here over: they run on, unfollowed, for another router
        to adopt, and nothing this router does from now on (its servers closing on their
        streams, `stop`) cancels them. For a router that stops while the cluster goes on."""
        self._leaving = True
        for d in list(self._drivers.values()):
            d.abandon()

    async def stop(self) -> None:
        """Stop. The requests still running here are cancelled, unless `leave` came first:
        on their workers, and in the store before its writer stops (a record left running
        would be adopted, and the request replayed for nobody, by the next router of this
        Redis). Both bounded: a worker or a store that does not answer is not waited for."""
        if not self._leaving:
            tasks = [d.task for d in self._drivers.values() if d.task is not None]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            if not await self.records.flush(5):
                log.warning("stopping with %d request store writes not made", self.records.pending)
        self.fleet.stop()
        for t in self._tasks:
            t.cancel()
        if self._tasks:  # let them finish cancelling (a Redis write in flight), bounded
            await asyncio.wait(self._tasks, timeout=5)

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            self.metrics.queue(self._queue_depth, len(self._drivers))

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, adm: Admission) -> AsyncIterator[Chunk]:
        """The request's chunks to its end; with n > 1, every choice's, each tagged with its
        index, and the stream ends once all have ended."""
        rid = adm.request_id
        if rid in self._drivers or rid in self._groups:
            raise RouterError(Status.ALREADY_EXISTS, f"request {rid} is already running")
        if self._queue_depth >= self.config.max_queue:
            raise RouterError(
                Status.RESOURCE_EXHAUSTED,
                f"the admission queue is full ({self._queue_depth} waiting); retry later",
            )
        ticket, spec = self.admission.ticket(adm)
        self._check_pools()
        timer = self.metrics.stream(ticket.tenant, spec.tenancy.tier)  # queue time counts
        n = spec.choices
        specs = [spec.choice(i) for i in range(n)] if n > 1 else [spec]
        self._queue_depth += 1
        self.metrics.queue(self._queue_depth, len(self._drivers))
        try:
            await self.admission.acquire(ticket)
        except RouterError as e:
            if isinstance(e, Shed):  # its predicted wait passed admission_shed_wait_s
                self.metrics.refused(timer.tenant_tags, "shed")
            elif e.status is Status.RESOURCE_EXHAUSTED:  # reject_if_late, while it waited
                self.metrics.refused(timer.tenant_tags, "late")
            raise
        finally:
            self._queue_depth -= 1
        timer.admitted(ticket.prompt_tokens)
        drivers: list[RequestDriver] = []
        shared: SharedStart | None = None
        made = [0] * n  # output tokens of each choice
        try:
            await self._create_records(specs, adm.tenant)
            streams = [
                RequestStream.open(c.request_id, self.tokenizer, c.sampling.stop, index=i)
                for i, c in enumerate(specs)
            ]
            if n > 1:
                shared = self._groups[rid] = SharedStart(self._env, spec, streams, adm.tenant)
                drivers = shared.drivers
            else:
                drivers = [RequestDriver(self._env, spec, streams[0], adm.tenant)]
            for driver in drivers:
                self._drivers[driver.request_id] = driver
            for driver in drivers:
                driver.start()
            self.metrics.queue(self._queue_depth, len(self._drivers))
            async for chunk in follow_all([d.stream for d in drivers]):
                ok = chunk.status is Status.OK
                status = (chunk.finish_reason or "") if ok else chunk.status.value
                timer.chunk(chunk.index, len(chunk.token_ids), chunk.finished, status)
                ended = chunk.finished and ok
                self.admission.served(ticket, made, chunk.index, len(chunk.token_ids), ended)
                yield chunk
        finally:
            self.admission.release(ticket)
            if not self._leaving:
                for driver in drivers:
                    if not driver.stream.finished and driver.task is not None:
                        driver.task.cancel()  # the caller went away: cancel, free the blocks
            if shared is not None:
                shared.cancel()
                if self._groups.get(rid) is shared:
                    del self._groups[rid]

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
                predicted_tokens=c.tenancy.predicted_tokens or 0.0,
                tpot_slo_ms=c.tenancy.tpot_slo_ms or 0.0,
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
                        finish_reason=FinishReason.ERROR if why else FinishReason.CANCELLED,
                        error=why,
                    )
                    self.records.end(ended, [])
                raise
            made.append(rec)

    def _check_pools(self) -> None:
        mode = self._env.mode
        pools = [Pool.DECODE] if mode is Mode.COLOCATED else [Pool.PREFILL, Pool.DECODE]
        for pool in pools:
            if not self.fleet.expects(pool):
                raise RouterError(
                    Status.UNAVAILABLE,
                    f"the {pool.value} pool is empty and set to stay so; scale it "
                    f"(tandem scale --{pool.value} N)",
                    final=False,
                )

    async def cancel(self, request_id: str) -> bool:
        """Cancel a request, every choice of it, wherever it runs."""
        group = self._groups.get(request_id)
        if group is not None:
            group.cancel()
            for d in group.drivers:
                if d.task is not None:
                    d.task.cancel()
            return True
        d = self._drivers.get(request_id)
        if d is not None:
            choices = d.choices
        else:
            rec = await self.records.read(request_id)
            if rec is None:
                return False
            choices = rec.choices
        found = False
        for i in range(choices):
            found |= await self._cancel_one(choice_id(request_id, i))
        return found

    async def _cancel_one(self, rid: str) -> bool:
        d = self._drivers.get(rid)
        if d is not None and not d.watching:
            if d.task is not None:
                d.task.cancel()
            return True
        # Driven by another router (or adopted and watched): cancel where it runs; its
        # decode worker tells whoever follows it, and the record ends CANCELLED.
        rec = await self.records.read(rid)
        if rec is None or rec.state.terminal:
            return False
        await self.fleet.cancel_on([n for n in (rec.prefill, rec.decode) if n], rid, notify=True)
        ended = replace(rec, state=RecordState.CANCELLED, finish_reason=FinishReason.CANCELLED)
        self.records.end(ended, await self.records.tokens(rid))
        return True

    async def resume(self, request_id: str, offset: int, index: int = 0) -> AsyncIterator[Chunk]:
        """A request's tokens (choice `index`'s, for n > 1) from `offset` on, then its end:
        from this router's own stream if it drives the request, else from the store's log,
        followed until it ends."""
        if self._resumes >= self.config.max_resumes:
            raise RouterError(
                Status.RESOURCE_EXHAUSTED,
                f"{self._resumes} Resume streams are open (router.max_resumes); retry later",
            )
        self._resumes += 1
        try:
            rid = choice_id(request_id, index)
            d = self._drivers.get(rid)
            if d is not None and not d.watching:
                stops = d.spec.sampling.stop
                async for c in from_stream(d.stream, offset, self.tokenizer, stops, index):
                    yield c
                return
            rec = await self.records.read(rid)
            if rec is None:
                which = f"request {request_id}" + (f" choice {index}" if index else "")
                raise RouterError(Status.NOT_FOUND, f"no {which} (or it expired)")
            stall = self.config.stall_timeout_s
            async for c in tail_log(self.records, self.tokenizer, rec, offset, stall, index):
                yield c
        finally:
            self._resumes -= 1

    # -- requests of other routers ----------------------------------------------------------
    def drives(self, rid: str) -> bool:
        return rid in self._drivers

    def adopt(self, rec: RequestRecord) -> None:
        """Drive a request whose router is gone (its record claimed for this router): watched
        while it still runs where it ran, replayed if it does not."""
        spec = RequestSpec(
            rec.request_id,
            rec.prompt_ids,
            rec.sampling,
            rec.attempt + 1,
            priority=rec.priority,
            tenancy=self.admission.tenancy(rec),
        )
        index = choice_index(rec.request_id)
        stream = RequestStream.open(rec.request_id, self.tokenizer, spec.sampling.stop, index=index)
        driver = RequestDriver(self._env, spec, stream, rec.tenant, rec.choices)
        self._drivers[rec.request_id] = driver
        driver.start(adopted=True)

    def status(self) -> RouterStatus:
        replays = self._env.replays
        recovery = replays.recovery_s
        return RouterStatus(
            queue_depth=self._queue_depth,
            in_flight=len(self._drivers),
            replays_in_flight=sum(d.replaying_since is not None for d in self._drivers.values()),
            replays_total=replays.started,
            replays_recovered=replays.recovered,
            recovery_p50_s=statistics.median(recovery) if recovery else 0.0,
            recovery_max_s=max(recovery, default=0.0),
            store_available=self.records.available,
        )

    # -- the drivers' events ----------------------------------------------------------------
    def _deliver(self, e: TokenEvent) -> None:
        d = self._drivers.get(e.request_id)
        if d is not None:
            d.deliver(e)

    def _lost(self, name: str) -> None:
        for d in list(self._drivers.values()):
            if name in (d.decode, d.prefill):
                d.deliver(WorkerLost(name))

    def _forget(self, d: RequestDriver) -> None:
        if self._drivers.get(d.request_id) is d:
            del self._drivers[d.request_id]

    def _snapshots(self) -> list[tuple[RequestRecord, list[int]]]:
        return [(d.record(), list(d.stream.tokens)) for d in self._drivers.values()]
