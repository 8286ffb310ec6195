"""Conditional disaggregation (router.local_prefill_max_tokens): a short request is prefilled
on its decode worker, a long one on the prefill worker, and both give the offline engine's
tokens; killing the decode worker loses none of them. Real Ray actors, Redis and gRPC,
SmolLM2 in fp32."""

import pytest

from tests.integration.harness import CHATS, greedy, offline_reference, one_by_one
from workers.completion import GenerationRequest
from workers.engine.request import SamplingParams
from workers.messages import Pool

pytestmark = pytest.mark.integration

LOCAL_MAX = 64  # every chat below fits; the long ones do not
MAX_LEN = 1024  # the engines' max_model_len, under the model's 8192
LONG = " ".join(CHATS)  # about 120 tokens with the chat template
REQUESTS = [greedy(c, 16) for c in CHATS[:4]] + [greedy(LONG + f" ({i})", 16) for i in range(2)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = one_by_one(
        str(tmp_path_factory.mktemp("data")),
        engine={"max_model_len": MAX_LEN},
        local_prefill_max_tokens=LOCAL_MAX,
    )
    yield h
    h.stop()


def test_short_requests_prefill_on_their_decode_worker_and_long_ones_do_not(cluster):
    want = offline_reference(REQUESTS)
    results = cluster.generate_many(REQUESTS)
    prefill = cluster.cluster.router.fleet.directory.members(Pool.PREFILL)[0]
    kinds = []

    async def pushed(rid):
        return await prefill.handle.push_result.remote(rid, 5.0)

    for r, tokens in zip(results, want):
        assert r.status == "OK", r.error
        assert r.token_ids == tokens  # G4, whichever worker prefilled it
        rec = cluster.ended(r.request_id)
        local = len(rec.prompt_ids) <= LOCAL_MAX
        kinds.append(local)
        assert rec.prefill == ("" if local else prefill.name), (rec.prefill, len(rec.prompt_ids))
        assert rec.decode == "decode-0" and rec.attempt == 1
        # A KV push exists for the long requests alone.
        push = cluster.run(pushed(r.request_id))
        assert push.ok != local, push
    assert kinds == [True] * 4 + [False] * 2
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w  # G3


def test_a_short_request_with_n_choices_forks_on_its_decode_worker(cluster):
    from client import to_proto

    [want] = offline_reference([greedy(CHATS[6], 12)])
    req = greedy(CHATS[6], 12, n=2)
    results = cluster.run(cluster.client.generate_choices(to_proto(req, "local-n2"), timeout_s=120))
    assert [r.index for r in results] == [0, 1]
    assert all(r.status == "OK" and r.token_ids == want for r in results)
    rec = cluster.ended("local-n2#1")
    assert rec.prefill == "" and rec.choices == 2
    cluster.wait_all_free()


def test_a_stop_the_prefill_workers_first_token_completes_is_cut_as_offline(cluster):
    """A long prompt's first token comes from the prefill worker, and the router streams it
    before a decode worker has matched it against the stops: its text must still end before
    a stop it completes, as the offline engine's does (G4, for the text)."""
    from workers.offline import LLM

    tok = cluster.cluster.router.tokenizer
    [plain] = cluster.generate_many([greedy(LONG, 8)])
    first = tok.decode(plain.token_ids[:1])
    stops = {first[-1], first.strip()[:2]} - {""}
    requests = [greedy(LONG, 8, stop=(stop,)) for stop in sorted(stops)]
    want = [c.text for c in LLM(dtype="float32", num_kv_blocks=512).generate(requests)]
    for req, r, text in zip(requests, cluster.generate_many(requests), want):
        assert r.status == "OK", r.error
        assert (r.text, r.finish_reason) == (text, "stop"), (req.sampling.stop, first)
    cluster.wait_all_free()


def test_the_engines_max_model_len_bounds_requests_at_the_router(cluster):
    """Past the engines' max_model_len (not the model's context) a request is refused as
    invalid at admission, naming the limit; it used to reach a worker that refused it, and
    came back RESOURCE_EXHAUSTED (retry) or UNAVAILABLE after every attempt."""
    from client import to_proto

    tok = cluster.cluster.router.tokenizer
    words = " ".join(["word"] * (MAX_LEN + 50))
    too_long = GenerationRequest(
        prompt_ids=tok.encode(words)[: MAX_LEN + 10], sampling=SamplingParams(max_tokens=4)
    )
    too_much = GenerationRequest(
        prompt_ids=tok.encode(words)[:1000], sampling=SamplingParams(max_tokens=100)
    )
    for req in (too_long, too_much):
        r = cluster.run(cluster.client.generate(to_proto(req), timeout_s=60))
        assert r.status == "INVALID_ARGUMENT" and str(MAX_LEN) in r.error, (r.status, r.error)
    [fits] = cluster.generate_many(
        [
            GenerationRequest(
                prompt_ids=tok.encode(words)[:1000],
                sampling=SamplingParams(max_tokens=4, ignore_eos=True),
            )
        ]
    )
    assert fits.status == "OK" and len(fits.token_ids) == 4, fits.error
    cluster.wait_all_free()


@pytest.mark.fault
@pytest.mark.timeout(900)
def test_locally_prefilled_streams_survive_their_decode_worker(cluster):
    from tests.fault.faults import (
        assert_clean,
        assert_whole,
        kill,
        live_workers,
        run_with_fault,
        wait_for,
        workload,
    )

    requests = workload(8, max_tokens=60)  # short chats: every first attempt is local
    reference = cluster.generate_many(requests)
    for r in reference:
        rec = cluster.ended(r.request_id)
        assert r.status == "OK" and rec.prefill == "", (r.error, len(rec.prompt_ids))

    async def strike():
        [only] = await live_workers(cluster.client, "decode")
        kill(only["pid"])

    results, _ = cluster.run(run_with_fault(cluster.client, requests, strike), timeout=600)
    # G1, G2: each stream whole, equal to the no-fault run, replayed on the replacement (a
    # replay carries the tokens already sent, so it may be long enough for the prefill worker).
    assert_whole(results, [r.token_ids for r in reference])
    recs = [cluster.ended(r.request_id) for r in results]
    assert any("decode-0" in f for rec in recs for f in rec.failures), "nothing replayed"
    wait_for(lambda: cluster.status()["pools"]["decode"]["live"] == 1, 180, "a new decode worker")
    assert_clean(cluster.status, lambda: cluster.run(cluster.store.active()))  # G3
