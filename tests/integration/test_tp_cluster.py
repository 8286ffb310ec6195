"""A colocated cluster whose worker runs tp 2 (SmolLM2, fp32): its streams equal the offline
tp 2 engine's (G4: the same arithmetic, split the same way), `tandem status` shows the
worker's other rank, and a rank SIGKILLed mid-stream takes its worker with it, so that every
stream is replayed whole on the replacement, the pool heals and every block is free."""

from __future__ import annotations

import pytest

from tests.integration.harness import CHATS, ClusterHarness, cluster_config, greedy
from workers.completion import GenerationRequest
from workers.engine.request import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ENGINE = {"dtype": "float32", "num_kv_blocks": 256}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = ClusterHarness(
        cluster_config(
            mode="colocated",
            router={"port": 0},
            dashboard=False,
            engine=ENGINE,
            decode={"replicas": 1, "cpus": 2, "engine": {"tp": 2}},
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()


@pytest.fixture(scope="module")
def llm():
    from workers.offline import LLM

    engine = LLM(tp=2, device="cpu", **ENGINE)
    yield engine
    engine.close()


def test_tp2_streams_equal_the_offline_tp2_engine_and_status_shows_the_ranks(cluster, llm, capsys):
    requests = [greedy(c, 16 + 2 * i) for i, c in enumerate(CHATS[:5])]
    requests.append(
        GenerationRequest(
            prompt=CHATS[0], sampling=SamplingParams(max_tokens=12, temperature=0.8, seed=5)
        )
    )
    want = [c.token_ids for c in llm.generate(requests)]
    for r, tokens in zip(cluster.generate_many(requests), want):
        assert r.status == "OK", r.error
        assert r.token_ids == tokens
    s = cluster.wait_all_free()
    [worker] = s["decode"]
    assert worker["kv_blocks_free"] == worker["kv_blocks_total"]  # G3
    assert len(worker["rank_pids"]) == 1 and worker["rank_pids"][0] != worker["pid"]
    from cluster.cli_remote import print_status

    print_status(s)
    assert f"ranks={worker['rank_pids'][0]} " in capsys.readouterr().out  # `tandem status`


@pytest.mark.fault
def test_a_rank_killed_mid_stream_is_its_workers_death_and_every_stream_is_replayed(cluster, llm):
    from tests.fault.faults import replayed_through_a_kill, workload

    requests = workload(6, max_tokens=40)
    want = [c.token_ids for c in llm.generate(requests)]
    replayed_through_a_kill(cluster, requests, want, lambda worker: worker["rank_pids"][0])
