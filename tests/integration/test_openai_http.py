"""The OpenAI-compatible HTTP front, called with the official `openai` client: one prefill and
one decode worker, real Ray, Redis and gRPC, SmolLM2 in fp32."""

import asyncio
import json

import httpx
import openai
import pytest

from router.api import tandem_pb2 as pb
from router.edge.http import OpenAIFront, start_http
from router.edge.keys import KeyRing
from tests.integration.harness import CHATS, offline_reference, one_by_one

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    h = one_by_one(str(tmp_path_factory.mktemp("data")), http_port=0)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(cluster):
    base = f"http://127.0.0.1:{cluster.cluster.http_port}/v1"
    c = openai.OpenAI(base_url=base, api_key="x", max_retries=0)  # statuses as they come
    yield c
    c.close()


def grpc_text(cluster, **msg) -> tuple[str, list[int]]:
    r = cluster.run(cluster.client.generate(pb.GenerateRequest(**msg), timeout_s=120))
    assert r.status == "OK", r.error
    return r.text, r.token_ids


def test_models_and_health(cluster, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"http://127.0.0.1:{cluster.cluster.http_port}/health")
    assert r.status_code == 200


def test_completions_equal_the_grpc_path_streaming_or_not(cluster, client):
    prompt = "The three primary colours are"
    ids = cluster.cluster.router.tokenizer.encode(prompt)
    want, tokens = grpc_text(
        cluster, prompt_ids=ids, sampling=pb.SamplingParams(max_tokens=24, temperature=0)
    )
    whole = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0
    )
    assert whole.choices[0].text == want
    assert whole.usage.completion_tokens == len(tokens)
    # Token for token, as far as the API shows tokens: each one's text.
    tok = cluster.cluster.router.tokenizer
    assert whole.choices[0].logprobs.tokens == [tok.token_text(t) for t in tokens]
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].finish_reason in ("stop", "length")
    # Token ids as the prompt, streamed, with the usage event at the end.
    events = list(
        client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(e.choices[0].text for e in events if e.choices) == want
    assert events[-1].usage.completion_tokens == len(tokens)
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] in ("stop", "length")


def test_chat_equals_the_grpc_path_with_logprobs(cluster, client):
    want, tokens = grpc_text(
        cluster, prompt=CHATS[1], sampling=pb.SamplingParams(max_tokens=20, temperature=0)
    )
    messages = [{"role": "user", "content": CHATS[1]}]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want
    tok = cluster.cluster.router.tokenizer
    assert [e.token for e in choice.logprobs.content] == [tok.token_text(t) for t in tokens]
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    parts = [e.choices[0].delta.content or "" for e in streamed]
    assert "".join(parts) == want


def test_seeded_sampling_matches_grpc(cluster, client):
    sampling = dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=42)
    want, _ = grpc_text(cluster, prompt=CHATS[2], sampling=pb.SamplingParams(**sampling))
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CHATS[2]}],
        extra_body={"min_tokens": 0, "repetition_penalty": 1.0},
        **sampling,
    )
    assert got.choices[0].message.content == want


def test_n_choices_equal_the_grpc_path_whole_or_streamed(cluster, client):
    sampling = dict(max_tokens=12, temperature=1.0, seed=5, n=3)
    msg = pb.GenerateRequest(prompt=CHATS[3], sampling=pb.SamplingParams(**sampling))
    want = cluster.run(cluster.client.generate_choices(msg, timeout_s=120))
    messages = [{"role": "user", "content": CHATS[3]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **sampling)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.message.content for c in whole.choices] == [w.text for w in want]
    assert whole.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, **sampling
    )
    texts, reasons = ["", "", ""], [None] * 3
    for event in streamed:
        for c in event.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [w.text for w in want]
    assert reasons == [w.finish_reason for w in want]


@pytest.mark.parametrize(
    "kwargs, status, fragment",
    [
        (dict(temperature=-1.0), 400, "temperature"),
        (dict(top_p=1.5), 400, "top_p"),
        (dict(max_tokens=10**6), 400, "max_tokens"),
        (dict(model="gpt-4"), 404, "does not exist"),
        (dict(extra_body={"deadline_s": 0.001}), 504, "deadline"),
        (dict(n=65), 400, "sampling.n=65"),
    ],
)
def test_errors_carry_their_http_status(cluster, client, kwargs, status, fragment):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=64)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**{**args, **kwargs})
    assert e.value.status_code == status
    assert fragment in e.value.message
    s = cluster.wait_all_free()  # G3: nothing held, not even a reservation
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"] and w["reserved"] == 0, w


