"""Fair share's one ledger: the rules by which tenants share what is scarce, kept in one place
for both places that apply them. The router's slot queue (router/admission/fair.py) hands
out generation slots with it; the engine's seat policy (workers/engine/policy.py) orders and
preempts the sequences in its seats with it. Pure bookkeeping: no torch, no Ray, no clock.

- **Cost.** A tenant is charged for the tokens it is served: a prompt token costs
  PROMPT_COST, an output token OUTPUT_COST (a decode step's token costs more than a batched
  prompt token).
- **Counters.** Each tenant's virtual token count is what it was charged divided by its
  weight. The tenant with the least count is served first (VTC, Sheng et al., OSDI 2024).
- **Lift.** A tenant that starts asking again is lifted to the least count of its peers (the
  tenants active now), so that a quiet spell banks nothing.
- **Pruning.** Counts of tenants with nothing here are forgotten past MAX_IDLE_COUNTS: a
  router without keys takes whatever tenant a request names.
- **Share.** Of `total` slots or seats, a tenant's weighted share is weight / (the weights of
  the tenants active now, its own counted). What it holds beyond that is its excess; what
  it may still take within it is owed to it.
- **Order.** Requests are ordered first by whether they have waited their max wait (those
  go first of all), then by tier (lower first), then by their tenant's count; each side's
  own order (the policy, orders.py) and tie-breaks follow.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

PROMPT_COST = 1.0
OUTPUT_COST = 2.0
MAX_IDLE_COUNTS = 4096
OVERDUE = (0, 0, 0.0)  # the head of a request that has waited its max wait


def cost(prompt_tokens: float = 0.0, output_tokens: float = 0.0) -> float:
    """What serving these tokens costs, in prompt tokens."""
    return PROMPT_COST * prompt_tokens + OUTPUT_COST * output_tokens


def share(weight: float, total: float, active_weight: float) -> float:
    """A tenant's weighted share of `total`, among tenants whose weights sum to
    `active_weight` (its own counted)."""
    return total * weight / active_weight


def owed(held: int, more: int, weight: float, total: float, active_weight: float) -> bool:
    """Whether `more` are still within the tenant's share, given that it holds `held`."""
    return held + more <= share(weight, total, active_weight)


def excess(held: int, weight: float, total: float, active_weight: float) -> float:
    """How far past its share a tenant holding `held` is (negative: below it)."""
    return held - share(weight, total, active_weight)


def overdue(waited_s: float, max_wait_s: float | None) -> bool:
    return max_wait_s is not None and waited_s >= max_wait_s


class Ledger:
    """The tenants' virtual token counts. With `fair` off, the counts are still kept (and
    shown), but no order is made by them."""

    def __init__(self, fair: bool = True) -> None:
        self.fair = fair
        self.counters: dict[str, float] = {}
        self._pending: dict[str, float] = {}  # charges not yet settled

    def count(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def charge(self, tenant: str, tokens_cost: float, weight: float) -> None:
        self.counters[tenant] = self.count(tenant) + tokens_cost / weight

    def charge_later(self, tenant: str, tokens_cost: float, weight: float) -> None:
        """A charge that moves the tenant's count only at `settle`: while a batch is being
        built, keys must not move under it."""
        self._pending[tenant] = self._pending.get(tenant, 0.0) + tokens_cost / weight

    def settle(self) -> None:
        for tenant, charged in self._pending.items():
            self.counters[tenant] = self.count(tenant) + charged
        self._pending.clear()

    def lift(self, tenant: str, peers: Iterable[str], floor: float | None = None) -> None:
        """A tenant that starts asking again starts at the least count of `peers` (the
        tenants active now, itself not among them), or at `floor` when there are none."""
        counts = [self.count(p) for p in peers]
        least = min(counts) if counts else floor
        if least is not None:
            self.counters[tenant] = max(self.count(tenant), least)

    def prune(self, keep: Container[str]) -> None:
        """Forget the counts of tenants not in `keep`, once there are too many."""
        if len(self.counters) > MAX_IDLE_COUNTS:
            self.counters = {k: v for k, v in self.counters.items() if k in keep}

    def head(self, tenant: str, tier: int, waited_s: float, max_wait_s: float | None) -> tuple:
        """The head of a request's sort key: OVERDUE once it has waited `max_wait_s`, else
        its tier, then its tenant's count (with fair share)."""
        if overdue(waited_s, max_wait_s):
            return OVERDUE
        return (1, tier, self.count(tenant) if self.fair else 0.0)
