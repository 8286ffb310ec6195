"""Two prefill and two decode workers, then the same router in colocated mode."""

import pytest

from client import to_proto
from tests.integration.harness import (
    CHATS,
    ClusterHarness,
    cluster_config,
    greedy,
    offline_reference,
)
from workers.completion import GenerationRequest
from workers.engine.request import SamplingParams

pytestmark = pytest.mark.integration

REQUESTS = [greedy(c, 20 + 3 * i) for i, c in enumerate(CHATS * 3)]  # 24 concurrent clients


@pytest.fixture(scope="module")
def reference():
    return offline_reference(REQUESTS)


CHOICES = GenerationRequest(
    prompt=CHATS[4], sampling=SamplingParams(max_tokens=16, temperature=1.0, seed=9, n=3)
)


@pytest.fixture(scope="module")
def choices_reference():
    from workers.offline import LLM

    return [c.token_ids for c in LLM(dtype="float32", num_kv_blocks=512).generate([CHOICES])]


@pytest.mark.parametrize("mode, prefill, decode", [("disaggregated", 2, 2), ("colocated", 0, 2)])
def test_greedy_streams_equal_the_offline_engine(
    tmp_path, reference, choices_reference, mode, prefill, decode
):
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
        assert s["router"]["mode"] == mode and router.status().queue_depth == 0
        # Both decode workers (and in disaggregated mode both prefill workers) were used.
        recs = [h.ended(r.request_id) for r in results]
        assert {rec.decode for rec in recs} == {"decode-0", "decode-1"}
        if mode == "disaggregated":
            assert {rec.prefill for rec in recs} == {"prefill-0", "prefill-1"}
        # n > 1 in either mode: each choice as the offline engine draws it.
        choices = h.run(h.client.generate_choices(to_proto(CHOICES), timeout_s=120))
        assert [c.token_ids for c in choices] == choices_reference
        s = h.wait_all_free()
        for w in s["prefill"] + s["decode"]:
            assert w["kv_blocks_free"] == w["kv_blocks_total"], w
    finally:
        h.stop()
