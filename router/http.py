"""The OpenAI-compatible HTTP face of the router, beside gRPC (`router.http_port`).

    POST /v1/completions        prompt as text (no chat template) or token ids
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the router serves

Both POSTs stream as server-sent events with `"stream": true` (`data: [DONE]` last;
`stream_options.include_usage` adds a usage event) or answer with one JSON object. Sampling
fields are the gRPC ones with OpenAI's and vLLM's names (`max_tokens`, `temperature`, `top_p`,
`top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty`, `logit_bias`, `min_tokens`, `logprobs`,
`top_logprobs`), plus Tandem's `deadline_s`: seconds after which the request is cancelled and
answered 504. Chat content is a string or a list of text parts. Fields that would change the
answer and are not served (tools, a response_format other than text, guided decoding, echo,
suffix, best_of > 1, prompt_logprobs) are refused with a 400 naming the field.

The handlers build the same GenerateRequest the gRPC edge receives, check it with the same
`validate`, and follow the router's own stream (`Router.generate`): no loopback call. A client
that disconnects cancels its request, which frees its blocks on every worker. Errors answer
with OpenAI's error object and the HTTP status of the router's status (400 invalid, 401 bad
key, 429 queue full, 503 pool empty, 504 deadline); a failure after streaming began ends the
stream with an `{"error": ...}` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from aiohttp import web

from router.api import tandem_pb2 as pb
from router.auth import GENERATE, bearer, scoped_id
from router.core import Router
from router.errors import RouterError
from router.keys import KeyRing
from router.stream import Chunk
from router.tls import ServerTLS
from router.tools import (
    CallStream,
    FieldError,
    Tools,
    body_constraint,
    call_text,
    parse_calls,
    read_tools,
    with_system,
)
from router.validation import (
    Admission,
    GrammarCheck,
    InvalidRequest,
    check_prompt_text,
    message_bytes_limit,
    validate,
)
from workers.engine.constraint import Constraint, ConstraintKind
from workers.messages import Status

log = logging.getLogger(__name__)
MAX_MESSAGES = 1024  # a chat's turns, each adding the template's own tokens
# The caller's tenant, as its key says, kept on each aiohttp request (RequestKey: 3.13 on).
TENANT = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "tandem.tenant"

HTTP_STATUS = {
    Status.INVALID_ARGUMENT: 400,
    Status.UNAUTHENTICATED: 401,
    Status.NOT_FOUND: 404,
    Status.ALREADY_EXISTS: 409,
    Status.FAILED_PRECONDITION: 400,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.CANCELLED: 499,
    Status.INTERNAL: 500,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
_ERROR_TYPE |= {409: "conflict_error", 429: "rate_limit_error"}

# Request fields copied as they are into the proto's SamplingParams.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "n",
)


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, e: RouterError) -> HttpError:
        return cls(HTTP_STATUS.get(e.status, 500), e.message, retry_after_s=e.retry_after_s)

    def body(self) -> dict:
        kind = _ERROR_TYPE.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def response(self) -> web.Response:
        headers = None
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(math.ceil(self.retry_after_s))}
        return web.json_response(self.body(), status=self.status, headers=headers)


class OpenAIFront:
    def __init__(
        self,
        router: Router,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        keys: KeyRing | None = None,
    ) -> None:
        self.router = router
        self.tokenizer = router.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.keys = keys
        self.grammars = GrammarCheck(router.tokenizer, vocab_size, getattr(router, "metrics", None))
        self.created = int(time.time())

    def app(self) -> web.Application:
        # JSON may spell one character in 6 bytes (a \u escape).
        body_limit = 6 * message_bytes_limit(self.max_model_len)
        app = web.Application(middlewares=[self._errors], client_max_size=body_limit)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if request.path != "/health" and self.keys is not None:
                # Before the body is read: a stranger's bytes are never parsed.
                header = request.headers.get("Authorization")
                who = self.keys.principal(bearer([("authorization", header)]))
                if who is None:
                    raise HttpError(401, "missing or wrong API key (Authorization: Bearer ...)")
                if request.method == "POST" and not who.may(GENERATE):
                    raise HttpError(403, f"this key (tenant {who.tenant}) may not generate")
                request[TENANT] = who.tenant
            return await handler(request)
        except HttpError as e:
            return e.response()
        except RouterError as e:
            return HttpError.of(e).response()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    # -- one request ------------------------------------------------------------------------
    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:  # in a thread: a body of megabytes must not hold the event loop while parsed
            body = await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HttpError(400, "the body is not valid JSON") from None
        except RecursionError:  # arrays or objects nested past the parser's depth
            raise HttpError(400, "the body's JSON is nested too deeply") from None
        if not isinstance(body, dict):
            raise HttpError(400, "the body must be a JSON object")
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise HttpError(
                404, f"the model {model!r} does not exist; this serves {self.model_name!r}", "model"
            )
        _refuse_unserved(body)
        try:
            if not chat and body.get("tools"):
                raise FieldError("tools", "served on /v1/chat/completions")
            tools = read_tools(body) if chat else None
            constraint = body_constraint(body, tools)
            if tools is not None:  # their parameters' schemas, refused as the tools'
                await asyncio.to_thread(
                    self.grammars.compile, Constraint(ConstraintKind.GRAMMAR, tools.grammar())
                )
        except FieldError as e:
            raise HttpError(400, str(e), e.param) from None
        except InvalidRequest as e:
            raise HttpError(400, f"tools: {e}", "tools") from None
        # In a thread: a long prompt's tokenizing must not hold the event loop.
        ids = await asyncio.to_thread(self._prompt_ids, body, chat, tools)
        try:
            sampling = self._sampling(body, chat, len(ids))
            if constraint is not None:
                sampling.constraint.CopyFrom(constraint)
            msg = pb.GenerateRequest(prompt_ids=ids, sampling=sampling, **_scheduling(body))
        except ValueError:  # an id past int32
            raise HttpError(400, "prompt: token ids must be in the vocabulary", "prompt") from None
        try:
            # In a thread: a constraint is compiled here.
            adm = await asyncio.to_thread(
                validate, msg, self.tokenizer, self.max_model_len, self.vocab_size, self.grammars
            )
        except (InvalidRequest, ValueError) as e:
            raise HttpError(400, str(e)) from None
        client_id, tenant = adm.request_id, request.get(TENANT)
        if tenant is not None:  # the key's tenant, never the body's
            adm = replace(adm, request_id=scoped_id(tenant, client_id), tenant=tenant)
        reply = Reply(self, adm, chat, body, len(ids), client_id, tools)
        chunks = self._chunks(adm, body.get("deadline_s"))
        try:
            if body.get("stream"):
                return await self._stream(request, reply, chunks)
            async for chunk in chunks:
                reply.add(chunk)
            return web.json_response(reply.whole())
        finally:
            await chunks.aclose()  # however the answer ends, the request does not outlive it

    async def _stream(
        self, request: web.Request, reply: Reply, chunks: AsyncIterator[Chunk]
    ) -> web.StreamResponse:
        # The first chunk before the headers: a request refused up front answers with its
        # HTTP status, not a 200 stream that holds only an error.
        first = await anext(chunks, None)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            for event in reply.opening():
                await _send(response, event)
            if first is not None:
                for event in reply.delta(first):
                    await _send(response, event)
                async for chunk in chunks:
                    for event in reply.delta(chunk):
                        await _send(response, event)
            if reply.include_usage:
                await _send(response, reply.usage_event())
        except (RouterError, HttpError) as e:
            err = HttpError.of(e) if isinstance(e, RouterError) else e
            await _send(response, err.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _chunks(self, adm, deadline_s) -> AsyncIterator[Chunk]:
        """The request's chunks; a failed request raises its RouterError, and one past its
        deadline is cancelled (closing the router's stream cancels it) and raises 504."""
        if deadline_s is not None and not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
            raise HttpError(400, f"deadline_s={deadline_s!r}: must be a positive number")
        stream = self.router.generate(adm)
        end = None if deadline_s is None else asyncio.get_running_loop().time() + deadline_s
        try:
            while True:
                # The deadline covers waiting for the router, never the caller's own writes.
                try:
                    async with asyncio.timeout_at(end):  # None: no deadline
                        chunk = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise HttpError(
                        504, f"the request passed its deadline of {deadline_s} s; cancelled"
                    ) from None
                if chunk.finished and chunk.status is not Status.OK:
                    raise RouterError(chunk.status, chunk.error or chunk.status.value)
                yield chunk
        finally:
            await stream.aclose()  # the router cancels a request whose caller went away

    def _check_text(self, name: str, texts) -> None:
        try:
            check_prompt_text(name, texts, self.max_model_len)
        except InvalidRequest as e:
            raise HttpError(400, str(e), name) from None

    def _prompt_ids(self, body: dict, chat: bool, tools: Tools | None = None) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages: give a non-empty list of messages", "messages")
            if len(messages) > MAX_MESSAGES:
                raise HttpError(
                    400, f"messages: {len(messages)}, at most {MAX_MESSAGES}", "messages"
                )
            turns = []
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                    raise HttpError(400, "messages: each needs a role and content", "messages")
                turns.append(_turn(m, native=tools is not None and self.tokenizer.takes_tools))
            self._check_text("messages", [t["role"] + t["content"] for t in turns])
            try:
                if tools is None:
                    return self.tokenizer.encode_messages(turns)
                if self.tokenizer.takes_tools:
                    return self.tokenizer.encode_messages(turns, tools=tools.openai_tools())
                return self.tokenizer.encode_messages(with_system(turns, tools.system_prompt()))
            except Exception as e:  # no template, or the template refuses these roles
                raise HttpError(400, f"messages: {e}", "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            self._check_text("prompt", prompt)
            return self.tokenizer.encode(_check_unicode(prompt, "prompt"))
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return prompt
        raise HttpError(400, "prompt: give one non-empty string or one list of token ids", "prompt")

    def _sampling(self, body: dict, chat: bool, prompt_len: int) -> pb.SamplingParams:
        sp = pb.SamplingParams()
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:  # chat: up to the context, as vLLM; completions: 16
            max_tokens = max(self.max_model_len - prompt_len, 1) if chat else 16
        fields = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
        fields["max_tokens"] = max_tokens
        stop = body.get("stop")
        if stop is not None:
            fields["stop"] = [stop] if isinstance(stop, str) else stop
        if body.get("logit_bias") is not None:
            bias = body["logit_bias"]
            try:
                fields["logit_bias"] = {int(k): v for k, v in bias.items()}
            except (AttributeError, ValueError):
                raise HttpError(400, "logit_bias: map token ids to biases", "logit_bias") from None
        logprobs = body.get("logprobs")
        if chat:  # logprobs: bool, top_logprobs: int
            fields["logprobs"] = bool(logprobs)
            if body.get("top_logprobs") is not None:
                fields["top_logprobs"] = body["top_logprobs"]
        elif logprobs is not None:  # completions: logprobs is the number of alternatives
            fields["logprobs"] = True
            fields["top_logprobs"] = logprobs
        for name, value in fields.items():
            try:
                if isinstance(value, list):
                    getattr(sp, name).extend(value)
                elif isinstance(value, dict):
                    getattr(sp, name).update(value)
                else:
                    setattr(sp, name, value)
            except (TypeError, ValueError, AttributeError) as e:
                raise HttpError(400, f"{name}={value!r}: wrong type ({e})", name) from None
        return sp


class Reply:
    """One request's answer in OpenAI's shapes: a whole response, or stream events; with
    n > 1, one choice per completion, by index."""

    def __init__(
        self,
        front: OpenAIFront,
        adm: Admission,
        chat: bool,
        body: dict,
        prompt_tokens: int,
        client_id: str,
        tools: Tools | None = None,
    ):
        self.front, self.chat = front, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + client_id
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        # Chat: logprobs is a flag; completions: the number of alternatives (0 included).
        logprobs = body.get("logprobs")
        want_logprobs = bool(logprobs) if chat else logprobs is not None
        options = body.get("stream_options") or {}
        self.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        self.choices = [
            _Choice(i, chat, want_logprobs, front.tokenizer, tools) for i in range(adm.sampling.n)
        ]

    @property
    def usage(self) -> dict:
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def add(self, chunk: Chunk) -> dict | None:
        return self.choices[chunk.index].add(chunk)

    def _head(self, chunked: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        if self.chat and chunked:
            kind += ".chunk"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.front.model_name,
        }

    def whole(self) -> dict:
        choices = [c.whole() for c in self.choices]
        return {**self._head(False), "choices": choices, "usage": self.usage}

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role (per choice), as OpenAI's do."""
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [
            self._event({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
            for c in self.choices
        ]

    def delta(self, chunk: Chunk) -> list[dict]:
        """The stream events of one chunk (a tool call's text may make none until it closes)."""
        logprobs = self.add(chunk)
        reason = chunk.finish_reason if chunk.finished else None
        i = chunk.index
        if self.chat and self.choices[i].calls is not None:  # tools: content or whole calls
            calls = self.choices[i].calls
            deltas = calls.feed(chunk.text) + (calls.finish() if chunk.finished else [])
            if chunk.finished and calls.calls and reason == "stop":
                reason = "tool_calls"
            deltas = deltas or [{}]
            events = [
                {"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas
            ]
            events[-1].update(logprobs=logprobs, finish_reason=reason)
            return [self._event(e) for e in events]
        if self.chat:
            delta = {"content": chunk.text} if chunk.text or not chunk.finished else {}
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": i, "text": chunk.text, "logprobs": logprobs, "finish_reason": reason}
        return [self._event(choice)]

    def usage_event(self) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage}

    def _event(self, choice: dict) -> dict:
        event = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event


class _Choice:
    """One completion's text, end and logprobs, as its chunks arrive."""

    def __init__(
        self, index: int, chat: bool, want_logprobs: bool, tokenizer, tools: Tools | None = None
    ) -> None:
        self.index, self.chat, self.want_logprobs = index, chat, want_logprobs
        self.names = tools.names if tools is not None else None
        self.calls = CallStream(self.names) if tools is not None else None  # streamed calls
        self.tokenizer = tokenizer
        self.completion_tokens = 0
        self.text = ""
        self.finish_reason = None
        self.content: list[dict] = []  # chat logprobs, per token
        self.tokens: list[str] = []  # completions logprobs
        self.token_logprobs: list[float] = []
        self.top: list[dict | None] = []
        self.offsets: list[int] = []
        self._offset = 0

    def add(self, chunk: Chunk) -> dict | None:
        """Take a chunk in; returns the logprobs of its tokens (None without logprobs)."""
        self.completion_tokens += len(chunk.token_ids)
        self.text += chunk.text
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
        if not self.want_logprobs or not chunk.token_ids:
            return None
        tok = self.tokenizer
        tops = chunk.top_logprobs or ((),) * len(chunk.token_ids)
        if self.chat:
            entries = [
                {
                    **_token_entry(tok.token_text(t), lp),
                    "top_logprobs": [_token_entry(tok.token_text(a), alp) for a, alp in top],
                }
                for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops)
            ]
            self.content += entries
            return {"content": entries}
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops):
            text = tok.token_text(t)
            part["tokens"].append(text)
            part["token_logprobs"].append(lp)
            part["top_logprobs"].append({tok.token_text(a): alp for a, alp in top} or None)
            part["text_offset"].append(self._offset)
            self._offset += len(text)
        self.tokens += part["tokens"]
        self.token_logprobs += part["token_logprobs"]
        self.top += part["top_logprobs"]
        self.offsets += part["text_offset"]
        return part

    def whole(self) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": self.text}
            calls = parse_calls(self.text, self.names) if self.calls is not None else None
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
            reason = "tool_calls" if calls and self.finish_reason == "stop" else self.finish_reason
            return {
                "index": self.index,
                "message": message,
                "logprobs": {"content": self.content} if self.want_logprobs else None,
                "finish_reason": reason,
            }
        logprobs = None
        if self.want_logprobs:
            logprobs = {
                "tokens": self.tokens,
                "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top,
                "text_offset": self.offsets,
            }
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
        }


# Request fields that change what comes back, which Tandem does not serve: a request that
# sets them is refused naming the field, never answered as if it had not (a tool call or a
# JSON object the client waits for would silently not come). Each maps a field to the values
# that mean "off", which pass.
_UNSERVED = {
    "functions": (None, []),  # the older form of tools: send `tools`
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "prompt_logprobs": (None, 0),
}


# Extensions of the body (as vLLM's `priority`): the request's place in admission and its
# service targets. The tenant is never among them: it comes from the key.
_SCHEDULING = {
    "priority": int,
    "ttft_slo_ms": float,
    "tpot_slo_ms": float,
    "reject_if_late": bool,
}


def _scheduling(body: dict) -> dict:
    out = {}
    for name, kind in _SCHEDULING.items():
        value = body.get(name)
        if value is None:
            continue
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and (kind is float or float(value).is_integer())
        )  # fmt: skip
        if not ok or (kind is int and not -(2**31) <= value < 2**31):
            raise HttpError(400, f"{name}={value!r}: expected {kind.__name__}", name)
        out[name] = kind(value)
    return out


