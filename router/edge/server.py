"""The gRPC face of the router: Generation and Admin services, standard health checking and
server reflection (so grpcurl and load balancers work), and API keys checked at the door
(router/edge/auth.py).

Every failure leaves as a gRPC status: RouterError carries one, a failed request's last chunk
carries one, and a request is never returned as a truncated success.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import replace

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.api import tandem_pb2 as pb
from router.api import tandem_pb2_grpc as pb_grpc
from router.controller import Controller
from router.edge import convert
from router.edge.auth import ADMIN, AuthInterceptor, bearer, caller, scoped_id
from router.edge.keys import KeyRing
from router.edge.tls import ServerTLS
from router.edge.tls import channel as tls_channel
from router.edge.validation import GrammarCheck, InvalidRequest, message_bytes_limit, validate
from router.errors import FINAL_KEY, RouterError
from router.fleet.directory import PoolRefusal
from router.requests.core import Router
from workers.messages import Pool, Status

log = logging.getLogger(__name__)


class Malformed:
    """A request whose bytes did not parse; answered with INVALID_ARGUMENT, not INTERNAL."""

    def __init__(self, why: str) -> None:
        self.why = why


def _parse_strict(cls):
    def parse(data: bytes):
        try:
            msg = cls.FromString(data)
        except Exception as e:  # protobuf's DecodeError, or anything a bad buffer raises
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


def _add_strict(server, service: str, servicer, methods: dict) -> None:
    """Like the generated registration, but with strict request parsing: a request whose
    bytes do not parse reaches its handler as Malformed (INVALID_ARGUMENT), never as an
    exception inside gRPC (UNKNOWN). methods: name -> (request, response, streams)."""
    rpcs = {}
    for name, (request, response, streams) in methods.items():
        make = (
            grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler
        )
        rpcs[name] = make(
            getattr(servicer, name),
            request_deserializer=_parse_strict(request),
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, rpcs),))


def _add_generation(servicer: GenerationService, server) -> None:
    _add_strict(
        server,
        "tandem.v1.Generation",
        servicer,
        {
            "Generate": (pb.GenerateRequest, pb.GenerateResponse, True),
            "Cancel": (pb.CancelRequest, pb.CancelResponse, False),
            "Resume": (pb.ResumeRequest, pb.GenerateResponse, True),
        },
    )


def _add_admin(servicer: AdminService, server) -> None:
    _add_strict(
        server,
        "tandem.v1.Admin",
        servicer,
        {
            "Status": (pb.StatusRequest, pb.StatusResponse, False),
            "Scale": (pb.ScaleRequest, pb.ScaleResponse, False),
            "Drain": (pb.DrainRequest, pb.DrainResponse, False),
            "Tenants": (pb.TenantsRequest, pb.TenantsResponse, False),
        },
    )


def _reject_malformed(request) -> None:
    if isinstance(request, Malformed):
        raise RouterError(Status.INVALID_ARGUMENT, request.why)


async def _abort(context, e: RouterError, tenant: str | None = None) -> None:
    # A request's final outcome is marked, so a client does not take it for a broken router
    # and resume elsewhere; a passing condition (no worker yet, Redis away) is left unmarked.
    meta = ((FINAL_KEY, "1"),) if e.final else ()
    if e.retry_after_s is not None:
        meta += (("retry-after", str(math.ceil(e.retry_after_s))),)
    # Ids as the client knows them: without the tenant the router scopes them by.
    message = e.message.replace(scoped_id(tenant, ""), "") if tenant else e.message
    await context.abort(getattr(grpc.StatusCode, e.status.value), message, trailing_metadata=meta)


def _failed(chunk) -> RouterError | None:
    if chunk.finished and chunk.status is not Status.OK:
        return RouterError(chunk.status, chunk.error or chunk.status.value)
    return None


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self, router: Router, max_model_len: int, vocab_size: int, keys: KeyRing | None = None
    ) -> None:
        self.router = router
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.keys = keys
        self.grammars = GrammarCheck(router.tokenizer, vocab_size, router.metrics)

    def _tenant(self, context) -> str | None:
        """The caller's tenant, from its key (None: no keys)."""
        who = caller(self.keys, context)
        return None if who is None else who.tenant

    async def Generate(self, request, context):
        tenant = self._tenant(context)
        try:
            _reject_malformed(request)
            try:
                # In a thread: a long prompt's tokenizing must not hold the event loop.
                adm = await asyncio.to_thread(
                    validate,
                    request,
                    self.router.tokenizer,
                    self.max_model_len,
                    self.vocab_size,
                    self.grammars,
                )
            except (InvalidRequest, ValueError) as e:
                raise RouterError(Status.INVALID_ARGUMENT, str(e)) from None
            client_id = adm.request_id
            if tenant is not None:  # the key's tenant, never the request's own say
                adm = replace(adm, request_id=scoped_id(tenant, client_id), tenant=tenant)
            completion = [0] * adm.sampling.n  # per choice
            async with contextlib.aclosing(self.router.generate(adm)) as chunks:
                async for chunk in chunks:
                    if (err := _failed(chunk)) is not None:
                        raise err  # one choice failing for good fails the call; closing
                        # the stream cancels the others at once
                    completion[chunk.index] += len(chunk.token_ids)
                    yield convert.response(
                        client_id, chunk, len(adm.prompt_ids), completion[chunk.index]
                    )
        except RouterError as e:
            await _abort(context, e, tenant)

    async def Cancel(self, request, context):
        tenant = self._tenant(context)
        try:
            _reject_malformed(request)
            rid = scoped_id(tenant, request.request_id)
            return pb.CancelResponse(found=await self.router.cancel(rid))
        except RouterError as e:
            await _abort(context, e, tenant)

    async def Resume(self, request, context):
        """A request's tokens from `offset`, then the live ones, to its end."""
        tenant = self._tenant(context)
        try:
            _reject_malformed(request)
            client_id, total = request.request_id, request.offset
            rid = scoped_id(tenant, client_id)
            # Closed however the call ends, so the Resume stream it counts is given back.
            resumed = self.router.resume(rid, request.offset, request.index)
            async with contextlib.aclosing(resumed) as chunks:
                async for chunk in chunks:
                    if (err := _failed(chunk)) is not None:
                        raise err
                    total += len(chunk.token_ids)
                    yield convert.response(client_id, chunk, 0, total)
        except RouterError as e:
            await _abort(context, e, tenant)


