"""One request, driven to its end across attempts.

    attempt: reserve blocks on a decode worker -> prefill on a prefill worker (first token
             streams out at once) -> follow the decode worker's events to the last one
             (colocated, or a short request with local_prefill_max_tokens: submit it whole
             to a decode worker, which prefills it too)
    failed?  clean up both workers -> replay: a new attempt re-prefills the prompt and every
             token already sent, and continues after them

An attempt fails when one of its workers dies (a failed call, or the pool manager's news), a
transfer fails, or no token comes for `stall_timeout_s` and its workers no longer hold it. A
request queued behind others on a live worker is overload, not failure: the worker answering
that it holds the request (an answer from its engine loop, between two steps) keeps the
attempt going, however long the queue; a hung step is the fleet's to find (fleet.py), and
its news fails the attempt; and a request held yet silent for HELD_STALLS stall timeouts in a
row is given up all the same, a backstop against a worker that keeps a request it lost track
of. Only UNAVAILABLE failures are
replayed, at most `max_retries` times; the request then ends with UNAVAILABLE naming every
cause. The seed is fixed at admission and draws depend only on (seed, position), so a replay
produces exactly the tokens the first attempt would have: the stream drops the overlap and
goes on.

A request with n > 1 choices runs one driver per choice, each under the choice's own id (see
RequestSpec.choice), and their first attempt is one shared start (router/requests/
shared_start.py): one reservation and one prefill of the prompt, one KV push, and the decode
worker forks the choices on the shared blocks. Until the KV has landed the choices share one
fate (one's failure fails them all); after that, and in every replay, each choice is a
request of its own.

An adopted request (its router died) is first watched: while its decode worker still runs it,
its tokens land in the log and clients follow them there; if that worker is gone, it is
replayed from the logged tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from router.config import Mode
from router.errors import AttemptFailed, RouterError
from router.fleet.directory import WorkerRef
from router.records.store import RecordState, RequestRecord
from router.requests.driving import DriverEnv, FirstAttempt
from router.requests.stream import RequestStream
from workers.engine.request import FinishReason, split_choice
from workers.messages import (
    Phase,
    Pool,
    PrefillJob,
    PrefillResult,
    RequestSpec,
    Status,
    TokenEvent,
    first_event,
)

log = logging.getLogger(__name__)

# Stall timeouts in a row that an attempt rides out while its workers say they hold it.
HELD_STALLS = 10


@dataclass(frozen=True)
class WorkerLost:
    """News from the pool manager: this worker is gone."""

    name: str


@dataclass(frozen=True)
class SiblingFailed:
    """An n > 1 request's shared first attempt failed, seen by another of its choices."""

    attempt: int
    reason: str