def _refuse_unserved(body: dict) -> None:
    for name, off in _UNSERVED.items():
        if name in body and body[name] not in off:
            raise HttpError(400, f"{name}: not served by Tandem (leave it out)", name)


def _content(content) -> str:
    """A message's text: a string, or OpenAI's list of content parts, whose text parts are
    joined by newlines (as vLLM joins them); any other part is refused by its type."""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise HttpError(
                    400, f"messages: only text content parts are served, not {kind!r}", "messages"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise HttpError(400, "messages: content must be text or a list of text parts", "messages")
    return _check_unicode(content, "messages")


def _turn(m: dict, native: bool) -> dict:
    """A message for the chat template. With `native` (a template that takes tools), an
    assistant's tool calls and a tool's result go to it as they are; otherwise they are written
    into the text as the model writes them: calls in tags, results as tool responses."""
    role, calls = m["role"], m.get("tool_calls")
    text = _content(m.get("content")) if m.get("content") is not None or not calls else ""
    if role == "assistant" and calls:
        try:
            parsed = [
                (c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                for c in calls
            ]
        except (KeyError, TypeError, ValueError):
            raise HttpError(
                400, "messages: a tool call needs function.name and JSON arguments", "messages"
            ) from None
        if native:
            fns = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in parsed]
            return {"role": role, "content": text, "tool_calls": fns}
        return {
            "role": role,
            "content": "\n".join([text] * bool(text) + [call_text(*p) for p in parsed]),
        }
    if role == "tool" and not native:
        return {"role": role, "content": f"<tool_response>\n{text}\n</tool_response>"}
    turn = {"role": role, "content": text}
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        turn["tool_call_id"] = m["tool_call_id"]
    return turn


def _check_unicode(text: str, param: str) -> str:
    """JSON may carry a lone surrogate (`"\\ud800"`), which no tokenizer or protobuf string
    takes: a 400 naming it, not a 500 from deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HttpError(
            400, f"{param}: not valid Unicode ({e.reason} at {e.start})", param
        ) from None
    return text


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(f"data: {json.dumps(event)}\n\n".encode())


async def start_http(
    front: OpenAIFront, host: str, port: int, tls: ServerTLS | None = None
) -> tuple[web.AppRunner, int]:
    """Serves the front (over TLS only, with `tls`); returns the runner (for `cleanup`) and
    the bound port. A client that disconnects has its handler cancelled, and with it its
    request."""
    runner = web.AppRunner(front.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    ssl_context = tls.http_context() if tls is not None else None
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    log.info("OpenAI-compatible HTTP on %s:%d", host, bound)
    return runner, bound
