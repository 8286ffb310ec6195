"""API keys on a real cluster (one prefill and one decode worker, real Ray, Redis and gRPC):
scopes at the gRPC and HTTP doors, requests that belong to their tenant, and no key, token or
password left in Redis, its AOF or the logs."""

import asyncio
import logging

import grpc
import httpx
import pytest

from client import TandemClient
from router.api import tandem_pb2 as pb
from router.edge.keys import key_hash
from tests.integration.harness import one_by_one

pytestmark = pytest.mark.integration

ACME, GLOBEX, OPS, ADMIN = "tdm-acme-k3y", "tdm-globex-k3y", "tdm-ops-k3y", "tdm-admin-t0ken"
KEYS = (ACME, GLOBEX, OPS, ADMIN)
LONG = pb.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def logged():
    handler = Lines()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, logged):
    folder = tmp_path_factory.mktemp("keys")
    keys = folder / "keys.yaml"
    keys.write_text(
        "keys:\n"
        f"  - {{sha256: {key_hash(ACME)}, tenant: acme, scopes: [generate]}}\n"
        f"  - {{sha256: {key_hash(GLOBEX)}, tenant: globex, scopes: [generate]}}\n"
        f"  - {{sha256: {key_hash(OPS)}, tenant: ops, scopes: [admin]}}\n"
    )
    h = one_by_one(
        str(folder / "data"),
        key=ACME,
        api_keys_file=str(keys),
        auth_token=ADMIN,
        http_port=0,
    )
    yield h
    h.stop()


def client(cluster, key: str | None) -> TandemClient:
    return TandemClient(cluster.address, key)


def call(cluster, coro_fn):
    """Run coro_fn(client) for a fresh client on the harness's loop, then close it."""

    async def go(key):
        c = client(cluster, key)
        try:
            return await coro_fn(c)
        finally:
            await c.close()

    return lambda key: cluster.run(go(key))


def code_of(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.aio.AioRpcError as e:
        return e.code()
    return None


def test_each_call_needs_a_key_with_its_scope(cluster):
    status = call(cluster, lambda c: c.status())
    assert code_of(lambda: status(None)) is grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: status("tdm-wrong")) is grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: status(ACME)) is None  # Status: any valid key
    assert code_of(lambda: status(OPS)) is None

    def scale(c):
        return c.admin.Scale(pb.ScaleRequest(pool="decode", replicas=1), timeout=60)

    assert code_of(lambda: call(cluster, scale)(ACME)) is grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: call(cluster, scale)(ADMIN)) is None  # already 1: nothing to do
    msg = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=4))
    gen = call(cluster, lambda c: c.generate(msg, timeout_s=120))
    assert gen(OPS).status == "PERMISSION_DENIED"  # admin alone may not generate
    assert gen(None).status == "UNAUTHENTICATED"
    assert gen(ACME).status == "OK"


def test_a_strangers_bytes_are_refused_before_they_are_parsed(cluster):
    """Garbage for Generate, with no key: UNAUTHENTICATED, never INVALID_ARGUMENT (which
    would mean the router parsed it)."""

    async def raw(key):
        async with grpc.aio.insecure_channel(cluster.address) as ch:
            rpc = ch.unary_stream("/tandem.v1.Generation/Generate")
            meta = [("authorization", f"Bearer {key}")] if key else None
            try:
                async for _ in rpc(b"\xff\x00garbage", timeout=30, metadata=meta):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()

    assert cluster.run(raw(None)) is grpc.StatusCode.UNAUTHENTICATED
    assert cluster.run(raw(ACME)) is grpc.StatusCode.INVALID_ARGUMENT  # let in, then parsed


