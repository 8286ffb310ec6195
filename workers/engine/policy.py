"""Scheduling policies. A policy is an ordering of requests: the scheduler admits waiting
requests in that order, serves running ones in that order, and preempts from its far end."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

from workers.engine.request import Request


class SchedulingPolicy(ABC):
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


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()
