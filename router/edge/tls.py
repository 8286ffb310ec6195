"""TLS for the router's gRPC and HTTP fronts, for its clients, and for calls between routers.

A router with `tls_cert` and `tls_key` serves both fronts over TLS only; with
`tls_client_ca` as well, a client must present a certificate that CA signed (mutual TLS),
or the handshake fails. A router forwarding an Admin call to the controller router verifies
it against `tls_ca` (default: `tls_client_ca`), presenting its own certificate. Clients
(`tandem generate/status/scale/drain --tls-ca`, `TandemClient(tls=...)`) verify the router's
certificate against the CA they are given, and present one of their own where asked.
Files are read once, when the router or the client starts: a missing or unreadable one is
refused then, naming its field.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSFileError(ValueError):
    pass


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TLSFileError(f"{what}={path}: cannot read it: {e.strerror or e}") from None


@dataclass(frozen=True)
class ServerTLS:
    """A router's certificate and key, and the CAs it trusts (PEM bytes)."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None  # clients must present a certificate this CA signed
    peer_ca: bytes | None = None  # other routers' certificates, for forwarded calls

    @classmethod
    def of(cls, cfg) -> ServerTLS | None:
        """From a RouterConfig's tls_* fields; None when it serves no TLS."""
        if not cfg.tls_cert:
            return None
        client_ca = _read(cfg.tls_client_ca, "router.tls_client_ca")
        tls = cls(
            _read(cfg.tls_cert, "router.tls_cert"),
            _read(cfg.tls_key, "router.tls_key"),
            client_ca,
            _read(cfg.tls_ca, "router.tls_ca") or client_ca,
        )
        try:  # loaded once now, so that a bad pair fails the start, not the first client
            tls.http_context()
        except (ssl.SSLError, ValueError) as e:
            raise TLSFileError(
                f"router.tls_cert/tls_key/tls_client_ca: not a PEM certificate, its key and "
                f"a CA: {e}"
            ) from None
        return tls

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def http_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, self.cert, self.key)
        if self.client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cadata=self.client_ca.decode())
        return ctx

    def peer_credentials(self) -> grpc.ChannelCredentials:
        """How this router calls another: verifying it, presenting its own certificate."""
        return grpc.ssl_channel_credentials(self.peer_ca, self.key, self.cert)


@dataclass(frozen=True)
class ClientTLS:
    """What a client trusts (ca) and, for a router that asks, what it presents."""

    ca: bytes | None = None  # None: the system's CAs
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def of(cls, ca: str | None, cert: str | None = None, key: str | None = None):
        """From file paths; None when none is given (a plaintext channel)."""
        if not (ca or cert or key):
            return None
        if bool(cert) != bool(key):
            raise TLSFileError("--tls-cert and --tls-key go together")
        return cls(_read(ca, "--tls-ca"), _read(cert, "--tls-cert"), _read(key, "--tls-key"))

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def channel(
    address: str, tls: ClientTLS | ServerTLS | None, interceptors: list | None = None
) -> grpc.aio.Channel:
    """A channel to a router: over TLS when `tls` is given (a ServerTLS: as a peer router),
    every call through `interceptors` (grpc.aio client interceptors), if any."""
    if tls is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors)
    creds = tls.peer_credentials() if isinstance(tls, ServerTLS) else tls.grpc_credentials()
    return grpc.aio.secure_channel(address, creds, interceptors=interceptors)


def _load_chain(ctx: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """ssl loads a chain from files only: through a private temporary folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        c, k = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        c.write_bytes(cert)
        k.touch(0o600)
        k.write_bytes(key)
        ctx.load_cert_chain(c, k)
