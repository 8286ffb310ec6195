"""API keys: the key file (each key only as its SHA-256, with a tenant and scopes), the
single-token shortcut, the scope each gRPC method needs, tenant-scoped request ids, and the
config that routers share through Redis, which holds no secret."""

import argparse

import grpc
import pytest

from cluster.cli import _key_line
from cluster.cluster import SECRET, shared_config
from cluster.config import ClusterConfig
from router.config import RouterConfig
from router.edge.auth import bearer, refusal, scoped_id
from router.edge.keys import (
    AUTH_TOKEN_ENV,
    DEFAULT_TENANT,
    KeyFileError,
    KeyRing,
    key_hash,
    read_key_file,
    router_keys,
)

ALICE, OPS = "tdm-alice-key", "tdm-ops-key"


def key_file(tmp_path, text: str):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


def ring(tmp_path) -> KeyRing:
    path = key_file(
        tmp_path,
        "keys:\n"
        f"  - {{sha256: {key_hash(ALICE)}, tenant: acme, scopes: [generate]}}\n"
        f"  - {{sha256: {key_hash(OPS).upper()}, tenant: ops, scopes: [admin]}}\n",
    )
    return KeyRing.build(str(path), None)


def test_a_key_is_known_by_its_hash_and_says_its_tenant_and_scopes(tmp_path):
    keys = ring(tmp_path)
    alice = keys.principal(ALICE)
    assert alice.tenant == "acme" and alice.may("generate") and not alice.may("admin")
    assert keys.principal(OPS).tenant == "ops"  # hex taken in either case
    assert keys.principal("tdm-alice-ke") is None and keys.principal("") is None
    assert keys.principal(None) is None


def test_the_auth_token_is_one_key_with_every_scope_and_the_env_stands_for_the_flag(
    tmp_path, monkeypatch
):
    keys = KeyRing.build(None, "s3cret")
    who = keys.principal("s3cret")
    assert who.tenant == DEFAULT_TENANT and who.may("generate") and who.may("admin")
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    assert router_keys(RouterConfig()) is None  # no keys at all: an open router
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    assert router_keys(RouterConfig()).principal("from-env").may("admin")


