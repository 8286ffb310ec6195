"""Autoscaling on a signal: a burst of long prompts queues prefill tokens, the prefill pool
grows within its bounds, and once the burst is served and the cool-down has passed it shrinks
back by draining; every request completes whole. Each decision shows in `tandem status`."""

import asyncio
import time

import pytest

from client import to_proto
from tests.integration.harness import ClusterHarness, cluster_config, greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

LONG = " ".join(
    f"Note {i}: the river rises after rain and falls in the dry season." for i in range(70)
)
BURST = [greedy(f"({i}) {LONG}", 8, ignore_eos=True) for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    autoscale = {
        "enabled": True,
        "min_replicas": 1,
        "max_replicas": 2,
        "signal": "queued_prefill_tokens",
        "target": 1500,
        "cooldown_s": 3,
    }
    h = ClusterHarness(
        cluster_config(
            engine={"dtype": "float32", "num_kv_blocks": 1024},
            prefill={"replicas": 1, "cpus": 0.5, "autoscale": autoscale},
            decode={"replicas": 1, "cpus": 0.5},
            router={"port": 0, "status_interval_s": 0.5},
            dashboard=False,
            ray_num_cpus=4,
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()


def wait_pool(cluster, check, what: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        pool = cluster.status()["pools"]["prefill"]
        if check(pool):
            return pool
        assert time.monotonic() < deadline, f"{what}: {pool}"
        time.sleep(0.2)


def test_a_burst_of_long_prompts_grows_the_prefill_pool_then_it_shrinks_back(cluster):
    async def burst():
        return [
            asyncio.create_task(cluster.client.generate(to_proto(r), timeout_s=600)) for r in BURST
        ]

    tasks = cluster.run(burst())
    grown = wait_pool(cluster, lambda p: p["target"] == 2, "the prefill pool never grew")
    assert "grows 1 -> 2: queued_prefill_tokens" in grown["autoscale"], grown
    wait_pool(cluster, lambda p: p["live"] == 2, "the second prefill worker never came up")

    async def done():
        return await asyncio.gather(*tasks)

    results = cluster.run(done(), timeout=600)
    for r in results:
        assert r.status == "OK" and len(r.token_ids) == 8, r.error
    shrunk = wait_pool(
        cluster, lambda p: p["live"] == 1 and p["target"] == 1, "the pool never shrank back"
    )
    assert "shrinks 2 -> 1: queued_prefill_tokens" in shrunk["autoscale"], shrunk
    assert shrunk["restarts"] == 0  # drained, not killed and replaced
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w
