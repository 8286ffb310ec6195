"""What the router needs from the request store (Redis, in cluster/state.py): the record of
every accepted request, its token log, and the leases and heartbeats that let several routers
share a cluster. The router depends on this interface only; the cluster injects the store.

A store that cannot be reached raises the builtin ConnectionError (or TimeoutError); none
waits longer than the store's own timeout (G6). Writes are idempotent, so a write that failed
may be sent again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from workers.engine.request import FinishReason, SamplingParams
from workers.messages import Status, TokenLog


class RecordState(str, enum.Enum):
    QUEUED = "QUEUED"  # accepted, no attempt started
    RUNNING = "RUNNING"  # an attempt is under way
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (RecordState.FINISHED, RecordState.FAILED, RecordState.CANCELLED)


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # the seed resolved
    priority: int = 0
    tenant: str = ""
    state: RecordState = RecordState.QUEUED
    owner: str = ""  # the router driving it
    attempt: int = 0  # attempts begun (0: none yet)
    prefill: str = ""
    decode: str = ""
    finish_reason: FinishReason | None = None
    status: Status = Status.OK  # how a FAILED request failed
    error: str = ""
    failures: tuple[str, ...] = ()  # why each failed attempt failed, in order
    # n > 1: how many choices the request has. Each has a record of its own, under
    # `choice_id(request_id, index)`, with its own seed and n = 1.
    choices: int = 1
    # What admission promised it (its tenancy's): kept so that a router adopting it schedules
    # it as its own router did. 0: none.
    predicted_tokens: float = 0.0
    tpot_slo_ms: float = 0.0


class BeginResult(str, enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no record: the store lost it (restore it)
    ENDED = "ended"  # already terminal
    NOT_OWNER = "not_owner"  # another router drives the request now
    STALE = "stale"  # a newer attempt was already begun


class RequestStore(Protocol):
    @property
    def where(self) -> str:
        """The store's address, without credentials, for messages."""

    async def ping(self) -> str:
        """The store's identity; it changes when the store restarts (lost writes possible)."""

    async def create(self, rec: RequestRecord, nonce: str = "") -> bool:
        """Write a new QUEUED record; False if the id exists. `nonce` names this create
        for `void`."""

    async def void(self, rid: str, nonce: str, status: Status, error: str) -> bool:
        """End as FAILED the record the create named `nonce` wrote, if it landed and nothing
        began on it: for a create that went unanswered and was refused. False otherwise (no
        such record, or a later create under the same id)."""

    async def restore(self, rec: RequestRecord, tokens: list[int]) -> None:
        """Put back a record the store lost (after a restart), with its tokens so far."""

    async def begin_attempt(
        self, rid: str, attempt: int, owner: str, prefill: str, decode: str, failure: str
    ) -> BeginResult:
        """Record that `attempt` starts (and why the one before failed)."""

    async def end(self, rec: RequestRecord, tokens: list[int]) -> None:
        """Make the record terminal (`rec`'s state, finish_reason, status and error for the
        attempt `rec.attempt`), with its complete token log; a TTL starts."""

    async def get(self, rid: str) -> RequestRecord | None: ...

    async def tokens(self, rid: str, start: int = 0) -> list[int]: ...

    async def active(self) -> list[str]:
        """Ids of every record not yet terminal."""

    async def claim(self, rid: str, old_owner: str, new_owner: str) -> bool:
        """Take over a request whose router is gone; False if someone else did first."""

    async def heartbeat(self, router_id: str, address: str, ttl_s: float) -> None: ...

    async def live_routers(self) -> dict[str, str]:
        """Router id -> gRPC address, for every router whose heartbeat has not lapsed."""

    async def hold_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        """Take or renew a lease; True while `holder` has it."""

    async def lease_holder(self, name: str) -> str | None: ...

    async def change_tenants(self, changes: dict[str, dict], resets: list[str]) -> int:
        """Reset the tenants' overrides named in `resets`, then merge `changes` ({tenant:
        {field: value}}) into theirs, at once for every router of the store; returns the
        overrides' new version."""

    async def tenants_version(self) -> int:
        """The overrides' version: it changes at every change (0: none ever)."""

    async def tenants(self) -> tuple[int, dict[str, dict]]:
        """The overrides, {tenant: {field: value}}, and their version."""

    def token_log(self) -> TokenLog:
        """A picklable writer for decode workers, onto the same store."""

    async def close(self) -> None: ...
