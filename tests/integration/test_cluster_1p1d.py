"""One prefill and one decode worker behind the router: real Ray actors, real Redis, real
gRPC on loopback, SmolLM2 in fp32."""

import json
import subprocess
import sys
import time

import grpc
import pytest

from router.api import tandem_pb2 as pb
from tests.integration.harness import CHATS, greedy, offline_reference, one_by_one

pytestmark = pytest.mark.integration

REQUESTS = [greedy(c, 24 + 4 * i) for i, c in enumerate(CHATS * 2)]  # 16 concurrent clients


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = one_by_one(str(tmp_path_factory.mktemp("data")))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def reference():
    return offline_reference(REQUESTS)


def test_greedy_streams_equal_the_offline_engine(cluster, reference):
    results = cluster.generate_many(REQUESTS)
    for r, want in zip(results, reference):
        assert r.status == "OK", r.error
        assert r.token_ids == want
        assert r.finish_reason in ("stop", "length")
        assert r.ttft_s is not None and r.ttft_s <= r.e2e_s
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w  # G3


def test_sampling_parameters_through_the_cluster_equal_the_offline_engine(cluster):
    """Seeded draws with every sampling parameter: the prefill worker draws the first token
    and the decode worker the rest, with the same tokens and logprobs as one engine."""
    from workers.engine.request import SamplingParams
    from workers.offline import LLM, GenerationRequest

    llm = LLM(dtype="float32", num_kv_blocks=512)
    eos = llm.engine.eos_token_ids[0]
    kinds = [
        dict(temperature=0.8, min_p=0.05, repetition_penalty=1.3),
        dict(temperature=1.0, top_k=40, presence_penalty=1.0, frequency_penalty=0.5),
        # EOS made the likeliest token: it comes right after min_tokens.
        dict(temperature=0.0, logit_bias={eos: 100.0}, min_tokens=8),
        dict(temperature=0.9, top_p=0.9, logprobs=True, top_logprobs=3),
    ]
    reqs = [
        GenerationRequest(
            prompt=c, sampling=SamplingParams(max_tokens=20, seed=7 + i, **kinds[i % 4])
        )
        for i, c in enumerate(CHATS[:8])
    ]
    offline = llm.generate(reqs)
    results = cluster.generate_many(reqs)
    for r, want in zip(results, offline):
        assert r.status == "OK", r.error
        assert r.token_ids == want.token_ids
        if want.logprobs is not None:
            assert r.logprobs == pytest.approx(want.logprobs, abs=1e-4)
            assert [[t for t, _ in top] for top in r.top_logprobs] == [
                [t for t, _ in top] for top in want.top_logprobs
            ]
            assert len(r.top_logprobs) == len(r.token_ids)
    assert all(r.token_ids[8:] == [eos] for r in results[2::4])
    cluster.wait_all_free()


def test_token_log_and_state_in_redis(cluster):
    from cluster.state import key
    from router.records.store import RecordState

    [r] = cluster.generate_many([greedy("Name a colour.", 8)])
    store = cluster.store
    rec = cluster.ended(r.request_id)
    assert rec.state is RecordState.FINISHED and rec.finish_reason == r.finish_reason
    assert rec.attempt == 1 and rec.failures == () and rec.decode == "decode-0"
    assert cluster.run(store.tokens(r.request_id)) == r.token_ids
    assert 0 < cluster.run(store.r.ttl(key(r.request_id))) <= store.ttl_s
    assert r.request_id not in cluster.run(store.active())  # nothing left in flight


def test_resume_replays_from_an_offset(cluster):
    [r] = cluster.generate_many([greedy("Count from one to ten.", 12)])

    async def resume():
        out = []
        async for m in cluster.client.gen.Resume(
            pb.ResumeRequest(request_id=r.request_id, offset=3)
        ):
            out.append(m)
        return out

    [m] = cluster.run(resume())
    assert list(m.token_ids) == r.token_ids[3:] and m.final.finish_reason == r.finish_reason


def test_cancel_mid_stream_frees_blocks_on_both_workers(cluster):
    async def go():
        msg = pb.GenerateRequest(
            prompt="Write a very long essay about the ocean.",
            sampling=pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
        )
        call = cluster.client.gen.Generate(msg)
        got, final = 0, None
        async for m in call:
            got += len(m.token_ids)
            if got >= 5 and final is None and not m.HasField("final"):
                await cluster.client.cancel(m.request_id)
            if m.HasField("final"):
                final = m.final
        return got, final

    got, final = cluster.run(go())
    assert final.finish_reason == "cancelled" and got < 400
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w


