"""The client library's channels put its key on every call, of every kind Tandem's API has
(unary: Status, Scale, Drain, Tenants, Cancel; server streaming: Generate, Resume), in place
of any other authorization; without a key they send none. A real gRPC server on loopback
reads what arrives."""

import asyncio

import grpc

from client.channel import open_channel

UNARY, STREAM = "/probe.Probe/Unary", "/probe.Probe/Stream"


def authorization(context) -> str:
    found = [v for k, v in context.invocation_metadata() if k == "authorization"]
    return ",".join(found) or "none"


async def unary(request: bytes, context) -> bytes:
    return authorization(context).encode()


async def stream(request: bytes, context):
    yield authorization(context).encode()
    yield b"second"


def seen(key, extra=None) -> tuple[str, list[str]]:
    """What the server saw on one unary and one streaming call through open_channel."""

    async def go():
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "probe.Probe",
            {
                "Unary": grpc.unary_unary_rpc_method_handler(unary),
                "Stream": grpc.unary_stream_rpc_method_handler(stream),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with open_channel(f"127.0.0.1:{port}", key) as ch:
                got = await ch.unary_unary(UNARY)(b"", timeout=10, metadata=extra)
                streamed = [
                    m async for m in ch.unary_stream(STREAM)(b"", timeout=10, metadata=extra)
                ]
            return got.decode(), [m.decode() for m in streamed]
        finally:
            await server.stop(None)

    return asyncio.run(go())


def test_the_key_goes_on_unary_and_streaming_calls():
    assert seen("k3y") == ("Bearer k3y", ["Bearer k3y", "second"])


def test_the_channels_key_replaces_any_other_and_keeps_other_metadata():
    other = (("authorization", "Bearer stale"), ("x-trace", "1"))
    assert seen("k3y", other) == ("Bearer k3y", ["Bearer k3y", "second"])


def test_without_a_key_none_is_sent():
    assert seen(None) == ("none", ["none", "second"])
