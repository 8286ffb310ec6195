"""The OpenAI-compatible HTTP face of the router, beside gRPC (`router.http_port`).

    POST /v1/completions        prompt as text (no chat template) or token ids
    POST /v1/chat/completions   messages through the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 while the router serves

Both POSTs stream as server-sent events with `"stream": true` (`data: [DONE]` last) or answer
with one JSON object (replies.py shapes both). The body is read by openai_body.py: sampling
fields by OpenAI's and vLLM's names, `tools` and `response_format` (router/edge/tools.py),
Tandem's scheduling extensions, and `deadline_s`: seconds after which the request is
cancelled and answered 504. Fields not served are refused with a 400 naming the field.

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
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from aiohttp import web

from router.api import tandem_pb2 as pb
from router.edge.auth import GENERATE, bearer, scoped_id
from router.edge.keys import KeyRing
from router.edge.openai_body import BodyReader, HttpError, refuse_unserved, scheduling
from router.edge.replies import Reply, sse
from router.edge.tls import ServerTLS
from router.edge.tools import FieldError, body_constraint, read_tools
from router.edge.validation import GrammarCheck, InvalidRequest, message_bytes_limit, validate
from router.errors import RouterError
from router.requests.core import Router
from router.requests.stream import Chunk
from workers.engine.constraint import Constraint, ConstraintKind
from workers.messages import Status

log = logging.getLogger(__name__)
# The caller's tenant, as its key says, kept on each aiohttp request (RequestKey: 3.13 on).
TENANT = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "tandem.tenant"


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
        self.body = BodyReader(router.tokenizer, max_model_len)
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
        refuse_unserved(body)
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
        ids = await asyncio.to_thread(self.body.prompt_ids, body, chat, tools)
        try:
            sampling = self.body.sampling(body, chat, len(ids))
            if constraint is not None:
                sampling.constraint.CopyFrom(constraint)
            msg = pb.GenerateRequest(prompt_ids=ids, sampling=sampling, **scheduling(body))
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
        reply = Reply(self.model_name, self.tokenizer, adm, chat, body, len(ids), client_id, tools)
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


async def _send(response: web.StreamResponse, event: dict) -> None:
    await response.write(sse(event))


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