def test_client_deadline_frees_blocks(cluster):
    [r] = cluster.generate_many(
        [greedy("Write a very long essay about mountains.", 400, ignore_eos=True)], timeout_s=1.5
    )
    assert r.status == "DEADLINE_EXCEEDED"
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt="hi", prompt_ids=[1, 2]), "either prompt or prompt_ids"),
        (dict(prompt_ids=[1] * 9000), "model's context is 8192"),
        (dict(prompt_ids=[10**6]), "outside the vocabulary"),
        (dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens=0"),
        (dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=9000)), "exceeds the model's"),
        (dict(prompt="hi", sampling=pb.SamplingParams(temperature=-0.5)), "temperature=-0.5"),
        (dict(prompt="hi", sampling=pb.SamplingParams(top_p=0.0)), "top_p=0.0"),
        (dict(prompt="hi", sampling=pb.SamplingParams(top_p=1.5)), "top_p=1.5"),
        (dict(prompt="hi", request_id="bad id!"), "request_id"),
        (dict(prompt="hi", sampling=pb.SamplingParams(min_p=2.0)), "sampling.min_p=2.0"),
        (
            dict(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=0.0)),
            "sampling.repetition_penalty=0.0",
        ),
        (
            dict(prompt="hi", sampling=pb.SamplingParams(logit_bias={10**6: 1.0})),
            "sampling.logit_bias: token 1000000 is outside",
        ),
        (
            dict(prompt="hi", sampling=pb.SamplingParams(top_logprobs=3)),
            "needs logprobs",
        ),
        (
            dict(prompt="hi", sampling=pb.SamplingParams(max_tokens=4, min_tokens=8)),
            "sampling.min_tokens=8",
        ),
    ],
)
def test_bad_input_gets_invalid_argument(cluster, kwargs, fragment):
    msg = pb.GenerateRequest(**kwargs)
    r = cluster.run(cluster.client.generate(msg, timeout_s=30))
    assert r.status == "INVALID_ARGUMENT" and fragment in r.error


