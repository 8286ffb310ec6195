"""Tandem's metrics on Ray's Prometheus endpoint: a one-prefill, one-decode cluster serves a
few requests (one with a shared prefix, so the prefix cache hits), and every series is scraped
with non-zero values, labelled by pool and worker (or by router)."""

import os
import re
import socket
import time
import urllib.request

import pytest

from tests.integration.harness import CHATS, ClusterHarness, cluster_config, greedy
from workers.engine.constraint import Constraint, ConstraintKind

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORKER_SERIES = [
    "tandem_kv_blocks_free",
    "tandem_prefill_tokens_total",
    "tandem_decode_tokens_total",
    "tandem_prefix_cache_hit_rate",
    "tandem_kv_transfer_bytes_total",
    "tandem_kv_transfer_seconds_count",
    "tandem_constrained_seqs_total",
    "tandem_grammar_mask_steps_total",
    "tandem_grammar_mask_seconds_total",
    "tandem_grammar_compiles_total",
    "tandem_grammar_compile_seconds_total",
]
ROUTER_SERIES = [
    "tandem_requests_total",
    "tandem_ttft_seconds_count",
    "tandem_itl_seconds_count",
    "tandem_e2e_seconds_count",
    "tandem_scale_events_total",
    "tandem_constrained_requests_total",
    "tandem_router_grammar_compile_seconds_count",
]
# Present from the start, possibly zero while nothing waits or runs.
GAUGES = [
    "tandem_running_seqs",
    "tandem_waiting_seqs",
    "tandem_kv_blocks_used",
    "tandem_router_queue_depth",
    "tandem_router_in_flight",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # read by the Ray processes started
    port = free_port()
    h = ClusterHarness(
        cluster_config(
            router={"port": 0, "status_interval_s": 0.5},
            dashboard=False,
            metrics_export_port=port,
            engine={"dtype": "float32", "num_kv_blocks": 256},
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    h.metrics_port = port
    yield h
    h.stop()
    del os.environ["RAY_metrics_report_interval_ms"]


def scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    """Series name (without Ray's `ray_` prefix) -> [(labels, value)]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    series: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        m = re.match(r"^ray_(tandem_\w+)(?:\{(.*)\})? ([-+0-9.eE]+|NaN)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            series.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return series


def test_every_series_is_scraped_with_traffic_values(cluster):
    prefix = "You are a careful assistant. Answer in one short sentence. " * 8
    requests = [greedy(prefix + c, 12) for c in CHATS[:4]]
    yes_no = Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))
    requests.append(greedy(CHATS[6], 4, constraint=yes_no))
    cluster.generate_many(requests[:1])  # the shared prefix is cached on the prefill worker
    results = cluster.generate_many(requests[1:])
    assert all(r.status == "OK" for r in results)

    want = WORKER_SERIES + ROUTER_SERIES
    deadline = time.monotonic() + 90
    while True:
        series = scrape(cluster.metrics_port)
        missing = [n for n in want if not any(v > 0 for _, v in series.get(n, []))]
        missing += [n for n in GAUGES if n not in series]
        ended = sum(v for _, v in series.get("tandem_requests_total", []))
        if not missing and ended >= len(requests):  # every request's end exported
            break
        assert time.monotonic() < deadline, f"not scraped with values: {missing}"
        time.sleep(1)
    for name in WORKER_SERIES + GAUGES[:3]:
        for labels, _ in series[name]:
            assert labels["pool"] in ("prefill", "decode") and labels["worker"], (name, labels)
    pools = {labels["pool"] for labels, v in series["tandem_decode_tokens_total"] if v > 0}
    assert pools == {"decode"}
    assert {labels["pool"] for labels, _ in series["tandem_kv_transfer_bytes_total"]} == {"prefill"}
    finished = {labels["status"]: v for labels, v in series["tandem_requests_total"]}
    assert set(finished) <= {"length", "stop"}  # by final status; none failed
    hits = [
        v for labels, v in series["tandem_prefix_cache_hit_rate"] if labels["pool"] == "prefill"
    ]
    assert 0 < max(hits) <= 1
