"""The Redis request store against a real redis-server: offset-checked token writes (gaps,
repeats, fenced attempts, lost records), terminal records, ownership and leases, restarts
of the embedded server from its AOF, and Redis URLs with a password."""

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import time

import pytest
import redis

from cluster import state
from cluster.redis_server import EmbeddedRedis, free_port
from cluster.state import RedisStore, RedisTokenLog, key, redact
from router.records.store import BeginResult, RecordState, RequestRecord
from workers.engine.request import FinishReason, SamplingParams
from workers.messages import LogResult, LogWrite, Status

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    r = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield r
    r.stop()


def run(coro):
    return asyncio.run(coro)


@contextlib.contextmanager
def redis_server(tmp_path, url: str, *args: str):
    """A redis-server of its own with these arguments, answering at `url`."""
    proc = subprocess.Popen(
        ["redis-server", "--save", "", *args], stdout=subprocess.DEVNULL, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait()


def record(rid, owner="router-a"):
    sp = SamplingParams(max_tokens=8, temperature=0.7, seed=11, stop=("\n",))
    return RequestRecord(rid, (1, 2, 3), sp, priority=2, tenant="t", owner=owner)


async def with_store(url, fn):
    store = RedisStore(url, ttl_s=60)
    try:
        return await fn(store)
    finally:
        await store.close()


def test_token_writes_skip_repeats_report_gaps_and_fence_old_attempts(server):
    log = RedisTokenLog(server.url, ttl_s=60)

    async def go(store):
        assert await store.create(record("a"))
        assert not await store.create(record("a"))  # an id is never reused
        assert await store.begin_attempt("a", 1, "router-a", "p0", "d0", "") is BeginResult.OK
        w = [LogWrite("a", 1, 0, (5, 6, 7))]
        assert log.write(w)[0].result is LogResult.OK
        again = log.write([LogWrite("a", 1, 1, (6, 7, 8))])[0]  # overlaps: only 8 is new
        assert (again.result, again.length) == (LogResult.OK, 4)
        gap = log.write([LogWrite("a", 1, 9, (1,))])[0]
        assert (gap.result, gap.length) == (LogResult.GAP, 4)
        assert await store.tokens("a") == [5, 6, 7, 8]
        # Attempt 2 begins (a replay): attempt 1's writes are refused from now on.
        cause = "attempt 1: d0 died"
        assert await store.begin_attempt("a", 2, "router-a", "p0", "d1", cause) is BeginResult.OK
        assert await store.begin_attempt("a", 1, "router-a", "p0", "d1", "") is BeginResult.STALE
        assert log.write([LogWrite("a", 1, 4, (9,))])[0].result is LogResult.FENCED
        done = log.write([LogWrite("a", 2, 4, (9, 10), FinishReason.LENGTH)])[0]
        assert done.result is LogResult.OK
        rec = await store.get("a")
        assert rec.state is RecordState.FINISHED and rec.finish_reason == "length"
        assert rec.attempt == 2 and rec.decode == "d1" and rec.failures == (cause,)
        assert rec.sampling == record("a").sampling and rec.prompt_ids == (1, 2, 3)
        assert await store.tokens("a") == [5, 6, 7, 8, 9, 10]
        assert "a" not in await store.active()
        assert 0 < await store.r.ttl(key("a")) <= 60
        assert log.write([LogWrite("nope", 1, 0, (1,))])[0].result is LogResult.MISSING
        # A decode worker's write may land before its router's note of the attempt: it is
        # taken, and raises the record's attempt; the older attempt is fenced from then on.
        await store.create(record("early"))
        assert log.write([LogWrite("early", 1, 0, (4, 5))])[0].result is LogResult.OK
        assert (await store.get("early")).attempt == 1
        assert await store.begin_attempt("early", 1, "router-a", "p0", "d0", "") is BeginResult.OK
        rec = await store.get("early")
        assert rec.decode == "d0" and rec.state is RecordState.RUNNING
        return True

    assert run(with_store(server.url, go))


def test_ownership_leases_and_a_router_end(server):
    async def go(store):
        await store.create(record("b"))
        assert await store.begin_attempt("b", 1, "router-b", "", "d0", "") is BeginResult.NOT_OWNER
        assert not await store.claim("b", "someone-else", "router-c")
        assert await store.claim("b", "router-a", "router-c")
        assert (await store.get("b")).owner == "router-c"
        assert await store.hold_lease("ctl", "router-c", 1.0)
        assert not await store.hold_lease("ctl", "router-d", 1.0)
        assert await store.hold_lease("ctl", "router-c", 1.0)  # renewed
        await store.heartbeat("router-c", "127.0.0.1:1", 1.0)
        assert (await store.live_routers())["router-c"] == "127.0.0.1:1"
        await asyncio.sleep(1.2)
        assert "router-c" not in await store.live_routers()
        assert await store.hold_lease("ctl", "router-d", 1.0)  # lapsed: another takes it
        # A router ends a request it never began an attempt of (the store lost it): the end
        # carries the whole token log, and the record is terminal.
        failed = RequestRecord(
            **{**record("b").__dict__, "attempt": 3, "state": RecordState.FAILED},
        )
        failed = failed.__class__(
            **{**failed.__dict__, "status": Status.UNAVAILABLE, "error": "gave up"}
        )
        await store.end(failed, [4, 4, 4])
        rec = await store.get("b")
        assert rec.state is RecordState.FAILED and rec.status is Status.UNAVAILABLE
        assert rec.attempt == 3 and await store.tokens("b") == [4, 4, 4]
        return True

    assert run(with_store(server.url, go))


def test_a_create_that_landed_after_it_was_refused_is_voided(server):
    """The router refused a request when its create went unanswered; had that create landed
    after all, `void` ends its record as FAILED. Never a record a later create wrote under
    the same id (the client's retry), nor one an attempt has begun on."""

    async def go(store):
        await store.create(record("late"), nonce="n1")
        assert await store.void("late", "n1", Status.UNAVAILABLE, "store away")
        rec = await store.get("late")
        assert rec.state is RecordState.FAILED and rec.status is Status.UNAVAILABLE
        assert rec.error == "store away"
        assert not await store.void("never-created", "n1", Status.UNAVAILABLE, "")
        assert await store.get("never-created") is None
        await store.create(record("retried"), nonce="second")
        assert not await store.void("retried", "first", Status.UNAVAILABLE, "")
        assert (await store.get("retried")).state is RecordState.QUEUED
        await store.create(record("begun"), nonce="n3")
        assert await store.begin_attempt("begun", 1, "router-a", "p0", "d0", "") is BeginResult.OK
        assert not await store.void("begun", "n3", Status.UNAVAILABLE, "")
        active = set(await store.active())
        return "late" not in active and {"retried", "begun"} <= active

    assert run(with_store(server.url, go))


def test_the_embedded_server_restarts_from_its_aof(server):
    async def write(store):
        await store.create(record("c"))
        await store.begin_attempt("c", 1, "router-a", "p0", "d0", "")
        return True

    run(with_store(server.url, write))
    time.sleep(1.5)  # appendfsync everysec: what is a second old is on disk
    old_pid = server.pid
    os.kill(old_pid, signal.SIGKILL)
    client = redis.Redis.from_url(server.url, socket_timeout=1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # answering, and the watchdog has counted it
        try:
            if client.ping() and server.restarts >= 1:
                break
        except redis.RedisError:
            pass
        time.sleep(0.1)
    assert server.pid != old_pid and server.restarts >= 1
    rec = run(with_store(server.url, lambda s: s.get("c")))
    assert rec is not None and rec.attempt == 1 and rec.state is RecordState.RUNNING


def test_connections_made_as_the_health_check_falls_due_still_connect(server, monkeypatch):
    """A health check due in the middle of the connect handshake must not read a handshake
    reply as its PONG: with the interval made tiny, every fresh connection of both clients
    still serves its first command. Before CLIENT SETINFO was turned off, every one of them
    failed here on a Redis older than 7.2."""
    monkeypatch.setattr(state, "_HEALTH_CHECK_S", 1e-9)

    async def fresh_reads():
        for i in range(20):
            store = RedisStore(server.url, ttl_s=60)
            try:
                assert await store.get(f"nobody-{i}") is None
            finally:
                await store.close()

    run(fresh_reads())
    for _ in range(20):
        log = RedisTokenLog(server.url, ttl_s=60)
        assert log._client().ping()
        log._client().close()


def test_pooled_connections_survive_a_redis_restart(tmp_path):
    """Connections pooled before Redis restarted are checked before use: the first calls
    after a restart succeed, on every one of them, instead of failing as unreachable."""
    r = EmbeddedRedis(tmp_path).start()

    async def go():
        store = RedisStore(r.url)
        await asyncio.gather(*(store.create(record(f"before-{i}")) for i in range(12)))
        old = r.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while r.restarts < 1 or r.pid == old:
            assert time.monotonic() < deadline, "redis did not restart"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.2)  # idle past the health-check interval, as between requests
        return await asyncio.gather(*(store.create(record(f"after-{i}")) for i in range(12)))

    try:
        assert run(go()) == [True] * 12
    finally:
        r.stop()


def test_a_password_protected_redis_and_its_url(tmp_path):
    port = free_port()
    url = f"redis://:s3cret@127.0.0.1:{port}/0"
    with redis_server(tmp_path, url, "--port", str(port), "--requirepass", "s3cret"):
        assert redact(url) == f"redis://:***@127.0.0.1:{port}/0"
        assert run(with_store(url, lambda s: s.create(record("p"))))
        with pytest.raises(ConnectionError, match="AuthenticationError"):  # says why
            run(with_store(f"redis://127.0.0.1:{port}/0", lambda s: s.create(record("q"))))


def test_a_tls_redis_through_a_rediss_url(tmp_path):
    """rediss:// with the server's CA in the URL: the store, the token log and the URL's
    redaction all work over TLS."""
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key_file),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    url = f"rediss://:pw@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    tls = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert)]
    tls += ["--tls-key-file", str(key_file), "--tls-ca-cert-file", str(cert)]
    with redis_server(tmp_path, url, *tls, "--tls-auth-clients", "no", "--requirepass", "pw"):
        assert "pw" not in redact(url)
        assert run(with_store(url, lambda s: s.create(record("tls"))))
        run(with_store(url, lambda s: s.begin_attempt("tls", 1, "router-a", "p", "d", "")))
        ack = RedisTokenLog(url).write([LogWrite("tls", 1, 0, (1, 2, 3))])[0]
        assert ack.result is LogResult.OK and ack.length == 3


