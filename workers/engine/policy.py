"""The engine's seat policy: the order in which the scheduler admits waiting requests, serves
running ones and preempts from the far end, and who gives up a seat for whom.

A request's key is, from the first that differs: whether it has waited `max_wait_s`; its
tier; its tenant's count of tokens computed here for its weight (fair share, the ledger of
fairness.py, shared with the router); then the order (orders.py: `fcfs`, `priority`,
`shortest-first`, `sjf`) and arrival. With one tenant (offline, or no keys) that is the
order itself.

When every seat (`max_num_seqs`) is taken, fair share also gives a waiting request of a
tenant holding less than its weighted share of the seats the seat of a request of the
tenant most over its share, which is preempted and recomputed later, as when blocks run
out (`seat_for`): a flood that took every seat while it was alone does not make the next
tenant wait for its long requests to end.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

from workers.engine import fairness
from workers.engine.fairness import Ledger, cost
from workers.engine.orders import Order, Side, make_order
from workers.engine.request import Request, drop

STARVE_AFTER_S = 10.0  # shortest-first's guard when no max_wait_s is set


class SeatPolicy:
    """As in VTC, a tenant with nothing waiting that sends a request is lifted to the least
    count of the tenants with requests waiting (or, with none waiting, to the count of the
    tenant last admitted, when it was): an idle spell banks nothing, and what other tenants
    have been served since they were admitted still counts. Charges made while a step is
    built move the counts only at its end (`end_step`)."""

    def __init__(self, order: Order, fair: bool = True, max_wait_s: float | None = None) -> None:
        self.order, self.max_wait_s = order, max_wait_s
        self.admits_ahead = order.admits_ahead
        self.ledger = Ledger(fair)
        self._ticket = itertools.count()
        self._arrived: dict[str, int] = {}  # request id -> its place in arrival order
        self._waiting: Counter[str] = Counter()  # waiting requests, by tenant
        self._waits: set[str] = set()  # the ids counted there
        self._here: Counter[str] = Counter()  # requests here, by tenant
        self._last_left = 0.0  # the count of the tenant last admitted, at its admission

    @property
    def fair(self) -> bool:
        return self.ledger.fair

    # -- the requests' lives ------------------------------------------------------------------
    def register(self, req: Request) -> None:
        """Called once when a request enters; ties are broken by arrival order."""
        self._arrived[req.request_id] = next(self._ticket)
        t = req.tenancy.tenant
        if not self._waiting[t]:
            waiting = [v for v, k in self._waiting.items() if k]
            self.ledger.lift(t, waiting, floor=self._last_left)
        self._wait(req)
        self._here[t] += 1

    def inherit(self, child: Request, parent: Request) -> None:
        """A request forked from `parent` (a choice of n > 1) takes its place in the order;
        it runs at once, so it never waits."""
        self._arrived[child.request_id] = self._arrived[parent.request_id]
        self._here[child.tenancy.tenant] += 1

    def admitted(self, req: Request) -> None:
        """req left the waiting queue for the running batch."""
        self._unwait(req)
        self._last_left = self.ledger.count(req.tenancy.tenant)

    def preempted(self, req: Request) -> None:
        """req went back to the waiting queue."""
        self._wait(req)

    def forget(self, req: Request) -> None:
        self._arrived.pop(req.request_id, None)
        self._unwait(req)
        t = req.tenancy.tenant
        self._here[t] -= 1
        if self._here[t] <= 0:
            del self._here[t]
        self.ledger.prune(self._here)

    def _wait(self, req: Request) -> None:
        if req.request_id not in self._waits:
            self._waits.add(req.request_id)
            self._waiting[req.tenancy.tenant] += 1

    def _unwait(self, req: Request) -> None:
        if req.request_id in self._waits:
            self._waits.discard(req.request_id)
            self._waiting[req.tenancy.tenant] -= 1

    # -- charges ------------------------------------------------------------------------------
    def served(self, req: Request, tokens: int, decode: bool) -> None:
        """`tokens` of req were scheduled this step (one output token if `decode`)."""
        t = req.tenancy
        spent = cost(output_tokens=tokens) if decode else cost(prompt_tokens=tokens)
        self.ledger.charge_later(t.tenant, spent, t.weight)

    def end_step(self) -> None:
        """The step is scheduled: what it served may now move keys (never while the step is
        built, when a request already in it could be taken for the last and preempted)."""
        self.ledger.settle()

    # -- seats --------------------------------------------------------------------------------
    def seat_swaps(
        self, waiting: list[Request], running: list[Request], seats: int
    ) -> list[tuple[Request, Request]]:
        """With every seat taken, (running request, waiting request) pairs: the first gives
        its seat to the second (preempted before anything is scheduled this step, the second
        admitted first). The first waiting request of each tenant asks, in `waiting`'s
        order; one given a seat lets its tenant's next ask too."""
        swaps: list[tuple[Request, Request]] = []
        running = list(running)
        given: list[Request] = []
        asked: set[str] = set()
        for first in waiting:
            if len(running) + len(given) < seats:
                break
            if first.tenancy.tenant in asked:
                continue
            asked.add(first.tenancy.tenant)
            victim = self.seat_for(first, running, seats, given)
            if victim is not None:
                drop(running, victim)
                given.append(first)
                swaps.append((victim, first))
                asked.discard(first.tenancy.tenant)
        return swaps

    def seat_for(
        self, waiting: Request, running: list[Request], seats: int, given: list[Request]
    ) -> Request | None:
        """With every one of `seats` taken (by `running`, and by `given`: waiting requests
        seats were already freed for), the running request that gives its seat to `waiting`
        (preempted, recomputed later), if any: for a tenant holding less than its share of
        the seats, from the tenant most over its share, its request with the largest key; or
        from a higher tier. Never to a tenant at its share, so seats do not change hands
        back and forth."""
        if not self.fair:
            return None
        w = waiting.tenancy
        seated = _Seats(waiting, [*running, *given], seats)
        lower = [r for r in running if r.tenancy.tier > w.tier]
        if lower:
            return max(lower, key=self.key)
        if not seated.owed(w.tenant, 1):  # it holds its share already (or would, with one more)
            return None
        peers = [r for r in running if r.tenancy.tier == w.tier and seated.over(r.tenancy.tenant)]
        if not peers:
            return None
        most = max(seated.excess(r.tenancy.tenant) for r in peers)
        return max((r for r in peers if seated.excess(r.tenancy.tenant) == most), key=self.key)

    def yielding_to(self, waiting: Request, running: list[Request], seats: int) -> set[str]:
        """The tenants over their share of the seats (or of a higher tier number), when
        `waiting`'s tenant holds less than its share: a tenant back with one request gets
        its first token from a step as short as when it was alone, the decodes of the
        tenants over their share held back for that step."""
        if not self.fair:
            return set()
        w = waiting.tenancy
        seated = _Seats(waiting, running, seats)
        if not seated.owed(w.tenant, waiting.sampling.n):  # it would hold more than its share
            return set()
        return {
            r.tenancy.tenant
            for r in running
            if r.tenancy.tier > w.tier
            or (r.tenancy.tier == w.tier and seated.over(r.tenancy.tenant))
        }

    # -- order --------------------------------------------------------------------------------
    def key(self, req: Request) -> tuple:
        """Smaller keys are served first and preempted last."""
        now = time.monotonic()
        order = (*self.order.key(req, now), self._arrived[req.request_id])
        head = self.ledger.head(
            req.tenancy.tenant, req.tenancy.tier, now - req.arrival_time, self.max_wait_s
        )
        return (*head, *order)


