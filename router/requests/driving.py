"""What a RequestDriver (router/requests/driver.py) needs from the router, as narrow interfaces:

- `Placement`: the workers, where a request may go and the calls that put it there
  (router/fleet/fleet.py's `Fleet` is the real one; the driver's unit tests script a fake);
- `RequestLog`: the request's record and token log in the store (router/records/records.py);
- `DriverEnv`: those two, the settings, and the counters a driver reports to.

Nothing here knows the Router or the driver's class: the driver depends on this module, and
the Router builds a DriverEnv out of its rooms.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.config import Mode, RouterConfig
from router.fleet.directory import WorkerRef
from router.records.store import RequestRecord
from workers.messages import Phase, Pool, PrefillJob, PrefillResult, RequestSpec, Reservation


class Placement(Protocol):
    decode_progress: int  # rises each time a decode worker was seen to free blocks

    def candidates(self, pool: Pool) -> list[WorkerRef]:
        """Live workers of a pool that take work, best first."""

    def expects(self, pool: Pool) -> bool:
        """Whether the pool has, or will have, a worker."""

    def pick_prefill(self, candidates: list[WorkerRef], spec: RequestSpec) -> WorkerRef: ...

    def fits_no_decode_worker(self, num_tokens: int) -> str | None:
        """Why no decode worker could ever hold this many tokens' KV, or None."""

    async def wait_for_room(self, timeout_s: float) -> None:
        """Until the decode pool next frees blocks, or timeout_s."""

    async def reserve(
        self, w: WorkerRef, spec: RequestSpec, ttl_s: float, wanted: Callable[[], bool]
    ) -> Reservation | None:
        """Blocks on w for the request, or None (no room, failed, too slow). A yes landing
        after the request gave up on w is cancelled unless `wanted()`."""

    async def submit(self, w: WorkerRef, spec: RequestSpec, wanted: Callable[[], bool]) -> bool:
        """The whole request to w (it prefills it too); False if w did not take it."""

    async def prefill(self, p: WorkerRef, job: PrefillJob, timeout_s: float) -> PrefillResult:
        """Raises AttemptFailed if p dies, fails or does not answer."""

    async def phase(self, name: str, rid: str, attempt: int) -> Phase: ...

    async def cancel_on(
        self,
        names: list[str],
        request_id: str | list[str],
        notify: bool = False,
        attempt: int | None = None,
    ) -> None: ...


class FirstAttempt(Protocol):
    """The first attempt of an n > 1 request, which its choices' drivers share
    (router/requests/shared_start.py)."""

    attempt: int  # which attempt it is
    local: bool  # it runs whole on its decode worker (no prefill worker, no transfer)

    async def begin(self) -> None:
        """Until the request is placed and its first tokens are out (the first caller
        starts the placement); raises as the placement failed."""

    def failed(self, driver: Any, reason: str) -> None:
        """One choice's attempt failed before the KV landed: so does every other's."""


class RequestLog(Protocol):
    """Writes are queued (they never block a request); reads raise RouterError while the
    store is unreachable."""

    def begin_attempt(
        self, rid: str, attempt: int, owner: str, prefill: str, decode: str, cause: str
    ) -> None: ...

    def end(self, rec: RequestRecord, tokens: list[int]) -> None: ...

    async def read(self, rid: str) -> RequestRecord | None: ...

    async def tokens(self, rid: str, start: int = 0) -> list[int]: ...


@dataclass
class Replays:
    """How replays went: started, recovered (a token after the failure), and how long
    recovery took, the last thousand (failure seen -> next token)."""

    started: int = 0
    recovered: int = 0
    recovery_s: list[float] = field(default_factory=list)
    on_start: Callable[[], None] = lambda: None  # metrics

    def start(self) -> float:
        self.started += 1
        self.on_start()
        return time.monotonic()

    def recover(self, since: float) -> float:
        took = time.monotonic() - since
        self.recovered += 1
        self.recovery_s.append(took)
        del self.recovery_s[:-1000]
        return took


@dataclass
class DriverEnv:
    router_id: str
    mode: Mode
    config: RouterConfig
    tokenizer: Any
    fleet: Placement
    log: RequestLog
    replays: Replays = field(default_factory=Replays)
    done: Callable[[Any], None] = lambda driver: None  # a driver has ended
    leaving: Callable[[], bool] = lambda: False  # the router hands its requests over
