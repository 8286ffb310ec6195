"""The request driver alone, with no Ray and no workers: a fake fleet (the driver's
`Placement`) answers its reservations, prefills and phases from a script, and plays the
decode workers, whose tokens follow a fixed function of the prompt and the position, so that
a replay must reproduce the run that never failed, token for token. Faults: a decode worker
dying mid-stream, a prefill worker dying, a failed KV transfer, refused reservations, waiting
for decode room, the retry limit, n > 1's shared start, and a cancel in every phase."""

import asyncio
from dataclasses import dataclass, field

import pytest

from router.config import Mode, RouterConfig
from router.errors import AttemptFailed
from router.fleet.directory import WorkerRef
from router.records.store import RecordState
from router.requests.driver import RequestDriver
from router.requests.driving import DriverEnv
from router.requests.shared_start import SharedStart
from router.requests.stream import RequestStream
from workers.engine.request import FinishReason, SamplingParams
from workers.messages import (
    DecodeEndpoint,
    FirstToken,
    Phase,
    Pool,
    PrefillResult,
    RequestSpec,
    Reservation,
    Status,
    TokenEvent,
    WorkerInfo,
)

PROMPT = (11, 12, 13, 14)
MAX_TOKENS = 12


def model(spec: RequestSpec, position: int) -> int:
    """The token at output position `position`: what any worker computes, replay or not."""
    return (sum(spec.prompt_ids) * 31 + spec.sampling.seed * 17 + position * 7) % 997 + 3


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def ref(name: str, pool: Pool) -> WorkerRef:
    endpoint = DecodeEndpoint(name, "127.0.0.1", 1) if pool is Pool.DECODE else None
    return WorkerRef(name, pool, None, WorkerInfo(name, pool, 1, "node", endpoint))


@dataclass
class Script:
    """What goes wrong, by attempt: each a set of attempt numbers (or counts)."""

    decode_dies_after: dict[int, int] = field(default_factory=dict)  # attempt: tokens first
    prefill_dies: set[int] = field(default_factory=set)
    transfer_fails: set[int] = field(default_factory=set)
    refusals: int = 0  # reservations refused (by every worker) before any is granted
    blocked: set[str] = field(default_factory=set)  # calls that never answer: reserve, ...
    # attempt: seconds its decode worker holds it after the first token, sending nothing
    # (queued behind others), before it goes on
    queued_s: dict[int, float] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)  # the decode worker forgets it, silently


