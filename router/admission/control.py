"""Admission control: what stands between a valid request and its generation slots.

    the tenant's quota (refused past it, with when to retry) -> its output length predicted,
    its SLOs settled (its own, else its tier's) -> a Ticket in the FairQueue (fair.py) ->
    slots -> its tokens counted against the tenant's share and quota as they stream -> at
    its end, the predictor learns the length it had

`AdmissionControl` owns the tenants (router/admission/tenants.py), the predictor
(router/admission/predictor.py) and the slots. The Router calls it for each request; the
Admin call `Tenants` and `tandem status` read it. The tenants' run-time changes go through
the store, when there is one: the router that takes the change writes it there, and every
router reads it back at its next controller round (router/controller.py), so a change holds
at every router, and across their restarts, until it is reset. Used from the router's event
loop alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from router.admission.fair import FairQueue, Ticket
from router.admission.predictor import LengthPredictor
from router.admission.request import Admission
from router.admission.tenants import TenantTable
from router.config import RouterConfig
from router.errors import RouterError
from router.metrics import RouterMetrics
from router.records.store import RequestRecord
from router.tenant_policy import DEFAULT, Tenant
from workers.engine.request import Tenancy
from workers.messages import RequestSpec, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TenantState:
    """A tenant's policy and what it holds on this router, for `tandem status`."""

    policy: Tenant
    running: int  # sequences holding slots
    waiting: int  # requests waiting for slots
    served: float  # fair share's count: tokens served / weight
    quota_left: float | None  # tokens its quota admits now; None: no quota


