"""Quantized weights and KV through the cluster, bf16 activations: int8 (each worker quantizes
the same checkpoint the same way), gguf (each serves the default model's Q4_1 and Q8_0 blocks
as stored) and an fp8 KV cache (shipped as fp8 from prefill to decode), so a stream through
prefill and decode workers is the quantized model's offline output (G4), greedy and seeded,
and stays so through a replay."""

import pytest

from tests.integration.harness import CHATS, greedy, one_by_one
from workers.engine.request import SamplingParams
from workers.model.cpu_kernels import cpu_kernels

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(cpu_kernels() is None, reason="int8 runs on Tandem's CPU kernels"),
]


SETTINGS = {
    "int8": {"quantization": "int8"},
    "gguf": {"quantization": "gguf"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def engine(request):
    return {"dtype": "bfloat16", **SETTINGS[request.param]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, engine):
    h = one_by_one(str(tmp_path_factory.mktemp("data")), engine=engine)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def llm(engine):
    from workers.offline import LLM

    return LLM(num_kv_blocks=512, **engine)


def test_quantized_streams_equal_the_quantized_offline_engine(cluster, llm, engine):
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
    cfg = llm.engine.model_config
    per_token = 2 * cfg.num_layers * cfg.kv_size * (1 if engine.get("kv_cache_dtype") else 2)
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w  # G3
        assert w["kv_bytes_per_token"] == per_token, w  # as `tandem status` shows it
    # The workers did quantize: the quantized model's greedy tokens are not bf16's everywhere.
    from workers.offline import LLM

    full = LLM(num_kv_blocks=512, dtype="bfloat16").generate(requests[: len(CHATS)])
    assert any(c.token_ids != tokens for c, tokens in zip(full, want))


def test_the_offline_engine_serves_quantized_weights(llm, engine):
    import torch

    from workers.model.gguf_linear import BlockWeight
    from workers.model.int8_linear import Int8Weight
    from workers.model.linear import PackedLinear

    if engine.get("kv_cache_dtype") == "fp8":
        assert llm.engine.runner.kv_layers[0].dtype == torch.float8_e4m3fn
        return
    kind = Int8Weight if engine["quantization"] == "int8" else BlockWeight
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(isinstance(m.quantized, kind) for m in linears)
    assert all(m.weight is None for m in linears[:-1])  # the tied lm_head keeps the embedding


@pytest.mark.fault
@pytest.mark.timeout(900)
def test_quantized_streams_stay_whole_through_a_decode_kill(cluster, llm):
    """The lone decode worker killed mid-stream: its replacement loads the same quantized
    weights the same way, so the replayed streams equal the offline engine's, token for
    token."""
    from tests.fault.faults import replayed_through_a_kill, workload

    requests = workload(8, max_tokens=48)
    want = [c.token_ids for c in llm.generate(requests)]
    replayed_through_a_kill(cluster, requests, want, lambda worker: worker["pid"])
