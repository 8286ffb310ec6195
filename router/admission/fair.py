"""Who gets the router's next generation slot: `max_in_flight` sequences at once, a request of
n choices taking n, handed out in an order made of, from the first that differs:

1. a request that has waited its tenant's `max_wait_s` (or the router's) goes first of all,
   in arrival order: nobody waits for ever, whatever the policy;
2. the tenant's `tier`, lower first;
3. with fair share, the tenant's virtual token count in the ledger it shares with the
   engines (workers/engine/fairness.py): prompt tokens charged once at admission, output
   tokens as they stream. A tenant that starts waiting again is lifted to the least count of
   the tenants active now (holding or waiting for slots). The tenant served least for its
   weight goes first;
4. the order (`admission_policy`, from the registry of workers/engine/orders.py): `fcfs`;
   `priority`; `sjf` (the prompt plus n times the predicted output); `slack`;
5. arrival.

The best request waits for room rather than let later ones pass it, so a request of many
choices is not passed over for ever; a tenant at its `max_concurrency` is skipped, its
requests waiting for its own to end.

With fair share, a tenant's weighted share of the slots is its own (`owed`): of `total`,
weight / (the active tenants' weights, its own counted). A flood may hold every slot while
nobody else asks, but a tenant of the best waiter's tier or better holding less than its
share is not made to wait for the flood's requests to end: with no slot free, it is let in
past `total` (and past the best waiter of another tenant, unless that one has waited its
max wait). Until the flood's requests end and give their slots back, the router holds up
to twice `total`, never more. Used from the router's event loop alone.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from router.admission.predictor import LinearFit
from router.admission.tenants import TenantTable
from router.errors import RouterError
from router.tenant_policy import Tenant
from workers.engine.fairness import OVERDUE, Ledger, cost, owed
from workers.engine.orders import Order, Side, make_order
from workers.messages import Status


@dataclass(eq=False)
class Ticket:
    """One request waiting for, or holding, its slots."""

    tenant: str
    n: int = 1  # choices: slots it takes
    prompt_tokens: int = 0
    priority: int = 0
    predicted_tokens: float = 0.0  # output tokens predicted, per choice
    ttft_deadline: float | None = None  # on the queue's clock: when its first token is due
    reject_if_late: bool = False  # refuse it, waiting or not, once the deadline cannot be met
    max_tokens: int = 16
    arrival: float = 0.0
    granted_at: float | None = None
    seq: int = 0
    _fut: asyncio.Future | None = field(default=None, repr=False)
    _late: asyncio.TimerHandle | None = field(default=None, repr=False)

    # -- as an order sees it (orders.Work) ----------------------------------------------------
    @property
    def prompt_left(self) -> int:
        return self.prompt_tokens

    @property
    def output_left(self) -> float:
        return self.n * self.predicted_tokens

    @property
    def deadline(self) -> float | None:
        return self.ttft_deadline


class Shed(RouterError):
    """A request refused at admission: its predicted wait for a slot passes the bound. Not
    final; worth a retry once the queue ahead has drained below the bound."""

    def __init__(self, wait_s: float, bound_s: float) -> None:
        retry_s = max(1.0, wait_s - bound_s)
        super().__init__(
            Status.RESOURCE_EXHAUSTED,
            f"overloaded: a slot is predicted in {wait_s:.1f} s, past "
            f"router.admission_shed_wait_s={bound_s:g}; retry in {retry_s:.0f} s",
            final=False,
            retry_after_s=retry_s,
        )


class FairQueue:
    def __init__(
        self,
        total: int,
        tenants: TenantTable,
        policy: str = "fcfs",
        fair_share: bool = True,
        aging_per_s: float = 0.0,
        max_wait_s: float | None = None,
        clock=time.monotonic,
        shed_wait_s: float | None = None,
    ) -> None:
        """`shed_wait_s`: refuse a request whose predicted wait for its slots passes it
        (`Shed`), rather than queue it to time out; None: queue every one."""
        self.total = self.free = total
        self.shed_wait_s = shed_wait_s
        self.tenants = tenants
        self.clock = clock
        self.ledger = Ledger(fair_share)  # virtual tokens: served / weight
        self.running: Counter[str] = Counter()  # slots held, by tenant
        self._waiting: list[Ticket] = []
        self._seq = itertools.count()
        self.first_token_s = LinearFit(prior=0.5)  # slot to first token, by prompt tokens
        self.hold_s = LinearFit(prior=5.0)  # a slot's holding time, by predicted output
        self.configure(policy, fair_share, aging_per_s, max_wait_s)

    def configure(
        self, policy: str, fair_share: bool, aging_per_s: float, max_wait_s: float | None
    ) -> None:
        """The order from the next slot handed out on (ValueError naming the choices for an
        order the router does not serve)."""
        self.order: Order = make_order(
            policy, Side.ROUTER, aging_per_s=aging_per_s, first_token_s=self.first_token_s
        )
        self.ledger.fair, self.max_wait_s = fair_share, max_wait_s

    @property
    def fair_share(self) -> bool:
        return self.ledger.fair

    # -- slots ------------------------------------------------------------------------------
    def check(self, t: Ticket) -> None:
        """Raise RouterError (INVALID_ARGUMENT) if t could never get its slots here."""
        pol = self.tenants.policy(t.tenant)
        if t.n > self.total:
            raise RouterError(
                Status.INVALID_ARGUMENT,
                f"sampling.n={t.n}: each choice takes a slot, and this router has "
                f"{self.total} (router.max_in_flight)",
            )
        if pol.max_concurrency and t.n > pol.max_concurrency:
            raise RouterError(
                Status.INVALID_ARGUMENT,
                f"sampling.n={t.n}: tenant {t.tenant} may run {pol.max_concurrency} sequences "
                "at once (tenants.max_concurrency)",
            )

    async def acquire(self, t: Ticket) -> None:
        """Wait for t's slots, in the order above. Raises RouterError when t can never run
        here, or (with reject_if_late) once its deadline cannot be met."""
        self.check(t)
        pol = self.tenants.policy(t.tenant)
        t.arrival, t.seq = self.clock(), next(self._seq)
        self._lift(t.tenant)
        if t.reject_if_late:
            self._refuse_if_late(t, self.start_estimate(t))
        if not self._waiting and self._fits(t, pol):
            self._grant(t)
            return
        if self.shed_wait_s is not None:
            wait_s = self.start_estimate(t)
            if wait_s > self.shed_wait_s:
                raise Shed(wait_s, self.shed_wait_s)
        t._fut = asyncio.get_running_loop().create_future()
        self._waiting.append(t)
        if t.reject_if_late and t.ttft_deadline is not None:
            latest = t.ttft_deadline - self.first_token_s(t.prompt_tokens) - self.clock()
            t._late = asyncio.get_running_loop().call_later(max(0.0, latest), self._late, t)
        self._wake()
        try:
            await t._fut
        except asyncio.CancelledError:
            if t._fut.done() and not t._fut.cancelled():  # given, then cancelled: give back
                self.release(t)
            else:
                self._leave(t)
                self._wake()  # a large waiter leaving may let smaller ones behind it in
            raise

    def recheck(self) -> None:
        """After a change of the tenants or the order: refuse the waiters that can never run
        now (a cap lowered below their choices), and hand out what the change allows."""
        for t in list(self._waiting):
            if t._fut is None or t._fut.done():
                continue
            try:
                self.check(t)
            except RouterError as e:
                self._leave(t)
                t._fut.set_exception(e)
        self._wake()

    def release(self, t: Ticket) -> None:
        if t.granted_at is None:
            return
        self.free += t.n
        self.running[t.tenant] -= t.n
        if self.running[t.tenant] <= 0:
            del self.running[t.tenant]
        self.hold_s.add(t.predicted_tokens, self.clock() - t.granted_at)
        t.granted_at = None
        self.ledger.prune(self.active())
        self._wake()

    def served(self, tenant: str, output_tokens: int) -> None:
        """Output tokens streamed to a tenant: they count against its share."""
        self._charge(tenant, cost(output_tokens=output_tokens))

    def first_token(self, t: Ticket) -> None:
        """t's first token arrived: learn how long a prompt of its length takes."""
        if t.granted_at is not None:
            self.first_token_s.add(t.prompt_tokens, self.clock() - t.granted_at)

    # -- what it would do -------------------------------------------------------------------
    def start_estimate(self, t: Ticket) -> float:
        """Seconds before t would get its slots: those asked by requests ordered ahead of it,
        beyond the free ones, freed at the rate slots have been freed."""
        now = self.clock()
        pol = self.tenants.policy(t.tenant)
        if (
            self._owed(t, pol)
            and self._under_cap(t, pol)
            and (t.n <= self.free or self.free <= 0)
            and all(
                w.tenant != t.tenant
                and pol.tier <= self.tenants.policy(w.tenant).tier
                and self._key(w, now, self.tenants.policy(w.tenant))[:3] != OVERDUE
                for w in self._waiting
            )
        ):
            return 0.0  # its share's slots are its own: it goes in at once, as in _wake
        mine = self._key(t, now, pol)
        ahead = sum(
            w.n for w in self._waiting if self._key(w, now, self.tenants.policy(w.tenant)) < mine
        )
        need = ahead + t.n - self.free
        return 0.0 if need <= 0 else need * self.hold_s(t.predicted_tokens) / self.total

    @property
    def depth(self) -> int:
        return len(self._waiting)

    def waiting(self, tenant: str) -> int:
        return sum(1 for t in self._waiting if t.tenant == tenant)

    def active(self) -> set[str]:
        """Tenants holding or waiting for slots now."""
        return set(self.running) | {t.tenant for t in self._waiting}

    # -- internals --------------------------------------------------------------------------
    def _key(self, t: Ticket, now: float, pol: Tenant) -> tuple:
        cap = pol.max_wait_s if pol.max_wait_s is not None else self.max_wait_s
        head = self.ledger.head(t.tenant, pol.tier, now - t.arrival, cap)
        if head == OVERDUE:  # in arrival order, whatever the order
            return (*head, t.arrival, t.seq)
        return (*head, *self.order.key(t, now), t.arrival, t.seq)

    def _fits(self, t: Ticket, pol: Tenant) -> bool:
        return self._under_cap(t, pol) and (t.n <= self.free or self._owed(t, pol))

    def _owed(self, t: Ticket, pol: Tenant, active_weight: float | None = None) -> bool:
        """t's slots are within its tenant's weighted share of `total`, among the tenants
        active now (`active_weight`, their weights: t's own counted): it takes them even
        when others hold every slot (fair share only)."""
        if not self.fair_share:
            return False
        if active_weight is None:
            active_weight = self._active_weight(t.tenant)
        # Never past twice `total` in all, however many tenants come one after another.
        mine = owed(self.running[t.tenant], t.n, pol.weight, self.total, active_weight)
        return mine and t.n <= self.free + self.total

    def _active_weight(self, *also: str) -> float:
        return sum(self.tenants.policy(a).weight for a in self.active().union(also))

    def _under_cap(self, t: Ticket, pol: Tenant) -> bool:
        return not pol.max_concurrency or self.running[t.tenant] + t.n <= pol.max_concurrency

    def _wake(self) -> None:
        # A waiter cancelled (its future too) leaves on a later turn of the loop: never
        # grant it meanwhile, or its slots would be lost.
        for w in [w for w in self._waiting if w._fut is None or w._fut.done()]:
            self._leave(w)
        while self._waiting:
            now = self.clock()
            policies = {w.tenant: self.tenants.policy(w.tenant) for w in self._waiting}
            open_ = [w for w in self._waiting if self._under_cap(w, policies[w.tenant])]
            if not open_:
                return

            def key(w: Ticket, now=now, policies=policies) -> tuple:
                return self._key(w, now, policies[w.tenant])

            best = min(open_, key=key)
            weight = self._active_weight() if self.fair_share else 1.0
            if best.n > self.free and not self._owed(best, policies[best.tenant], weight):
                # Room is kept for it. Only once none is left (a flood holds it all), and
                # unless it has waited its max wait, another tenant of its tier or better,
                # owed slots, takes its own past it: from nobody's free room.
                if self.free > 0 or key(best)[:3] == OVERDUE:
                    return
                owed = [
                    w
                    for w in open_
                    if w.tenant != best.tenant
                    and policies[w.tenant].tier <= policies[best.tenant].tier
                    and self._owed(w, policies[w.tenant], weight)
                ]
                if not owed:
                    return
                best = min(owed, key=key)
            self._leave(best)
            self._grant(best)
            best._fut.set_result(None)

    def _grant(self, t: Ticket) -> None:
        self.free -= t.n
        self.running[t.tenant] += t.n
        t.granted_at = self.clock()
        self._charge(t.tenant, cost(prompt_tokens=t.prompt_tokens))

    def _leave(self, t: Ticket) -> None:
        if t in self._waiting:
            self._waiting.remove(t)
        if t._late is not None:
            t._late.cancel()

    def _lift(self, tenant: str) -> None:
        """A tenant that starts waiting again starts at the least count of the active ones."""
        active = self.active()
        if tenant not in active:
            self.ledger.lift(tenant, active)

    def _charge(self, tenant: str, tokens_cost: float) -> None:
        self.ledger.charge(tenant, tokens_cost, self.tenants.policy(tenant).weight)

    def _refuse_if_late(self, t: Ticket, wait_s: float) -> None:
        if t.ttft_deadline is None:
            return
        due = self.clock() + wait_s + self.first_token_s(t.prompt_tokens)
        if due > t.ttft_deadline:
            raise RouterError(
                Status.RESOURCE_EXHAUSTED,
                f"its first token is predicted in {1e3 * (due - t.arrival):.0f} ms, past its "
                f"ttft_slo_ms of {1e3 * (t.ttft_deadline - t.arrival):.0f} (reject_if_late)",
            )

    def _late(self, t: Ticket) -> None:
        if t._fut is None or t._fut.done() or t not in self._waiting:
            return
        self._leave(t)
        try:
            self._refuse_if_late(t, 0.0)
        except RouterError as e:
            t._fut.set_exception(e)
        else:  # the fit moved: look again at the new latest start
            latest = t.ttft_deadline - self.first_token_s(t.prompt_tokens) - self.clock()
            self._waiting.append(t)
            t._late = asyncio.get_running_loop().call_later(max(0.01, latest), self._late, t)
        self._wake()
