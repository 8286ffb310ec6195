"""A tenant's policy (`Tenant`) and the config tree's form of every tenant's (`TenantsConfig`):
one mapping per field, tenant name to value, the entry `default` standing for every tenant not
named (so every field is also a flag: `--tenants-weight default=1,gold=4`). What each field
means is in router/admission/tenants.py, which runs them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from workers.engine.config import described

DEFAULT = "default"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# The SLO defaults are per tier: their mappings are keyed by the tier's number.
TIER_FIELDS = ("tier_ttft_slo_ms", "tier_tpot_slo_ms")


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    max_concurrency: int = 0
    tokens_per_minute: float = 0.0
    tier: int = 1
    max_wait_s: float | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"tenant {self.name!r}: {name}={getattr(self, name)!r}: {why}")

        if not _NAME.match(self.name):
            raise ValueError(f"tenant {self.name!r}: use 1-64 letters, digits and . _ -")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise bad("weight", "must be a positive number")
        if self.max_concurrency < 0:
            raise bad("max_concurrency", "must be >= 0 (0: no cap)")
        if not (math.isfinite(self.tokens_per_minute) and self.tokens_per_minute >= 0):
            raise bad("tokens_per_minute", "must be >= 0 (0: no quota)")
        if not 0 <= self.tier <= 9:
            raise bad("tier", "must be 0 (first) to 9")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise bad("max_wait_s", "must be positive (or unset)")


# Each policy field and the type its values take (from a config mapping, a flag, the CLI).
POLICY_TYPES: dict[str, type] = {
    "weight": float,
    "max_concurrency": int,
    "tokens_per_minute": float,
    "tier": int,
    "max_wait_s": float,
}
POLICY_FIELDS = tuple(POLICY_TYPES)
assert POLICY_FIELDS == tuple(f.name for f in fields(Tenant) if f.name != "name")


@dataclass(frozen=True)
class TenantsConfig:
    weight: dict = field(
        default_factory=dict,
        metadata=described("tenant=weight: share while tenants wait (default 1)"),
    )
    max_concurrency: dict = field(
        default_factory=dict,
        metadata=described(
            "tenant=N: sequences it may run at once; past it, it queues (0: no cap)"
        ),
    )
    tokens_per_minute: dict = field(
        default_factory=dict,
        metadata=described(
            "tenant=N: prompt and output tokens a minute; past it, 429 (0: no quota)"
        ),
    )
    tier: dict = field(
        default_factory=dict,
        metadata=described("tenant=T: priority class, 0 served first (default 1)"),
    )
    max_wait_s: dict = field(
        default_factory=dict,
        metadata=described("tenant=S: longest wait for a slot before going first"),
    )
    tier_ttft_slo_ms: dict = field(
        default_factory=dict,
        metadata=described("tier=MS: default ttft_slo_ms of a tier's requests"),
    )
    tier_tpot_slo_ms: dict = field(
        default_factory=dict,
        metadata=described("tier=MS: default tpot_slo_ms of a tier's requests"),
    )

    def __post_init__(self) -> None:
        for name in POLICY_FIELDS:
            for tenant in getattr(self, name):
                self.policy(tenant)  # each named tenant must make a valid policy
        for name in TIER_FIELDS:
            for tier, ms in getattr(self, name).items():
                if not (str(tier).isdigit() and 0 <= int(tier) <= 9):
                    raise ValueError(f"{name}: {tier!r} is not a tier (0 to 9)")
                if not ms > 0:
                    raise ValueError(f"{name}: tier {tier}: {ms!r} must be a positive ms")

    def names(self) -> set[str]:
        return {t for name in POLICY_FIELDS for t in getattr(self, name)} - {DEFAULT}

    def policy(self, tenant: str) -> Tenant:
        """The tenant's policy: its own entries, else the `default` entries, else the
        built-in defaults."""
        values = {}
        for name in POLICY_FIELDS:
            table = getattr(self, name)
            value = table.get(tenant, table.get(DEFAULT))
            if value is not None:
                values[name] = POLICY_TYPES[name](value)
        return Tenant(tenant, **values)

    def slo_ms(self, tier: int) -> tuple[float | None, float | None]:
        """A tier's default (ttft_slo_ms, tpot_slo_ms)."""
        return (self.tier_ttft_slo_ms.get(str(tier)), self.tier_tpot_slo_ms.get(str(tier)))
