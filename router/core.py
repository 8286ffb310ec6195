"""The router's request path, independent of gRPC:

    admit (queue bound) -> record QUEUED in Redis -> reserve blocks on a decode worker ->
    prefill on a prefill worker (first token streams out at once) -> relay the decode
    worker's tokens -> final state in Redis

Cancellation, a client that goes away, or a deadline all end in the same place: the request
is cancelled on both workers and its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from cluster.pools import PoolManager, WorkerRef
from router.routing import RoutingPolicy, WorkerLoad
from router.stream import Chunk, Event, RequestStream
from router.validation import Admission

log = logging.getLogger(__name__)


class RouterError(Exception):
    """Ends a request with a gRPC status: code is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RouterConfig:
    max_in_flight: int = 256
    max_queue: int = 1024
    reserve_timeout_s: float = 60.0
    prefill_timeout_s: float = 300.0
    rpc_timeout_s: float = 30.0
    status_interval_s: float = 0.5
    stall_timeout_s: float = 120.0  # a stream with no event for this long is given up


class Router:
    def __init__(
        self,
        pools: PoolManager,
        tokenizer,
        block_size: int,
        state=None,
        config: RouterConfig = RouterConfig(),
        mode: str = "disaggregated",
    ) -> None:
        self.pools = pools
        self.mode = mode
        self.tokenizer = tokenizer
        self.state = state
        self.config = config
        self.policy = RoutingPolicy(block_size)
        self.loads: dict[str, WorkerLoad] = {}
        self.streams: dict[str, RequestStream] = {}
        self.slots = asyncio.Semaphore(config.max_in_flight)
        self.queue_depth = 0
        self._tasks: dict[str, asyncio.Task] = {}
        self._status_task: asyncio.Task | None = None
        pools.listeners.append(self._on_pool_event)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        for w in self.pools.members("decode"):
            self._on_pool_event("added", w)
        for w in self.pools.members("prefill"):
            self._on_pool_event("added", w)
        await self.refresh_loads()
        self._status_task = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        for t in [*self._tasks.values(), self._status_task]:
            if t is not None:
                t.cancel()

    def _on_pool_event(self, event: str, w: WorkerRef) -> None:
        if event == "added":
            self.loads[w.name] = WorkerLoad(w.name)
            if w.pool == "decode":
                self._tasks[w.name] = asyncio.get_event_loop().create_task(self._poll(w))
        else:
            load = self.loads.pop(w.name, None)
            task = self._tasks.pop(w.name, None)
            if task is not None:
                task.cancel()
            if load is not None:
                self._fail_streams_on(w.name, f"{w.name} {'died' if event == 'dead' else 'left'}")

    def _fail_streams_on(self, worker: str, why: str) -> None:
        for s in list(self.streams.values()):
            if worker == s.decode_worker and not s.finished:
                s.end_now("error", f"UNAVAILABLE: {why}")

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            try:
                await self.refresh_loads()
            except Exception:
                log.exception("status refresh failed")

    async def refresh_loads(self) -> None:
        for pool in ("prefill", "decode"):
            for w in self.pools.members(pool):
                try:
                    s = await asyncio.wait_for(w.handle.status.remote(), self.config.rpc_timeout_s)
                except (TimeoutError, ray.exceptions.RayActorError):
                    self.pools.mark_dead(w.name)
                    continue
                load = self.loads.setdefault(w.name, WorkerLoad(w.name))
                load.kv_blocks_free = s["kv_blocks_free"]
                load.running = s["running"] + s["waiting"]
                load.draining = s["draining"] or w.draining
                if pool == "prefill":
                    load.queued_tokens = s.get("queued_prefill_tokens", 0)

    async def _poll(self, w: WorkerRef) -> None:
        """Relays one decode worker's outputs to the streams they belong to."""
        while True:
            try:
                events = await w.handle.poll.remote(1.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("polling %s failed: %s", w.name, e)
                self.pools.mark_dead(w.name)
                return
            for d in events:
                s = self.streams.get(d["request_id"])
                if s is not None:
                    s.put(Event.from_dict(d))

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, adm: Admission) -> AsyncIterator[Chunk]:
        if adm.request_id in self.streams:
            raise RouterError("ALREADY_EXISTS", f"request {adm.request_id} is already running")
        if self.queue_depth >= self.config.max_queue:
            raise RouterError(
                "RESOURCE_EXHAUSTED",
                f"the admission queue is full ({self.queue_depth} waiting); retry later",
            )
        if not self._pools_ready():
            raise RouterError(
                "UNAVAILABLE",
                "no live prefill or decode worker; check `tandem status` and scale the empty pool",
            )
        self.queue_depth += 1
        try:
            await self.slots.acquire()
        finally:
            self.queue_depth -= 1
        stream = RequestStream(adm.request_id, self.tokenizer, adm.sampling.stop)
        ended, created, failure = False, False, None
        try:
            self._record_new(adm)
            created = True
            self.streams[adm.request_id] = stream
            if self.mode == "colocated":
                await self._dispatch_colocated(adm, stream)
            else:
                await self._dispatch_disaggregated(adm, stream)
            while True:
                try:
                    event = await asyncio.wait_for(stream.queue.get(), self.config.stall_timeout_s)
                except TimeoutError:
                    raise RouterError(
                        "UNAVAILABLE",
                        f"no tokens from {stream.decode_worker} for "
                        f"{self.config.stall_timeout_s:.0f} s; the request was cancelled",
                    ) from None
                for chunk in stream.order(event):
                    if chunk.finished:
                        ended = True
                        self._record_end(adm.request_id, chunk)
                    yield chunk
                if stream.finished:
                    return
        except RouterError as e:
            failure = e
            raise
        finally:
            if created:
                self.streams.pop(adm.request_id, None)
            self.slots.release()
            if created and not ended:  # an error, a cancel, a deadline or a gone client
                await self._cancel_on_workers(stream)
                if failure is not None:
                    self._record_state(adm.request_id, "FAILED", "error", failure.message)
                else:
                    self._record_state(adm.request_id, "CANCELLED", "cancelled")

    def _pools_ready(self) -> bool:
        if self.mode == "disaggregated" and not self.pools.members("prefill"):
            return False
        return bool(self.pools.members("decode"))

    async def _dispatch_disaggregated(self, adm: Admission, stream: RequestStream) -> None:
        decode = await self._reserve(adm)
        stream.decode_worker = decode.name
        prefill = self._pick_prefill(adm)
        stream.prefill_worker = prefill.name
        self._assign(adm, prefill=prefill.name, decode=decode.name)
        job = {**self._job(adm), "decode": decode.info}
        self.loads[prefill.name].queued_tokens += len(adm.prompt_ids)
        try:
            first = await asyncio.wait_for(
                prefill.handle.prefill.remote(job), self.config.prefill_timeout_s + 5
            )
        except ray.exceptions.RayActorError:
            self.pools.mark_dead(prefill.name)
            raise RouterError("UNAVAILABLE", f"{prefill.name} died during prefill") from None
        finally:
            if prefill.name in self.loads:
                self.loads[prefill.name].queued_tokens -= len(adm.prompt_ids)
        if "error" in first and first["error"] != "cancelled":
            raise RouterError("INTERNAL", f"prefill failed on {prefill.name}: {first['error']}")
        if "error" not in first:  # (a cancel has already queued the stream's end)
            lp = [first["first_logprob"]] if first.get("first_logprob") is not None else None
            stream.put(Event(0, [first["first_token"]], lp))

    async def _dispatch_colocated(self, adm: Admission, stream: RequestStream) -> None:
        loads = [
            self.loads[w.name]
            for w in self.pools.members("decode")
            if w.name in self.loads and not w.draining
        ]
        for load in self.policy.decode_candidates(loads):
            w = self.pools.get(load.name)
            if w is None:
                continue
            stream.decode_worker = w.name
            self._assign(adm, worker=w.name)
            try:
                await asyncio.wait_for(
                    w.handle.submit.remote(self._job(adm)), self.config.rpc_timeout_s
                )
            except (TimeoutError, ray.exceptions.RayActorError):
                self.pools.mark_dead(w.name)
                continue
            load.running += 1
            return
        raise RouterError("UNAVAILABLE", "no live worker")

    @staticmethod
    def _job(adm: Admission) -> dict:
        return {
            "request_id": adm.request_id,
            "prompt_ids": adm.prompt_ids,
            "sampling": adm.sampling_dict,
            "seed": adm.seed,
            "priority": adm.priority,
        }

    async def cancel(self, request_id: str) -> bool:
        s = self.streams.get(request_id)
        if s is None:
            return False
        s.end_now("cancelled")
        await self._cancel_on_workers(s)
        return True

    async def _cancel_on_workers(self, s: RequestStream) -> None:
        calls = []
        for name in (s.prefill_worker, s.decode_worker):
            w = self.pools.get(name) if name else None
            if w is not None and w.alive:
                calls.append(w.handle.cancel.remote(s.request_id))
        if calls:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*calls, return_exceptions=True), self.config.rpc_timeout_s
                )
            except TimeoutError:
                log.warning("cancel of %s timed out", s.request_id)

    async def _reserve(self, adm: Admission) -> WorkerRef:
        """Decode allocates first: find a decode worker with room for the prompt's blocks."""
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while True:
            loads = [
                self.loads[w.name]
                for w in self.pools.members("decode")
                if w.name in self.loads and not w.draining
            ]
            if not loads:
                raise RouterError("UNAVAILABLE", "no live decode worker")
            for load in self.policy.decode_candidates(loads):
                w = self.pools.get(load.name)
                if w is None:
                    continue
                try:
                    blocks = await asyncio.wait_for(
                        w.handle.reserve.remote(adm.request_id, len(adm.prompt_ids)),
                        self.config.rpc_timeout_s,
                    )
                except (TimeoutError, ray.exceptions.RayActorError):
                    self.pools.mark_dead(w.name)
                    continue
                if blocks is not None:
                    load.kv_blocks_free -= len(blocks)
                    load.running += 1
                    return w
            if time.monotonic() > deadline:
                raise RouterError(
                    "RESOURCE_EXHAUSTED",
                    "no decode worker has room for this "
                    f"prompt ({len(adm.prompt_ids)} tokens) after "
                    f"{self.config.reserve_timeout_s:.0f} s; retry later",
                )
            await asyncio.sleep(0.05)

    def _pick_prefill(self, adm: Admission) -> WorkerRef:
        loads = [
            self.loads[w.name]
            for w in self.pools.members("prefill")
            if w.name in self.loads and not w.draining
        ]
        choice = self.policy.pick_prefill(loads, adm.prompt_ids)
        w = self.pools.get(choice.name) if choice else None
        if w is None:
            raise RouterError("UNAVAILABLE", "no live prefill worker")
        return w

    # -- Redis bookkeeping (best effort: Redis trouble is logged, never hangs a stream) -------
    def _record_new(self, adm: Admission) -> None:
        if self.state is not None:
            if not self._redis(
                self.state.create,
                adm.request_id,
                adm.prompt_ids,
                {**adm.sampling_dict, "seed": adm.seed},
                adm.tenant,
            ):
                raise RouterError("ALREADY_EXISTS", f"request id {adm.request_id} was used before")

    def _assign(self, adm: Admission, **workers: str) -> None:
        if self.state is not None:
            self._redis(self.state.assign, adm.request_id, **workers)
            self._redis(self.state.transition, adm.request_id, "DECODING", ("QUEUED",))

    def _record_end(self, request_id: str, chunk: Chunk) -> None:
        state = (
            "FAILED"
            if chunk.finish_reason == "error"
            else ("CANCELLED" if chunk.finish_reason == "cancelled" else "FINISHED")
        )
        self._record_state(request_id, state, chunk.finish_reason or "", chunk.error or "")

    def _record_state(self, request_id: str, state: str, reason: str, error: str = "") -> None:
        if self.state is not None:
            self._redis(self.state.finish, request_id, state, reason, error)

    def _redis(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            log.warning("Redis %s failed: %s", getattr(fn, "__name__", fn), e)
            return True
