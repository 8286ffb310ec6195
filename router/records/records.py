"""The router's side of the request store, kept off every request's critical path:

- `create` must reach the store: while it is unreachable, new requests get UNAVAILABLE with a
  message that says so (and should the unanswered create land after all, a queued write
  ends that record as FAILED, as its caller was told);
- every other write (an attempt begins, a request ends) is queued and written, in order, by
  one background task; while the store is unreachable the queue waits and streams go on;
- the store's identity is watched: when it comes back as a new process (a restart that may
  have lost its last second of writes), every request this router drives, and every one it
  ended in the last minute, is written back whole before the queue goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from router.errors import RouterError
from router.records.store import RecordState, RequestRecord, RequestStore
from workers.messages import Status

log = logging.getLogger(__name__)
_KEEP_ENDED_S = 60.0
# What a store raises when it cannot be reached (see router/records/store.py), and our own timeout.
AWAY = (ConnectionError, TimeoutError)
_RETRY_S = 0.5


@dataclass(frozen=True)
class _Ended:
    record: RequestRecord
    tokens: tuple[int, ...]
    at: float


Snapshots = Callable[[], list[tuple[RequestRecord, list[int]]]]


class Records:
    def __init__(
        self,
        store: RequestStore | None,
        timeout_s: float = 5.0,
        snapshots: Snapshots = lambda: [],
    ) -> None:
        """`snapshots`: the records and tokens of the requests running here now, written
        back to a store that lost them (restarted without its data)."""
        self.store = store
        self.timeout_s = timeout_s
        self.down_since: float | None = None
        self.identity: str | None = None
        self._queue: deque[tuple[str, Callable[[], Awaitable]]] = deque()
        self._wake = asyncio.Event()
        self._ended: deque[_Ended] = deque()
        self.snapshots = snapshots

    @property
    def available(self) -> bool:
        return self.store is not None and self.down_since is None

    @property
    def pending(self) -> int:
        return len(self._queue)

    def _unreachable(self, e: Exception) -> RouterError:
        return RouterError(
            Status.UNAVAILABLE,
            f"the request store (Redis at {self.store.where}) is unreachable "
            f"({type(e).__name__}: {e}); new requests are refused until it returns",
            final=False,
        )

    async def _call(self, coro: Awaitable):
        return await asyncio.wait_for(coro, self.timeout_s)

    async def create(self, rec: RequestRecord) -> None:
        if self.store is None:
            return
        if self.down_since is not None:
            raise self._unreachable(ConnectionError("it did not answer the last call"))
        try:
            nonce = uuid.uuid4().hex
            created = await self._call(self.store.create(rec, nonce))
        except AWAY as e:
            self._went_down(e)
            err = self._unreachable(e)
            # The create may still land (it sat in a socket buffer): once the store is back,
            # end that record as the caller was told, or nobody ever would. The nonce spares
            # a retry of the same request id, accepted meanwhile.
            self.write(
                f"void {rec.request_id}",
                lambda: self.store.void(rec.request_id, nonce, err.status, err.message),
            )
            raise err from None
        if not created:
            raise RouterError(Status.ALREADY_EXISTS, f"request id {rec.request_id} was used before")

    def write(self, what: str, make: Callable[[], Awaitable]) -> None:
        """Queue a write; the writer task sends it in order, retrying while the store is away."""
        if self.store is None:
            return
        self._queue.append((what, make))
        self._wake.set()

    def ended(self, rec: RequestRecord, tokens: list[int]) -> None:
        """Remember a request's end for a while, to write it back if the store restarts."""
        now = time.monotonic()
        self._ended.append(_Ended(rec, tuple(tokens), now))
        while self._ended and now - self._ended[0].at > _KEEP_ENDED_S:
            self._ended.popleft()

    # -- what a request's driver writes and reads (the RequestLog of driving.py) --------------
    def begin_attempt(
        self, rid: str, attempt: int, owner: str, prefill: str, decode: str, cause: str
    ) -> None:
        store = self.store
        self.write(
            f"{rid} attempt {attempt}",
            lambda: store.begin_attempt(rid, attempt, owner, prefill, decode, cause),
        )

    def end(self, rec: RequestRecord, tokens: list[int]) -> None:
        """The request ended (rec is terminal) with these tokens."""
        self.ended(rec, tokens)
        self.write(f"{rec.request_id} end", lambda: self.store.end(rec, tokens))

    async def read(self, rid: str) -> RequestRecord | None:
        return await self._fetch(lambda: self.store.get(rid))

    async def tokens(self, rid: str, start: int = 0) -> list[int]:
        return await self._fetch(lambda: self.store.tokens(rid, start))

    async def _fetch(self, make: Callable[[], Awaitable]):
        if self.store is None:
            raise RouterError(Status.UNAVAILABLE, "this router runs without a request store")
        try:
            return await self._call(make())
        except AWAY as e:
            self._went_down(e)
            raise self._unreachable(e) from None

    def _went_down(self, e: Exception) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning(
                "request store %s unreachable (%s: %s); writes are kept until it returns",
                self.store.where,
                type(e).__name__,
                e,
            )

    async def flush(self, timeout_s: float) -> bool:
        """Wait, at most timeout_s, until every queued write has reached the store (the
        writer task sends them); False if some have not (the store is away, or slow)."""
        deadline = time.monotonic() + timeout_s
        while self._queue and self.down_since is None and time.monotonic() < deadline:
            self._wake.set()
            await asyncio.sleep(0.02)
        return not self._queue

    # -- background -------------------------------------------------------------------------
    async def write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue and self.down_since is None:
                what, make = self._queue[0]
                try:
                    await self._call(make())
                except AWAY as e:
                    self._went_down(e)
                    break
                except Exception:  # a bug, not an outage: say so, and do not wedge the queue
                    log.exception("request store write %r failed; dropped", what)
                self._queue.popleft()

    async def watch_forever(self, interval_s: float = _RETRY_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:  # keep watching whatever happened, unless stopped meanwhile
                if asyncio.current_task().cancelling():
                    raise asyncio.CancelledError from None
                log.exception("request store check failed")

    async def check(self) -> None:
        if self.store is None:
            return
        try:
            identity = await self._call(self.store.ping())
        except AWAY as e:
            self._went_down(e)
            return
        restarted = self.identity is not None and identity != self.identity
        self.identity = identity
        if restarted:
            try:
                await self._restore()
            except AWAY as e:
                self._went_down(e)
                return
        if self.down_since is not None:
            log.warning(
                "request store %s is back after %.1f s%s; %d writes were kept",
                self.store.where,
                time.monotonic() - self.down_since,
                " (restarted)" if restarted else "",
                len(self._queue),
            )
            self.down_since = None
        if self._queue:
            self._wake.set()

    async def _restore(self) -> None:
        """Write back what a restarted store may have lost: writes are idempotent."""
        live = self.snapshots()
        for rec, tokens in live:
            await self._call(self.store.restore(rec, tokens))
        for e in list(self._ended):
            await self._call(self.store.restore(replace(e.record, state=RecordState.RUNNING), []))
            await self._call(self.store.end(e.record, list(e.tokens)))
        log.warning(
            "request store restarted: wrote back %d running and %d ended requests",
            len(live),
            len(self._ended),
        )