class AdminService(pb_grpc.AdminServicer):
    def __init__(
        self,
        router: Router,
        controller: Controller,
        mode: str,
        status_timeout_s: float = 0.5,
        tls: ServerTLS | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.router = router
        self.controller = controller
        self.keys = keys  # who calls: Status shows a tenant's key its own tenant alone
        self.mode = mode
        self.status_timeout_s = status_timeout_s
        self.tls = tls  # to call the controller router as it is served

    async def Status(self, request, context):
        try:
            _reject_malformed(request)
        except RouterError as e:
            await _abort(context, e)
            return
        router = self.router
        me = router.status()
        out = pb.StatusResponse(
            router=pb.RouterStatus(
                queue_depth=me.queue_depth,
                in_flight=me.in_flight,
                mode=self.mode,
                router_id=router.id,
                controller=self.controller.leader,
                replays_in_flight=me.replays_in_flight,
                replays_total=me.replays_total,
                replays_recovered=me.replays_recovered,
                recovery_p50_s=me.recovery_p50_s,
                recovery_max_s=me.recovery_max_s,
                store_available=me.store_available,
            ),
            pools=[convert.pool_status(p) for p in router.fleet.directory.pool_status()],
        )
        # Within status_timeout_s whatever a worker does: one that does not answer shows its
        # last answer, marked unresponsive (an SRE asks exactly when something hangs).
        for s in await router.fleet.snapshot(self.status_timeout_s):
            field = out.prefill if s.pool is Pool.PREFILL else out.decode
            field.append(convert.worker_status(s))
        # Other tenants' names and usage are for admins: a tenant's key sees its own alone.
        who = caller(self.keys, context)
        states = router.admission.states()
        if who is not None and not who.may(ADMIN):
            states = [t for t in states if t.policy.name == who.tenant]
        out.tenants.extend(convert.tenant_state(t) for t in states)
        return out

    async def Tenants(self, request, context):
        """Read the tenants; with `set` or `reset`, change them first, on every router of
        this store (or on this router alone, without one)."""
        try:
            _reject_malformed(request)
            admission = self.router.admission
            changes: dict[str, dict] = {}
            for p in request.set:
                changes.setdefault(p.name, {}).update(convert.tenant_changes(p))
            resets = list(request.reset)
            store = self.router.records.store
            try:
                await admission.change(store, changes, resets)  # all or none
            except ValueError as e:
                raise RouterError(Status.INVALID_ARGUMENT, str(e)) from None
            except (ConnectionError, TimeoutError) as e:
                raise RouterError(
                    Status.UNAVAILABLE,
                    f"the store at {store.where} is unreachable ({e}): the tenants are shared "
                    "through it, and nothing changed; retry",
                ) from None
            for name in resets:
                log.warning("tenant %s reset: %s", name, admission.tenants.policy(name))
            for name in changes:
                log.warning("tenant %s changed: %s", name, admission.tenants.policy(name))
            error = admission.predictor.mean_abs_error
            return pb.TenantsResponse(
                tenants=[convert.tenant_state(t) for t in admission.states()],
                length_error_tokens=-1.0 if error is None else error,
            )
        except RouterError as e:
            await _abort(context, e)

    async def _forward(self, method: str, request, context):
        """Pool changes are made by the controller alone: pass them on to it."""
        address = self.controller.leader_address
        if not address:
            raise RouterError(
                Status.UNAVAILABLE, "no controller router is known now; retry in a few seconds"
            )
        # The caller's own key goes on, for the controller to check as this router did: only
        # to a router whose certificate a CA of ours signed, never to whatever address Redis
        # names (anyone able to write Redis could name their own).
        key = bearer(context.invocation_metadata())
        if key and (self.tls is None or self.tls.peer_ca is None):
            raise RouterError(
                Status.FAILED_PRECONDITION,
                f"this router is not the controller: send {method} to the controller router, "
                f"{address} (a key goes from router to router only over TLS with router.tls_ca)",
            )
        metadata = [("authorization", f"Bearer {key}")] if key else None
        async with tls_channel(address, self.tls) as channel:
            stub = pb_grpc.AdminStub(channel)
            try:
                return await getattr(stub, method)(
                    request, timeout=context.time_remaining(), metadata=metadata
                )
            except grpc.aio.AioRpcError as e:
                raise RouterError(Status[e.code().name], e.details()) from None

    async def Scale(self, request, context):
        try:
            _reject_malformed(request)
            if request.pool not in ("prefill", "decode"):
                raise RouterError(
                    Status.INVALID_ARGUMENT, f"pool {request.pool!r}: prefill or decode"
                )
            if request.replicas < 1:
                raise RouterError(
                    Status.INVALID_ARGUMENT, "replicas must be >= 1 (a pool needs a worker)"
                )
            if not self.controller.leader:
                return await self._forward("Scale", request, context)
            try:
                directory = self.router.fleet.directory
                names = await directory.scale(Pool(request.pool), request.replicas)
            except PoolRefusal as e:  # nothing changed
                raise RouterError(e.status, str(e)) from None
            except ValueError as e:
                raise RouterError(Status.RESOURCE_EXHAUSTED, str(e)) from None
            return pb.ScaleResponse(workers=names)
        except RouterError as e:
            await _abort(context, e)

    async def Drain(self, request, context):
        try:
            _reject_malformed(request)
            if not self.controller.leader:
                return await self._forward("Drain", request, context)
            directory = self.router.fleet.directory
            if directory.get(request.worker) is None:
                raise RouterError(Status.NOT_FOUND, f"no worker named {request.worker!r}")
            try:
                ok, message = await directory.drain(request.worker, request.timeout_s or 60)
            except PoolRefusal as e:
                raise RouterError(e.status, str(e)) from None
            return pb.DrainResponse(drained=ok, message=message)
        except RouterError as e:
            await _abort(context, e)


async def start_server(
    router: Router,
    port: int,
    max_model_len: int,
    vocab_size: int,
    mode: str,
    keys: KeyRing | None = None,
    host: str = "127.0.0.1",
    tls: ServerTLS | None = None,
):
    """Binds, starts the services and the router's controller duties; returns (server,
    bound port, controller). With `keys`, every call but health checks and reflection needs
    one (router/edge/auth.py); with `tls`, the port serves TLS only (router/edge/tls.py)."""
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(keys)] if keys is not None else None,
        options=[("grpc.max_receive_message_length", message_bytes_limit(max_model_len))],
    )
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.grpc_credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port} (in use?)")
    advertised = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    controller = Controller(router, f"{advertised}:{bound}")
    _add_generation(GenerationService(router, max_model_len, vocab_size, keys), server)
    _add_admin(AdminService(router, controller, mode, tls=tls, keys=keys), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        pb.DESCRIPTOR.services_by_name["Admin"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    await server.start()
    await controller.tick()
    controller.start()
    for name in ("", *names[:2]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, controller
