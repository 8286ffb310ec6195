"""Overload is not failure: in a colocated cluster whose one decode worker runs one sequence
at a time (max_num_seqs 1), a request queued in its engine behind a long one gets no token
for longer than stall_timeout_s (2 s), and is still not replayed: the worker answers that it
holds the request. Real Ray actors, Redis and gRPC, SmolLM2 in fp32."""

import time

import pytest

from tests.integration.harness import ClusterHarness, cluster_config, greedy, offline_reference

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STALL_S = 2.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = ClusterHarness(
        cluster_config(
            router={"port": 0, "stall_timeout_s": STALL_S},
            dashboard=False,
            engine={"num_kv_blocks": 256, "dtype": "float32", "max_num_seqs": 1},
            mode="colocated",
            decode={"replicas": 1},
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()


def test_a_request_queued_past_the_stall_timeout_on_a_live_worker_is_not_replayed(cluster):
    requests = [
        greedy(f"({i}) Write a long story about a lighthouse keeper.", 240, ignore_eos=True)
        for i in range(2)
    ]
    want = offline_reference(requests)
    t0 = time.monotonic()
    results = cluster.generate_many(requests)
    took = time.monotonic() - t0
    for r, tokens in zip(results, want):
        assert r.status == "OK", r.error
        assert r.token_ids == tokens
    records = [cluster.ended(r.request_id) for r in results]
    # One at a time: the second waited with no token for the whole of the first, about half
    # the time both took. Past the stall timeout, or the test would prove nothing.
    assert took / 2 > STALL_S, f"both ended in {took:.1f} s: nothing queued past the timeout"
    for rec in records:
        assert rec.attempt == 1 and rec.failures == (), (rec.attempt, rec.failures)
    s = cluster.wait_all_free()
    assert all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in s["decode"])