def test_wrongly_typed_field_gets_invalid_argument(cluster):
    async def raw():
        call = cluster.client.channels[0].unary_stream(
            "/tandem.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        # field 5 (priority, an int) sent as a string
        try:
            async for _ in call(b"\x12\x02hi" + b"\x2a\x03abc", timeout=10):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()

    code, details = cluster.run(raw())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "[5]" in details


def test_health_reflection_and_status_cli(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def check():
        stub = health_pb2_grpc.HealthStub(cluster.client.channels[0])
        r = await stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Generation"))
        return r.status

    assert cluster.run(check()) == 1  # SERVING
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "status", "--address", cluster.address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert [w["name"] for w in s["prefill"]] == ["prefill-0"]
    assert [w["name"] for w in s["decode"]] == ["decode-0"]
    for w in s["prefill"] + s["decode"]:
        assert (
            set(w)
            >= {
                "name",
                "pid",
                "node",
                "alive",
                "kv_blocks_total",
                "kv_blocks_free",
                "running",
                "waiting",
            }
            and w["alive"]
            and w["pid"] > 0
        )
    assert s["router"]["mode"] == "disaggregated" and "queue_depth" in s["router"]


def test_generate_cli_against_the_cluster(cluster, tmp_path, reference):
    f = tmp_path / "r.jsonl"
    f.write_text(
        "".join(
            json.dumps({"prompt": r.prompt, "max_tokens": r.sampling.max_tokens, "temperature": 0})
            + "\n"
            for r in REQUESTS[:3]
        )
    )
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "generate",
            "--address",
            cluster.address,
            "--requests",
            str(f),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert [x["token_ids"] for x in lines] == reference[:3]
    assert all(0 < x["ttft_s"] <= x["e2e_s"] < time.monotonic() - t0 for x in lines)


# -- n > 1: the prompt prefilled and pushed once, the choices forked on the decode worker ----
N_SAMPLING = dict(max_tokens=20, temperature=0.9, top_p=0.95, seed=42, logprobs=True)


@pytest.fixture(scope="module")
def lone_choices():
    """Choice i of the n = 4 request, as a lone offline request seeded 42 + i."""
    from workers.engine.request import SamplingParams, choice_seed
    from workers.offline import LLM, GenerationRequest

    llm = LLM(dtype="float32", num_kv_blocks=512)
    seeded = [SamplingParams(**{**N_SAMPLING, "seed": choice_seed(42, i)}) for i in range(4)]
    return llm.generate([GenerationRequest(prompt=CHATS[1], sampling=sp) for sp in seeded])


def test_n_choices_share_one_prefill_and_push_and_equal_lone_requests(cluster, lone_choices):
    from client import to_proto
    from router.records.store import RecordState
    from workers.engine.request import SamplingParams, choice_id
    from workers.messages import Pool
    from workers.offline import GenerationRequest

    req = GenerationRequest(prompt=CHATS[1], sampling=SamplingParams(**N_SAMPLING, n=4))
    seen = []
    results = cluster.run(
        cluster.client.generate_choices(
            to_proto(req, "n4"), timeout_s=120, on_chunk=lambda m: seen.append(m)
        )
    )
    assert [r.index for r in results] == [0, 1, 2, 3]
    for r, want in zip(results, lone_choices):
        assert r.status == "OK" and r.finish_reason == want.finish_reason, r.error
        assert r.token_ids == want.token_ids
        assert r.text == want.text
        assert r.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert len({tuple(r.token_ids) for r in results}) > 1  # four draws, not one four times
    # Every response names the request itself; each choice ends with a final of its own,
    # whose usage counts that choice's tokens.
    assert {m.request_id for m in seen} == {"n4"}
    finals = {m.index: m.final for m in seen if m.HasField("final")}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(finals[r.index].usage.completion_tokens == len(r.token_ids) for r in results)
    # One KV push, under the request's own id; none for any other choice.
    prefill = cluster.cluster.router.fleet.directory.members(Pool.PREFILL)[0]

    async def pushed(rid):
        return await prefill.handle.push_result.remote(rid, 5.0)

    assert cluster.run(pushed("n4")).ok
    assert all(cluster.run(pushed(choice_id("n4", i))).error == "no such push" for i in (1, 2, 3))
    # Each choice is a request of its own in the store: its record, its tokens.
    for r in results:
        cid = choice_id("n4", r.index)
        rec = cluster.ended(cid)
        assert rec.state is RecordState.FINISHED and rec.choices == 4 and rec.attempt == 1
        assert rec.sampling.n == 1 and rec.sampling.seed == 42 + r.index
        assert cluster.run(cluster.store.tokens(cid)) == r.token_ids
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w  # G3


def test_resume_takes_one_choice_from_its_own_offset(cluster, lone_choices):
    async def resume(index):
        msg = pb.ResumeRequest(request_id="n4", offset=5, index=index)
        return [m async for m in cluster.client.gen.Resume(msg)]

    for i in (0, 2):
        msgs = cluster.run(resume(i))
        assert all(m.index == i for m in msgs)
        assert [t for m in msgs for t in m.token_ids] == lone_choices[i].token_ids[5:]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        cluster.run(resume(4))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "choice 4" in e.value.details()


def test_cancel_ends_every_choice_and_frees_every_block(cluster):
    from router.records.store import RecordState
    from workers.engine.request import choice_id

    async def go():
        msg = pb.GenerateRequest(
            request_id="n3-cancel",
            prompt="Write a very long essay about the ocean.",
            sampling=pb.SamplingParams(
                max_tokens=400, temperature=1.0, seed=7, ignore_eos=True, n=3
            ),
        )
        got, finals, cancelled = [0] * 3, {}, False
        async for m in cluster.client.gen.Generate(msg):
            got[m.index] += len(m.token_ids)
            if min(got) >= 3 and not cancelled:
                cancelled = await cluster.client.cancel("n3-cancel")
            if m.HasField("final"):
                finals[m.index] = m.final.finish_reason
        return got, finals

    got, finals = cluster.run(go())
    assert finals == {0: "cancelled", 1: "cancelled", 2: "cancelled"} and max(got) < 400
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w
    for i in range(3):
        rec = cluster.ended(choice_id("n3-cancel", i))
        assert rec.state is RecordState.CANCELLED


def test_generate_cli_prints_each_choice_apart(cluster, lone_choices, tmp_path):
    cli = [sys.executable, "-m", "cluster.cli", "generate", "--address", cluster.address]
    f = tmp_path / "n.jsonl"
    f.write_text(json.dumps({"prompt": CHATS[1], "n": 4, **N_SAMPLING}) + "\n")
    proc = subprocess.run(
        [*cli, "--json", "--requests", str(f)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [(x["index"], x["choice"]) for x in lines] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [x["token_ids"] for x in lines] == [c.token_ids for c in lone_choices]
    # A prompt with --n: each choice under a header of its own, in order.
    proc = subprocess.run(
        [*cli, CHATS[1], "--n", "2", "--temperature", "0.9", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.index("=== request 0, choice 0 ===") < out.index("=== request 0, choice 1 ===")
