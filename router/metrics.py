"""The router's series (see workers/metrics.py for how they are exported): requests by final
status; TTFT, inter-token latency and end-to-end latency; the admission queue; replays. Pool
events are counted where they happen (cluster/pools.py, workers/metrics.PoolEvents)."""

from __future__ import annotations

import time
from collections import deque

from workers.metrics import counter, gauge, histogram

WINDOW_S = 60.0  # the recent latencies an autoscaler reads


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

    def stream(self) -> StreamTimer:
        return StreamTimer(self)


class StreamTimer:
    """Times one request's chunks (per choice, for n > 1) as they leave the router."""

    def __init__(self, m: RouterMetrics) -> None:
        self.m = m
        self.t0 = time.monotonic()
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def chunk(self, index: int, tokens: int, finished: bool, status: str) -> None:
        now = time.monotonic()
        tags = self.m.tags
        if tokens:
            before = self.last.get(index)
            if before is None:
                self.m.ttft.observe(now - self.t0, tags)
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
            n = self.tokens.get(index, 0)
            if n > 1:
                self.m.note("tpot", (self.last[index] - self.first[index]) / (n - 1))
