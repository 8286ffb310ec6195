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
    from router.store import RecordState

    [r] = cluster.generate_many([greedy("Name a colour.", 8)])
    store = cluster.store
    rec = cluster.run(store.get(r.request_id))
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
