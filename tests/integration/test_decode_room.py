"""A burst bigger than the decode pool's KV: requests wait their turn for room as long as the
pool moves, and are served, not refused; a request no decode worker could ever hold is
refused at once, as invalid. One prefill and one decode worker of 64 KV blocks (1,024
tokens) each, reserve_timeout_s=5: real Ray actors, Redis and gRPC, SmolLM2 in fp32."""

import pytest

from client import to_proto
from tests.integration.harness import greedy, offline_reference, one_by_one
from workers.completion import GenerationRequest
from workers.engine.request import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BLOCKS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = one_by_one(
        str(tmp_path_factory.mktemp("data")),
        engine={"num_kv_blocks": BLOCKS},
        reserve_timeout_s=5,
    )
    yield h
    h.stop()


def test_a_burst_past_the_decode_pools_room_is_served_in_turn(cluster):
    """12 prompts of about 300 tokens (19 blocks each): three fit on the decode worker at
    once, so the last wait several rounds, well past reserve_timeout_s, while the pool moves.
    Each ends whole and equal to the offline engine (G1, G4), and every block is free (G3)."""
    text = "Summarise: " + "the river bends past the old mill and the quiet town " * 26
    requests = [greedy(f"({i}) {text}", 32, ignore_eos=True) for i in range(12)]
    want = offline_reference(requests)
    results = cluster.generate_many(requests)
    for r, tokens in zip(results, want):
        assert r.status == "OK", r.error
        assert r.token_ids == tokens
    s = cluster.wait_all_free()
    assert all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in s["prefill"] + s["decode"])


def test_a_request_no_decode_worker_could_hold_is_refused_at_once(cluster):
    tok = cluster.cluster.router.tokenizer
    ids = tok.encode("word " * 1200)[: BLOCKS * 16 + 40]
    req = GenerationRequest(prompt_ids=ids, sampling=SamplingParams(max_tokens=4))
    r = cluster.run(cluster.client.generate(to_proto(req), timeout_s=30))
    assert r.status == "INVALID_ARGUMENT" and "cannot run here" in r.error, (r.status, r.error)
    assert f"can hold {BLOCKS} for one request" in r.error
