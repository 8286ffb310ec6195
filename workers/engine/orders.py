"""The orders a queue may serve its requests in, within a tier and behind fair share
(fairness.py): one registry for the router's slots and the engine's seats.

- `fcfs` (router, engine): arrival;
- `priority` (router, engine): the request's priority, lower first, minus `aging_per_s` for
  each second it has waited;
- `shortest-first` (engine): fewest prompt tokens left to compute;
- `sjf` (router, engine): least predicted cost, prompt tokens left plus OUTPUT_COST for each
  output token predicted;
- `slack` (router): least time to the TTFT deadline, less the predicted time to a first
  token.

Each side wraps a request in its own `Work` view and breaks ties by arrival itself. With
`starve_after_s`, a shortest-first order puts a request that has waited that long ahead of
every one that has not (the engine's guard against starving long prompts; the router's
max wait does the same at the head of its key).
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from workers.engine.fairness import cost


class Side(enum.Enum):
    ROUTER = "router"  # the router's generation slots
    ENGINE = "engine"  # an engine's seats


class Work(Protocol):
    """What an order reads of a request, on the clock its `now` is given in."""

    @property
    def priority(self) -> int: ...
    @property
    def arrival(self) -> float: ...
    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to compute."""

    @property
    def output_left(self) -> float:
        """Output tokens it is predicted still to make, all its choices together."""

    @property
    def deadline(self) -> float | None:
        """When its first token is due; None: no deadline."""


@dataclass(frozen=True)
class OrderOptions:
    """What a side sets for the order it serves (each order reads what it needs)."""

    aging_per_s: float = 0.0  # priority: what a request gains each second it waits
    starve_after_s: float | None = None  # shortest-first: past this wait, first of all
    first_token_s: Callable[[float], float] | None = None  # slack: prompt tokens -> seconds


class Order(ABC):
    name: ClassVar[str]
    sides: ClassVar[frozenset[Side]]
    # Whether a waiting request may be admitted ahead of a running one with a larger key.
    # FCFS and priority keep running requests first, as vLLM does.
    admits_ahead: ClassVar[bool] = False

    @classmethod
    def of(cls, options: OrderOptions) -> Order:
        return cls()

    @abstractmethod
    def key(self, w: Work, now: float) -> tuple:
        """Smaller keys first; ties are broken by the caller, by arrival."""


ORDERS: dict[str, type[Order]] = {}


def _registered(cls: type[Order]) -> type[Order]:
    ORDERS[cls.name] = cls
    return cls


def order_names(side: Side) -> tuple[str, ...]:
    return tuple(name for name, cls in ORDERS.items() if side in cls.sides)


@_registered
class Fcfs(Order):
    name, sides = "fcfs", frozenset(Side)

    def key(self, w: Work, now: float) -> tuple:
        return ()


@_registered
class Priority(Order):
    """vLLM's convention: a lower `priority` is more urgent. With `aging_per_s`, a request
    gains that much for each second it has waited, so that a stream of urgent requests
    cannot hold a less urgent one back for ever."""

    name, sides = "priority", frozenset(Side)

    def __init__(self, aging_per_s: float = 0.0) -> None:
        self.aging_per_s = aging_per_s

    @classmethod
    def of(cls, options: OrderOptions) -> Order:
        return cls(options.aging_per_s)

    def key(self, w: Work, now: float) -> tuple:
        return (w.priority - self.aging_per_s * (now - w.arrival),)


@_registered
class ShortestFirst(Order):
    """Fewest prompt tokens left first: decodes, then short prompts, then the next chunk of
    a long one, so that a short prompt's first token waits a step, not for a long prompt's
    every chunk (the mean TTFT of a prefill queue is least this way). Prompt tokens found in
    the prefix cache still count as left: the cache is only looked up at admission."""

    name, sides = "shortest-first", frozenset({Side.ENGINE})
    admits_ahead = True

    def __init__(self, starve_after_s: float | None = None) -> None:
        self.starve_after_s = starve_after_s

    @classmethod
    def of(cls, options: OrderOptions) -> Order:
        return cls(options.starve_after_s)

    def key(self, w: Work, now: float) -> tuple:
        if self.starve_after_s is not None and now - w.arrival >= self.starve_after_s:
            return (0, 0)
        return (1, self.size(w))

    def size(self, w: Work) -> float:
        return w.prompt_left


@_registered
class PredictedCost(ShortestFirst):
    """Shortest-first by the whole cost left: prompt tokens left, plus OUTPUT_COST for each
    output token it is predicted still to make (the router's prediction; without one, its
    max_tokens)."""

    name, sides = "sjf", frozenset(Side)

    def size(self, w: Work) -> float:
        return cost(w.prompt_left, w.output_left)


@_registered
class Slack(Order):
    """Least slack first: the time left to a request's TTFT deadline, less the predicted time
    from a slot to its first token (`first_token_s`, by prompt tokens). Requests with no
    deadline come after those with one."""

    name, sides = "slack", frozenset({Side.ROUTER})

    def __init__(self, first_token_s: Callable[[float], float]) -> None:
        self.first_token_s = first_token_s

    @classmethod
    def of(cls, options: OrderOptions) -> Order:
        assert options.first_token_s is not None, "slack orders by a time to a first token"
        return cls(options.first_token_s)

    def key(self, w: Work, now: float) -> tuple:
        if w.deadline is None:
            return (math.inf,)
        return (w.deadline - now - self.first_token_s(w.prompt_left),)


def make_order(
    name: str,
    side: Side,
    aging_per_s: float = 0.0,
    starve_after_s: float | None = None,
    first_token_s: Callable[[float], float] | None = None,
) -> Order:
    """The order `name` as `side` serves it; ValueError naming the choices if it serves no
    such order."""
    names = order_names(side)
    if name not in names:
        raise ValueError(f"policy {name!r} is unknown (choose from {', '.join(names)})")
    return ORDERS[name].of(OrderOptions(aging_per_s, starve_after_s, first_token_s))