class FakeFleet:
    """The driver's Placement, playing the workers too."""

    block_size = 16

    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.workers = {
            n: ref(n, Pool.DECODE if n.startswith("decode") else Pool.PREFILL)
            for n in ("decode-0", "decode-1", "prefill-0", "prefill-1")
        }
        self.decode_progress = 0
        self.calls: list[tuple] = []
        self.drivers: dict[str, RequestDriver] = {}
        self.tasks: set[asyncio.Task] = set()
        self.entered = asyncio.Event()  # a blocked call was reached
        self.holding: set[tuple[str, str, int]] = set()  # (decode worker, request, attempt)

    def candidates(self, pool):
        return [w for w in self.workers.values() if w.pool is pool and w.alive]

    def expects(self, pool):
        return True  # each pool has a target: a dead worker is replaced

    def pick_prefill(self, candidates, spec):
        return candidates[0]

    def fits_no_decode_worker(self, num_tokens):
        return None

    async def wait_for_room(self, timeout_s):
        self.calls.append(("wait_for_room",))
        self.decode_progress += 1  # a worker frees blocks
        await asyncio.sleep(0)

    async def _block(self, what: str) -> None:
        if what in self.script.blocked:
            self.entered.set()
            await asyncio.Event().wait()

    async def reserve(self, w, spec, ttl_s, wanted):
        self.calls.append(("reserve", w.name, spec.attempt, spec.request_id))
        await self._block("reserve")
        if self.script.refusals > 0:
            self.script.refusals -= 1
            return None
        return Reservation(spec.request_id, spec.attempt, 1)

    async def submit(self, w, spec, wanted):
        self.calls.append(("submit", w.name, spec.attempt))
        self._decode(w.name, spec)
        return True

    async def prefill(self, p, job, timeout_s):
        spec = job.spec
        self.calls.append(("prefill", p.name, spec.attempt, spec.request_id, spec.output_ids))
        await self._block("prefill")
        if spec.attempt in self.script.prefill_dies:
            self.kill(p.name)
            raise AttemptFailed(Status.UNAVAILABLE, f"{p.name} died")
        position = len(spec.output_ids)
        choices = [spec.choice(i) if spec.choices > 1 else spec for i in range(spec.choices)]
        first = tuple(FirstToken(model(c, position)) for c in choices)
        self._decode(job.decode.name, spec, transferred=True)
        return PrefillResult(spec.request_id, spec.attempt, Status.OK, first)

    async def phase(self, name, rid, attempt):
        self.calls.append(("phase", name, rid, attempt))
        return Phase.RUNNING if (name, rid, attempt) in self.holding else Phase.ABSENT

    async def cancel_on(self, names, request_id, notify=False, attempt=None):
        self.calls.append(("cancel_on", tuple(names)))
        await self._block("cancel_on")

    # -- the decode workers -----------------------------------------------------------------
    def _decode(self, name: str, spec: RequestSpec, transferred: bool = False) -> None:
        """Generate the rest of the request (each choice, for n > 1) on decode worker `name`,
        from the token after the first one (the prefill's), as events to its drivers."""
        for i in range(spec.choices):
            choice = spec.choice(i) if spec.choices > 1 else spec
            task = asyncio.get_running_loop().create_task(
                self._generate(name, choice, transferred, not transferred)
            )
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _generate(self, name, spec, transferred, with_first) -> None:
        await asyncio.sleep(0)
        d = self.drivers[spec.request_id]
        start = len(spec.output_ids) + (0 if with_first else 1)
        if transferred and spec.attempt in self.script.transfer_fails:
            d.deliver(
                TokenEvent(
                    spec.request_id,
                    spec.attempt,
                    start,
                    status=Status.UNAVAILABLE,
                    error="KV transfer failed",
                )
            )
            return
        dies_after = self.script.decode_dies_after.get(spec.attempt)
        held = (name, spec.request_id, spec.attempt)
        if spec.attempt in self.script.dropped:
            return  # never held, never a token
        self.holding.add(held)
        try:
            await self._stream(name, spec, d, start, dies_after)
        finally:
            self.holding.discard(held)

    async def _stream(self, name, spec, d, start, dies_after) -> None:
        queued = self.script.queued_s.get(spec.attempt)
        if queued:
            await asyncio.sleep(queued)
        for pos in range(start, MAX_TOKENS):
            if dies_after is not None and pos - start >= dies_after:
                self.kill(name)
                return
            last = pos == MAX_TOKENS - 1
            reason = FinishReason.LENGTH if last else None
            d.deliver(
                TokenEvent(
                    spec.request_id, spec.attempt, pos, (model(spec, pos),), finish_reason=reason
                )
            )
            await asyncio.sleep(0)

    def kill(self, name: str) -> None:
        """A worker dies: the fleet's news reaches every driver with a request there."""
        from router.requests.driver import WorkerLost

        self.workers[name].alive = False
        for d in self.drivers.values():
            if name in (d.decode, d.prefill):
                d.deliver(WorkerLost(name))


class FakeLog:
    def __init__(self) -> None:
        self.attempts: list[tuple] = []
        self.ended: list = []

    def begin_attempt(self, rid, attempt, owner, prefill, decode, cause):
        self.attempts.append((rid, attempt, prefill, decode, cause))

    def end(self, rec, tokens):
        self.ended.append((rec, list(tokens)))

    async def read(self, rid):
        return None

    async def tokens(self, rid, start=0):
        return []


def env(fleet, mode=Mode.DISAGGREGATED, **config) -> DriverEnv:
    cfg = RouterConfig(**{"stall_timeout_s": 5, "local_prefill_max_tokens": 0, **config})
    done: list = []
    e = DriverEnv("router-1", mode, cfg, Tok(), fleet, FakeLog(), done=done.append)
    e.finished = done
    return e


