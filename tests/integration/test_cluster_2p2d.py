"""Two prefill and two decode workers, then the same router in colocated mode."""

import pytest

from tests.integration.harness import (
    CHATS,
    ClusterHarness,
    cluster_config,
    greedy,
    offline_reference,
)

pytestmark = pytest.mark.integration

REQUESTS = [greedy(c, 20 + 3 * i) for i, c in enumerate(CHATS * 3)]  # 24 concurrent clients


@pytest.fixture(scope="module")
def reference():
    return offline_reference(REQUESTS)


@pytest.mark.parametrize("mode, prefill, decode", [("disaggregated", 2, 2), ("colocated", 0, 2)])
def test_greedy_streams_equal_the_offline_engine(tmp_path, reference, mode, prefill, decode):
    h = ClusterHarness(
        cluster_config(
            router={"port": 0},
            dashboard=False,
            engine={"num_kv_blocks": 256},
            mode=mode,
            prefill={"replicas": max(prefill, 1), "cpus": 0.5},
            decode={"replicas": decode, "cpus": 0.5},
            data_dir=str(tmp_path),
        )
    )
    try:
        results = h.generate_many(REQUESTS)
        for r, want in zip(results, reference):
            assert r.status == "OK", r.error
            assert r.token_ids == want
        router = h.cluster.router
        s = h.wait_all_free()
        assert len(s["decode"]) == 2 and len(s["prefill"]) == prefill
        for w in s["prefill"] + s["decode"]:
            assert w["kv_blocks_free"] == w["kv_blocks_total"], w
        assert s["router"]["mode"] == mode and router.queue_depth == 0
        # Both decode workers (and in disaggregated mode both prefill workers) were used.
        recs = [h.run(h.store.get(r.request_id)) for r in results]
        assert {rec.decode for rec in recs} == {"decode-0", "decode-1"}
        if mode == "disaggregated":
            assert {rec.prefill for rec in recs} == {"prefill-0", "prefill-1"}
    finally:
        h.stop()
