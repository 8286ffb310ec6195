"""`tandem scale` and `tandem drain` against a running cluster while streams run: the pools
grow from 1P/1D to 2P/2D, new streams land on the new workers, and the pools shrink back by
draining them mid-stream. No stream fails or comes back short, and every block is free."""

import asyncio
import json
import subprocess
import sys
import time

import pytest

from client import to_proto
from tests.integration.harness import CHATS, ClusterHarness, cluster_config, greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAX_TOKENS = 160
BATCH_A = [greedy(f"{c} ({i})", MAX_TOKENS, ignore_eos=True) for i, c in enumerate(CHATS * 2)]
BATCH_B = [greedy(f"{c} [{i}]", MAX_TOKENS, ignore_eos=True) for i, c in enumerate(CHATS * 2)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = ClusterHarness(
        cluster_config(
            engine={"dtype": "float32", "num_kv_blocks": 512},
            prefill={"replicas": 1, "cpus": 0.5},
            decode={"replicas": 1, "cpus": 0.5},
            router={"port": 0},
            dashboard=False,
            ray_num_cpus=4,
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()


def tandem(cluster, *args: str) -> dict:
    cmd = [sys.executable, "-m", "cluster.cli", *args, "--address", cluster.address, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def start(cluster, requests, counts):
    def counter(i):
        def on_chunk(m):
            counts[i] += len(m.token_ids)

        return on_chunk

    async def go():
        return [
            asyncio.create_task(
                cluster.client.generate(to_proto(r), timeout_s=600, on_chunk=counter(i))
            )
            for i, r in enumerate(requests)
        ]

    return cluster.run(go())


def wait_tokens(counts, at_least: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while min(counts) < at_least:
        assert time.monotonic() < deadline, f"streams stalled: {counts}"
        time.sleep(0.05)


def test_scale_up_then_drain_back_while_24_streams_run(cluster):
    counts_a, counts_b = [0] * len(BATCH_A), [0] * len(BATCH_B)
    tasks = start(cluster, BATCH_A, counts_a)
    wait_tokens(counts_a, 2)

    grown = tandem(cluster, "scale", "--prefill", "2", "--decode", "2")
    assert grown["scale"] == {
        "prefill to 2": ["prefill-0", "prefill-1"],
        "decode to 2": ["decode-0", "decode-1"],
    }
    pools = grown["status"]["pools"]
    assert (pools["prefill"]["live"], pools["decode"]["live"]) == (2, 2)

    # New streams go to the new workers too; then both new workers are retired mid-stream.
    tasks += start(cluster, BATCH_B, counts_b)
    wait_tokens(counts_b, 2)
    s = cluster.status()
    assert next(w for w in s["decode"] if w["name"] == "decode-1")["running"] > 0
    drained = tandem(cluster, "drain", "--worker", "decode-1", "--drain-timeout", "300")
    assert drained["drain"] == {"drain decode-1": {"drained": True, "message": "drained"}}
    shrunk = tandem(cluster, "scale", "--prefill", "1")
    assert shrunk["scale"] == {"prefill to 1": ["prefill-0"]}

    async def all_of():
        return await asyncio.gather(*tasks)

    results = cluster.run(all_of(), timeout=600)
    for r in results:
        assert r.status == "OK" and r.finish_reason == "length", r.error
        assert len(r.token_ids) == MAX_TOKENS  # none short
    s = cluster.wait_all_free()
    assert s["pools"]["prefill"] == {
        "target": 1,
        "live": 1,
        "starting": 0,
        "restarts": 0,
        "autoscale": "",
    }
    assert s["pools"]["decode"] == {
        "target": 1,
        "live": 1,
        "starting": 0,
        "restarts": 0,
        "autoscale": "",
    }
    for w in s["prefill"] + s["decode"]:
        assert w["alive"] and w["kv_blocks_free"] == w["kv_blocks_total"], w
    assert s["router"]["replays_total"] == 0  # drained, not failed over