def driver(e: DriverEnv, n: int = 1, seed: int = 5) -> list[RequestDriver]:
    spec = RequestSpec("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, n=n))
    specs = [spec.choice(i) for i in range(n)] if n > 1 else [spec]
    streams = [RequestStream.open(c.request_id, Tok(), index=i) for i, c in enumerate(specs)]
    if n > 1:
        drivers = SharedStart(e, spec, streams).drivers
    else:
        drivers = [RequestDriver(e, spec, streams[0])]
    for d in drivers:
        e.fleet.drivers[d.request_id] = d
    return drivers


def run(script: Script | None = None, n: int = 1, mode=Mode.DISAGGREGATED, **config):
    """Drive one request to its end; (env, drivers)."""

    async def go():
        e = env(FakeFleet(script), mode, **config)
        ds = driver(e, n)
        for d in ds:
            d.start()
        await asyncio.wait_for(asyncio.gather(*(d.task for d in ds)), 20)
        return e, ds

    return asyncio.run(go())


def expected(n: int = 1, seed: int = 5) -> list[list[int]]:
    spec = RequestSpec("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, seed=seed, n=n))
    specs = [spec.choice(i) for i in range(n)] if n > 1 else [spec]
    return [[model(c, k) for k in range(MAX_TOKENS)] for c in specs]


def ended(e: DriverEnv) -> tuple[RecordState, list[int]]:
    [(rec, tokens)] = e.log.ended
    return rec.state, tokens


def test_a_request_with_no_fault_streams_the_model_once():
    e, [d] = run()
    assert d.stream.tokens == expected()[0] and d.stream.chunks[-1].finish_reason == "length"
    assert ended(e) == (RecordState.FINISHED, expected()[0])
    assert [a[1] for a in e.log.attempts] == [1] and e.finished == [d]


@pytest.mark.parametrize(
    "script, cause, sent",
    [
        (Script(decode_dies_after={1: 5}), "decode-0 died", 6),
        (Script(prefill_dies={1}), "prefill-0 died", 0),
        (Script(transfer_fails={1}), "KV transfer failed", 1),  # the first token went out
        (Script(decode_dies_after={1: 0}), "decode-0 died", 1),  # before its first own token
    ],
    ids=["decode-death", "prefill-death", "failed-transfer", "decode-death-at-once"],
)
def test_a_replay_after_each_failure_ends_as_the_run_that_never_failed(script, cause, sent):
    e, [d] = run(script)
    assert d.stream.tokens == expected()[0]  # nothing lost, nothing repeated
    assert ended(e) == (RecordState.FINISHED, expected()[0])
    attempts = e.log.attempts
    assert [a[1] for a in attempts] == [1, 2] and cause in attempts[1][4]
    assert d.failures and cause in d.failures[0]
    assert e.replays.started == 1 and e.replays.recovered == 1
    # The replay's prefill carried the tokens already sent: it started where they end.
    prefills = [c for c in e.fleet.calls if c[0] == "prefill"]
    assert [c[2] for c in prefills] == [1, 2]
    assert prefills[1][4] == tuple(expected()[0][:sent])
    assert ("cancel_on", tuple(n for n in (attempts[0][2], attempts[0][3]) if n)) in e.fleet.calls


def test_a_request_queued_past_the_stall_timeout_on_a_worker_that_holds_it_is_not_replayed():
    """Overload is not failure: no token for five stall timeouts, but the decode worker
    says each time that it still holds the request; it goes on in its first attempt."""
    e, [d] = run(Script(queued_s={1: 1.0}), stall_timeout_s=0.2)
    assert d.stream.tokens == expected()[0] and [a[1] for a in e.log.attempts] == [1]
    assert d.failures == [] and e.replays.started == 0
    assert d.waits >= 3 and ("phase", "decode-0", "r1", 1) in e.fleet.calls


def test_a_request_held_but_silent_for_ten_stall_timeouts_is_replayed_all_the_same():
    e, [d] = run(Script(queued_s={1: 2.0}), stall_timeout_s=0.05)
    assert d.stream.tokens == expected()[0] and [a[1] for a in e.log.attempts] == [1, 2]
    assert "held but silent for 10 stall timeouts" in d.failures[0] and d.waits == 9


def test_a_request_its_worker_no_longer_holds_is_replayed_after_the_stall_timeout():
    e, [d] = run(Script(dropped={1}), stall_timeout_s=0.2)
    assert d.stream.tokens == expected()[0] and [a[1] for a in e.log.attempts] == [1, 2]
    assert "no longer has it" in d.failures[0] and d.waits == 0


def test_a_refused_reservation_tries_the_next_worker_then_waits_for_room():
    e, [d] = run(Script(refusals=1))  # decode-0 says no: decode-1, in the same attempt
    reserves = [c[1] for c in e.fleet.calls if c[0] == "reserve"]
    assert reserves == ["decode-0", "decode-1"] and d.stream.tokens == expected()[0]
    assert ("wait_for_room",) not in e.fleet.calls and len(e.log.attempts) == 1
    e, [d] = run(Script(refusals=5))  # every worker says no, twice round, then one says yes
    assert e.fleet.calls.count(("wait_for_room",)) == 2
    assert d.stream.tokens == expected()[0] and len(e.log.attempts) == 1


def test_no_room_for_reserve_timeout_s_with_none_freed_is_resource_exhausted():
    async def go():
        fleet = FakeFleet(Script(refusals=10**6))

        async def still(timeout_s):  # the pool never moves
            await asyncio.sleep(0.01)

        fleet.wait_for_room = still
        e = env(fleet, reserve_timeout_s=0.2)
        [d] = driver(e)
        d.start()
        await asyncio.wait_for(d.task, 10)
        return e, d

    e, d = asyncio.run(go())
    last = d.stream.chunks[-1]
    assert last.status is Status.RESOURCE_EXHAUSTED and "no decode worker had room" in last.error
    assert ended(e)[0] is RecordState.FAILED and not e.log.attempts  # never began


def test_the_retry_limit_ends_the_request_unavailable_naming_every_cause():
    script = Script(decode_dies_after={a: 1 for a in range(1, 10)})

    async def go():
        fleet = FakeFleet(script)
        e = env(fleet, max_retries=2)
        [d] = driver(e)
        d.start()
        # Each attempt kills its decode worker: bring them back for the next attempt.
        while not d.task.done():
            for w in fleet.workers.values():
                w.alive = True
            await asyncio.sleep(0.001)
        return e, d

    e, d = asyncio.run(go())
    last = d.stream.chunks[-1]
    assert last.status is Status.UNAVAILABLE and "gave up after 3 attempts" in last.error
    assert last.error.count("died") == 3 and len(e.log.attempts) == 3
    assert d.stream.tokens == expected()[0][: len(d.stream.tokens)]  # a true prefix
    assert ended(e)[0] is RecordState.FAILED


def test_n_choices_share_one_placement_then_each_replays_alone():
    e, ds = run(Script(decode_dies_after={2: 2}), n=3)  # attempt 1 is shared: no fault there
    want = expected(n=3)
    assert [d.stream.tokens for d in ds] == want
    reserves = [c for c in e.fleet.calls if c[0] == "reserve"]
    prefills = [c for c in e.fleet.calls if c[0] == "prefill"]
    assert [(c[2], c[3]) for c in reserves] == [(1, "r1")]  # one reservation, the request's
    assert [(c[2], c[3]) for c in prefills] == [(1, "r1")]
    assert sorted(rec.request_id for rec, _ in e.log.ended) == ["r1", "r1#1", "r1#2"]


def test_a_shared_start_that_fails_before_the_kv_lands_fails_every_choice_and_replays_each():
    e, ds = run(Script(transfer_fails={1}), n=2)
    assert [d.stream.tokens for d in ds] == expected(n=2)
    prefills = sorted((c[2], c[3]) for c in e.fleet.calls if c[0] == "prefill")
    assert prefills == [(1, "r1"), (2, "r1"), (2, "r1#1")]  # then each choice on its own


@pytest.mark.parametrize("phase", ["reserve", "prefill", "decode"])
def test_a_cancel_in_each_phase_ends_the_stream_and_frees_the_workers(phase):
    async def go():
        blocked = {phase} if phase != "decode" else set()
        fleet = FakeFleet(Script(blocked=blocked))
        if phase == "decode":  # generating: its events stop coming
            fleet._generate = lambda *a: fleet.entered.set() or asyncio.sleep(3600)
        e = env(fleet)
        [d] = driver(e)
        d.start()
        await asyncio.wait_for(fleet.entered.wait(), 5)
        d.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(d.task, 5)
        return e, d

    e, d = asyncio.run(go())
    assert d.stream.finished and d.stream.chunks[-1].finish_reason == "cancelled"
    assert ended(e)[0] is RecordState.CANCELLED and e.finished == [d]
    held = {
        "reserve": (),
        "prefill": ("prefill-0", "decode-0"),
        "decode": ("prefill-0", "decode-0"),
    }
    assert ("cancel_on", held[phase]) in e.fleet.calls


def test_a_second_cancel_during_clean_up_still_ends_the_stream_and_record():
    """A Cancel call and the client going away may both cancel a request's driver; the second
    can land while the first waits on its workers to free the request. The stream and the
    record must end all the same: a stream left open waits forever (G6)."""

    async def go():
        fleet = FakeFleet(Script(blocked={"cancel_on"}))
        fleet._generate = lambda *a: asyncio.sleep(3600)  # generating
        e = env(fleet)
        [d] = driver(e)
        d.start()
        while d.decode is None or d.prefill is None:
            await asyncio.sleep(0.001)
        d.task.cancel()
        await asyncio.wait_for(fleet.entered.wait(), 5)
        d.task.cancel()  # again, mid clean-up
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(d.task, 5)
        return e, d

    e, d = asyncio.run(go())
    assert d.stream.finished and d.stream.chunks[-1].finish_reason == "cancelled"
    assert ended(e)[0] is RecordState.CANCELLED and e.finished == [d]


def test_colocated_runs_each_attempt_whole_on_a_decode_worker():
    e, [d] = run(Script(decode_dies_after={1: 4}), mode=Mode.COLOCATED)
    assert d.stream.tokens == expected()[0]
    calls = [c[:3] for c in e.fleet.calls if c[0] in ("submit", "prefill", "reserve")]
    assert calls == [("submit", "decode-0", 1), ("submit", "decode-1", 2)]
