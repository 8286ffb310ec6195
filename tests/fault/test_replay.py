"""Failure replay on the default model (SmolLM2, fp32), with 16 concurrent streams and real
processes killed by pid: a decode worker (with two decode workers, and alone), a prefill
worker mid-prefill, a KV transfer cut midway, Redis killed and restarted, Redis unreachable.
Every stream must end whole and equal to the no-fault run, token for token (greedy, and
seeded sampling at temperature 0.8); afterwards no worker holds a KV block and no request
record is left non-terminal. The router-failover case is in test_router_failover.py."""

import asyncio
import os
import signal
import time

import pytest

from client import to_proto
from router.records.store import RecordState
from tests.fault.faults import (
    assert_clean,
    assert_whole,
    kill,
    live_workers,
    run_with_fault,
    wait_for,
    workload,
)
from tests.integration.harness import CHATS, ClusterHarness, cluster_config, greedy
from workers.completion import GenerationRequest
from workers.engine.constraint import Constraint, ConstraintKind
from workers.engine.request import SamplingParams, choice_id

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.timeout(900)]

REQUESTS = workload(16)
LONG_TEXT = " ".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank."
    for i in range(90)
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = ClusterHarness(
        cluster_config(
            engine={"dtype": "float32", "num_kv_blocks": 640},
            prefill={"replicas": 1, "cpus": 0.5},
            decode={"replicas": 2, "cpus": 0.5},
            router={"port": 0},
            dashboard=False,
            ray_num_cpus=4,
            transfer_timeout_s=5,
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()


@pytest.fixture(scope="module")
def reference(cluster):
    """The no-fault run of the workload, on the same cluster."""
    results = cluster.generate_many(REQUESTS)
    for r in results:
        assert r.status == "OK", r.error
    return [r.token_ids for r in results]


def clean(cluster) -> dict:
    return assert_clean(cluster.status, lambda: cluster.run(cluster.store.active()))


def live(cluster, pool: str) -> list[dict]:
    return [w for w in cluster.status()[pool] if w["alive"]]


def healed(cluster, pool: str, n: int) -> dict:
    def ok():
        s = cluster.status()
        return s if s["pools"][pool]["live"] == n and not s["pools"][pool]["starting"] else None

    return wait_for(ok, 180, f"the {pool} pool back at {n}")


def failures(cluster, results) -> list[str]:
    recs = [cluster.ended(r.request_id) for r in results]
    return [f for rec in recs for f in rec.failures]


def test_decode_worker_killed_mid_stream_with_two_decode_workers(cluster, reference):
    victim = max(live(cluster, "decode"), key=lambda w: w["name"])
    restarts = cluster.status()["pools"]["decode"]["restarts"]

    async def strike():
        busiest = max(await live_workers(cluster.client, "decode"), key=lambda w: w["running"])
        victim.update(busiest)
        kill(busiest["pid"])

    results, _ = cluster.run(run_with_fault(cluster.client, REQUESTS, strike), timeout=600)
    assert_whole(results, reference)  # greedy and the two seeded sampled streams alike
    assert any(victim["name"] in f for f in failures(cluster, results)), "nothing replayed"
    s = healed(cluster, "decode", 2)
    assert s["pools"]["decode"]["restarts"] == restarts + 1
    assert victim["name"] not in [w["name"] for w in s["decode"] if w["alive"]]
    assert s["router"]["replays_recovered"] >= 1
    clean(cluster)


def test_prefill_worker_killed_mid_prefill(cluster, reference):
    long = greedy(LONG_TEXT, 24, ignore_eos=True)
    [want] = cluster.generate_many([long])
    assert want.status == "OK"
    requests = [long, *REQUESTS[:8]]

    async def strike_mid_prefill(client):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # strike while the long prompt is being computed
            s = await client.status()
            p = [w for w in s.prefill if w.alive][0]
            if p.queued_prefill_tokens >= 1000:
                kill(p.pid)
                return p.name
            await asyncio.sleep(0.01)
        raise AssertionError("never saw the long prompt queued on the prefill worker")

    async def go():
        tasks = [
            asyncio.create_task(cluster.client.generate(to_proto(r), timeout_s=400))
            for r in requests
        ]
        name = await strike_mid_prefill(cluster.client)
        return name, await asyncio.gather(*tasks)

    victim, results = cluster.run(go(), timeout=600)
    assert_whole(results, [want.token_ids, *reference[:8]])
    assert any(victim in f for f in failures(cluster, results[:1]))
    healed(cluster, "prefill", 1)
    clean(cluster)


def test_kv_transfer_cut_midway(cluster, reference):
    """Both decode workers are frozen (SIGSTOP) as the first prefill ends, so the pushes
    then under way stop mid-payload; the one holding the most reservations (pushes on their
    way to it) is killed, the other thawed."""
    prompts = [greedy(LONG_TEXT[: 900 + 60 * i], 16, ignore_eos=True) for i in range(12)]
    wanted = [r.token_ids for r in cluster.generate_many(prompts)]
    frozen: list[dict] = []

    async def strike():
        workers = await live_workers(cluster.client, "decode")
        frozen.extend(sorted(workers, key=lambda w: w["reserved"], reverse=True))
        for w in frozen:
            os.kill(w["pid"], signal.SIGSTOP)
        # The prefill worker goes on prefilling and pushing: within a second its sender is
        # blocked mid-payload on a frozen receiver (gloo sends of MBs cannot complete).
        await asyncio.sleep(1.0)
        kill(frozen[0]["pid"])
        for w in frozen[1:]:
            os.kill(w["pid"], signal.SIGCONT)

    results, _ = cluster.run(
        run_with_fault(cluster.client, prompts, strike, when_tokens=1), timeout=600
    )
    assert_whole(results, wanted)
    cut = [f for f in failures(cluster, results) if frozen[0]["name"] in f]
    assert cut, "no attempt on the killed decode worker failed"
    healed(cluster, "decode", 2)
    clean(cluster)


N_REQUEST = GenerationRequest(
    prompt=CHATS[5],
    sampling=SamplingParams(max_tokens=60, temperature=0.8, seed=77, ignore_eos=True, n=4),
)


def test_n_choices_replay_each_on_its_own_when_their_decode_worker_dies(cluster):
    """The four choices of one request run forked on one decode worker, which is killed
    mid-stream: each choice replays as a request of its own (seed + i, from its own tokens)
    and every one ends whole, equal to the no-fault run."""
    client = cluster.client
    want = cluster.run(client.generate_choices(to_proto(N_REQUEST), timeout_s=300))
    counts = [0] * 4

    def count(m):
        counts[m.index] += len(m.token_ids)

    async def go():
        msg = to_proto(N_REQUEST, "n-decode-dies")
        task = asyncio.create_task(client.generate_choices(msg, timeout_s=400, on_chunk=count))
        deadline = time.monotonic() + 120
        while min(counts) < 8:
            assert time.monotonic() < deadline and not task.done(), counts
            await asyncio.sleep(0.01)
        rec = await cluster.store.get("n-decode-dies")
        [victim] = [w for w in await live_workers(client, "decode") if w["name"] == rec.decode]
        kill(victim["pid"])
        return victim["name"], await task

    victim, results = cluster.run(go(), timeout=600)
    assert [r.status for r in results] == ["OK"] * 4, [r.error for r in results]
    assert [r.token_ids for r in results] == [w.token_ids for w in want]
    for i in range(4):
        rec = cluster.run(cluster.store.get(choice_id("n-decode-dies", i)))
        assert rec.attempt >= 2 and any(victim in f for f in rec.failures), rec
        assert rec.sampling.n == 1 and rec.sampling.seed == 77 + i
    healed(cluster, "decode", 2)
    clean(cluster)


def test_n_choices_replay_when_their_shared_prefill_dies(cluster):
    """The prefill worker computing an n = 3 request's long prompt is killed: the shared first
    attempt fails for all three choices, and each replays alone, equal to the no-fault run."""
    sp = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True, n=3)
    req = GenerationRequest(prompt=LONG_TEXT, sampling=sp)
    want = cluster.run(cluster.client.generate_choices(to_proto(req), timeout_s=300))

    async def go():
        msg = to_proto(req, "n-prefill-dies")
        task = asyncio.create_task(cluster.client.generate_choices(msg, timeout_s=400))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # strike while the long prompt is being computed
            s = await cluster.client.status()
            p = [w for w in s.prefill if w.alive][0]
            if p.queued_prefill_tokens >= 1000:
                kill(p.pid)
                return p.name, await task
            await asyncio.sleep(0.01)
        raise AssertionError("never saw the long prompt queued on the prefill worker")

    victim, results = cluster.run(go(), timeout=600)
    assert [r.status for r in results] == ["OK"] * 3, [r.error for r in results]
    assert [r.token_ids for r in results] == [w.token_ids for w in want]
    for i in range(3):
        rec = cluster.run(cluster.store.get(choice_id("n-prefill-dies", i)))
        assert any(victim in f for f in rec.failures), rec
    healed(cluster, "prefill", 1)
    clean(cluster)


def test_redis_killed_and_restarted_under_load(cluster, reference):
    redis = cluster.cluster.redis
    old = redis.pid

    results, _ = cluster.run(
        run_with_fault(cluster.client, REQUESTS, lambda: kill(old)), timeout=600
    )
    assert_whole(results, reference)
    wait_for(lambda: redis.pid != old and redis.restarts >= 1, 30, "redis restarted")
    clean(cluster)
    # What the restart lost was written again: every record is whole and terminal.
    for r in results:
        rec = cluster.run(cluster.store.get(r.request_id))
        assert rec is not None and rec.state is RecordState.FINISHED, r.request_id
        assert cluster.run(cluster.store.tokens(r.request_id)) == r.token_ids


def test_redis_unreachable_refuses_new_requests_and_streams_go_on(cluster, reference):
    pid = cluster.cluster.redis.pid
    stopped = {}

    async def strike():
        os.kill(pid, signal.SIGSTOP)  # alive but silent: calls time out
        try:
            stopped["late"] = await cluster.client.generate(
                to_proto(greedy("Hello?", 4)), timeout_s=60, max_resumes=0
            )
        finally:
            os.kill(pid, signal.SIGCONT)

    results, _ = cluster.run(run_with_fault(cluster.client, REQUESTS[:12], strike), timeout=600)
    assert_whole(results, reference[:12])
    late = stopped["late"]
    assert late.status == "UNAVAILABLE" and "unreachable" in late.error, late
    clean(cluster)
    [after] = cluster.generate_many([greedy("Hello again.", 4)])
    assert after.status == "OK"


def test_lone_decode_worker_killed_and_its_replacement_takes_over(cluster, reference):
    from router.api import tandem_pb2 as pb

    names = [w["name"] for w in live(cluster, "decode")]

    async def drain():
        request = pb.DrainRequest(worker=names[-1], timeout_s=60)
        return await cluster.client.admin.Drain(request, timeout=120)

    assert cluster.run(drain()).drained
    s = cluster.status()
    assert s["pools"]["decode"]["target"] == 1 and len(live(cluster, "decode")) == 1

    async def strike():
        [only] = await live_workers(cluster.client, "decode")
        kill(only["pid"])

    results, _ = cluster.run(run_with_fault(cluster.client, REQUESTS, strike), timeout=600)
    assert_whole(results, reference)
    healed(cluster, "decode", 1)
    clean(cluster)


GUEST_LIST = {
    "type": "object",
    "properties": {
        "guests": {
            "type": "array",
            "minItems": 4,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "age": {"type": "integer", "minimum": 1, "maximum": 99},
                    "diet": {"enum": ["any", "vegetarian", "vegan"]},
                },
                "required": ["name", "age", "diet"],
            },
        }
    },
    "required": ["guests"],
}


