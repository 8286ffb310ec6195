"""The OpenAI front's structured-output and tool fields, through the official client against a
router stub: each field becomes the one constraint the router is handed; bad ones are refused
with a 400 naming the problem before the router is touched; a model's tool calls come back in
OpenAI's shape, whole and streamed."""

import asyncio
import json

import openai
import pytest

from router.edge.tools import CallStream, parse_calls
from router.requests.stream import Chunk
from tests.unit.test_http_front import serve as serve_front
from workers.engine.constraint import ConstraintKind
from workers.messages import Status
from workers.model.loader import resolve_model
from workers.model.tokenizer import Tokenizer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


class ScriptedRouter:
    """Answers every request with `text`, a few characters a chunk; keeps what it was
    handed."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer, self.text = tokenizer, text
        self.admitted = []

    async def generate(self, adm):
        self.admitted.append(adm)
        pieces = [self.text[i : i + 7] for i in range(0, len(self.text), 7)]
        for n in range(adm.sampling.n):
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                yield Chunk(
                    i,
                    (100 + i,),
                    piece,
                    finished=last,
                    finish_reason="stop" if last else None,
                    index=n,
                )


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return Tokenizer(resolve_model(str(tiny_llama_dir)))


def serve(router, body):
    """The front over `router`, called by the official client in `body`."""
    return asyncio.run(serve_front(router.tokenizer, Status.OK, router=router)(body))


CHAT = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=32)


def test_each_field_becomes_its_constraint(tokenizer):
    router = ScriptedRouter(tokenizer, '{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    async def body(client):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        }
        await client.chat.completions.create(**CHAT, response_format=fmt)
        await client.chat.completions.create(**CHAT, response_format={"type": "json_object"})
        await client.chat.completions.create(**CHAT, extra_body={"guided_json": schema})
        await client.chat.completions.create(**CHAT, extra_body={"guided_regex": "[ab]+"})
        await client.completions.create(
            model="m", prompt="x", extra_body={"guided_choice": ["a", "b"]}
        )
        await client.completions.create(
            model="m", prompt="x", extra_body={"guided_grammar": 'root ::= "a"'}
        )
        await client.chat.completions.create(**CHAT, tools=[WEATHER], tool_choice="required")

    serve(router, body)
    got = [a.sampling.constraint for a in router.admitted]
    assert [c.kind for c in got] == [
        ConstraintKind.JSON_SCHEMA,
        ConstraintKind.JSON_OBJECT,
        ConstraintKind.JSON_SCHEMA,
        ConstraintKind.REGEX,
        ConstraintKind.CHOICE,
        ConstraintKind.GRAMMAR,
        ConstraintKind.GRAMMAR,
    ]
    assert json.loads(got[0].text) == schema and got[4].choices == ("a", "b")


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


NAMED_NOPE = {"type": "function", "function": {"name": "nope"}}


@pytest.mark.parametrize(
    "extra, named",
    [
        (dict(response_format=schema_format({"type": "wat"})), "wat"),
        (dict(extra_body={"guided_regex": "a(b"}), "unclosed group"),
        (dict(extra_body={"guided_grammar": "start: nowhere"}), "nowhere"),
        (dict(extra_body={"guided_choice": []}), "at least one"),
        (
            dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
            "one constraint",
        ),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(tools=[WEATHER], tool_choice=NAMED_NOPE), "nope"),
        (dict(tools=[WEATHER, WEATHER]), "distinct"),
        (dict(tool_choice="required"), "needs tools"),
        (
            dict(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}
                ]
            ),
            "tools: .*wat",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it_before_the_router_is_touched(tokenizer, extra, named):
    router = ScriptedRouter(tokenizer, "x")

    async def body(client):
        with pytest.raises(openai.BadRequestError, match=named):
            await client.chat.completions.create(**CHAT, **extra)

    serve(router, body)
    assert router.admitted == []


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_in_openai_shape(tokenizer, stream):
    router = ScriptedRouter(tokenizer, CALL + "\n" + CALL.replace("Paris", "Oslo"))

    async def body(client):
        args = dict(**CHAT, tools=[WEATHER, TIME], tool_choice="auto", stream=stream)
        if not stream:
            r = await client.chat.completions.create(**args)
            return (
                r.choices[0].finish_reason,
                r.choices[0].message.tool_calls,
                r.choices[0].message.content,
            )
        calls, reason, content = {}, None, ""
        async for ev in await client.chat.completions.create(**args):
            d = ev.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            reason = ev.choices[0].finish_reason or reason
        return reason, [calls[i] for i in sorted(calls)], content or None

    reason, calls, content = serve(router, body)
    assert reason == "tool_calls" and content is None
    names = [c.function.name if not stream else c["name"] for c in calls]
    args = [json.loads(c.function.arguments if not stream else c["arguments"]) for c in calls]
    assert names == ["get_weather", "get_weather"]
    assert args == [{"city": "Paris"}, {"city": "Oslo"}]


def test_plain_text_under_auto_tools_stays_content(tokenizer):
    router = ScriptedRouter(tokenizer, "It is sunny.")

    async def body(client):
        r = await client.chat.completions.create(**CHAT, tools=[WEATHER])
        return r.choices[0]

    choice = serve(router, body)
    assert choice.message.content == "It is sunny." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tools_reach_the_prompt_and_past_calls_are_written_as_the_model_writes_them(tokenizer):
    router = ScriptedRouter(tokenizer, "Done.")
    past = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": past}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]

    async def body(client):
        await client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])

    serve(router, body)
    prompt = tokenizer.decode(list(router.admitted[0].prompt_ids))
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert CALL.replace("\n", "").replace("<tool_call>", "").split("</tool_call>")[
        0
    ] in prompt.replace("\n", "")
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_parse_calls_refuses_what_is_not_calls():
    assert parse_calls("hello") is None
    assert parse_calls('<tool_call>\n{"name": "f", "argu') is None  # cut by max_tokens
    assert parse_calls(CALL)[0]["function"]["name"] == "get_weather"


def test_only_declared_functions_and_exact_tags_are_calls():
    undeclared = CALL.replace("get_weather", "rm_rf")
    assert parse_calls(undeclared, {"get_weather"}) is None
    assert parse_calls(" " + CALL, {"get_weather"}) is None  # text, as the grammar reads it
    assert parse_calls(CALL + "\n" + CALL, {"get_weather"})[1]["function"]["name"] == "get_weather"


def test_a_closing_tag_inside_an_argument_does_not_end_the_streamed_call():
    tricky = '<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>b"}}\n</tool_call>'
    stream = CallStream({"f"})
    deltas = [d for i in range(0, len(tricky), 5) for d in stream.feed(tricky[i : i + 5])]
    deltas += stream.finish()
    [call] = [d["tool_calls"][0] for d in deltas]
    assert json.loads(call["function"]["arguments"]) == {"s": "a</tool_call>b"}
    assert not any("content" in d for d in deltas)
