"""The gRPC face of the router: Generation and Admin services, standard health checking and
server reflection (so grpcurl and load balancers work), optional bearer-token auth."""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.api import tandem_pb2 as pb
from router.api import tandem_pb2_grpc as pb_grpc
from router.core import Router, RouterError
from router.validation import InvalidRequest, validate

log = logging.getLogger(__name__)


def _check_auth(context, token: str | None) -> None:
    if not token:
        return
    meta = dict(context.invocation_metadata())
    if meta.get("authorization") != f"Bearer {token}":
        raise RouterError(
            "UNAUTHENTICATED",
            "missing or wrong bearer token (send metadata authorization: Bearer <token>)",
        )


class Malformed:
    """A request whose bytes did not parse; answered with INVALID_ARGUMENT, not INTERNAL."""

    def __init__(self, why: str) -> None:
        self.why = why


def _parse_strict(cls):
    def parse(data: bytes):
        try:
            msg = cls.FromString(data)
        except Exception as e:
            return Malformed(f"malformed {cls.__name__}: {e}")
        unknown = sorted({f.field_number for f in UnknownFieldSet(msg)})
        if unknown:
            # Known numbers with the wrong wire type land here too: refuse rather than
            # silently dropping what the client meant.
            return Malformed(
                f"{cls.__name__} has unknown or wrongly typed field number(s) "
                f"{unknown}; check the client against proto/tandem.proto"
            )
        return msg

    return parse


def _add_generation(servicer: GenerationService, server) -> None:
    """Like the generated registration, but with strict request parsing."""
    rpcs = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_parse_strict(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            servicer.Cancel,
            request_deserializer=_parse_strict(pb.CancelRequest),
            response_serializer=pb.CancelResponse.SerializeToString,
        ),
        "Resume": grpc.unary_stream_rpc_method_handler(
            servicer.Resume,
            request_deserializer=_parse_strict(pb.ResumeRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("tandem.v1.Generation", rpcs),)
    )


def _reject_malformed(request) -> None:
    if isinstance(request, Malformed):
        raise RouterError("INVALID_ARGUMENT", request.why)


async def _abort(context, e: RouterError) -> None:
    await context.abort(getattr(grpc.StatusCode, e.code), e.message)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self, router: Router, max_model_len: int, vocab_size: int, auth_token: str | None = None
    ) -> None:
        self.router = router
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.auth_token = auth_token

    async def Generate(self, request, context):
        try:
            _check_auth(context, self.auth_token)
            _reject_malformed(request)
            try:
                adm = validate(request, self.router.tokenizer, self.max_model_len, self.vocab_size)
            except (InvalidRequest, ValueError) as e:
                raise RouterError("INVALID_ARGUMENT", str(e)) from None
            completion = 0
            async for chunk in self.router.generate(adm):
                completion += len(chunk.token_ids)
                msg = pb.GenerateResponse(
                    request_id=adm.request_id,
                    offset=chunk.offset,
                    token_ids=chunk.token_ids,
                    text=chunk.text,
                    logprobs=chunk.logprobs,
                )
                if chunk.finished:
                    if chunk.error and chunk.error.startswith("UNAVAILABLE: "):
                        raise RouterError("UNAVAILABLE", chunk.error.removeprefix("UNAVAILABLE: "))
                    msg.final.CopyFrom(
                        pb.Final(
                            finish_reason=chunk.finish_reason or "",
                            error=chunk.error or "",
                            usage=pb.Usage(
                                prompt_tokens=len(adm.prompt_ids), completion_tokens=completion
                            ),
                        )
                    )
                yield msg
        except RouterError as e:
            await _abort(context, e)

    async def Cancel(self, request, context):
        try:
            _check_auth(context, self.auth_token)
            _reject_malformed(request)
        except RouterError as e:
            await _abort(context, e)
        return pb.CancelResponse(found=await self.router.cancel(request.request_id))

    async def Resume(self, request, context):
        """Replays a request's logged tokens from `offset`; following a live request across
        a router restart comes with failure replay."""
        try:
            _check_auth(context, self.auth_token)
            _reject_malformed(request)
            state = self.router.state
            if state is None:
                raise RouterError("UNAVAILABLE", "Resume needs the Redis state store")
            rec = state.get(request.request_id)
            if rec is None:
                raise RouterError("NOT_FOUND", f"no request {request.request_id} (or it expired)")
            tokens = state.tokens(request.request_id, request.offset)
            final = None
            if rec.state in ("FINISHED", "FAILED", "CANCELLED"):
                final = pb.Final(finish_reason=rec.finish_reason or "", error=rec.error or "")
            msg = pb.GenerateResponse(
                request_id=rec.request_id,
                offset=request.offset,
                token_ids=tokens,
                text=self.router.tokenizer.decode(tokens),
            )
            if final is not None:
                msg.final.CopyFrom(final)
            yield msg
        except RouterError as e:
            await _abort(context, e)


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, router: Router, mode: str, auth_token: str | None = None) -> None:
        self.router = router
        self.mode = mode
        self.auth_token = auth_token

    async def Status(self, request, context):
        try:
            _check_auth(context, self.auth_token)
        except RouterError as e:
            await _abort(context, e)
        pools = self.router.pools
        out = pb.StatusResponse(
            router=pb.RouterStatus(
                queue_depth=self.router.queue_depth,
                in_flight=len(self.router.streams),
                mode=self.mode,
            )
        )
        for pool, field in (("prefill", out.prefill), ("decode", out.decode)):
            for w in pools.members(pool, include_dead=True):
                try:
                    s = await asyncio.wait_for(w.handle.status.remote(), 10)
                    s.pop("reserved", None)
                    s.pop("queued_prefill_tokens", None)
                    field.append(pb.WorkerStatus(**s))
                except Exception:
                    field.append(pb.WorkerStatus(name=w.name, alive=False))
        return out

    async def Scale(self, request, context):
        try:
            _check_auth(context, self.auth_token)
            if request.pool not in ("prefill", "decode"):
                raise RouterError("INVALID_ARGUMENT", f"pool {request.pool!r}: prefill or decode")
            if request.replicas < 1:
                raise RouterError(
                    "INVALID_ARGUMENT", "replicas must be >= 1 (a pool needs a worker)"
                )
            try:
                names = await self.router.pools.scale(request.pool, request.replicas)
            except ValueError as e:
                raise RouterError("RESOURCE_EXHAUSTED", str(e)) from None
            return pb.ScaleResponse(workers=names)
        except RouterError as e:
            await _abort(context, e)

    async def Drain(self, request, context):
        try:
            _check_auth(context, self.auth_token)
            if self.router.pools.get(request.worker) is None:
                raise RouterError("NOT_FOUND", f"no worker named {request.worker!r}")
            ok, message = await self.router.pools.drain(request.worker, request.timeout_s or 60)
            return pb.DrainResponse(drained=ok, message=message)
        except RouterError as e:
            await _abort(context, e)


async def start_server(
    router: Router,
    port: int,
    max_model_len: int,
    vocab_size: int,
    mode: str,
    auth_token: str | None = None,
    host: str = "127.0.0.1",
):
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    _add_generation(GenerationService(router, max_model_len, vocab_size, auth_token), server)
    pb_grpc.add_AdminServicer_to_server(AdminService(router, mode, auth_token), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        pb.DESCRIPTOR.services_by_name["Admin"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port} (in use?)")
    await server.start()
    for name in ("", *names[:2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