def guided_workload() -> list[GenerationRequest]:
    """8 constrained streams: JSON schema greedy and seeded, a regex and any JSON object."""
    schema = Constraint.json_schema(GUEST_LIST)
    words = Constraint(ConstraintKind.REGEX, r"([a-z]{2,8} ){12,20}[a-z]{2,8}\.")

    def req(i, c, **kw):
        sp = SamplingParams(max_tokens=240, constraint=c, **kw)
        return GenerationRequest(prompt=CHATS[i % len(CHATS)] + " Answer as asked.", sampling=sp)

    return [
        *[req(i, schema, temperature=0) for i in range(4)],
        req(4, schema, temperature=0.8, seed=41),
        req(5, schema, temperature=0.8, top_p=0.9, seed=42),
        req(6, words, temperature=0.7, seed=43),
        req(7, Constraint(ConstraintKind.JSON_OBJECT), temperature=0.8, seed=44),
    ]


def test_guided_streams_whole_through_a_decode_kill(cluster):
    """A constrained stream's matcher is rebuilt from its tokens wherever it lands: killed
    mid-stream, every guided stream ends equal to its no-fault run, and valid."""
    import json
    import re

    import jsonschema

    requests = guided_workload()
    decoders = cluster.status()["pools"]["decode"]["target"]  # 1 or 2, as tests before left it
    reference = cluster.generate_many(requests)
    assert all(r.status == "OK" for r in reference), [r.error for r in reference]

    async def strike():
        busiest = max(await live_workers(cluster.client, "decode"), key=lambda w: w["running"])
        kill(busiest["pid"])

    results, _ = cluster.run(run_with_fault(cluster.client, requests, strike), timeout=600)
    assert_whole(results, [r.token_ids for r in reference])
    assert failures(cluster, results), "nothing was replayed"
    for r in results[:6]:
        jsonschema.validate(json.loads(r.text), GUEST_LIST)
    assert re.fullmatch(r"([a-z]{2,8} ){12,20}[a-z]{2,8}\.", results[6].text)
    healed(cluster, "decode", decoders)
    clean(cluster)