def test_auth_with_the_same_token_as_grpc(cluster):
    front = OpenAIFront(cluster.cluster.router, MODEL, 8192, 49152, KeyRing.build(None, "s3cret"))
    runner, port = cluster.run(start_http(front, "127.0.0.1", 0))
    try:
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=base, api_key="s3cret")
        assert ok.models.list().data[0].id == MODEL
    finally:
        cluster.run(runner.cleanup())


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(cluster):
    url = f"http://127.0.0.1:{cluster.cluster.http_port}/v1/completions"
    body = {
        "prompt": "Count from one to one thousand:",
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def read_some() -> int:
        got = 0
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        got += len(json.loads(line[6:])["choices"][0]["text"]) > 0
                    if got >= 5:
                        break  # leaving the block closes the connection mid-stream
        return got

    assert asyncio.run(read_some()) >= 5
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w
        assert w["running"] == 0
    assert cluster.cluster.router.status().in_flight == 0


# -- structured output and tools, through the cluster ---------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
        "email": {"type": "string", "maxLength": 40},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
    },
    "required": ["name", "age", "langs"],
}
ITEMS = {
    "type": "array",
    "items": {
        "anyOf": [
            {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}},
             "required": ["sku"]},
            {"type": "integer", "minimum": 1, "maximum": 99},
        ]
    },
    "minItems": 1,
    "maxItems": 3,
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.mark.parametrize("schema", [PERSON, ITEMS], ids=["person", "items"])
@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=3)])
def test_json_schema_outputs_validate_and_grpc_equals_http(cluster, client, schema, sampling):
    import jsonschema

    prompt = "Describe one person as JSON." if schema is PERSON else "List items as JSON."
    text, _ = grpc_text(
        cluster,
        prompt=prompt,
        sampling=pb.SamplingParams(
            max_tokens=120, constraint=pb.Constraint(json_schema=json.dumps(schema)), **sampling
        ),
    )
    jsonschema.validate(json.loads(text), schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    got = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=120,
        response_format=fmt,
        **sampling,
    )
    assert got.choices[0].message.content == text
    assert got.choices[0].finish_reason == "stop"


def test_regex_choice_and_n_json_objects_over_http(cluster, client):
    import re

    messages = [{"role": "user", "content": "When was the moon landing?"}]
    date = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0,
        extra_body={"guided_regex": r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )  # fmt: skip
    assert re.fullmatch(r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].message.content)
    pick = client.completions.create(
        model=MODEL, prompt="Is water wet? Answer:", max_tokens=8, temperature=0.7, seed=1,
        extra_body={"guided_choice": ["yes", "no"]},
    )  # fmt: skip
    assert pick.choices[0].text in ("yes", "no")
    many = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=80, temperature=1.0, seed=9, n=4,
        response_format={"type": "json_object"},
    )  # fmt: skip
    for c in many.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        else:  # cut by max_tokens: still the beginning of an object
            assert c.message.content.startswith("{")
    assert sum(c.finish_reason == "stop" for c in many.choices) >= 2


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_name_a_declared_function_with_valid_arguments(cluster, client, stream):
    import jsonschema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # One call each: this small model, free to call again, calls again until max_tokens.
        args = dict(model=MODEL, messages=messages, tools=[WEATHER, ADD], tool_choice=choice,
                    parallel_tool_calls=False, max_tokens=80, temperature=0)  # fmt: skip
        if stream:
            calls, reason = {}, None
            for ev in client.chat.completions.create(**args, stream=True):
                for tc in ev.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
                reason = ev.choices[0].finish_reason or reason
            made = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        else:
            r = client.chat.completions.create(**args)
            reason = r.choices[0].finish_reason
            made = [
                (c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls
            ]
        assert reason == "tool_calls" and made
        tools = {"get_weather": WEATHER, "add": ADD}
        for name, arguments in made:
            assert name in tools and (choice == "required" or name == "get_weather")
            jsonschema.validate(json.loads(arguments), tools[name]["function"]["parameters"])


def test_a_bad_schema_is_refused_before_any_worker(cluster, client):
    before = cluster.status()["router"]["in_flight"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], response_format=fmt
        )
    r = cluster.run(
        cluster.client.generate(
            pb.GenerateRequest(
                prompt="hi", sampling=pb.SamplingParams(constraint=pb.Constraint(regex="a(b"))
            ),
            timeout_s=30,
        )
    )
    assert r.status == "INVALID_ARGUMENT" and "unclosed group" in r.error
    assert cluster.status()["router"]["in_flight"] == before


def test_constrained_greedy_output_equals_the_offline_engine(cluster):
    """G4 for constrained requests: the prefill worker's first token under the grammar and
    the decode worker's matcher rebuilt from it give the offline engine's tokens."""
    from workers.completion import GenerationRequest
    from workers.engine.constraint import Constraint, ConstraintKind
    from workers.engine.request import SamplingParams

    constraints = [
        Constraint.json_schema(PERSON),
        Constraint(ConstraintKind.REGEX, r"[A-Z][a-z]+ (is|was) [a-z ]{5,40}\."),
        Constraint(ConstraintKind.CHOICE, choices=("Paris", "London", "Rome")),
    ]
    requests = [
        GenerationRequest(
            prompt=CHATS[i], sampling=SamplingParams(max_tokens=96, temperature=0, constraint=c)
        )
        for i, c in enumerate(constraints)
    ]
    got = cluster.generate_many(requests)
    assert all(r.status == "OK" for r in got), [r.error for r in got]
    assert [r.token_ids for r in got] == offline_reference(requests)
