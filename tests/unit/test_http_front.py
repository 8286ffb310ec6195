"""The HTTP front's error mapping, against a router that answers with a given status: each
router status arrives as its HTTP status and OpenAI's error object, through the official
client. (The conditions themselves, a full queue or an empty pool, are the router's, tested
over gRPC.)"""

import asyncio

import openai
import pytest
from aiohttp.test_utils import TestServer

from router.errors import RouterError
from router.http import OpenAIFront
from router.stream import Chunk
from workers.messages import Status
from workers.model.loader import resolve_model
from workers.model.tokenizer import Tokenizer


class StubRouter:
    """Answers every request with `status`, after `tokens` tokens if any."""

    def __init__(self, tokenizer, status: Status, tokens: int = 0) -> None:
        self.tokenizer, self.status, self.tokens = tokenizer, status, tokens

    async def generate(self, adm):
        for i in range(self.tokens):
            yield Chunk(i, (100 + i,), "x")
        if self.status is Status.OK:
            yield Chunk(self.tokens, (), "", finished=True, finish_reason="length")
        elif self.tokens:
            yield Chunk(self.tokens, (), "", finished=True, status=self.status, error="boom")
        else:
            raise RouterError(self.status, f"refused: {self.status.value}")


def serve(tokenizer, status, tokens=0):
    async def run(body):
        front = OpenAIFront(StubRouter(tokenizer, status, tokens), "m", 2048, 49152)
        server = TestServer(front.app())
        await server.start_server()
        try:
            client = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0
            )
            return await body(client)
        finally:
            await server.close()

    return run


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer(resolve_model(str(tiny_llama_dir)))


@pytest.mark.parametrize(
    "status, http",
    [
        (Status.RESOURCE_EXHAUSTED, 429),
        (Status.UNAVAILABLE, 503),
        (Status.DEADLINE_EXCEEDED, 504),
        (Status.INVALID_ARGUMENT, 400),
        (Status.INTERNAL, 500),
    ],
)
def test_router_statuses_become_http_statuses(tokenizer, status, http):
    async def body(client):
        with pytest.raises(openai.APIStatusError) as e:
            await client.completions.create(model="m", prompt="hi", max_tokens=4)
        assert e.value.status_code == http
        assert f"refused: {status.value}" in e.value.message
        # Streaming too: refused before the stream opens, so the status is the HTTP one.
        with pytest.raises(openai.APIStatusError) as e:
            await client.completions.create(model="m", prompt="hi", max_tokens=4, stream=True)
        assert e.value.status_code == http

    asyncio.run(serve(tokenizer, status)(body))


def test_a_failure_after_streaming_began_ends_the_stream_with_an_error_event(tokenizer):
    async def body(client):
        stream = await client.completions.create(model="m", prompt="hi", stream=True)
        texts = []
        with pytest.raises(openai.APIError, match="boom"):
            async for e in stream:
                texts.append(e.choices[0].text)
        assert texts == ["x", "x", "x"]

    asyncio.run(serve(tokenizer, Status.INTERNAL, tokens=3)(body))


def test_malformed_bodies_are_400_naming_the_field(tokenizer):
    async def body(client):
        for kwargs, fragment in [
            (dict(prompt="hi", extra_body={"temperature": "hot"}), "temperature"),
            (dict(prompt=""), "prompt"),
            (dict(prompt="hi", extra_body={"logit_bias": {"x": 1}}), "logit_bias"),
            (dict(prompt="hi", extra_body={"deadline_s": -1}), "deadline_s"),
            (dict(prompt="hi", extra_body={"stop": {"x": 1}}), "stop"),
            (dict(prompt=[2**40]), "prompt"),
        ]:
            with pytest.raises(openai.BadRequestError, match=fragment):
                await client.completions.create(model="m", **kwargs)
        with pytest.raises(openai.BadRequestError, match="messages"):
            await client.chat.completions.create(model="m", messages=[])
        done = await client.completions.create(model="m", prompt="hi", max_tokens=4)
        assert done.choices[0].finish_reason == "length"

    asyncio.run(serve(tokenizer, Status.OK, tokens=2)(body))