@pytest.mark.parametrize(
    "text, named",
    [
        ("keys: 3", "expected 'keys:' with a list"),
        ("keys: [{sha256: abc, tenant: a, scopes: [generate]}]", "keys[0].sha256: expected 64"),
        (f"keys: [{{sha256: {'a' * 64}, tenant: 'a b', scopes: [generate]}}]", "keys[0].tenant"),
        (f"keys: [{{sha256: {'a' * 64}, tenant: a/b, scopes: [generate]}}]", "keys[0].tenant"),
        (f"keys: [{{sha256: {'a' * 64}, tenant: a, scopes: []}}]", "keys[0].scopes"),
        (f"keys: [{{sha256: {'a' * 64}, tenant: a, scopes: [root]}}]", "keys[0].scopes"),
        (f"keys: [{{sha256: {'a' * 64}, tenant: a, scopes: [admin], key: x}}]", "key's text"),
        (
            f"keys: [{{sha256: {'a' * 64}, tenant: a, scopes: [admin]}},"
            f" {{sha256: {'A' * 64}, tenant: b, scopes: [admin]}}]",
            "keys[1].sha256: the same key is listed twice",
        ),
        ("keys: []", "lists no keys"),
        ("keys: [", "not YAML"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_entry_and_field(tmp_path, text, named):
    with pytest.raises(KeyFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        KeyRing.build(str(key_file(tmp_path, text)), None)


def test_a_missing_key_file_is_named(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read it"):
        KeyRing.build(str(tmp_path / "absent.yaml"), None)


def test_tandem_keys_prints_a_line_the_key_file_takes(tmp_path):
    line = _key_line(ALICE, argparse.Namespace(tenant="acme", scopes="generate,admin"))
    [(digest, tenant, scopes)] = read_key_file(key_file(tmp_path, "keys:\n" + line + "\n"))
    assert (digest, tenant, scopes) == (key_hash(ALICE), "acme", ("generate", "admin"))
    assert ALICE not in line


@pytest.mark.parametrize(
    "method, key, want",
    [
        ("/tandem.v1.Generation/Generate", ALICE, None),
        ("/tandem.v1.Generation/Generate", None, grpc.StatusCode.UNAUTHENTICATED),
        ("/tandem.v1.Generation/Generate", "wrong", grpc.StatusCode.UNAUTHENTICATED),
        ("/tandem.v1.Generation/Generate", OPS, grpc.StatusCode.PERMISSION_DENIED),
        ("/tandem.v1.Generation/Cancel", OPS, grpc.StatusCode.PERMISSION_DENIED),
        ("/tandem.v1.Admin/Status", ALICE, None),
        ("/tandem.v1.Admin/Status", OPS, None),
        ("/tandem.v1.Admin/Status", None, grpc.StatusCode.UNAUTHENTICATED),
        ("/tandem.v1.Admin/Scale", ALICE, grpc.StatusCode.PERMISSION_DENIED),
        ("/tandem.v1.Admin/Drain", ALICE, grpc.StatusCode.PERMISSION_DENIED),
        ("/tandem.v1.Admin/Scale", OPS, None),
        ("/grpc.health.v1.Health/Check", None, None),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", None, None),
    ],
)
def test_each_method_needs_its_scope(tmp_path, method, key, want):
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    why = refusal(ring(tmp_path), method, metadata)
    assert (why[0] if why else None) == want


def test_the_bearer_key_is_read_from_its_header_alone():
    assert bearer([("x-other", "1"), ("authorization", "Bearer  k1 ")]) == "k1"
    assert bearer([("authorization", "bearer k2")]) == "k2"
    assert bearer([("authorization", "Basic k3")]) is None
    assert bearer([("authorization", "Bearer")]) is None
    assert bearer(None) is None


def test_request_ids_are_scoped_by_tenant():
    assert scoped_id("acme", "job-1") == "acme/job-1" != scoped_id("other", "job-1")
    assert scoped_id(None, "job-1") == "job-1"  # no keys: the client's id as it is


def test_the_config_shared_through_redis_holds_no_secret():
    cfg = ClusterConfig(router=RouterConfig(auth_token="s3cret", api_keys_file="/etc/k.yaml"))
    stored = shared_config(cfg, "redis://:hunter2@10.0.0.5:6379/0")
    text = repr(stored)
    assert "s3cret" not in text and "hunter2" not in text
    assert stored["router"]["auth_token"] == SECRET  # marked set: a keyless joiner is refused
    assert stored["router"]["api_keys_file"] == "/etc/k.yaml"  # a path, not a secret
    assert shared_config(ClusterConfig(), "redis://127.0.0.1:1/0")["router"]["auth_token"] is None


class StoredConfig:
    def __init__(self, value) -> None:
        self.value = value

    async def get_json(self, name):
        return self.value


def joined(stored: dict, cfg: ClusterConfig):
    import asyncio

    from cluster.cluster import Cluster

    c = Cluster(cfg, join=True)
    c.store = StoredConfig(stored)
    return asyncio.run(c._check_joined(cfg, "redis://127.0.0.1:1/0"))


def test_a_joining_router_runs_on_its_own_config_and_refuses_a_different_or_planted_one():
    from workers.engine.config import EngineConfig

    up = ClusterConfig(engine=EngineConfig(dtype="float32"), router=RouterConfig(port=50051))
    stored = shared_config(up, "redis://127.0.0.1:1/0")
    same = ClusterConfig(engine=EngineConfig(dtype="float32"), router=RouterConfig(port=50052))
    joined(stored, same)  # its own address and keys are its own
    with pytest.raises(ValueError, match="engine.dtype: the cluster's 'float32', this router's"):
        joined(stored, ClusterConfig())
    planted = {**stored, "engine": {**stored["engine"], "model": "/tmp/evil"}}
    with pytest.raises(ValueError, match="engine.model: the cluster's '/tmp/evil'"):
        joined(planted, same)
    keyed_up = ClusterConfig(
        engine=EngineConfig(dtype="float32"), router=RouterConfig(auth_token="s3cret")
    )
    keyed = shared_config(keyed_up, "redis://x:1/0")
    with pytest.raises(ValueError, match="require API keys"):
        joined(keyed, same)


def test_a_bad_certificate_or_key_file_fails_the_start_naming_its_field(tmp_path):
    from router.edge.tls import ServerTLS, TLSFileError

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate")
    key.write_text("not a key")
    with pytest.raises(TLSFileError, match="router.tls_cert/tls_key"):
        ServerTLS.of(RouterConfig(tls_cert=str(cert), tls_key=str(key)))
    with pytest.raises(TLSFileError, match="router.tls_key=.*absent.pem: cannot read it"):
        ServerTLS.of(RouterConfig(tls_cert=str(cert), tls_key=str(tmp_path / "absent.pem")))
    assert ServerTLS.of(RouterConfig()) is None


def test_the_longest_scoped_choice_id_fits_the_kv_header():
    """A tenant of 64 characters, an id of 64 and a choice's suffix: what workers carry."""
    from kv_transfer.layout import KVLayout
    from kv_transfer.protocol import TransferDescriptor, empty_header
    from workers.engine.request import choice_id

    rid = choice_id(scoped_id("t" * 64, "i" * 64), 63)
    desc = TransferDescriptor(rid, KVLayout(2, 1, 4, 4, "float32"), 1, 3)
    assert desc.encode().shape == empty_header().shape
    assert TransferDescriptor.decode(desc.encode(), desc.layout) == desc


def test_keys_from_the_environment_and_tls_bind_a_joining_router_too(monkeypatch):
    from workers.engine.config import EngineConfig

    engine = EngineConfig(dtype="float32")
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    stored = shared_config(ClusterConfig(engine=engine), "redis://127.0.0.1:1/0")
    assert stored["router"]["auth_token"] == SECRET and "from-env" not in repr(stored)
    monkeypatch.delenv(AUTH_TOKEN_ENV)
    with pytest.raises(ValueError, match="require API keys"):
        joined(stored, ClusterConfig(engine=engine))
    tls = RouterConfig(tls_cert="c.pem", tls_key="k.pem")
    served = shared_config(ClusterConfig(engine=engine, router=tls), "redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="serve TLS"):
        joined(served, ClusterConfig(engine=engine))
