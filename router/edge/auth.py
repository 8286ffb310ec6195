"""Authentication and scopes at the router's gRPC door, before a request's bytes are parsed.

A server interceptor reads the `authorization: Bearer <key>` metadata of each call, finds the
key in the router's KeyRing (router/edge/keys.py) and checks the scope the method needs: a wrong or
missing key is UNAUTHENTICATED, a key without the scope PERMISSION_DENIED, and either way the
handler never runs and the message is never deserialized. Health checks and reflection stay
open. The handlers then ask `caller` who is calling, to learn the tenant.

A request id belongs to its tenant: with keys, the router knows a request as
`<tenant>/<id>` (`scoped_id`), so one tenant's ids never meet another's, and a Resume or
Cancel of another tenant's request finds nothing, exactly as for an id that does not exist.
"""

from __future__ import annotations

import grpc

from router.edge.keys import KeyRing, Principal

GENERATE, ADMIN, ANY_KEY = "generate", "admin", ""
# The scope each method needs (ANY_KEY: a valid key of any scope); a method not named here
# (health checks, reflection) needs no key.
METHOD_SCOPES = {
    "/tandem.v1.Generation/Generate": GENERATE,
    "/tandem.v1.Generation/Resume": GENERATE,
    "/tandem.v1.Generation/Cancel": GENERATE,
    "/tandem.v1.Admin/Status": ANY_KEY,
    "/tandem.v1.Admin/Scale": ADMIN,
    "/tandem.v1.Admin/Drain": ADMIN,
    "/tandem.v1.Admin/Tenants": ADMIN,
}
UNAUTHENTICATED_MESSAGE = "missing or wrong API key (send metadata authorization: Bearer <key>)"


def bearer(metadata) -> str | None:
    """The key in `authorization: Bearer <key>` among a call's metadata pairs, if any."""
    for name, value in metadata or ():
        if name == "authorization" and isinstance(value, str):
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer" and key:
                return key.strip()
    return None


def scoped_id(tenant: str | None, request_id: str) -> str:
    """The router's id for a client's request id: its tenant's, with keys (None: no keys,
    the id as the client gave it)."""
    return request_id if tenant is None else f"{tenant}/{request_id}"


def caller(keys: KeyRing | None, context) -> Principal | None:
    """Who is calling (the interceptor has let only valid keys through); None with no keys."""
    if keys is None:
        return None
    return keys.principal(bearer(context.invocation_metadata()))


def refusal(keys: KeyRing, method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
    """Why a call to `method` with this metadata is refused; None if it may go on."""
    need = METHOD_SCOPES.get(method)
    if need is None:
        return None
    who = keys.principal(bearer(metadata))
    if who is None:
        return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE
    if need and not who.may(need):
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"this key (tenant {who.tenant}) lacks the '{need}' scope {method} needs",
        )
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: KeyRing) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, details):
        why = refusal(self.keys, details.method, details.invocation_metadata)
        handler = await continuation(details)
        if why is None or handler is None:
            return handler
        code, message = why

        async def refuse(request, context):
            await context.abort(code, message)

        # Same kind of call, no deserializer: the request's bytes are never parsed.
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
