"""Tenants: what each may take of the cluster, and what it has taken.

A request's tenant comes from its API key (router/edge/keys.py), never from the request. Each
tenant has a policy (`Tenant`):

- `weight`: its share of the cluster while several tenants wait (fair share, fair.py);
- `max_concurrency`: sequences it may run at once (0: no cap); past it, its requests queue;
- `tokens_per_minute`: its rate quota, prompt and output tokens counted (0: none); past it,
  RESOURCE_EXHAUSTED with the time to retry;
- `tier`: its priority class, lower first: a tier is served before any higher one;
- `max_wait_s`: the longest any of its requests waits for a slot before it goes ahead of
  every request that has not waited that long (None: `router.admission_max_wait_s`).

`TenantsConfig` (router/tenant_policy.py) is the config tree's form. `TenantTable` is the
running form: that config with the changes made at run time by the Admin call `Tenants`
(`tandem tenants`) on top, its `overrides` ({tenant: {field: value}}, a value None unsetting
the field). Routers sharing a store share their overrides through it (control.py), so a change
made at one router holds at every router, and across their restarts, until it is reset. Used
from the router's event loop alone.
"""

from __future__ import annotations

import time
from dataclasses import replace

from router.tenant_policy import (
    POLICY_FIELDS,
    Tenant,
    TenantsConfig,
)

MAX_CACHED = 4096  # tenants whose policy or quota bucket is kept at once


class TokenBucket:
    """A rate quota: `per_minute` tokens a minute, bursting to a minute's worth. Taking more
    than is left is allowed (output tokens are counted as they come), leaving a debt that
    refills first."""

    def __init__(self, per_minute: float, clock=time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self.level = per_minute
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.per_minute, self.level + (now - self._at) * self.per_minute / 60)
        self._at = now

    def wait_s(self, tokens: int) -> float:
        """Seconds until `tokens` may be taken (0: now). Asking more than a minute's worth
        waits for a full bucket."""
        self._refill()
        need = min(tokens, self.per_minute)
        return 0.0 if self.level >= need else (need - self.level) * 60 / self.per_minute

    def take(self, tokens: int) -> None:
        self._refill()
        self.level -= tokens


class TenantTable:
    """The tenants' running policies and rate quotas. A policy is looked up for every chunk
    a tenant is served: each is built once per config, not at every lookup."""

    def __init__(self, config: TenantsConfig | None = None, clock=time.monotonic) -> None:
        self.base = config or TenantsConfig()  # the config tree's, before any override
        self.overrides: dict[str, dict] = {}
        self.config = self.base
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}

    @property
    def config(self) -> TenantsConfig:
        return self._config

    @config.setter
    def config(self, config: TenantsConfig) -> None:
        self._config = config
        self._policies: dict[str, Tenant] = {}

    def policy(self, tenant: str) -> Tenant:
        pol = self._policies.get(tenant)
        if pol is None:
            if len(self._policies) >= MAX_CACHED:  # a router without keys: any name comes
                self._policies.clear()
            pol = self._policies[tenant] = self._config.policy(tenant)
        return pol

    def names(self) -> list[str]:
        return sorted(self.config.names())

    def update(self, tenant: str, **changes) -> Tenant:
        """Change a tenant's policy (or, for `default`, every unnamed tenant's) from now on,
        on this table alone."""
        self.set_overrides(self.with_changes({tenant: changes}))
        return self.policy(tenant)

    def with_changes(self, changes: dict[str, dict], resets=()) -> dict[str, dict]:
        """The overrides once the tenants in `resets` are back to the config's and then
        `changes` ({tenant: {field: value}}) are made; ValueError naming the tenant and the
        field if that makes a policy that cannot be."""
        overrides = {t: dict(f) for t, f in self.overrides.items() if t not in set(resets)}
        for tenant, changed in changes.items():
            overrides.setdefault(tenant, {}).update(changed)
        overridden_all(self.base, overrides)  # raises if a policy cannot be
        return overrides

    def set_overrides(self, overrides: dict[str, dict]) -> dict[str, str]:
        """Run by these overrides from now on. A tenant's entry that cannot be (a store
        written by another version) is left out, not the others: returns those left out,
        tenant -> why."""
        self.config, bad = overridden_all(self.base, overrides, skip_bad=True)
        self.overrides = {t: f for t, f in overrides.items() if t not in bad}
        return bad

    def quota_wait_s(self, tenant: str, tokens: int) -> float:
        """Seconds before the tenant's quota admits `tokens` more (0: now, or no quota)."""
        bucket = self._bucket(tenant)
        return 0.0 if bucket is None else bucket.wait_s(tokens)

    def charge(self, tenant: str, tokens: int) -> None:
        bucket = self._bucket(tenant)
        if bucket is not None:
            bucket.take(tokens)

    def quota_left(self, tenant: str) -> float | None:
        bucket = self._bucket(tenant)
        if bucket is None:
            return None
        bucket.wait_s(0)  # refills
        return bucket.level

    def _bucket(self, tenant: str) -> TokenBucket | None:
        per_minute = self.policy(tenant).tokens_per_minute
        if not per_minute:
            return None
        bucket = self._buckets.get(tenant)
        if bucket is None or bucket.per_minute != per_minute:
            if len(self._buckets) >= MAX_CACHED:  # full buckets are as good as new ones
                self._buckets = {
                    k: b for k, b in self._buckets.items() if b.wait_s(b.per_minute) > 0
                }
            bucket = self._buckets[tenant] = TokenBucket(per_minute, self.clock)
        return bucket


def overridden(config: TenantsConfig, tenant: str, fields: dict) -> TenantsConfig:
    """`config` with a tenant's fields set (a value None: the tenant's entry removed, so the
    `default` entry or the built-in default holds); ValueError naming what is wrong."""
    if not isinstance(fields, dict):
        raise ValueError(f"tenant {tenant!r}: {fields!r} is not a mapping of fields")
    unknown = set(fields) - set(POLICY_FIELDS)
    if unknown:
        raise ValueError(f"tenant {tenant!r}: unknown field(s) {', '.join(sorted(unknown))}")
    tables = {}
    for name, value in fields.items():
        table = dict(getattr(config, name))
        if value is None:
            table.pop(tenant, None)
        else:
            table[tenant] = value
        tables[name] = table
    return replace(config, **tables)  # validates, or raises naming the field


def overridden_all(
    config: TenantsConfig, overrides: dict[str, dict], skip_bad: bool = False
) -> tuple[TenantsConfig, dict[str, str]]:
    """`config` with every tenant's overrides, and the tenants left out (skip_bad) -> why;
    without skip_bad, the first that cannot be raises."""
    bad: dict[str, str] = {}
    for tenant, changed in overrides.items():
        try:
            config = overridden(config, tenant, changed)
        except (ValueError, TypeError) as e:
            if not skip_bad:
                raise ValueError(str(e)) from None
            bad[tenant] = str(e)
    return config, bad