class AdmissionControl:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.tenants = TenantTable(config.tenants)
        self.predictor = LengthPredictor()
        self.slots = FairQueue(  # n choices take n
            config.max_in_flight,
            self.tenants,
            config.admission_policy,
            config.admission_fair_share,
            config.admission_aging_per_s,
            config.admission_max_wait_s,
            shed_wait_s=config.admission_shed_wait_s,
        )
        self._tenants_version = 0  # of the overrides read from the store (0: none)

    def configure(self, c: RouterConfig) -> None:
        """The admission order from the next slot freed on (the tenants change through
        `tenants.update`; max_in_flight is fixed at start)."""
        self.slots.configure(
            c.admission_policy,
            c.admission_fair_share,
            c.admission_aging_per_s,
            c.admission_max_wait_s,
        )
        self.slots.recheck()

    def update(self, changes: dict[str, dict], resets=()) -> None:
        """Change tenants' policies on this router alone: `resets` back to the config's, then
        `changes` ({tenant: {field: value}}), all or none (ValueError naming the field); the
        waiting requests then see them."""
        self._run_by(self.tenants.with_changes(changes, resets))

    async def change(self, store, changes: dict[str, dict], resets=()) -> None:
        """Change tenants' policies as `update` does, on every router of the store: written
        there (ConnectionError when it cannot be, and then nothing changed anywhere), then
        read back here at once; the other routers read it at their next `sync`."""
        overrides = self.tenants.with_changes(changes, resets)  # refused before it is sent
        if store is None:
            self._run_by(overrides)
            return
        await store.change_tenants(changes, list(resets))
        await self.sync(store)

    def _run_by(self, overrides: dict[str, dict]) -> dict[str, str]:
        bad = self.tenants.set_overrides(overrides)
        self.slots.recheck()
        return bad

    async def sync(self, store) -> None:
        """Take up the tenants' overrides in the store if they changed since last read."""
        if await store.tenants_version() == self._tenants_version:
            return
        version, overrides = await store.tenants()
        if version == self._tenants_version:
            return
        for why in self._run_by(overrides).values():
            log.error("tenants' changes in the store: left out %s", why)
        log.info("tenants' changes (version %d): %s", version, self.tenants.overrides)
        self._tenants_version = version

    def ticket(self, adm: Admission) -> tuple[Ticket, RequestSpec]:
        """The request's place in the queue, and its spec with its tenancy: its tenant's
        weight and tier, its predicted output, its TPOT target. Refuses it if its tenant's
        quota is spent (RESOURCE_EXHAUSTED, with when to retry), or if it could never get
        its slots (INVALID_ARGUMENT)."""
        tenant = adm.tenant or DEFAULT
        pol = self.tenants.policy(tenant)
        spec, prompt = adm.spec, len(adm.prompt_ids)
        ttft_ms, tpot_ms = self.tenants.config.slo_ms(pol.tier)
        ttft_ms = adm.ttft_slo_ms or ttft_ms
        tpot_ms = adm.tpot_slo_ms or tpot_ms
        if adm.reject_if_late and ttft_ms is None:
            raise RouterError(
                Status.INVALID_ARGUMENT,
                f"reject_if_late: give ttft_slo_ms (tier {pol.tier} has no default)",
            )
        wait_s = self.tenants.quota_wait_s(tenant, prompt)
        if wait_s > 0:
            self.metrics.refused(self.metrics.tenant_tags(tenant, pol.tier), "quota")
            raise RouterError(
                Status.RESOURCE_EXHAUSTED,
                f"tenant {tenant} has used its {pol.tokens_per_minute:.0f} tokens a minute "
                f"(tenants.tokens_per_minute); retry in {wait_s:.1f} s",
                final=False,
                retry_after_s=wait_s,
            )
        max_tokens = spec.sampling.max_tokens
        predicted = self.predictor.predict(tenant, prompt, max_tokens)
        deadline = self.slots.clock() + ttft_ms / 1000 if ttft_ms else None
        ticket = Ticket(
            tenant,
            spec.choices,
            prompt,
            adm.priority,
            predicted,
            deadline,
            adm.reject_if_late,
            max_tokens=max_tokens,
        )
        self.slots.check(ticket)
        tenancy = Tenancy(tenant, pol.weight, pol.tier, predicted, tpot_ms)
        return ticket, replace(spec, tenancy=tenancy)

    async def acquire(self, ticket: Ticket) -> None:
        """Wait for the ticket's slots; its prompt then counts against its tenant's quota."""
        await self.slots.acquire(ticket)
        self.tenants.charge(ticket.tenant, ticket.prompt_tokens)

    def release(self, ticket: Ticket) -> None:
        self.slots.release(ticket)

    def served(self, ticket: Ticket, made: list[int], index: int, k: int, ended: bool) -> None:
        """Count `k` output tokens of choice `index` against its tenant's share and quota
        (`made`: output tokens of each choice so far); once the choice has ended well
        (`ended`), teach the predictor its length."""
        if k:
            if not any(made):
                self.slots.first_token(ticket)
            made[index] += k
            self.slots.served(ticket.tenant, k)
            self.tenants.charge(ticket.tenant, k)
        if ended:
            p = self.predictor
            p.observe(ticket.tenant, ticket.prompt_tokens, ticket.max_tokens,
                      ticket.predicted_tokens, made[index])  # fmt: skip
            self.metrics.length_error.set(p.mean_abs_error or 0.0, self.metrics.tags)

    def tenancy(self, rec: RequestRecord) -> Tenancy:
        """The tenancy of a request adopted from its record: its tenant's policy now, with
        the prediction and TPOT target its admission gave it."""
        try:
            pol = self.tenants.policy(rec.tenant or DEFAULT)
        except ValueError:  # a record from before tenant names were checked
            pol = self.tenants.policy(DEFAULT)
        return Tenancy(
            pol.name, pol.weight, pol.tier, rec.predicted_tokens or None, rec.tpot_slo_ms or None
        )

    def states(self) -> list[TenantState]:
        """Each named tenant's policy and holdings, and every other tenant active now."""
        q = self.slots
        return [
            TenantState(
                self.tenants.policy(name),
                running=q.running.get(name, 0),
                waiting=q.waiting(name),
                served=q.ledger.count(name),
                quota_left=self.tenants.quota_left(name),
            )
            for name in sorted(set(self.tenants.names()) | q.active())
        ]
