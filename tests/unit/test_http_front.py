"""The HTTP front's error mapping, against a router that answers with a given status: each
router status arrives as its HTTP status and OpenAI's error object, through the official
client. (The conditions themselves, a full queue or an empty pool, are the router's, tested
over gRPC.)"""

import asyncio

import openai
import pytest
from aiohttp.test_utils import TestServer

from router.edge.http import OpenAIFront
from router.errors import RouterError
from router.requests.stream import Chunk
from workers.messages import Status
from workers.model.loader import resolve_model
from workers.model.tokenizer import Tokenizer


class StubRouter:
    """Answers every request with `status`, after `tokens` tokens if any."""

    def __init__(self, tokenizer, status: Status, tokens: int = 0) -> None:
        self.tokenizer, self.status, self.tokens = tokenizer, status, tokens
        self.prompts: list[list[int]] = []  # what each request asked, in order

    async def generate(self, adm):
        self.prompts.append(list(adm.prompt_ids))
        for i in range(self.tokens):
            yield Chunk(i, (100 + i,), "x")
        if self.status is Status.OK:
            yield Chunk(self.tokens, (), "", finished=True, finish_reason="length")
        elif self.tokens:
            yield Chunk(self.tokens, (), "", finished=True, status=self.status, error="boom")
        else:
            raise RouterError(self.status, f"refused: {self.status.value}")


def serve(tokenizer, status, tokens=0, router=None):
    async def run(body):
        router_ = router or StubRouter(tokenizer, status, tokens)
        front = OpenAIFront(router_, "m", 2048, 49152)
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


def test_a_lone_surrogate_is_a_400_naming_its_field(tokenizer):
    """JSON can spell a string no tokenizer or protobuf takes ("\\ud800"): a clear 400, not a
    500 from inside the tokenizer."""
    import httpx

    async def body(client):
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:
            for path, raw, field in [
                ("completions", r'{"prompt": "\ud800 hi"}', "prompt"),
                (
                    "chat/completions",
                    r'{"messages": [{"role": "user", "content": "a\udfff"}]}',
                    "messages",
                ),
                ("completions", r'{"prompt": "hi", "stop": ["\ud800"]}', "stop"),
            ]:
                r = await http.post(path, content=raw, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, r.text)
                assert field in r.json()["error"]["message"], r.text

    asyncio.run(serve(tokenizer, Status.OK, tokens=2)(body))


def test_chat_content_parts_are_their_text_and_other_parts_are_refused(tokenizer):
    """OpenAI's list-of-parts content: text parts joined by newlines, as vLLM does; an image
    part is a 400 naming its type. The StubRouter's prompt ids show what was encoded."""
    router = StubRouter(tokenizer, Status.OK, tokens=2)

    async def body(client):
        parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
        for content in (parts, "Hello\nthere"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": content}], max_tokens=2
            )
        want = tokenizer.encode_messages([{"role": "user", "content": "Hello\nthere"}])
        assert router.prompts == [want, want]
        image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        with pytest.raises(openai.BadRequestError, match="image_url"):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": [image]}], max_tokens=2
            )

    asyncio.run(serve(tokenizer, Status.OK, router=router)(body))


def test_fields_that_change_the_answer_and_are_not_served_are_refused_by_name(tokenizer):
    """A client that asks for the older `functions`, echo or best_of waits for something
    Tandem does not make: a 400 naming the field, rather than an answer without it. Their "off"
    values pass, as clients often send them."""

    async def body(client):
        fn = {"name": "f", "parameters": {}}
        chat = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        for extra, field in [
            (dict(functions=[fn]), "functions"),
            (dict(function_call={"name": "f"}), "function_call"),
        ]:
            with pytest.raises(openai.BadRequestError, match=field):
                await client.chat.completions.create(**chat, **extra)
        for extra, field in [(dict(echo=True), "echo"), (dict(best_of=3), "best_of")]:
            with pytest.raises(openai.BadRequestError, match=field):
                await client.completions.create(model="m", prompt="hi", **extra)
        done = await client.chat.completions.create(
            **chat, tool_choice="none", response_format={"type": "text"}
        )
        assert done.choices[0].finish_reason == "length"
        done = await client.completions.create(model="m", prompt="hi", echo=False, best_of=1)
        assert done.choices[0].finish_reason == "length"

    asyncio.run(serve(tokenizer, Status.OK, tokens=2)(body))