class _Seats:
    """Who holds how many seats beyond a weighted share, among the tenants of `holding` and
    `waiting`'s."""

    def __init__(self, waiting: Request, holding: list[Request], seats: int) -> None:
        self.held = Counter(r.tenancy.tenant for r in holding)
        self.weights = {r.tenancy.tenant: r.tenancy.weight for r in holding}
        self.weights[waiting.tenancy.tenant] = waiting.tenancy.weight
        self.total_weight = sum(self.weights.values())
        self.seats = seats

    def excess(self, tenant: str) -> float:
        return fairness.excess(
            self.held[tenant], self.weights[tenant], self.seats, self.total_weight
        )

    def over(self, tenant: str) -> bool:
        return self.excess(tenant) > 0

    def owed(self, tenant: str, more: int) -> bool:
        weight = self.weights[tenant]
        return fairness.owed(self.held[tenant], more, weight, self.seats, self.total_weight)


def make_policy(
    name: str,
    fair_share: bool = True,
    aging_per_s: float = 0.0,
    max_wait_s: float | None = None,
) -> SeatPolicy:
    starve = max_wait_s if max_wait_s is not None else STARVE_AFTER_S
    order = make_order(name, Side.ENGINE, aging_per_s=aging_per_s, starve_after_s=starve)
    return SeatPolicy(order, fair_share, max_wait_s)
