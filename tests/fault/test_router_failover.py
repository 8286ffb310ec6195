"""Routers are not a single point of failure. This test's process runs Ray and Redis only;
`tandem up` (router A, which starts the pools) and `tandem router` (router B) are separate
processes joining Ray by its explicit address (with Ray's token auth on). Router A is killed
(SIGKILL) while 12 greedy streams of SmolLM2 run through it: the workers outlive it, every
client resumes on B and gets its whole output, equal to the no-fault run; B takes over the
controller lease. Then a decode worker is killed while its requests' router is dead: B adopts
those requests and replays them from the token log."""

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest
import ray

from client import TandemClient, fetch_status, to_proto
from cluster.cli_up import spawn
from cluster.redis_server import EmbeddedRedis
from tests.fault.faults import assert_clean, assert_whole, kill, run_with_fault, wait_for, workload

pytestmark = [pytest.mark.fault, pytest.mark.integration, pytest.mark.timeout(900)]
REQUESTS = workload(12, max_tokens=80, sampled=0)


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failover")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    gcs = ray.get_runtime_context().gcs_address  # an explicit address, not "auto"
    redis = EmbeddedRedis(tmp / "redis").start()
    procs = []
    try:
        # Every router of the cluster is given the same config (they check it at join).
        common = ["--ray-address", gcs, "--redis-url", redis.url, "--port", "0", "--dtype",
                  "float32", "--num-kv-blocks", "640", "--prefill-cpus", "0.5",
                  "--decode-cpus", "0.5"]  # fmt: skip
        a, addr_a = spawn(["up", *common, "--decode", "2"], tmp / "router-a.log", timeout_s=300)
        procs.append(a)
        b, addr_b = spawn(["router", *common], tmp / "router-b.log", timeout_s=300)
        procs.append(b)
        yield {"a": a, "b": b, "addr_a": addr_a, "addr_b": addr_b, "redis": redis, "common": common}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        ray.shutdown()  # the local Ray this process started: its detached workers go with it
        redis.stop()


def tenants(address: str, *args: str) -> dict:
    """`tandem tenants` against one router, its --json answer as {tenant: policy}."""
    out = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "tenants", "--address", address, "--json", *args],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return {t["name"]: t for t in json.loads(out.stdout)["tenants"]}


def test_a_tenant_change_at_one_router_holds_at_the_other(routers):
    """`tandem tenants --set` sent to router A: router B (another process, on the same Redis)
    runs by it from its next controller round; `--reset` sent to B takes it off both."""
    a, b = routers["addr_a"], routers["addr_b"]
    gold = tenants(a, "--set", "gold", "weight=4,tier=0,tokens_per_minute=60000")["gold"]
    assert (gold["weight"], gold["tier"], gold["tokens_per_minute"]) == (4, 0, 60000)
    wait_for(lambda: tenants(b).get("gold", {}).get("weight") == 4, 30, "router B's gold weight 4")
    assert tenants(b)["gold"]["tier"] == 0
    assert "gold" not in tenants(b, "--reset", "gold")  # back to the config's: not named
    wait_for(lambda: "gold" not in tenants(a), 30, "router A's gold reset")


def test_a_cancel_sent_to_another_router_ends_the_stream_at_once(routers):
    """A stream runs through router A; its cancel goes to router B, which does not drive it.
    B cancels it on its decode worker, and the worker's last event tells A, whose stream ends
    "cancelled" then. (A used to hear nothing, give up on the decode worker after
    stall_timeout_s, and replay the cancelled request to its end.)"""
    from workers.completion import GenerationRequest
    from workers.engine.request import SamplingParams

    req = GenerationRequest(
        prompt="Count from one to a thousand, in words.",
        sampling=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
    )

    async def go():
        a, b = TandemClient(routers["addr_a"]), TandemClient(routers["addr_b"])
        got = []
        try:
            task = asyncio.create_task(
                a.generate(
                    to_proto(req, "cross-cancel"),
                    timeout_s=60,
                    on_chunk=lambda m: got.extend(m.token_ids),
                )
            )
            for _ in range(3000):  # bounded: 30 s
                if len(got) >= 5 or task.done():
                    break
                await asyncio.sleep(0.01)
            assert await b.cancel("cross-cancel")
            return await task
        finally:
            await a.close()
            await b.close()

    r = asyncio.run(go())
    assert (r.status, r.finish_reason) == ("OK", "cancelled"), (r.status, r.finish_reason, r.error)
    assert 5 <= len(r.token_ids) < 400

    def status():
        return asyncio.run(fetch_status(routers["addr_a"]))

    assert status()["router"]["replays_total"] == 0
    assert_clean(status, lambda: asyncio.run(active(routers)))


def test_router_killed_mid_stream_clients_resume_on_another(routers):
    async def go():
        client = TandemClient([routers["addr_a"], routers["addr_b"]])
        try:
            reference = await asyncio.gather(
                *(client.generate(to_proto(r), timeout_s=300) for r in REQUESTS)
            )
            results, _ = await run_with_fault(
                client, REQUESTS, lambda: kill(routers["a"].pid), when_tokens=10
            )
            return [r.token_ids for r in reference], results
        finally:
            await client.close()

    reference, results = asyncio.run(go())
    assert_whole(results, reference)
    assert all(r.resumes >= 1 for r in results), "a stream did not move to router B"

    def status():
        return asyncio.run(fetch_status(routers["addr_b"]))

    s = wait_for(
        lambda: (st := status())["router"]["controller"] and st,
        30,
        "router B holding the controller lease",
    )
    assert s["pools"]["decode"]["live"] == 2 and s["pools"]["prefill"]["live"] == 1

    assert_clean(status, lambda: asyncio.run(active(routers)))


async def active(routers) -> list[str]:
    from cluster.state import RedisStore

    store = RedisStore(routers["redis"].url)
    try:
        return await store.active()
    finally:
        await store.close()


def test_requests_of_a_dead_router_are_replayed_when_their_worker_dies(routers):
    """Router C takes requests, dies; then their decode worker dies. Router B, the
    controller, adopts them and replays them from the token log; their clients resume on B."""
    c, addr_c = spawn(
        ["router", *routers["common"]], routers["redis"].data_dir / "router-c.log", timeout_s=300
    )

    async def go():
        client = TandemClient([addr_c, routers["addr_b"]])
        try:
            reference = await asyncio.gather(
                *(client.generate(to_proto(r), timeout_s=300) for r in REQUESTS)
            )

            async def strike():
                kill(c.pid)
                s = await fetch_status(routers["addr_b"])
                busiest = max((w for w in s["decode"] if w["alive"]), key=lambda w: w["running"])
                os.kill(busiest["pid"], signal.SIGKILL)

            results, _ = await run_with_fault(client, REQUESTS, strike, when_tokens=10)
            return [r.token_ids for r in reference], results
        finally:
            await client.close()

    try:
        reference, results = asyncio.run(go())
    finally:
        if c.poll() is None:
            c.kill()
    assert_whole(results, reference)
    records = asyncio.run(read_records(routers["redis"].url, [r.request_id for r in results]))
    adopted = [f for rec in records for f in rec.failures if "its router is gone" in f]
    assert adopted, "no request was adopted and replayed by router B"
    assert_clean(
        lambda: asyncio.run(fetch_status(routers["addr_b"])), lambda: asyncio.run(active(routers))
    )


async def read_records(url: str, ids: list[str]):
    from cluster.state import RedisStore

    store = RedisStore(url)
    try:
        return [await store.get(i) for i in ids]
    finally:
        await store.close()
