"""Router admission and auth decisions that need no workers: queue bound, empty pools,
bearer tokens."""

import asyncio

import pytest

from router.config import RouterConfig
from router.core import Router
from router.errors import RouterError
from router.server import _check_auth
from router.validation import Admission
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


class Ctx:
    def __init__(self, meta):
        self.meta = meta

    def invocation_metadata(self):
        return self.meta


def test_bearer_token_is_checked():
    _check_auth(Ctx([]), None)  # no token configured: open
    _check_auth(Ctx([("authorization", "Bearer s3cret")]), "s3cret")
    for meta in ([], [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
        with pytest.raises(RouterError) as e:
            _check_auth(Ctx(meta), "s3cret")
        assert e.value.status is Status.UNAUTHENTICATED


def test_validation_takes_the_decimal_a_float32_field_came_from_and_names_bad_fields():
    from router.api import tandem_pb2 as pb
    from router.validation import InvalidRequest, validate

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
