"""Scheduling policies. A policy is an ordering of requests: the scheduler admits waiting
requests in that order, serves running ones in that order, and preempts from its far end.

`make_policy` composes one of the orders below (`fcfs`, `priority`, `shortest-first`, `sjf`)
with `FairShare`, which puts first, from the first that differs: a request that has waited
`max_wait_s`; the lower tier; the tenant served least for its weight (tokens computed here,
an output token counting `OUTPUT_COST` prompt tokens, as the router counts them); then the
order itself. With one tenant (offline, or no keys) that is the order itself.

When every seat (`max_num_seqs`) is taken, fair share also gives a waiting request of a
tenant holding less than its weighted share of the seats the seat of a request of the
tenant most over its share, which is preempted and recomputed later, as when blocks run
out (`seat_for`): a flood that took every seat while it was alone does not make the next
tenant wait for its long requests to end."""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections import Counter

from workers.engine.request import Request

OUTPUT_COST = 2.0  # a decode step's token against a batched prompt token (router/fair.py)
MAX_IDLE_COUNTS = 4096  # counts of tenants with nothing here kept at most (router/fair.py)


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

    def served(self, req: Request, tokens: int, decode: bool) -> None:
        """`tokens` of req were scheduled this step (one output token if `decode`)."""

    def admitted(self, req: Request) -> None:
        """req left the waiting queue for the running batch."""

    def preempted(self, req: Request) -> None:
        """req went back to the waiting queue."""

    def end_step(self) -> None:
        """The step is scheduled: what it served may now move keys (never while the step is
        built, when a request already in it could be taken for the last and preempted)."""

    def seat_for(
        self, waiting: Request, running: list[Request], seats: int, given: list[Request]
    ) -> Request | None:
        """With every one of `seats` taken (by `running`, and by `given`: waiting requests
        seats were already freed for), the running request that gives its seat to `waiting`
        (preempted, recomputed later), if any. Only fair share names one."""
        return None

    def yielding_to(self, waiting: Request, running: list[Request], seats: int) -> set[str]:
        """Tenants whose decodes wait the step that gives `waiting` its first token. Only
        fair share names any."""
        return set()

    @abstractmethod
    def key(self, req: Request) -> tuple:
        """Smaller keys are served first and preempted last."""


class FCFSPolicy(SchedulingPolicy):
    def key(self, req: Request) -> tuple:
        return (self._order[req.request_id],)


class PriorityPolicy(SchedulingPolicy):
    """vLLM's convention: a lower `priority` value is more urgent; FCFS among equals. With
    `aging_per_s`, a request gains that much priority for each second since it arrived, so
    that a stream of urgent requests cannot hold a less urgent one back for ever."""

    def __init__(self, aging_per_s: float = 0.0) -> None:
        super().__init__()
        self.aging_per_s = aging_per_s

    def key(self, req: Request) -> tuple:
        aged = self.aging_per_s * (time.monotonic() - req.arrival_time)
        return (req.priority - aged, self._order[req.request_id])


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


class PredictedShortestFirstPolicy(ShortestFirstPolicy):
    """Shortest-first by the whole cost left: prompt tokens left to compute, plus
    OUTPUT_COST for each output token the router predicts it still has to make (its
    `tenancy.predicted_tokens`; without a prediction, its max_tokens)."""

    def key(self, req: Request) -> tuple:
        if time.monotonic() - req.arrival_time >= self.starve_after_s:
            return (0, 0, self._order[req.request_id])
        predicted = req.tenancy.predicted_tokens
        total = req.sampling.max_tokens if predicted is None else predicted
        left = max(0.0, total - req.num_output_tokens)
        prompt_left = req.num_tokens - req.num_computed_tokens
        return (1, prompt_left + OUTPUT_COST * left, self._order[req.request_id])


