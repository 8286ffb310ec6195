"""Scheduling policies. A policy is an ordering of requests: the scheduler admits waiting
requests in that order, serves running ones in that order, and preempts from its far end."""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod

from workers.engine.request import Request


class SchedulingPolicy(ABC):
    # Whether a waiting request may be admitted ahead of a running one with a larger key.
    # FCFS and priority keep running requests first, as vLLM does.
    admits_ahead = False

    def __init__(self) -> None:
        self._ticket = itertools.count()
        self._order: dict[str, int] = {}

    def register(self, req: Request) -> None:
        """Called once when a request enters; ties are broken by arrival order."""
        self._order[req.request_id] = next(self._ticket)

    def inherit(self, child: Request, parent: Request) -> None:
        """A request forked from `parent` (a choice of n > 1) takes its place in the order."""
        self._order[child.request_id] = self._order[parent.request_id]

    def forget(self, req: Request) -> None:
        self._order.pop(req.request_id, None)

    @abstractmethod
    def key(self, req: Request) -> tuple:
        """Smaller keys are served first and preempted last."""


class FCFSPolicy(SchedulingPolicy):
    def key(self, req: Request) -> tuple:
        return (self._order[req.request_id],)


class PriorityPolicy(SchedulingPolicy):
    """vLLM's convention: a lower `priority` value is more urgent; FCFS among equals."""

    def key(self, req: Request) -> tuple:
        return (req.priority, self._order[req.request_id])


class ShortestFirstPolicy(SchedulingPolicy):
    """Fewest prompt tokens left to compute first: decodes, then short prompts, then the
    next chunk of a long one. A short prompt that arrives while long ones are being prefilled
    is admitted ahead of them, so its first token waits one step, not for the long prompts'
    every chunk (the mean TTFT of a prefill queue is least this way). Against starvation, a
    request that has waited `starve_after_s` since it arrived goes ahead of every one that
    has not, in arrival order. Prompt tokens found in the prefix cache still count as left:
    the cache is only looked up at admission."""

    admits_ahead = True

    def __init__(self, starve_after_s: float = 10.0) -> None:
        super().__init__()
        self.starve_after_s = starve_after_s

    def key(self, req: Request) -> tuple:
        if time.monotonic() - req.arrival_time >= self.starve_after_s:
            return (0, 0, self._order[req.request_id])
        return (1, req.num_tokens - req.num_computed_tokens, self._order[req.request_id])


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
    "shortest-first": ShortestFirstPolicy,
}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()
