"""Every message that crosses a process or package boundary inside the cluster: router ->
prefill and decode workers, prefill -> decode, workers -> router, and into the Redis log.

They are frozen dataclasses of plain values (plus one Ray actor handle), so Ray pickles them
as they are and a reader sees every field with its type. Protobuf never travels past the
router's edge; these never leave the cluster. This module imports neither torch nor Ray, so
clients and the CLI can load it cheaply.

A request's life in these types:

    router --PrefillJob--> prefill worker --RequestSpec, the KV, FirstTokens--> decode worker
    router <--PrefillResult-- prefill worker       router <--TokenEvent-- decode worker
    decode worker --LogWrite--> TokenLog (Redis) --LogAck--> decode worker

`attempt` numbers a request's tries (1 for the first, +1 for each replay). Every message of
an attempt carries it, so whatever a superseded attempt still sends is told apart and dropped.

A request with n > 1 choices is prefilled, and its KV pushed, once: the PrefillResult and the
transfer's trailer carry every choice's first token, and the decode worker forks the choices
onto the shared blocks. From there each choice is a request of its own (`RequestSpec.choice`): its
TokenEvents, token log and replays are under its own id, `choice_id(request_id, index)`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.engine.request import (
    ErrorKind,
    FinishReason,
    SamplingParams,
    Tenancy,
    choice_id,
    choice_seed,
)


class Status(enum.Enum):
    """How a request, an attempt or a call ended, by gRPC status name. UNAVAILABLE is the one
    transient failure: the attempt may be retried elsewhere. Every other non-OK status ends
    the request."""

    OK = "OK"
    CANCELLED = "CANCELLED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"

    @property
    def retryable(self) -> bool:
        return self is Status.UNAVAILABLE

    @classmethod
    def of_error(cls, kind: ErrorKind | None) -> Status:
        """The status of a request the engine ended in error: too big for the worker is a
        resource limit; anything else (a failed step) is the worker's fault."""
        return cls.RESOURCE_EXHAUSTED if kind is ErrorKind.TOO_BIG else cls.INTERNAL


class Pool(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Phase(str, enum.Enum):
    """Where one attempt of a request stands on a worker (its `phase` call)."""

    ABSENT = "absent"  # not there (never was, ended, or another attempt is)
    RESERVED = "reserved"  # decode: its blocks are held, its KV has not landed
    RUNNING = "running"  # decode: generating
    PREFILLING = "prefilling"  # prefill: in the engine
    PUSHING = "pushing"  # prefill: its KV queued or on the wire

    @property
    def on_its_way(self) -> bool:
        """Prefilling or pushing: the KV has yet to land on its decode worker."""
        return self in (Phase.PREFILLING, Phase.PUSHING)


def sampling_to_dict(sp: SamplingParams) -> dict:
    """JSON-ready: for the request record in Redis."""
    d = dataclasses.asdict(sp)
    if sp.constraint is not None:
        c = sp.constraint
        d["constraint"] = {"kind": c.kind.value, "text": c.text, "choices": list(c.choices)}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def sampling_from_dict(d: dict) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names}
    )


@dataclass(frozen=True)
class PoolStatus:
    """A pool as its manager sees it: the size it should have and where it stands."""

    pool: Pool
    target: int
    live: int
    starting: int = 0  # workers being started (a scale-up or a replacement)
    restarts: int = 0  # dead workers replaced since the cluster started
    autoscale: str = ""  # the last autoscaling decision, with its reason


@dataclass(frozen=True)
class DecodeEndpoint:
    """Where a prefill worker sends a request's KV: the decode worker's rendezvous store
    (host, port) and its actor handle, for the handshake and the receive call."""

    name: str
    host: str
    port: int
    handle: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once it has started."""

    name: str
    pool: Pool
    pid: int
    node: str
    endpoint: DecodeEndpoint | None = None  # decode workers only
    # A TCP port (on `host`) the worker's process accepts on while it lives: a refused
    # connection means the process is gone, seen faster than Ray reports an actor's death.
    host: str = ""
    liveness_port: int = 0


@dataclass(frozen=True)
class RequestSpec:
    """One request as every worker sees it. `output_ids` are tokens already sent to the client
    (a replay continues after them); `sampling.seed` is always resolved, so that draws depend
    only on (seed, position) and a replay samples exactly what the first attempt would have."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    attempt: int = 1
    output_ids: tuple[int, ...] = ()
    priority: int = 0
    router_id: str = ""  # the router that follows this attempt's events
    tenancy: Tenancy = Tenancy()

    def __post_init__(self) -> None:
        assert self.sampling.seed is not None, "resolve the seed before a request leaves"
        assert self.prompt_ids, "a request needs a prompt"

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV a prefill computes: the prompt and what was already sent."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def choices(self) -> int:
        return self.sampling.n

    @property
    def held_ids(self) -> list[str]:
        """What it is held under on its workers: its own id, and with n > 1 (the shared
        first attempt) each choice's."""
        return [choice_id(self.request_id, i) for i in range(self.choices)]

    def choice(self, index: int) -> RequestSpec:
        """Choice `index` of an n > 1 request as a request of its own: id
        `choice_id(request_id, index)`, seed `choice_seed(seed, index)`, n = 1. Past the
        shared first attempt, each choice is routed, logged and replayed as this."""
        sp = self.sampling
        return dataclasses.replace(
            self,
            request_id=choice_id(self.request_id, index),
            sampling=dataclasses.replace(sp, seed=choice_seed(sp.seed, index), n=1),
        )


