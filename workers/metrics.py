"""Tandem's metrics, through `ray.util.metrics`: they reach the Ray dashboard and Ray's
Prometheus endpoint (each node's metrics export port; Ray prefixes every name with `ray_`,
so `tandem_ttft_seconds` is scraped as `ray_tandem_ttft_seconds`). Outside a Ray session (the
offline engine, unit tests) every metric is a no-op.

Workers are labelled by `pool` and `worker`; the router's series by `router`. Worker gauges
and counters are brought up to date when a router asks the worker for its status (every
`router.status_interval_s`), never on the engine's step path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Latency buckets, seconds: from a fast decode step on a GPU to a long CPU prefill.
LATENCY_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Noop:
    def inc(self, value: float = 1.0, tags: dict | None = None) -> None: ...

    def set(self, value: float, tags: dict | None = None) -> None: ...

    def observe(self, value: float, tags: dict | None = None) -> None: ...


class _Guarded:
    """A Ray metric whose failures are logged once, never raised: a metric must not break the
    path that records it (a KV sender thread, a status call)."""

    def __init__(self, metric) -> None:
        self.metric = metric
        self.warned = False

    def _call(self, method: str, *args) -> None:
        try:
            getattr(self.metric, method)(*args)
        except Exception as e:
            if not self.warned:
                self.warned = True
                log.warning("metric %s: %s failed: %s", self.metric.info.get("name"), method, e)

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        if value > 0:  # Ray's counters refuse anything else
            self._call("inc", value, tags)

    def set(self, value: float, tags: dict | None = None) -> None:
        self._call("set", value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._call("observe", value, tags)


def _ray_ready() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:
        return False


def counter(name: str, help: str, tags: Sequence[str]):
    if not _ray_ready():
        return _Noop()
    from ray.util.metrics import Counter

    return _Guarded(Counter(name, help, tag_keys=tuple(tags)))


def gauge(name: str, help: str, tags: Sequence[str]):
    if not _ray_ready():
        return _Noop()
    from ray.util.metrics import Gauge

    return _Guarded(Gauge(name, help, tag_keys=tuple(tags)))


def histogram(name: str, help: str, tags: Sequence[str], buckets=LATENCY_S):
    if not _ray_ready():
        return _Noop()
    from ray.util.metrics import Histogram

    return _Guarded(Histogram(name, help, boundaries=list(buckets), tag_keys=tuple(tags)))


class WorkerMetrics:
    """One worker's series: sequences, KV blocks, prefix cache, preemptions, tokens computed,
    and (prefill workers) KV transfers."""

    TAGS = ("pool", "worker")

    def __init__(self, pool: str, worker: str) -> None:
        self.tags = {"pool": pool, "worker": worker}
        t = self.TAGS
        self.running = gauge("tandem_running_seqs", "sequences running in the engine", t)
        self.waiting = gauge("tandem_waiting_seqs", "sequences waiting for the engine", t)
        self.blocks_used = gauge("tandem_kv_blocks_used", "KV cache blocks held", t)
        self.blocks_free = gauge("tandem_kv_blocks_free", "KV cache blocks free", t)
        self.hit_rate = gauge(
            "tandem_prefix_cache_hit_rate", "prefix-cache hit blocks / blocks looked up", t
        )
        self.preemptions = counter("tandem_preemptions_total", "sequences preempted", t)
        self.prefill_tokens = counter(
            "tandem_prefill_tokens_total", "prompt tokens computed (rate: prefill tok/s)", t
        )
        self.decode_tokens = counter(
            "tandem_decode_tokens_total", "tokens decoded (rate: decode tok/s)", t
        )
        self.transfer_bytes = counter("tandem_kv_transfer_bytes_total", "KV bytes pushed", t)
        self.transfer_seconds = histogram(
            "tandem_kv_transfer_seconds",
            "what a KV push adds to a request: its first token sampled -> admitted to decode",
            t,
        )
        self.transfer_failures = counter(
            "tandem_kv_transfer_failures_total", "KV pushes that failed", t
        )
        self.transfer_staged = counter(
            "tandem_kv_transfer_staged_bytes_total",
            "KV bytes pushed that went through a staging buffer (gathered on the sender,"
            " scattered on the receiver, or both: their blocks were not in one run)",
            t,
        )
        self.constrained = counter(
            "tandem_constrained_seqs_total", "sequences decoded under a constraint", t
        )
        self.mask_steps = counter(
            "tandem_grammar_mask_steps_total", "steps that built constrained rows' masks", t
        )
        self.mask_seconds = counter(
            "tandem_grammar_mask_seconds_total",
            "seconds building masks (per step: rate of this over rate of mask steps)",
            t,
        )
        self.compiles = counter("tandem_grammar_compiles_total", "constraints compiled", t)
        self.compile_seconds = counter(
            "tandem_grammar_compile_seconds_total", "seconds compiling constraints", t
        )
        self.cache_hits = counter(
            "tandem_grammar_cache_hits_total", "constraints found compiled", t
        )
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, s) -> None:
        """Bring the series up to `s` (an EngineStats): gauges set, counters by their delta."""
        tags = self.tags
        self.running.set(s.running, tags)
        self.waiting.set(s.waiting, tags)
        self.blocks_used.set(s.kv_blocks_total - s.kv_blocks_free, tags)
        self.blocks_free.set(s.kv_blocks_free, tags)
        if s.prefix_query_blocks:
            self.hit_rate.set(s.prefix_hit_blocks / s.prefix_query_blocks, tags)
        with self._lock:
            for name, value in (
                ("preemptions", s.preemptions),
                ("prefill_tokens", s.prefill_tokens),
                ("decode_tokens", s.decode_tokens),
                ("constrained", s.constrained_seqs),
                ("mask_steps", s.grammar_mask_steps),
                ("mask_seconds", s.grammar_mask_seconds),
                ("compiles", s.grammar_compiles),
                ("compile_seconds", s.grammar_compile_seconds),
                ("cache_hits", s.grammar_cache_hits),
            ):
                delta = value - self._last.get(name, 0)
                self._last[name] = value
                if delta > 0:
                    getattr(self, name).inc(delta, tags)

    def transfer(self, nbytes: int, seconds: float, ok: bool, staged_bytes: int = 0) -> None:
        if ok:
            self.transfer_bytes.inc(nbytes, self.tags)
            self.transfer_seconds.observe(seconds, self.tags)
            if staged_bytes:
                self.transfer_staged.inc(staged_bytes, self.tags)
        else:
            self.transfer_failures.inc(1, self.tags)


class PoolEvents:
    """tandem_scale_events_total{pool, event}: counted by the pool manager that acts (the
    controller router's, or `tandem up`'s at start): started, removed (drained or scaled
    away), dead, autoscale_up, autoscale_down."""

    def __init__(self) -> None:
        self.counter = counter(
            "tandem_scale_events_total", "pool changes, by pool and kind", ("pool", "event")
        )

    def count(self, pool: str, event: str) -> None:
        self.counter.inc(1, {"pool": pool, "event": event})
