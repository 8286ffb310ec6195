"""The channels the client library calls a router over. With an API key, every call on them
carries it (`authorization: Bearer <key>`): it is attached here, by an interceptor, and
nowhere else, so that no call (a generate, a resume, a status, an admin verb) can forget it.
"""

from __future__ import annotations

import grpc

from router.edge.tls import ClientTLS, channel

AUTHORIZATION = "authorization"


class _SendsKey:
    """Puts the key in a call's metadata, in place of any other authorization."""

    def __init__(self, key: str) -> None:
        self.header = (AUTHORIZATION, f"Bearer {key}")

    def _keyed(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        others = [(k, v) for k, v in (details.metadata or ()) if k != AUTHORIZATION]
        metadata = grpc.aio.Metadata(*others, self.header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per kind of call: a channel files an interceptor under the first kind it is.
class KeyOnUnary(_SendsKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._keyed(client_call_details), request)


class KeyOnStream(_SendsKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._keyed(client_call_details), request)


def open_channel(
    address: str, key: str | None = None, tls: ClientTLS | None = None
) -> grpc.aio.Channel:
    """A channel to the router at `address`, over TLS with `tls`, sending `key` on every call."""
    return channel(address, tls, [KeyOnUnary(key), KeyOnStream(key)] if key else None)