class FairShare(SchedulingPolicy):
    """Wraps an order with the max wait, the tier and the tenants' fair share (see the
    module's docstring). As in VTC, a tenant with nothing waiting that sends a request is
    lifted to the least count of the tenants with requests waiting (or, with none waiting,
    to the count of the tenant last admitted, when it was): an idle spell banks nothing,
    and what other tenants have been served since they were admitted still counts."""

    def __init__(self, inner: SchedulingPolicy, fair: bool, max_wait_s: float | None) -> None:
        super().__init__()
        self.inner, self.fair, self.max_wait_s = inner, fair, max_wait_s
        self.admits_ahead = inner.admits_ahead
        self.counters: dict[str, float] = {}
        self._step: dict[str, float] = {}  # this step's charges, applied at its end
        self._waiting: Counter[str] = Counter()  # waiting requests, by tenant
        self._waits: set[str] = set()  # the ids counted there
        self._here: Counter[str] = Counter()  # requests here, by tenant
        self._last_left = 0.0  # the count of the tenant last admitted, at its admission

    def register(self, req: Request) -> None:
        self.inner.register(req)
        t = req.tenancy.tenant
        if not self._waiting[t]:
            waiting = [self.counters.get(v, 0.0) for v, k in self._waiting.items() if k]
            floor = min(waiting) if waiting else self._last_left
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self._wait(req)
        self._here[t] += 1

    def inherit(self, child: Request, parent: Request) -> None:
        self.inner.inherit(child, parent)  # a forked choice runs at once: it never waits
        self._here[child.tenancy.tenant] += 1

    def admitted(self, req: Request) -> None:
        self._unwait(req)
        self._last_left = self.counters.get(req.tenancy.tenant, 0.0)

    def preempted(self, req: Request) -> None:
        self._wait(req)

    def forget(self, req: Request) -> None:
        self.inner.forget(req)
        self._unwait(req)
        t = req.tenancy.tenant
        self._here[t] -= 1
        if self._here[t] <= 0:
            del self._here[t]
        if len(self.counters) > MAX_IDLE_COUNTS:
            self.counters = {k: v for k, v in self.counters.items() if k in self._here}

    def _wait(self, req: Request) -> None:
        if req.request_id not in self._waits:
            self._waits.add(req.request_id)
            self._waiting[req.tenancy.tenant] += 1

    def _unwait(self, req: Request) -> None:
        if req.request_id in self._waits:
            self._waits.discard(req.request_id)
            self._waiting[req.tenancy.tenant] -= 1

    def served(self, req: Request, tokens: int, decode: bool) -> None:
        t = req.tenancy
        cost = OUTPUT_COST * tokens if decode else float(tokens)
        self._step[t.tenant] = self._step.get(t.tenant, 0.0) + cost / t.weight

    def end_step(self) -> None:
        for tenant, cost in self._step.items():
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        self._step.clear()

    def seat_for(
        self, waiting: Request, running: list[Request], seats: int, given: list[Request]
    ) -> Request | None:
        """A seat for a waiting request of a tenant holding less than its share of the seats
        (weight over the weights of the tenants here), from the tenant most over its share,
        its request with the largest key; or from a higher tier. Never to a tenant at its
        share, so seats do not change hands back and forth."""
        if not self.fair:
            return None
        w = waiting.tenancy
        over = self._over(waiting, [*running, *given], seats)
        lower = [r for r in running if r.tenancy.tier > w.tier]
        if lower:
            return max(lower, key=self.key)
        if over(w.tenant) + 1 > 0:  # it holds its share already (or would, with one more)
            return None
        peers = [r for r in running if r.tenancy.tier == w.tier and over(r.tenancy.tenant) > 0]
        if not peers:
            return None
        most = max(over(r.tenancy.tenant) for r in peers)
        return max((r for r in peers if over(r.tenancy.tenant) == most), key=self.key)

    def yielding_to(self, waiting: Request, running: list[Request], seats: int) -> set[str]:
        """The tenants over their share of the seats (or of a higher tier number), when
        `waiting`'s tenant holds less than its share: a tenant back with one request gets
        its first token from a step as short as when it was alone, the decodes of the
        tenants over their share held back for that step (the first to wait)."""
        if not self.fair:
            return set()
        w = waiting.tenancy
        over = self._over(waiting, running, seats)
        if over(w.tenant) + waiting.sampling.n > 0:  # it would hold more than its share
            return set()
        return {
            r.tenancy.tenant
            for r in running
            if r.tenancy.tier > w.tier or (r.tenancy.tier == w.tier and over(r.tenancy.tenant) > 0)
        }

    @staticmethod
    def _over(waiting: Request, holding: list[Request], seats: int):
        """Seats a tenant holds beyond its weighted share, among the tenants of `holding`
        and `waiting`'s."""
        held = Counter(r.tenancy.tenant for r in holding)
        weights = {r.tenancy.tenant: r.tenancy.weight for r in holding}
        weights[waiting.tenancy.tenant] = waiting.tenancy.weight
        total = sum(weights.values())
        return lambda t: held[t] - seats * weights[t] / total

    def key(self, req: Request) -> tuple:
        inner = self.inner.key(req)
        waited = time.monotonic() - req.arrival_time
        if self.max_wait_s is not None and waited >= self.max_wait_s:
            return (0, 0, 0.0, *inner)
        share = self.counters.get(req.tenancy.tenant, 0.0) if self.fair else 0.0
        return (1, req.tenancy.tier, share, *inner)


POLICIES = ("fcfs", "priority", "shortest-first", "sjf")


def make_policy(
    name: str,
    fair_share: bool = True,
    aging_per_s: float = 0.0,
    max_wait_s: float | None = None,
) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy {name!r} is unknown (choose from {', '.join(POLICIES)})")
    starve = max_wait_s if max_wait_s is not None else 10.0
    inner = {
        "fcfs": FCFSPolicy,
        "priority": lambda: PriorityPolicy(aging_per_s),
        "shortest-first": lambda: ShortestFirstPolicy(starve),
        "sjf": lambda: PredictedShortestFirstPolicy(starve),
    }[name]()
    return FairShare(inner, fair_share, max_wait_s)