def test_a_redis_that_refuses_writes_is_away_until_it_takes_them_again(tmp_path):
    """Out of memory (or its AOF disk full: MISCONF), Redis answers every write with an error.
    The store raises the builtin ConnectionError for it, as for a Redis that is down, so the
    router refuses new requests as UNAVAILABLE and its writer retries; it used to raise a raw
    ResponseError (gRPC UNKNOWN, HTTP 500) and drop queued writes."""
    r = EmbeddedRedis(tmp_path).start()
    admin = redis.Redis.from_url(r.url)

    async def go():
        store = RedisStore(r.url)
        log = store.token_log()
        assert await store.create(record("fits"))
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        try:
            with pytest.raises(ConnectionError, match="OutOfMemory|OOM"):
                await store.create(record("refused"))
            with pytest.raises(ConnectionError, match="OutOfMemory|OOM"):
                await asyncio.to_thread(log.write, [LogWrite("fits", 1, 0, (5, 6))])
        finally:
            admin.config_set("maxmemory", 0)
        return await store.create(record("after"))

    try:
        assert run(go())
    finally:
        admin.close()
        r.stop()


def test_redis_errors_that_mean_away_are_told_from_bugs():
    """Refusals of writes count as a Redis away, also as a pipeline reports them (the code
    after "caused error: "); any other error (a bug) stays what it is."""
    from cluster.state import _away

    away = [
        redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("MISCONF Redis is configured to save RDB snapshots"),
        redis.ResponseError("Command # 1 (EVALSHA 25) of pipeline caused error: MISCONF x"),
        redis.ConnectionError("Connection refused"),
    ]
    assert all(isinstance(_away(e), ConnectionError) for e in away)
    assert _away(redis.ResponseError("WRONGTYPE Operation against a key")) is None


