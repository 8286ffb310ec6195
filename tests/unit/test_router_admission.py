"""Router admission and auth decisions that need no workers: queue bound, empty pools,
bearer tokens."""

import asyncio
import re
from dataclasses import replace

import pytest

from router.admission.request import Admission
from router.config import RouterConfig
from router.errors import RouterError
from router.requests.core import Router
from workers.engine.request import SamplingParams
from workers.messages import Pool, PoolStatus, Status


class NoPools:
    """A worker directory with no workers at all, and none starting."""

    def subscribe(self, listener):
        pass

    def members(self, pool, include_dead=False):
        return []

    def starting(self, pool):
        return 0

    def pool_status(self):
        return [PoolStatus(p, target=0, live=0) for p in Pool]


def admission(rid="r1"):
    return Admission(rid, (1, 2, 3), SamplingParams(max_tokens=4, seed=7))


async def first_error(router, adm):
    try:
        async for _ in router.generate(adm):
            pass
    except RouterError as e:
        return e
    return None


def test_full_queue_is_resource_exhausted_and_empty_pools_unavailable():
    async def go():
        router = Router(NoPools(), tokenizer=None, block_size=16, config=RouterConfig(max_queue=0))
        full = await first_error(router, admission())
        router.config = RouterConfig(max_queue=10)
        empty = await first_error(router, admission("r2"))
        return full, empty

    full, empty = asyncio.run(go())
    assert full.status is Status.RESOURCE_EXHAUSTED and "queue is full" in full.message
    assert empty.status is Status.UNAVAILABLE and "scale it" in empty.message


def test_validation_takes_the_decimal_a_float32_field_came_from_and_names_bad_fields():
    from router.api import tandem_pb2 as pb
    from router.edge.validation import InvalidRequest, validate

    sp = pb.SamplingParams(
        temperature=0.8, top_p=0.95, min_p=0.05, repetition_penalty=1.3, logit_bias={5: -2.7}
    )
    adm = validate(pb.GenerateRequest(prompt_ids=[1, 2], sampling=sp), None, 100, 1000)
    s = adm.sampling
    assert (s.temperature, s.top_p, s.min_p, s.repetition_penalty) == (0.8, 0.95, 0.05, 1.3)
    assert s.logit_bias == ((5, -2.7),)
    for bad, name in [
        (pb.SamplingParams(presence_penalty=2.5), "sampling.presence_penalty=2.5"),
        (pb.SamplingParams(n=-1), "sampling.n=-1"),
        (pb.SamplingParams(n=65), "sampling.n=65"),
        (pb.SamplingParams(logit_bias={1000: 1.0}), "token 1000 is outside"),
    ]:
        with pytest.raises(InvalidRequest, match=name):
            validate(pb.GenerateRequest(prompt_ids=[1, 2], sampling=bad), None, 100, 1000)


class CountingTokenizer:
    """Counts what it is asked to tokenize: a refused prompt must never get here."""

    def __init__(self) -> None:
        self.calls = 0

    def encode_chat(self, text: str) -> list[int]:
        self.calls += 1
        return [1] * 3


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"sampling": {"stop": ["x"] * 17}}, "17 strings, at most 16 (max_stop_strings)"),
        ({"sampling": {"stop": ["y" * 257]}}, "257 characters, at most 256 (max_stop_chars)"),
        ({"sampling": {"stop_token_ids": list(range(257))}}, "257 ids, at most 256"),
        ({"sampling": {"logit_bias": {i: 1.0 for i in range(1025)}}}, "(max_logit_bias)"),
        ({"prompt": "é" * 3300}, "prompt: over 6400 bytes"),  # 3300 chars, 6600 bytes
        ({"prompt": "a" * 6401}, "limit: 64 bytes a token"),
        ({"request_id": "acme/job-1"}, "request_id: use 1-64 characters"),
        ({"request_id": "tandem:req:x"}, "request_id: use 1-64 characters"),
        ({"request_id": "job#1"}, "request_id: use 1-64 characters"),
    ],
)
def test_each_cost_limit_is_refused_before_any_work_naming_itself(fields, named):
    from router.api import tandem_pb2 as pb
    from router.edge.validation import InvalidRequest, validate

    sampling = pb.SamplingParams(**fields.pop("sampling", {}))
    msg = pb.GenerateRequest(sampling=sampling, **{"prompt": "Hello", **fields})
    tok = CountingTokenizer()
    with pytest.raises(InvalidRequest, match=re.escape(named)):
        validate(msg, tok, 100, 1000)
    assert tok.calls == 0  # refused unread


def test_requests_at_the_limits_are_taken():
    from router.api import tandem_pb2 as pb
    from router.edge.validation import message_bytes_limit, validate

    sampling = pb.SamplingParams(
        stop=["z" * 256] * 16, stop_token_ids=list(range(256)), max_tokens=4
    )
    msg = pb.GenerateRequest(request_id="A.b_c-9", prompt="a" * 6400, sampling=sampling)
    adm = validate(msg, CountingTokenizer(), 100, 1000)
    assert len(adm.sampling.stop) == 16 and adm.request_id == "A.b_c-9"
    assert msg.ByteSize() < message_bytes_limit(100)  # the largest valid message gets in


