"""TLS on a real cluster (one prefill and one decode worker, real Ray, Redis and gRPC), with
certificates from a CA made here by openssl: the router serves gRPC and HTTP over TLS only,
and with a client CA asks every client for a certificate it signed."""

import json
import ssl

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from client import TandemClient
from cluster.cli import main
from router.api import tandem_pb2 as pb
from router.edge.tls import ClientTLS, ServerTLS, channel
from tests.integration.harness import one_by_one
from tests.integration.pki import make_ca, make_cert

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    make_ca(folder, "ca")
    make_ca(folder, "other-ca")
    make_cert(folder, "ca", "router", san="IP:127.0.0.1,DNS:localhost")
    make_cert(folder, "ca", "client")
    make_cert(folder, "other-ca", "stranger")
    return folder


def files(pki, *names):
    return [str(pki / n) for n in names]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, pki):
    cert, key, ca = files(pki, "router.pem", "router.key", "ca.pem")
    client = ClientTLS.of(*files(pki, "ca.pem", "client.pem", "client.key"))
    h = one_by_one(
        str(tmp_path_factory.mktemp("data")),
        tls=client,
        tls_cert=cert,
        tls_key=key,
        tls_client_ca=ca,
        http_port=0,
    )
    yield h
    h.stop()


def status_code(cluster, tls) -> grpc.StatusCode | None:
    async def go():
        c = TandemClient(cluster.address, tls=tls)
        try:
            await c.admin.Status(pb.StatusRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
        finally:
            await c.close()

    return cluster.run(go())


def test_a_client_with_the_ca_and_its_certificate_is_served(cluster):
    msg = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=4))
    r = cluster.run(cluster.client.generate(msg, timeout_s=120))
    assert r.status == "OK" and r.token_ids


def test_a_client_trusting_another_ca_fails_the_handshake(cluster, pki):
    wrong = ClientTLS.of(*files(pki, "other-ca.pem", "client.pem", "client.key"))
    assert status_code(cluster, wrong) is grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_the_ca_signed_is_refused(cluster, pki):
    no_cert = ClientTLS.of(str(pki / "ca.pem"))
    assert status_code(cluster, no_cert) is grpc.StatusCode.UNAVAILABLE
    stranger = ClientTLS.of(*files(pki, "ca.pem", "stranger.pem", "stranger.key"))
    assert status_code(cluster, stranger) is grpc.StatusCode.UNAVAILABLE
    assert status_code(cluster, None) is grpc.StatusCode.UNAVAILABLE  # plaintext


def test_the_cli_reaches_it_with_tls_flags(cluster, pki, capsys):
    argv = ["status", "--address", cluster.address, "--json", "--tls-ca", str(pki / "ca.pem")]
    argv += ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [w["name"] for w in out["decode"]] == ["decode-0"]


def test_the_http_front_serves_tls_and_asks_for_the_client_certificate(cluster, pki):
    port = cluster.cluster.http_port
    ca, cert, key = files(pki, "ca.pem", "client.pem", "client.key")
    url = f"https://127.0.0.1:{port}/v1/models"
    trusted = ssl.create_default_context(cafile=ca)
    trusted.load_cert_chain(cert, key)
    assert httpx.get(url, verify=trusted, timeout=30).status_code == 200
    with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
        httpx.get(url, verify=ssl.create_default_context(cafile=ca), timeout=30)
    with pytest.raises(httpx.HTTPError):  # plaintext to a TLS port
        httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)


def test_without_a_client_ca_a_client_trusting_the_ca_is_served(cluster, pki):
    """The same credentials on a server that asks no client certificate (the router's own
    code: ServerTLS, router.edge.tls.channel)."""
    cert, key = (pki / "router.pem").read_bytes(), (pki / "router.key").read_bytes()

    async def go():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", ServerTLS(cert, key).grpc_credentials())
        await server.start()
        try:
            codes = []
            for tls in (ClientTLS.of(str(pki / "ca.pem")), ClientTLS.of(str(pki / "other-ca.pem"))):
                async with channel(f"127.0.0.1:{port}", tls) as ch:
                    try:
                        await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=10
                        )
                        codes.append(None)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
            return codes
        finally:
            await server.stop(None)

    assert cluster.run(go()) == [None, grpc.StatusCode.UNAVAILABLE]
