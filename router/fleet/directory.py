"""What the router needs from whoever manages the worker pools (cluster/pools.py does): who
is in each pool, news of workers joining, dying or leaving, and the pool operations the Admin
service exposes. The router depends on this interface only."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.messages import DecodeEndpoint, Pool, PoolStatus, Status, WorkerInfo


class PoolRefusal(ValueError):
    """A scale or drain refused before anything changed: `status` says how (INVALID_ARGUMENT
    for a size past the pool's limit, FAILED_PRECONDITION for draining its last worker)."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class PoolEvent(str, enum.Enum):
    ADDED = "added"
    DEAD = "dead"  # failed: its requests must be replayed
    REMOVED = "removed"  # drained or scaled away


@dataclass(eq=False)
class WorkerRef:
    name: str
    pool: Pool
    handle: Any  # the Ray actor handle
    info: WorkerInfo
    alive: bool = True
    draining: bool = False
    missed_heartbeats: int = field(default=0, repr=False)

    @property
    def endpoint(self) -> DecodeEndpoint:
        """Where prefill workers send this decode worker's KV."""
        assert self.info.endpoint is not None, f"{self.name} is not a decode worker"
        return DecodeEndpoint(
            self.name, self.info.endpoint.host, self.info.endpoint.port, self.handle
        )


Listener = Callable[[PoolEvent, WorkerRef], None]


class WorkerDirectory(Protocol):
    def members(self, pool: Pool, include_dead: bool = False) -> list[WorkerRef]:
        """Workers of a pool, live ones only unless include_dead."""

    def get(self, name: str) -> WorkerRef | None: ...

    def subscribe(self, listener: Listener) -> None:
        """Called on the event loop with every ADDED, DEAD or REMOVED worker."""

    def mark_dead(self, name: str, why: str) -> None:
        """The worker is gone (or hung): stop using it. Under control, also make sure it is
        gone (a hung worker must not come back as a zombie)."""

    def set_control(self, control: bool) -> None:
        """This router holds the controller lease (it may stop workers), or no longer does."""

    def starting(self, pool: Pool) -> int:
        """Workers of the pool being started now (a scale-up or a replacement)."""

    def pool_status(self) -> list[PoolStatus]: ...

    async def scale(self, pool: Pool, replicas: int) -> list[str]:
        """Grow or shrink (by draining) a pool; returns its members' names. PoolRefusal,
        with nothing changed, past the pool's max_replicas."""

    async def drain(self, name: str, timeout_s: float) -> tuple[bool, str]:
        """Stop routing to a worker, let its requests end, then stop it. PoolRefusal for
        the pool's last live worker."""

    async def heal(self) -> None:
        """Replace dead workers so that each pool returns to its target size (run by the
        one router that holds the controller lease)."""

    async def refresh(self) -> None:
        """Pick up workers started by another router's pool manager."""