def test_each_choice_takes_a_slot_and_resume_streams_are_capped():
    async def go():
        config = RouterConfig(max_in_flight=4, max_resumes=1)
        router = Router(NoPools(), tokenizer=None, block_size=16, config=config)
        wide = Admission("wide", (1, 2), SamplingParams(max_tokens=4, seed=7, n=5))
        too_many = await first_error(router, wide)
        router._resumes = 1  # one Resume stream open already
        try:
            async for _ in router.resume("anything", 0):
                pass
        except RouterError as e:
            return too_many, e

    too_many, resumes = asyncio.run(go())
    assert too_many.status is Status.INVALID_ARGUMENT
    assert "sampling.n=5: each choice takes a slot" in too_many.message
    assert resumes.status is Status.RESOURCE_EXHAUSTED and "router.max_resumes" in resumes.message


def test_a_spent_quota_is_resource_exhausted_with_when_to_retry():
    from router.tenant_policy import TenantsConfig

    async def go():
        tenants = TenantsConfig(tokens_per_minute={"metered": 60})
        router = Router(NoPools(), None, 16, config=RouterConfig(tenants=tenants))
        router.admission.tenants.charge("metered", 90)  # 30 tokens in debt
        adm = Admission("q1", (1, 2, 3), SamplingParams(max_tokens=4, seed=7), tenant="metered")
        spent = await first_error(router, adm)
        other = await first_error(router, admission("q2"))  # another tenant: not refused
        late = await first_error(router, replace(admission("q3"), reject_if_late=True))
        return spent, other, late

    spent, other, late = asyncio.run(go())
    assert spent.status is Status.RESOURCE_EXHAUSTED and not spent.final
    assert "tokens_per_minute" in spent.message
    assert spent.retry_after_s == pytest.approx(33.0, abs=0.5)  # 30 owed + 3 asked, 1 a second
    assert other.status is Status.UNAVAILABLE  # on to the (empty) pools
    assert late.status is Status.INVALID_ARGUMENT and "ttft_slo_ms" in late.message


def test_tandem_tenants_set_builds_its_request_and_names_bad_fields():
    from cluster.cli_remote import tenant_request

    r = tenant_request(
        [("gold", "weight=4,tier=0,max_wait_s=none"), ("free", "tokens_per_minute=600")],
        ["silver"],
    )
    gold, free = r.set
    assert list(r.reset) == ["silver"]
    assert (gold.name, gold.weight, gold.tier, gold.max_wait_s) == ("gold", 4.0, 0, 0.0)
    assert not gold.HasField("max_concurrency") and free.tokens_per_minute == 600
    for bad, why in (("colour=red", "FIELD one of"), ("tier=x", "takes a number"),
                     ("weight=none", "only max_wait_s")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            tenant_request([("gold", bad)])


def test_records_flush_waits_for_queued_writes_and_gives_up_in_time():
    from router.records.records import Records

    class Store:
        where = "fake"

        def __init__(self, delay_s: float) -> None:
            self.delay_s, self.done = delay_s, []

        async def put(self, what: str) -> None:
            await asyncio.sleep(self.delay_s)
            self.done.append(what)

    async def go(delay_s: float, timeout_s: float):
        store = Store(delay_s)
        records = Records(store, timeout_s=60)
        writer = asyncio.get_running_loop().create_task(records.write_forever())
        for i in range(3):
            records.write(f"w{i}", lambda i=i: store.put(f"w{i}"))
        flushed = await records.flush(timeout_s)
        writer.cancel()
        return flushed, store.done

    assert asyncio.run(go(0.02, 5)) == (True, ["w0", "w1", "w2"])
    flushed, done = asyncio.run(go(10, 0.2))  # a store that does not answer: not waited for
    assert not flushed and done == []


def test_a_stopped_controller_stops_though_its_store_client_swallows_the_cancel():
    from router.controller import Controller

    class Swallowing(Controller):
        rounds = 0

        async def tick(self) -> None:
            Swallowing.rounds += 1
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:  # as a store client that turns it into its own
                raise ConnectionError("connection closed") from None

    async def go():
        c = Swallowing(router=None, address="x:1", interval_s=0.01)
        c.start()
        await asyncio.sleep(0.05)
        await c.stop()
        await asyncio.sleep(0.1)
        return c._task.done(), Swallowing.rounds

    done, rounds = asyncio.run(go())
    assert done and rounds == 1


def test_a_tenant_name_outside_the_id_alphabet_is_refused():
    from router.api import tandem_pb2 as pb
    from router.edge.validation import InvalidRequest, validate

    msg = pb.GenerateRequest(prompt_ids=[1, 2], tenant="acme corp")
    with pytest.raises(InvalidRequest, match="tenant"):
        validate(msg, None, 64, 100)