def test_the_embedded_redis_is_closed_to_other_local_users(tmp_path):
    """A generated password, never on the command line; the data folder (the AOF holds every
    prompt and output) and the file with the URL readable by their owner alone."""
    r = EmbeddedRedis(tmp_path / "redis").start()
    try:
        assert stat.S_IMODE(os.stat(r.data_dir).st_mode) == 0o700
        for name in ("url", "redis.conf"):
            assert stat.S_IMODE(os.stat(r.data_dir / name).st_mode) == 0o600
        assert (r.data_dir / "url").read_text().strip() == r.url
        cmdline = open(f"/proc/{r.pid}/cmdline", "rb").read()
        assert r.password.encode() not in cmdline
        stranger = redis.Redis(port=r.port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            stranger.get("tandem:config")
        assert run(with_store(r.url, lambda s: s.ping()))
    finally:
        r.stop()


def test_a_malformed_record_is_skipped_and_later_orphans_are_still_adopted(server):
    """A record that does not parse (damaged, or written by something else) is logged and
    skipped once; it must not stop the adoption of every orphan after it."""
    from types import SimpleNamespace

    from cluster.state import ACTIVE
    from router.controller import Controller

    adopted = []

    async def go():
        store = RedisStore(server.url, ttl_s=60)
        try:
            await store.create(record("orphan-b", owner="gone-router"))
            raw = redis.Redis.from_url(server.url)
            raw.hset(key("orphan-a"), mapping={"sampling": "{not json", "state": "RUNNING"})
            raw.sadd(ACTIVE, "orphan-a")
            router = SimpleNamespace(
                id="router-z",
                records=SimpleNamespace(store=store),
                drives=lambda rid: rid in {r.request_id for r in adopted},
                adopt=adopted.append,
            )
            controller = Controller(router, "127.0.0.1:1")
            await controller.adopt_orphans()
            await controller.adopt_orphans()  # a second round: skipped, not logged again
            return controller._malformed
        finally:
            await store.close()

    malformed = run(go())
    assert malformed == {"orphan-a"}
    ids = [r.request_id for r in adopted]  # (and the module's other orphans)
    assert "orphan-b" in ids and "orphan-a" not in ids and len(ids) == len(set(ids))


def test_tenant_changes_made_at_one_router_hold_at_every_router_and_after_a_restart(server):
    """Two routers' admission controls on one Redis: a change made through one (and a reset)
    is read by the other at its next sync, and by a router that starts later; a change that
    makes a bad policy reaches nobody; an entry the store holds that this version cannot
    read is left out alone, the others kept."""
    from cluster.state import TENANTS
    from router.admission.control import AdmissionControl
    from router.config import RouterConfig
    from router.metrics import RouterMetrics
    from router.tenant_policy import TenantsConfig

    base = RouterConfig(tenants=TenantsConfig(weight={"gold": 2.0}, tier={"gold": 1}))

    def admission(name):
        return AdmissionControl(base, RouterMetrics(name))

    async def go(store):
        a, b = admission("a"), admission("b")
        await a.change(store, {"gold": {"weight": 4.0, "tier": 0}, "free": {"max_wait_s": 3.0}})
        assert (a.tenants.policy("gold").weight, a.tenants.policy("gold").tier) == (4.0, 0)
        assert b.tenants.policy("gold").weight == 2.0  # not read yet
        await b.sync(store)
        assert (b.tenants.policy("gold").weight, b.tenants.policy("gold").tier) == (4.0, 0)
        assert b.tenants.policy("free").max_wait_s == 3.0
        with pytest.raises(ValueError, match="weight"):
            await b.change(store, {"gold": {"weight": -1.0}})
        await b.change(store, {"gold": {"tier": 2}}, resets=["free"])  # field by field
        await a.sync(store)
        assert (a.tenants.policy("gold").weight, a.tenants.policy("gold").tier) == (4.0, 2)
        assert a.tenants.policy("free").max_wait_s is None  # back to the config's
        late = admission("late")  # a router started (or restarted) since
        await late.sync(store)
        assert late.tenants.overrides == a.tenants.overrides == {"gold": {"weight": 4.0, "tier": 2}}
        # Written by some other version: that entry is left out, the rest still hold.
        await store.r.hset(TENANTS, "odd", '{"colour": "red"}')
        await store.change_tenants({}, [])
        await late.sync(store)
        assert late.tenants.policy("gold").tier == 2 and "odd" not in late.tenants.overrides
        await a.change(store, {}, resets=["gold", "odd"])
        await late.sync(store)
        assert late.tenants.policy("gold").weight == 2.0 and late.tenants.overrides == {}
        return True

    assert run(with_store(server.url, go))


def test_an_adopted_request_keeps_what_its_admission_promised(server):
    """The record keeps the request's predicted output and TPOT target: a router adopting it
    schedules it by them, with its tenant's policy as it stands now."""
    from dataclasses import replace as with_

    from router.admission.control import AdmissionControl
    from router.config import RouterConfig
    from router.metrics import RouterMetrics
    from router.tenant_policy import TenantsConfig

    async def go(store):
        await store.create(with_(record("promised"), predicted_tokens=37.5, tpot_slo_ms=40.0))
        await store.create(record("plain"))
        return await store.get("promised"), await store.get("plain")

    promised, plain = run(with_store(server.url, go))
    adm = AdmissionControl(
        RouterConfig(tenants=TenantsConfig(weight={"t": 3.0})), RouterMetrics("adopter")
    )
    t = adm.tenancy(promised)
    assert (t.tenant, t.weight, t.predicted_tokens, t.tpot_slo_ms) == ("t", 3.0, 37.5, 40.0)
    t = adm.tenancy(plain)
    assert (t.predicted_tokens, t.tpot_slo_ms) == (None, None)