def test_health_checks_need_no_key(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def check():
        async with grpc.aio.insecure_channel(cluster.address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            return r.status

    assert cluster.run(check()) == health_pb2.HealthCheckResponse.SERVING


def test_a_tenants_request_is_invisible_to_another_tenant(cluster):
    """globex's Resume and Cancel of acme's request find nothing, exactly as for an id that
    does not exist; acme's own still work; both may use the same id."""

    async def scenario():
        acme, globex = client(cluster, ACME), client(cluster, GLOBEX)
        try:
            msg = pb.GenerateRequest(request_id="job-1", prompt="Count to fifty:", sampling=LONG)
            first = asyncio.Event()
            running = asyncio.create_task(
                acme.generate(msg, timeout_s=300, on_chunk=lambda *a: first.set())
            )
            await asyncio.wait_for(first.wait(), 120)
            theirs = await globex.cancel("job-1")
            nobodys = await globex.cancel("job-404")
            resume = []
            for rid in ("job-1", "job-404"):
                try:
                    async for _ in globex.gen.Resume(pb.ResumeRequest(request_id=rid), timeout=30):
                        pass
                except grpc.aio.AioRpcError as e:
                    resume.append((e.code(), e.details().replace(rid, "ID")))
            # The same id is globex's own to use.
            short = pb.GenerateRequest(
                request_id="job-1", prompt="Hi", sampling=pb.SamplingParams(max_tokens=4)
            )
            own = await globex.generate(short, timeout_s=120)
            mine = await acme.cancel("job-1")
            ended = await running
            return theirs, nobodys, resume, own, mine, ended
        finally:
            await acme.close()
            await globex.close()

    theirs, nobodys, resume, own, mine, ended = cluster.run(scenario(), timeout=400)
    assert theirs is False and nobodys is False
    assert resume[0] == resume[1] and resume[0][0] is grpc.StatusCode.NOT_FOUND
    assert own.status == "OK" and own.request_id == "job-1"
    assert mine is True and ended.finish_reason == "cancelled" and ended.request_id == "job-1"
    s = cluster.wait_all_free()
    for w in s["prefill"] + s["decode"]:
        assert w["kv_blocks_free"] == w["kv_blocks_total"], w


def test_the_http_front_takes_the_same_keys(cluster):
    url = f"http://127.0.0.1:{cluster.cluster.http_port}/v1"
    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}

    def post(key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{url}/completions", json=body, headers=headers, timeout=120)

    assert post(None).status_code == 401
    assert post("tdm-wrong").status_code == 401
    assert post(OPS).status_code == 403
    ok = post(GLOBEX)
    assert ok.status_code == 200 and ok.json()["id"].startswith("cmpl-")
    assert "globex" not in ok.json()["id"]  # the client's id, not the router's scoped one
    models = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {OPS}"})
    assert models.status_code == 200
    assert httpx.get(f"http://127.0.0.1:{cluster.cluster.http_port}/health").status_code == 200


def test_no_key_token_or_password_is_in_redis_its_aof_or_the_logs(cluster, logged):
    marker = "aof-marker-request"
    msg = pb.GenerateRequest(
        request_id=marker, prompt="Hi", sampling=pb.SamplingParams(max_tokens=2)
    )
    assert cluster.run(cluster.client.generate(msg, timeout_s=120)).status == "OK"

    async def every_value() -> bytes:
        r = cluster.store.r
        out = []
        async for name in r.scan_iter(count=500):
            out.append(name if isinstance(name, bytes) else name.encode())
            kind = await r.type(name)
            kind = kind.decode() if isinstance(kind, bytes) else kind
            value = {
                "string": r.get,
                "hash": r.hgetall,
                "list": lambda n: r.lrange(n, 0, -1),
                "set": r.smembers,
                "zset": lambda n: r.zrange(n, 0, -1),
            }.get(kind)
            if value is not None:
                out.append(repr(await value(name)).encode())
        return b"\n".join(out)

    stored = cluster.run(every_value())
    assert marker.encode() in stored  # the scan saw the records
    data_dir = cluster.cluster.redis.data_dir
    aof = b""
    for _ in range(100):  # fsync'd once a second: wait (bounded) until it holds the marker
        aof = b"".join(p.read_bytes() for p in data_dir.rglob("*.aof"))
        if marker.encode() in aof:
            break
        cluster.run(asyncio.sleep(0.1))
    assert marker.encode() in aof
    logs = "\n".join(logged.lines).encode()
    for secret in KEYS:
        for where, text in (("Redis", stored), ("the AOF", aof), ("the logs", logs)):
            assert secret.encode() not in text, f"a key is in {where}"


def test_tenants_are_the_keys_and_a_spent_quota_says_when_to_retry(cluster):
    tenants = call(
        cluster,
        lambda c: c.admin.Tenants(
            pb.TenantsRequest(set=[pb.TenantPolicy(name="acme", tokens_per_minute=60)]),
            timeout=30,
        ),
    )
    assert code_of(lambda: tenants(ACME)) is grpc.StatusCode.PERMISSION_DENIED  # admin only
    reply = tenants(ADMIN)
    acme = next(t for t in reply.tenants if t.policy.name == "acme")
    assert acme.policy.tokens_per_minute == 60 and acme.quota_left == pytest.approx(60, abs=1)
    # acme spends its minute (prompt and output counted), naming another tenant in vain.
    msg = pb.GenerateRequest(prompt="Count to ten.", tenant="globex", sampling=LONG)
    msg.sampling.max_tokens = 64
    assert call(cluster, lambda c: c.generate(msg, timeout_s=120))(ACME).status == "OK"

    async def refused(c):
        try:
            await c.gen.Generate(msg, timeout=30).read()
        except grpc.aio.AioRpcError as e:
            return e.code(), dict(e.trailing_metadata() or ()), e.details()
        return None

    code, meta, details = call(cluster, refused)(ACME)
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in details
    assert 1 <= int(meta["retry-after"]) <= 120
    r = httpx.post(
        f"http://127.0.0.1:{cluster.cluster.http_port}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 4},
        headers={"Authorization": f"Bearer {ACME}"},
        timeout=60,
    )
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    # Another tenant is not held back by acme's quota.
    assert call(cluster, lambda c: c.generate(msg, timeout_s=120))(GLOBEX).status == "OK"
    status = call(cluster, lambda c: c.status())(ADMIN)
    shown = {t.policy.name: t for t in status.tenants}
    assert shown["acme"].quota_left < 0 and shown["acme"].policy.tokens_per_minute == 60
    # An admin key sees every tenant; a tenant's key its own alone, never another's usage.
    assert "acme" in {t.policy.name for t in call(cluster, lambda c: c.status())(OPS).tenants}
    assert [t.policy.name for t in call(cluster, lambda c: c.status())(ACME).tenants] == ["acme"]
    assert "acme" not in {
        t.policy.name for t in call(cluster, lambda c: c.status())(GLOBEX).tenants
    }
    lift = pb.TenantsRequest(set=[pb.TenantPolicy(name="acme", tokens_per_minute=0)])
    call(cluster, lambda c: c.admin.Tenants(lift, timeout=30))(ADMIN)
    assert call(cluster, lambda c: c.generate(msg, timeout_s=120))(ACME).status == "OK"
