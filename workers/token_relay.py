"""Carries a decode worker's token events out, two ways that never wait on each other:

- to the router that follows each request: one outbox per router, drained by that router's
  `poll`. A router that stops polling (it died) has its outbox dropped after a while; its
  requests go on generating, and their tokens still reach the log.
- to the token log (Redis behind the TokenLog interface): a thread of its own writes, in one
  call, every request's tokens not yet logged. While the store is unreachable the tokens are
  kept and the writes retried; when it is back, everything still held is written again from
  the start (the store skips what it already has), so a store that restarted and lost its
  last second of writes is filled in. A write the store refuses as FENCED (a newer attempt of
  the request runs elsewhere) stops this worker's copy of the request.

The engine loop thread calls `begin`, `emit` and `end`; everything else is thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workers.engine.request import FinishReason
from workers.messages import LogAck, LogResult, LogWrite, TokenEvent, TokenLog

log = logging.getLogger(__name__)

_NATURAL = (FinishReason.STOP, FinishReason.LENGTH)


@dataclass
class _Outbox:
    events: list[TokenEvent] = field(default_factory=list)
    last_poll: float = field(default_factory=time.monotonic)


@dataclass
class _Cursor:
    """One request's output tokens from index 0, and how many of them the log holds."""

    attempt: int
    tokens: list[int]
    logged: int
    finish: FinishReason | None = None
    finish_logged: bool = False
    ended_at: float | None = None
    retry_at: float = 0.0

    @property
    def dirty(self) -> bool:
        return self.logged < len(self.tokens) or (
            self.finish in _NATURAL and not self.finish_logged
        )


