"""The router's series (see workers/metrics.py for how they are exported): requests by final
status; TTFT, inter-token latency and end-to-end latency; the admission queue; replays; and
per tenant and tier: requests, tokens, time queued, TTFT and TPOT, refusals by reason, with
the output-length predictor's error. Pool events are counted where they happen
(cluster/pools.py, workers/metrics.PoolEvents).

Tenant labels are bounded: past MAX_TENANT_LABELS distinct tenants (a router without keys
takes the tenant a request names), the rest are counted as "other"."""

from __future__ import annotations

import time
from collections import deque

from workers.metrics import counter, gauge, histogram

WINDOW_S = 60.0  # the recent latencies an autoscaler reads
MAX_TENANT_LABELS = 64


class RouterMetrics:
    def __init__(self, router_id: str) -> None:
        self.tags = {"router": router_id}
        t = ("router",)
        self.requests = counter(
            "tandem_requests_total",
            "requests (each choice of n > 1) by final status",
            (*t, "status"),
        )
        self.ttft = histogram("tandem_ttft_seconds", "admission to first token", t)
        self.itl = histogram("tandem_itl_seconds", "time between a stream's tokens", t)
        self.e2e = histogram("tandem_e2e_seconds", "admission to the last message", t)
        self.queue_depth = gauge("tandem_router_queue_depth", "requests waiting for a slot", t)
        self.in_flight = gauge("tandem_router_in_flight", "requests being served", t)
        self.replays = counter("tandem_replays_total", "attempts replayed after a failure", t)
        tt = (*t, "tenant", "tier")
        self.tenant_requests = counter(
            "tandem_tenant_requests_total", "requests by tenant, tier and final status",
            (*tt, "status"),
        )  # fmt: skip
        self.tenant_tokens = counter(
            "tandem_tenant_tokens_total", "tokens by tenant, tier and kind (prompt, output)",
            (*tt, "kind"),
        )  # fmt: skip
        self.tenant_refusals = counter(
            "tandem_tenant_refusals_total",
            "requests refused by tenant, tier and reason (quota, late)",
            (*tt, "reason"),
        )
        self.tenant_queue = histogram("tandem_tenant_queue_seconds", "time waiting for a slot", tt)
        self.tenant_ttft = histogram("tandem_tenant_ttft_seconds", "admission to first token", tt)
        self.tenant_tpot = histogram("tandem_tenant_tpot_seconds", "time per output token", tt)
        self.constrained = counter(
            "tandem_constrained_requests_total",
            "requests with a constraint, by kind (json_schema, regex, choice, ...)",
            (*t, "kind"),
        )
        self.grammar_compile = histogram(
            "tandem_router_grammar_compile_seconds",
            "a constraint compiled on the router (not cached)",
            t,
        )
        self.grammar_cache_hits = counter(
            "tandem_router_grammar_cache_hits_total", "constraints found compiled on the router", t
        )
        self.length_error = gauge(
            "tandem_length_prediction_error_tokens",
            "recent mean absolute error of the output-length predictor",
            t,
        )
        self._labels: set[str] = set()
        # (when, seconds) of this router's recent first tokens and per-request TPOTs.
        self.recent: dict[str, deque[tuple[float, float]]] = {"ttft": deque(), "tpot": deque()}

    def note(self, kind: str, seconds: float) -> None:
        now = time.monotonic()
        q = self.recent[kind]
        q.append((now, seconds))
        while q and now - q[0][0] > WINDOW_S:
            q.popleft()

    def p90(self, kind: str) -> float | None:
        """The 90th percentile over the last WINDOW_S seconds; None with no sample."""
        now = time.monotonic()
        values = sorted(v for t, v in self.recent[kind] if now - t <= WINDOW_S)
        return values[int(0.9 * (len(values) - 1))] if values else None

    def replayed(self) -> None:
        self.replays.inc(1, self.tags)

    def queue(self, depth: int, in_flight: int) -> None:
        self.queue_depth.set(depth, self.tags)
        self.in_flight.set(in_flight, self.tags)

    def stream(self, tenant: str = "", tier: int = 1) -> StreamTimer:
        return StreamTimer(self, self.tenant_tags(tenant, tier))

    def tenant_tags(self, tenant: str, tier: int) -> dict:
        if tenant not in self._labels and len(self._labels) < MAX_TENANT_LABELS:
            self._labels.add(tenant)
        label = tenant if tenant in self._labels else "other"
        return {**self.tags, "tenant": label, "tier": str(tier)}

    def refused(self, tags: dict, reason: str) -> None:
        self.tenant_refusals.inc(1, {**tags, "reason": reason})


class StreamTimer:
    """Times one request's chunks (per choice, for n > 1) as they leave the router."""

    def __init__(self, m: RouterMetrics, tenant_tags: dict) -> None:
        self.m = m
        self.tenant_tags = tenant_tags
        self.t0 = time.monotonic()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def chunk(self, index: int, tokens: int, finished: bool, status: str) -> None:
        now = time.monotonic()
        tags = self.m.tags
        if tokens:
            before = self.last.get(index)
            self.m.tenant_tokens.inc(tokens, {**self.tenant_tags, "kind": "output"})
            if before is None:
                self.m.ttft.observe(now - self.t0, tags)
                self.m.tenant_ttft.observe(now - self.t0, self.tenant_tags)
                self.m.note("ttft", now - self.t0)
                self.first[index] = now
            else:  # a chunk of k tokens: k gaps of equal share
                for _ in range(tokens):
                    self.m.itl.observe((now - before) / tokens, tags)
            self.last[index] = now
            self.tokens[index] = self.tokens.get(index, 0) + tokens
        if finished:
            self.m.e2e.observe(now - self.t0, tags)
            self.m.requests.inc(1, {**tags, "status": status})
            self.m.tenant_requests.inc(1, {**self.tenant_tags, "status": status})
            n = self.tokens.get(index, 0)
            if n > 1:
                tpot = (self.last[index] - self.first[index]) / (n - 1)
                self.m.note("tpot", tpot)
                self.m.tenant_tpot.observe(tpot, self.tenant_tags)

    def admitted(self, prompt_tokens: int) -> None:
        """The request got its slots: its time queued, its prompt's tokens."""
        self.m.tenant_queue.observe(time.monotonic() - self.t0, self.tenant_tags)
        self.m.tenant_tokens.inc(prompt_tokens, {**self.tenant_tags, "kind": "prompt"})