@dataclass(frozen=True)
class PrefillJob:
    spec: RequestSpec
    decode: DecodeEndpoint  # where the KV goes


@dataclass(frozen=True)
class FirstToken:
    """A token a prefill sampled after `spec.output_ids`, with its logprobs when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def encode_first(first: tuple[FirstToken, ...]) -> bytes:
    """Each choice's first token as the KV transfer's trailer payload (JSON)."""
    return json.dumps([[f.token_id, f.logprob, f.top_logprobs] for f in first]).encode()


def decode_first(payload: bytes) -> tuple[FirstToken, ...]:
    """The inverse of encode_first; ValueError on anything else."""
    try:
        rows = json.loads(payload)
        return tuple(
            FirstToken(
                int(tok), lp, None if top is None else tuple((int(t), float(v)) for t, v in top)
            )
            for tok, lp, top in rows
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"not a first-token payload: {e}") from None


@dataclass(frozen=True)
class PrefillResult:
    """The first token sampled after `spec.output_ids` (output index len(output_ids)) for each
    of the request's choices (one unless n > 1), or why there is none."""

    request_id: str
    attempt: int
    status: Status = Status.OK
    first: tuple[FirstToken, ...] = ()
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker holds for a prompt's KV before any prefill starts."""

    request_id: str
    attempt: int
    num_blocks: int


@dataclass(frozen=True)
class PushResult:
    request_id: str
    ok: bool
    # From the prefill's end (its first token sampled) to the decode worker's admission of
    # the request: what the handoff adds to the time to first token.
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens of one attempt, in order: `token_ids[0]` is output index `offset`.
    The last event of an attempt has `finish_reason`; a failed attempt ends with status !=
    OK and `error` saying what failed (UNAVAILABLE: the router may replay it)."""

    request_id: str
    attempt: int
    offset: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    finish_reason: FinishReason | None = None
    status: Status = Status.OK
    error: str = ""
    text: str | None = None  # the text so far, cut at a stop string (stop requests only)
    # With top_logprobs: per token, its most likely (token id, logprob) alternatives.
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.status is not Status.OK


def first_event(spec: RequestSpec, first: FirstToken, index: int = 0) -> TokenEvent:
    """The event of the token a prefill sampled after `spec.output_ids` for choice `index`
    (under that choice's id): sent by the router as soon as the prefill returns, and again
    by the decode worker that admits it."""
    sp = spec.sampling
    lp, top = first.logprob, first.top_logprobs
    return TokenEvent(
        choice_id(spec.request_id, index),
        spec.attempt,
        len(spec.output_ids),
        (first.token_id,),
        (lp,) if sp.logprobs and lp is not None else None,
        top_logprobs=(top,) if sp.top_logprobs and top is not None else None,
    )


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    pool: Pool
    pid: int = 0
    node: str = ""
    alive: bool = True
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_reservable: int = 0  # the most one request can ever hold (total less the watermark)
    kv_bytes_per_token: int = 0  # K and V of one token, every layer, in the cache's dtype
    rank_pids: tuple[int, ...] = ()  # tp > 1: the worker's other ranks (it is rank 0)
    running: int = 0
    waiting: int = 0
    reserved: int = 0  # decode: reservations whose KV has not landed yet
    queued_prefill_tokens: int = 0  # prefill: prompt tokens accepted and not yet computed
    draining: bool = False
    steps: int = 0
    preemptions: int = 0
    prefix_hit_blocks: int = 0
    stalled_s: float = 0.0  # how long the engine step now running has taken
    # Not answering now: the figures above are its last answer, this many seconds old.
    unresponsive_s: float = 0.0

    @property
    def idle(self) -> bool:
        """Nothing to finish here: no request, no reservation, and no block held (a prefill
        worker holds a request's blocks until its KV push ends)."""
        return (
            self.running == 0
            and self.waiting == 0
            and self.reserved == 0
            and self.kv_blocks_free == self.kv_blocks_total
        )


# -- the token log, as the decode worker sees it (Redis behind it; see cluster/state.py) -------
class LogResult(enum.Enum):
    OK = "ok"
    GAP = "gap"  # the log is shorter than `offset`: write again from LogAck.length
    FENCED = "fenced"  # a newer attempt owns the request: stop writing it
    MISSING = "missing"  # no record (the store lost it): keep the tokens, try again later


@dataclass(frozen=True)
class LogWrite:
    """Append `token_ids` at output index `offset` (tokens already there are skipped), and
    with `finish_reason`, mark the request finished."""

    request_id: str
    attempt: int
    offset: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    error: str = ""


@dataclass(frozen=True)
class LogAck:
    request_id: str
    result: LogResult
    length: int = 0  # the log's length after the write


class TokenLog(Protocol):
    """Where a decode worker records each step's tokens: one call per step for all its
    requests. Raises ConnectionError (or the store's own error) when the store is unreachable;
    the caller keeps the writes and tries again."""

    def write(self, writes: list[LogWrite]) -> list[LogAck]: ...
