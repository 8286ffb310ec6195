"""int8 weights through the cluster (quantization: int8, bf16 activations): each worker
quantizes the same checkpoint the same way, so a stream through prefill and decode workers is
the quantized model's offline output (G4), greedy and seeded."""

import pytest

from tests.integration.harness import CHATS, greedy, one_by_one
from workers.engine.request import SamplingParams
from workers.model.cpu_kernels import cpu_kernels

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cpu_kernels() is None, reason="int8 runs on Tandem's CPU kernels"),
]

ENGINE = {"dtype": "bfloat16", "quantization": "int8"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = one_by_one(str(tmp_path_factory.mktemp("data")), engine=ENGINE)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def llm():
    from workers.offline import LLM

    return LLM(num_kv_blocks=512, **ENGINE)


def test_int8_streams_equal_the_int8_offline_engine(cluster, llm):
    from workers.completion import GenerationRequest

    requests = [greedy(c, 20 + 3 * i) for i, c in enumerate(CHATS)]
    requests += [
        GenerationRequest(
            prompt=c, sampling=SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i)
        )
        for i, c in enumerate(CHATS[:4])
    ]
    want = [c.token_ids for c in llm.generate(requests)]
    results = cluster.generate_many(requests)
    for r, tokens in zip(results, want):
        assert r.status == "OK", r.error
        assert r.token_ids == tokens
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w  # G3
    # The workers did quantize: int8's greedy tokens are not bf16's everywhere.
    from workers.offline import LLM

    full = LLM(num_kv_blocks=512, dtype="bfloat16").generate(requests[: len(CHATS)])
    assert any(c.token_ids != tokens for c, tokens in zip(full, want))


def test_the_offline_engine_serves_int8_weights(llm):
    from workers.model.linear import PackedLinear

    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.int8 is not None and m.weight is None for m in linears[:-1])
    assert linears[-1].int8 is not None  # the tied lm_head too; the embedding stays bf16


@pytest.mark.fault
@pytest.mark.timeout(900)
def test_int8_streams_stay_whole_through_a_decode_kill(cluster, llm):
    """The lone decode worker killed mid-stream: its replacement quantizes the checkpoint the
    same way, so the replayed streams equal the int8 offline engine's, token for token."""
    from tests.fault.faults import (
        assert_clean,
        assert_whole,
        kill,
        live_workers,
        run_with_fault,
        wait_for,
    )
    from tests.fault.faults import workload as fault_workload

    requests = fault_workload(8, max_tokens=48)
    want = [c.token_ids for c in llm.generate(requests)]
    restarts = cluster.status()["pools"]["decode"]["restarts"]

    async def strike():
        [only] = await live_workers(cluster.client, "decode")
        kill(only["pid"])

    results, _ = cluster.run(run_with_fault(cluster.client, requests, strike), timeout=600)
    assert_whole(results, want)
    wait_for(
        lambda: cluster.status()["pools"]["decode"]["restarts"] == restarts + 1,
        180,
        "the decode pool restarted once",
    )
    assert_clean(cluster.status, lambda: cluster.run(cluster.store.active()))