class RequestDriver:
    """Runs on the router's event loop: its task (`start`) and whoever delivers its events."""

    def __init__(
        self,
        env: DriverEnv,
        spec: RequestSpec,
        stream: RequestStream | None,
        tenant: str = "",
        choices: int = 1,
        shared: FirstAttempt | None = None,
    ) -> None:
        """`choices`: the request's n (its record says so for Cancel and Resume); `shared`:
        an n > 1 request's choice has its first attempt there."""
        self.env = env
        self.spec = spec  # attempt and output_ids are filled in per attempt
        self.stream = stream
        self.tenant, self.choices = tenant, choices
        self.shared = shared
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.attempt = spec.attempt - 1  # attempts begun
        self.prefill: str | None = None
        self.decode: str | None = None
        self.failures: list[str] = []
        self.replaying_since: float | None = None  # a failure was seen; no new token yet
        self.task: asyncio.Task | None = None
        self.watching = False  # adopted and not yet replayed: its tokens are in the log only
        self.landed = False  # the attempt followed now has had an event from its decode worker
        self.abandoned = False  # this router is leaving: the request goes on without it
        self.waits = 0  # stall timeouts ridden out: its workers still held it

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    def start(self, adopted: bool = False) -> RequestDriver:
        self.task = asyncio.get_running_loop().create_task(self.run(adopted))
        return self

    def deliver(self, item: TokenEvent | WorkerLost | SiblingFailed) -> None:
        self.inbox.put_nowait(item)

    def abandon(self) -> None:
        """Stop following the request without cancelling it: it keeps running on its workers,
        and the controller adopts it once this router's heartbeat lapses."""
        self.abandoned = True
        if self.task is not None:
            self.task.cancel()

    def record(
        self,
        state: RecordState = RecordState.RUNNING,
        reason: FinishReason | None = None,
        error: str = "",
    ) -> RequestRecord:
        """The request's record as it stands (with a terminal state: as it ends)."""
        status = self.stream.chunks[-1].status if self.stream.finished else Status.OK
        return RequestRecord(
            self.request_id,
            self.spec.prompt_ids,
            self.spec.sampling,
            self.spec.priority,
            self.tenant,
            state,
            self.env.router_id,
            max(self.attempt, 0),
            self.prefill or "",
            self.decode or "",
            reason,
            status,
            error,
            tuple(self.failures),
            self.choices,
            self.spec.tenancy.predicted_tokens or 0.0,
            self.spec.tenancy.tpot_slo_ms or 0.0,
        )

    # -- the attempts -----------------------------------------------------------------------
    async def run(self, adopted: bool = False) -> None:
        cfg = self.env.config
        try:
            if adopted:
                self.watching = True
                ended = await self._watch()
                self.watching = False
                if ended:
                    return
            while True:
                self.attempt += 1
                try:
                    done = await self._attempt(self.attempt)
                    self._end(Status.OK, done.finish_reason)
                    return
                except AttemptFailed as f:
                    cause = f"attempt {self.attempt}: {f.reason}"
                    self.failures.append(cause)
                    await self.clean_up()
                    retries = len(self.failures)
                    if not (f.status.retryable and cfg.replay and retries <= cfg.max_retries):
                        self._give_up(f, retries)
                        return
                    self._replay_starts(f.reason)
        except asyncio.CancelledError:
            if not self.abandoned:
                try:  # a second cancel may land while this waits: the stream still ends
                    await self.clean_up()
                finally:
                    self._end(Status.OK, FinishReason.CANCELLED)
            raise
        except Exception as e:  # a bug here must still end the stream and the record
            log.exception("request %s: driver failed", self.request_id)
            try:
                await self.clean_up()
            finally:
                self._end(Status.INTERNAL, FinishReason.ERROR, f"{type(e).__name__}: {e}")
        finally:
            self.env.done(self)

    def _give_up(self, f: AttemptFailed, retries: int) -> None:
        if f.status is Status.CANCELLED:
            self._end(Status.OK, FinishReason.CANCELLED)
        elif not f.status.retryable:
            self._end(f.status, FinishReason.ERROR, f.reason)
        else:
            how = f"{retries} attempts" if self.env.config.replay else "a failure (replay is off)"
            why = f"gave up after {how}: " + "; ".join(self.failures)
            self._end(f.status, FinishReason.ERROR, why)

    def _replay_starts(self, cause: str) -> None:
        self.replaying_since = self.env.replays.start()
        log.warning(
            "request %s: replaying (attempt %d) after %s, from %d tokens",
            self.request_id,
            self.attempt + 1,
            cause,
            self.stream.next_offset,
        )

    def _note_progress(self) -> None:
        """A token arrived: if a replay was under way, it has recovered."""
        if self.replaying_since is not None:
            took = self.env.replays.recover(self.replaying_since)
            self.replaying_since = None
            log.warning(
                "request %s: replay recovered; next token %.2f s after the failure was seen",
                self.request_id,
                took,
            )

    async def _attempt(self, attempt: int) -> TokenEvent:
        spec = replace(
            self.spec,
            attempt=attempt,
            output_ids=tuple(self.stream.tokens),
            router_id=self.env.router_id,
        )
        self.prefill = self.decode = None
        if self.shared is not None and attempt == self.shared.attempt:
            await self.shared.begin()  # its workers are `placed` here as they are chosen
            return await self._follow(attempt, landed=self.shared.local)
        if self.runs_whole(spec):
            d = await self.place_whole(spec)
            self.began(attempt, "", d.name)
            return await self._follow(attempt, landed=True)
        d = await self.reserve_decode(spec)
        p = await self.pick_prefill()
        self.prefill = p.name
        self.began(attempt, p.name, d.name)
        r = await self.prefill_on(p, PrefillJob(spec, d.endpoint))
        self.put(first_event(spec, r.first[0]))
        return await self._follow(attempt, landed=False)

    def runs_whole(self, spec: RequestSpec) -> bool:
        """Whether this attempt runs whole on a decode worker: always in colocated mode; in
        disaggregated mode when it is short enough that a prefill worker's queue and the KV
        transfer would cost it more than a step on its decode worker does (as Dynamo's
        conditional disaggregation)."""
        if self.env.mode is Mode.COLOCATED:
            return True
        return spec.num_tokens <= self.env.config.local_prefill_max_tokens

    def placed(self, prefill: str | None, decode: str | None) -> None:
        """The workers this attempt runs on, as a shared start chooses them (a worker's
        death is news to this request from then on)."""
        self.prefill, self.decode = prefill, decode

    def began(self, attempt: int, prefill: str, decode: str) -> None:
        """An attempt begins on these workers: its record says so."""
        cause = self.failures[-1] if self.failures else ""
        rid, owner = self.request_id, self.env.router_id
        self.env.log.begin_attempt(rid, attempt, owner, prefill, decode, cause)

    async def reserve_decode(self, spec: RequestSpec) -> WorkerRef:
        """Decode allocates first: a decode worker with room for the KV. While the pool has
        none, the request waits for room as long as the pool frees blocks, so that a burst
        bigger than the decode pool's KV is served rather than refused; it gives up once
        reserve_timeout_s pass with no block freed, and in any case after prefill_timeout_s
        (G6: a request the pool never gets to is not kept forever)."""
        cfg, fleet = self.env.config, self.env.fleet
        now = time.monotonic()
        deadline, limit = now + cfg.reserve_timeout_s, now + cfg.prefill_timeout_s
        progress = fleet.decode_progress
        ttl = cfg.prefill_timeout_s + 2 * cfg.rpc_timeout_s
        while True:
            for w in await self._candidates(Pool.DECODE):
                wanted = lambda w=w: self.decode == w.name  # noqa: E731
                if await fleet.reserve(w, spec, ttl, wanted) is not None:
                    self.decode = w.name
                    return w
            if (never := fleet.fits_no_decode_worker(spec.num_tokens)) is not None:
                raise AttemptFailed(
                    Status.INVALID_ARGUMENT, f"this request cannot run here: {never}"
                )
            now = time.monotonic()
            if fleet.decode_progress != progress:
                progress = fleet.decode_progress
                deadline = min(now + cfg.reserve_timeout_s, limit)
            if now > deadline:
                why = (
                    f"for {cfg.prefill_timeout_s:.0f} s"
                    if now > limit
                    else f"and none freed any for {cfg.reserve_timeout_s:.0f} s"
                )
                raise AttemptFailed(
                    Status.RESOURCE_EXHAUSTED,
                    f"no decode worker had room for this request ({spec.num_tokens} tokens) "
                    f"{why}; retry later",
                )
            await fleet.wait_for_room(cfg.status_interval_s)

    async def place_whole(self, spec: RequestSpec) -> WorkerRef:
        """The whole request to a decode worker: it prefills the prompt itself."""
        for w in await self._candidates(Pool.DECODE):
            wanted = lambda w=w: self.decode == w.name  # noqa: E731
            if await self.env.fleet.submit(w, spec, wanted):
                self.decode = w.name
                return w
        raise AttemptFailed(Status.UNAVAILABLE, "no decode worker took the request")

    async def _candidates(self, pool: Pool) -> list[WorkerRef]:
        """Live, undrained workers of a pool, best first. With none, wait for the pool to heal
        (the controller starts replacements up to the pool's target) up to replay_wait_s."""
        cfg, fleet = self.env.config, self.env.fleet
        t0 = time.monotonic()
        while True:
            found = fleet.candidates(pool)
            if found:
                return found
            waited = time.monotonic() - t0
            if waited > cfg.replay_wait_s or not fleet.expects(pool):
                raise AttemptFailed(
                    Status.UNAVAILABLE,
                    f"no live {pool.value} worker after {waited:.0f} s; "
                    "check `tandem status` and scale the pool",
                )
            await asyncio.sleep(0.1)

    async def pick_prefill(self) -> WorkerRef:
        candidates = await self._candidates(Pool.PREFILL)
        return self.env.fleet.pick_prefill(candidates, self.spec)

    async def prefill_on(self, p: WorkerRef, job: PrefillJob) -> PrefillResult:
        """The prompt prefilled on p: its first token(s), or AttemptFailed."""
        r = await self.env.fleet.prefill(p, job, self.env.config.prefill_timeout_s)
        if not r.ok:
            raise AttemptFailed(
                r.status, f"prefill on {p.name} failed: {r.error or r.status.value}"
            )
        return r

    async def _follow(self, attempt: int, landed: bool) -> TokenEvent:
        """This attempt's events until its last one. Before the KV has landed (no event from
        the decode worker yet), the prefill worker's death fails the attempt too."""
        try:
            return await self._events(attempt, landed)
        except AttemptFailed as f:
            if self.shared is not None and attempt == self.shared.attempt and not self.landed:
                self.shared.failed(self, f.reason)
            raise

    async def _events(self, attempt: int, landed: bool) -> TokenEvent:
        stall = self.env.config.stall_timeout_s
        self.landed = landed
        silent = 0  # stall timeouts in a row with no event, its workers holding it
        while True:
            try:
                item = await asyncio.wait_for(self.inbox.get(), stall)
            except TimeoutError:
                held = silent + 1 < HELD_STALLS and await self._still_running(
                    self.decode, self.prefill, attempt
                )
                if held:  # queued where it runs: overload, not failure
                    if not silent:
                        log.info(
                            "request %s: no token for %.0f s, still held by %s; waiting on",
                            self.request_id,
                            stall,
                            self.decode if self.landed else f"{self.prefill} and {self.decode}",
                        )
                    silent += 1
                    self.waits += 1
                    continue
                why = (
                    f"held but silent for {HELD_STALLS} stall timeouts"
                    if silent
                    else "and it no longer has it (or did not answer)"
                )
                raise AttemptFailed(
                    Status.UNAVAILABLE,
                    f"no tokens from {self.decode} for {(silent + 1) * stall:.0f} s, {why}",
                ) from None
            silent = 0
            if isinstance(item, WorkerLost):
                if item.name == self.decode or (item.name == self.prefill and not self.landed):
                    phase = "" if self.landed else " before the KV landed"
                    raise AttemptFailed(Status.UNAVAILABLE, f"{item.name} died{phase}")
                continue
            if item.attempt != attempt:
                continue  # left over from an attempt that was given up
            if isinstance(item, SiblingFailed):
                if self.landed:
                    continue
                raise AttemptFailed(Status.UNAVAILABLE, item.reason)
            if item.status is not Status.OK:
                raise AttemptFailed(item.status, item.error or item.status.value)
            self.landed = True
            self.put(item)
            if item.finished:
                return item

    def put(self, event: TokenEvent) -> None:
        """An event of the attempt followed now (a first token, from whoever computed it)."""
        before = self.stream.next_offset
        self.stream.put(event)
        if self.stream.next_offset > before:
            self._note_progress()

    async def clean_up(self) -> None:
        """Whatever this attempt still holds on its workers is freed."""
        names = [n for n in (self.prefill, self.decode) if n]
        await self.env.fleet.cancel_on(names, self.spec.held_ids)

    def _end(self, status: Status, reason: FinishReason, error: str = "") -> None:
        """The request's end: its stream's last chunk and its record's terminal state. A
        cancel is a normal end (finish_reason "cancelled"); any other non-OK status fails."""
        if reason is FinishReason.CANCELLED:
            state, status = RecordState.CANCELLED, Status.OK
        elif status is Status.OK:
            state = RecordState.FINISHED
        else:
            state = RecordState.FAILED
            log.warning("request %s failed (%s): %s", self.request_id, status.value, error)
        self.stream.end(status, reason, error)
        self.env.log.end(self.record(state, reason, error), list(self.stream.tokens))

    # -- adopted requests -----------------------------------------------------------------
    async def _watch(self) -> bool:
        """An adopted request: True once it ended where it ran; False if it must be run again
        here (its workers are gone or no longer have it)."""
        log_ = self.env.log
        gone_since: float | None = None
        while True:
            try:
                rec = await log_.read(self.request_id)
            except RouterError:  # the store is away: keep watching until it is back
                await asyncio.sleep(1.0)
                continue
            if rec is None or rec.state.terminal:
                self.stream.end(Status.OK, rec.finish_reason if rec else FinishReason.ERROR)
                return True
            if rec.attempt and await self._still_running(rec.decode, rec.prefill, rec.attempt):
                gone_since = None
                try:  # news of its workers' deaths, or a second, then look again
                    await asyncio.wait_for(self.inbox.get(), 1.0)
                except TimeoutError:
                    pass
                continue
            # Not running any more: either it failed, or it has just ended and its end is not
            # in the log yet. Look twice, a second apart, before running it again.
            if rec.attempt and gone_since is None:
                gone_since = time.monotonic()
                await asyncio.sleep(1.0)
                continue
            try:
                tokens = await log_.tokens(self.request_id)
            except RouterError:
                continue
            stops, index = self.spec.sampling.stop, self.stream.index
            self.stream = RequestStream.open(
                self.request_id, self.env.tokenizer, stops, tokens, index
            )
            self.attempt, self.failures = rec.attempt, list(rec.failures)
            self.prefill, self.decode = rec.prefill or None, rec.decode or None
            await self.clean_up()  # whatever the old attempt still holds
            if rec.attempt == 0:  # its router died before it began: a start, not a replay
                log.warning("request %s: starting it (its router is gone)", self.request_id)
                return False
            cause = f"{rec.decode or 'its worker'} no longer runs it (its router is gone)"
            self.failures.append(f"attempt {rec.attempt}: {cause}")
            self._replay_starts(cause)
            return False

    async def _still_running(self, decode: str | None, prefill: str | None, attempt: int) -> bool:
        """This attempt is on its decode worker (generating, or queued in its engine), or on
        its way there (prefilling, or its KV being pushed to a reservation). A choice > 0 of
        an n > 1 request, in its shared first attempt, is on its way while the request's own
        KV is."""
        on_decode, on_prefill = await self._phases(decode, prefill, self.request_id, attempt)
        if on_decode is Phase.RUNNING or (on_decode is Phase.RESERVED and on_prefill.on_its_way):
            return True
        request_id, index = split_choice(self.request_id)
        if index == 0 or attempt != 1:
            return False
        on_decode, on_prefill = await self._phases(decode, prefill, request_id, attempt)
        return on_decode is Phase.RESERVED and on_prefill.on_its_way

    async def _phases(
        self, decode: str | None, prefill: str | None, rid: str, attempt: int
    ) -> tuple[Phase, Phase]:
        """`rid`'s phase on the decode worker and on the prefill worker named."""
        fleet = self.env.fleet
        return (
            await fleet.phase(decode or "", rid, attempt),
            await fleet.phase(prefill or "", rid, attempt),
        )
