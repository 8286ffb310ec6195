"""Every CLI verb against a keyed router, over plain gRPC and over TLS, as an SRE runs it: the
`tandem` command in a process of its own, its key from TANDEM_API_KEY, --api-key-file or
--token. Each verb works with a key of the scope it needs, and is refused with one of another
scope (PERMISSION_DENIED) or none (UNAUTHENTICATED): generate, status, scale, drain, tenants.
Scale and drain change the decode pool for real, 1 -> 2 -> 1."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cluster.config import ClusterConfig
from router.edge.keys import key_hash
from router.edge.tls import ClientTLS
from tests.integration.harness import ClusterHarness, cluster_config
from tests.integration.pki import make_ca, make_cert

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

GEN, ADMIN, EVERY = "tdm-cli-generate", "tdm-cli-admin", "tdm-cli-every-scope"


def config(folder, keys_file, **router) -> ClusterConfig:
    return cluster_config(
        engine={"dtype": "float32", "num_kv_blocks": 256},
        prefill={"replicas": 1, "cpus": 0.5},
        decode={"replicas": 1, "cpus": 0.5},
        router={"port": 0, "api_keys_file": str(keys_file), "auth_token": EVERY, **router},
        dashboard=False,
        ray_num_cpus=4,
        data_dir=str(folder / "data"),
    )


@pytest.fixture(scope="module", params=["grpc", "tls"])
def keyed(request, tmp_path_factory):
    """A cluster whose router takes three keys: GEN (generate, tenant acme), ADMIN (admin,
    tenant ops) and EVERY (both, tenant default); over TLS with a client CA for "tls"."""
    folder = tmp_path_factory.mktemp(f"cli-{request.param}")
    keys = folder / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{sha256: {key_hash(GEN)}, tenant: acme, scopes: [generate]}}\n"
        f"  - {{sha256: {key_hash(ADMIN)}, tenant: ops, scopes: [admin]}}\n"
    )
    flags, tls, router = [], None, {}
    if request.param == "tls":
        make_ca(folder, "ca")
        make_cert(folder, "ca", "router", san="IP:127.0.0.1,DNS:localhost")
        make_cert(folder, "ca", "client")
        ca, cert, key = (str(folder / n) for n in ("ca.pem", "client.pem", "client.key"))
        flags = ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key]
        tls = ClientTLS.of(ca, cert, key)
        router = {
            "tls_cert": str(folder / "router.pem"),
            "tls_key": str(folder / "router.key"),
            "tls_client_ca": ca,
        }
    h = ClusterHarness(config(folder, keys, **router), EVERY, tls)
    yield SimpleNamespace(harness=h, flags=flags, folder=folder)
    h.stop()


def tandem(keyed, verb: str, *args: str, key: str | None = None, via: str = "env"):
    """Run `tandem VERB --address ... ARGS` in a process of its own, its key given `via` the
    environment, a key file or --token: (exit status, stdout, stderr)."""
    argv = [verb, "--address", keyed.harness.address, *args, *keyed.flags]
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    if key is not None and via == "env":
        env["TANDEM_API_KEY"] = key
    elif key is not None and via == "file":
        path = keyed.folder / "api-key"
        path.write_text(key + "\n")
        argv += ["--api-key-file", str(path)]
    elif key is not None:
        argv += ["--token", key]
    cmd = [sys.executable, "-m", "cluster.cli", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def refused(result, code: str) -> bool:
    rc, _, err = result
    return rc != 0 and code in err


def decode_pool(keyed) -> tuple[int, list[str]]:
    """The decode pool's target and its live workers' names."""
    s = keyed.harness.status()
    return s["pools"]["decode"]["target"], sorted(w["name"] for w in s["decode"] if w["alive"])


def test_generate_needs_the_generate_scope(keyed):
    rc, out, err = tandem(keyed, "generate", "Name a colour.", "--max-tokens", "4", key=GEN)
    assert rc == 0 and out.strip(), err
    rc, out, err = tandem(keyed, "generate", "Hi", "--max-tokens", "2", key=EVERY, via="file")
    assert rc == 0 and out.strip(), err
    assert refused(tandem(keyed, "generate", "Hi", "--max-tokens", "2", key=ADMIN), "PERMISSION")
    assert refused(tandem(keyed, "generate", "Hi", "--max-tokens", "2"), "UNAUTHENTICATED")


def test_status_takes_any_valid_key(keyed):
    for key, via in ((GEN, "env"), (ADMIN, "file"), (EVERY, "token")):
        rc, out, err = tandem(keyed, "status", "--json", key=key, via=via)
        assert rc == 0, err
        assert [w["name"] for w in json.loads(out)["prefill"]] == ["prefill-0"]
    assert refused(tandem(keyed, "status", key="tdm-not-a-key"), "UNAUTHENTICATED")
    assert refused(tandem(keyed, "status"), "UNAUTHENTICATED")


def test_scale_and_drain_need_the_admin_scope(keyed):
    assert refused(tandem(keyed, "scale", "--decode", "2", key=GEN), "PERMISSION_DENIED")
    assert decode_pool(keyed) == (1, ["decode-0"])
    rc, out, err = tandem(keyed, "scale", "--decode", "2", "--json", key=ADMIN, via="file")
    assert rc == 0, err
    added = [w for w in json.loads(out)["scale"]["decode to 2"] if w != "decode-0"]
    assert len(added) == 1 and decode_pool(keyed) == (2, sorted(["decode-0", *added]))
    drain = ("drain", "--worker", added[0], "--json")
    assert refused(tandem(keyed, *drain, key=GEN), "PERMISSION_DENIED")
    rc, out, err = tandem(keyed, *drain, key=EVERY, via="token")
    assert rc == 0 and json.loads(out)["drain"][f"drain {added[0]}"]["drained"], err
    assert decode_pool(keyed) == (1, ["decode-0"])


def test_tenants_needs_the_admin_scope(keyed):
    change = ("tenants", "--set", "acme", "weight=3", "--json")
    assert refused(tandem(keyed, *change, key=GEN), "PERMISSION_DENIED")
    assert refused(tandem(keyed, *change), "UNAUTHENTICATED")
    rc, out, err = tandem(keyed, *change, key=ADMIN)
    assert rc == 0, err
    acme = next(t for t in json.loads(out)["tenants"] if t["name"] == "acme")
    assert acme["weight"] == 3
    rc, out, err = tandem(keyed, "tenants", "--reset", "acme", "--json", key=EVERY, via="file")
    assert rc == 0, err
    # Back to the config's policy: no longer listed (neither named nor active), or weight 1.
    acme = [t["weight"] for t in json.loads(out)["tenants"] if t["name"] == "acme"]
    assert acme in ([], [1])