class TokenRelay:
    def __init__(
        self,
        name: str,
        token_log: TokenLog | None,
        on_fenced: Callable[[str], None],
        orphan_after_s: float = 30.0,
        retry_s: float = 0.5,
        keep_ended_s: float = 60.0,
    ) -> None:
        self.name = name
        self.token_log = token_log
        self.on_fenced = on_fenced
        self.orphan_after_s, self.retry_s, self.keep_ended_s = orphan_after_s, retry_s, keep_ended_s
        self._owners: dict[str, str] = {}  # request id -> router id
        self._outboxes: dict[str, _Outbox] = {}
        self._cond = threading.Condition()
        self._log_queue: queue.Queue = queue.Queue()
        self._cursors: dict[str, _Cursor] = {}  # the log thread's alone
        self.log_down_since: float | None = None
        self._next_try = 0.0
        self._thread = threading.Thread(target=self._log_forever, name=f"{name}-log", daemon=True)
        self._thread.start()

    # -- from the engine loop -------------------------------------------------------------
    def begin(self, request_id: str, attempt: int, router_id: str, prior: list[int]) -> None:
        """A request starts here with `prior` output tokens already sent (and logged)."""
        with self._cond:
            self._owners[request_id] = router_id
        self._log_queue.put(("begin", request_id, attempt, list(prior)))

    def follow(self, request_id: str, router_id: str) -> None:
        """Send this request's events to `router_id` (set at reservation, before `begin`)."""
        with self._cond:
            self._owners[request_id] = router_id

    def end(self, request_id: str) -> None:
        """The request left this worker without a natural end (cancelled, failed, fenced):
        what it logged stays; nothing more is sent."""
        with self._cond:
            self._owners.pop(request_id, None)
        self._log_queue.put(("end", request_id))

    def emit(self, events: list[TokenEvent]) -> None:
        now = time.monotonic()
        with self._cond:
            for e in events:
                owner = self._owners.get(e.request_id)
                box = self._outboxes.setdefault(owner, _Outbox()) if owner else None
                if box is not None and now - box.last_poll < self.orphan_after_s:
                    box.events.append(e)
                if e.finished:
                    self._owners.pop(e.request_id, None)
            self._cond.notify_all()
        self._log_queue.put(("events", events))

    # -- from routers ---------------------------------------------------------------------
    def poll(self, router_id: str, timeout_s: float) -> list[TokenEvent]:
        with self._cond:
            box = self._outboxes.setdefault(router_id, _Outbox())
            box.last_poll = time.monotonic()
            if not box.events:
                self._cond.wait(timeout_s)
            out, box.events = box.events, []
            box.last_poll = time.monotonic()
            self._drop_orphans()
        return out

    def _drop_orphans(self) -> None:
        now = time.monotonic()
        for rid, box in list(self._outboxes.items()):
            if now - box.last_poll > self.orphan_after_s:
                log.info("router %s stopped polling; dropping its %d events", rid, len(box.events))
                del self._outboxes[rid]

    def stop(self) -> None:
        self._log_queue.put(None)

    # -- the log thread -------------------------------------------------------------------
    def _log_forever(self) -> None:
        while True:
            wait = self.retry_s if any(c.dirty for c in self._cursors.values()) else 5.0
            try:
                item = self._log_queue.get(timeout=wait)
            except queue.Empty:
                item = ()
            if item is None:
                return
            items = [item] if item else []
            while True:
                try:
                    nxt = self._log_queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    return
                items.append(nxt)
            for it in items:
                self._apply(it)
            if self.token_log is not None:
                self._write()
            self._forget_ended()

    def _apply(self, item: tuple) -> None:
        if item[0] == "begin":
            _, rid, attempt, prior = item
            self._cursors[rid] = _Cursor(attempt, prior, logged=len(prior))
            return
        if item[0] == "end":
            c = self._cursors.get(item[1])
            if c is not None and c.ended_at is None:
                c.ended_at = time.monotonic()
            return
        for e in item[1]:
            c = self._cursors.get(e.request_id)
            if c is None or c.attempt != e.attempt:
                continue
            if e.token_ids and e.offset == len(c.tokens):
                c.tokens += e.token_ids
            if e.finished:
                c.finish = e.finish_reason or FinishReason.ERROR
                c.ended_at = time.monotonic()

    def _write(self) -> None:
        now = time.monotonic()
        due = [(rid, c) for rid, c in self._cursors.items() if c.dirty and c.retry_at <= now]
        if not due or (self.log_down_since is not None and now < self._next_try):
            return
        writes = [
            LogWrite(
                rid,
                c.attempt,
                c.logged,
                tuple(c.tokens[c.logged :]),
                c.finish if c.finish in _NATURAL else None,
            )
            for rid, c in due
        ]
        try:
            acks = self.token_log.write(writes)
        except Exception as e:  # unreachable (ConnectionError) or not: keep all, try again
            if self.log_down_since is None:
                self.log_down_since = now
                log.warning(
                    "token log unreachable (%s: %s); tokens are kept and written when it returns",
                    type(e).__name__,
                    e,
                    exc_info=not isinstance(e, (ConnectionError, TimeoutError)),
                )
            self._next_try = now + self.retry_s
            return
        if self.log_down_since is not None:
            log.info(
                "token log reachable again after %.1f s; rewriting %d requests",
                now - self.log_down_since,
                len(self._cursors),
            )
            self.log_down_since = None
            for c in self._cursors.values():  # a restarted store may have lost recent writes
                c.logged, c.finish_logged = 0, False
            return  # written, whole, at the next turn
        for ack in acks:
            self._ack(ack, now)

    def _ack(self, ack: LogAck, now: float) -> None:
        c = self._cursors.get(ack.request_id)
        if c is None:
            return
        if ack.result is LogResult.OK:
            c.logged = max(c.logged, min(ack.length, len(c.tokens)))
            if c.logged == len(c.tokens) and c.finish in _NATURAL:
                c.finish_logged = True
        elif ack.result is LogResult.GAP:
            c.logged = min(ack.length, len(c.tokens))
        elif ack.result is LogResult.MISSING:
            c.retry_at = now + self.retry_s
        else:  # FENCED: a newer attempt owns the request
            log.info("request %s: a newer attempt runs elsewhere; stopping here", ack.request_id)
            del self._cursors[ack.request_id]
            self.on_fenced(ack.request_id)

    def _forget_ended(self) -> None:
        """Ended requests stay a while after their last write, to be written again should the
        store come back without them; one that cannot be written for ten minutes is dropped."""
        now = time.monotonic()
        for rid, c in list(self._cursors.items()):
            if c.ended_at is None:
                continue
            age = now - c.ended_at
            if age > 600 and c.dirty:
                log.warning("request %s: giving up logging its last tokens", rid)
            if (age > self.keep_ended_s and not c.dirty) or age > 600:
                del self._cursors[rid]
