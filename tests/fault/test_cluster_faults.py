"""Whole-cluster failures: a decode worker killed mid-stream, the pool scaled back up, and
`tandem up` stopped with SIGTERM. Tiny random Llama, real Ray, Redis and gRPC."""

import os
import select
import signal
import subprocess
import sys
import time

import grpc
import pytest

from router.api import tandem_pb2 as pb
from tests.integration.harness import ClusterHarness, cluster_config

pytestmark = [pytest.mark.fault, pytest.mark.integration]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    h = ClusterHarness(
        cluster_config(
            engine={"model": str(tiny_llama_dir), "num_kv_blocks": 128, "block_size": 4},
            router={"port": 0},
            dashboard=False,
            transfer_timeout_s=3,
            ray_num_cpus=3,  # room for one more worker, and no more
            data_dir=str(tmp_path_factory.mktemp("data")),
        )
    )
    yield h
    h.stop()


def long_request():
    return pb.GenerateRequest(
        prompt_ids=list(range(100, 120)),
        sampling=pb.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True),
    )


def test_killed_lone_decode_worker_is_replaced_and_its_stream_ends_whole(cluster):
    """With one decode worker, its death leaves no one to replay on until the pool heals:
    the replacement starts by itself and the stream goes on, token-exact."""
    want = cluster.run(cluster.client.generate(long_request(), timeout_s=120))
    assert want.status == "OK" and len(want.token_ids) == 480

    async def go():
        got, t_kill = [], None
        async for m in cluster.client.gen.Generate(long_request(), timeout=180):
            got += m.token_ids
            if len(got) >= 3 and t_kill is None:
                pid = (await cluster.client.status()).decode[0].pid
                os.kill(pid, signal.SIGKILL)
                t_kill = time.monotonic()
            if m.HasField("final"):
                return got, m.final, time.monotonic() - t_kill

    got, final, after_kill = cluster.run(go(), timeout=240)
    assert got == want.token_ids and final.finish_reason == "length"  # whole, exactly once
    assert after_kill < 120
    s = cluster.status()
    assert s["pools"]["decode"] == {
        "target": 1,
        "live": 1,
        "starting": 0,
        "restarts": 1,
        "autoscale": "",
    }
    assert [w["name"] for w in s["decode"] if w["alive"]] == ["decode-1"]
    assert s["router"]["replays_total"] >= 1 and s["router"]["replays_recovered"] >= 1


def test_tandem_up_serves_and_stops_on_sigterm(tiny_llama_dir, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "up",
            "--model",
            str(tiny_llama_dir),
            "--port",
            "0",
            "--no-dashboard",
            "--data-dir",
            str(tmp_path),
            "--block-size",
            "4",
            "--kv-cache-gb",
            "0.05",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        address, deadline = None, time.monotonic() + 240
        while address is None and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if line.startswith("tandem serving on "):
                    address = line.split()[3]
            assert proc.poll() is None, proc.stderr.read()
        assert address, "tandem up did not report its address"
        gen = subprocess.run(
            [
                sys.executable,
                "-m",
                "cluster.cli",
                "generate",
                "--address",
                address,
                "--json",
                "hello",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0
        assert "stopped" in proc.stderr.read()
        assert (tmp_path / "redis" / "appendonlydir").exists()  # AOF in the data dir
    finally:
        if proc.poll() is None:
            proc.kill()


def test_drain_stops_routing_then_removes_the_worker(cluster):
    async def go():
        admin = cluster.client.admin
        await admin.Scale(pb.ScaleRequest(pool="decode", replicas=2), timeout=300)
        too_many = None
        try:  # a third decode worker does not fit in 3 logical CPUs: refused, not pending
            await admin.Scale(pb.ScaleRequest(pool="decode", replicas=3), timeout=60)
        except grpc.aio.AioRpcError as e:
            too_many = (e.code().name, e.details())
        names = [w.name for w in (await cluster.client.status()).decode if w.alive]
        drained = await admin.Drain(pb.DrainRequest(worker=names[-1], timeout_s=30), timeout=60)
        after = [w.name for w in (await cluster.client.status()).decode if w.alive]
        missing = None
        try:
            await admin.Drain(pb.DrainRequest(worker="decode-99"), timeout=30)
        except grpc.aio.AioRpcError as e:
            missing = e.code().name
        return names, drained, after, missing, too_many

    names, drained, after, missing, too_many = cluster.run(go(), timeout=400)
    assert too_many[0] == "RESOURCE_EXHAUSTED" and "not enough CPU" in too_many[1]
    assert len(names) == 2 and drained.drained and names[-1] not in after and len(after) == 1
    assert missing == "NOT_FOUND"
    cluster.run(cluster.cluster.pools.heal())  # a drained worker is not "healed" back
    s = cluster.status()
    assert s["pools"]["decode"]["target"] == 1 and s["pools"]["decode"]["live"] == 1
    r = cluster.run(
        cluster.client.generate(
            pb.GenerateRequest(
                prompt_ids=[5, 6, 7],
                sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
            ),
            timeout_s=60,
        )
    )
    assert r.status == "OK" and len(r.token_ids) == 3


def test_past_the_retry_limit_a_stream_fails_with_every_cause(cluster):
    """max_retries=1: the first decode worker's death is replayed, the second's is not. The
    stream ends UNAVAILABLE naming both causes, never as a short success, and the record
    says FAILED with both."""
    from dataclasses import replace

    from router.records.store import RecordState
    from tests.fault.faults import wait_for

    router = cluster.cluster.router
    router.config = replace(router.config, max_retries=1)
    try:

        async def go():
            admin = cluster.client.admin
            await admin.Scale(pb.ScaleRequest(pool="decode", replicas=2), timeout=300)
            killed, got, error = [], 0, None
            try:
                async for m in cluster.client.gen.Generate(long_request(), timeout=180):
                    got += len(m.token_ids)
                    if got >= 3 * (len(killed) + 1) and len(killed) < 2:
                        s = await cluster.client.status()
                        busy = [w for w in s.decode if w.alive and w.running]
                        if busy:
                            killed.append(busy[0].name)
                            os.kill(busy[0].pid, signal.SIGKILL)
                    rid = m.request_id
            except grpc.aio.AioRpcError as e:
                error = (e.code().name, e.details())
            return rid, killed, got, error

        rid, killed, got, error = cluster.run(go(), timeout=400)
    finally:
        router.config = replace(router.config, max_retries=3)
    assert len(killed) == 2 and got < 480
    assert error[0] == "UNAVAILABLE" and "gave up after 2 attempts" in error[1], error
    assert all(name in error[1] for name in killed), error
    rec = wait_for(  # the router writes the end behind the stream
        lambda: (r := cluster.run(cluster.store.get(rid))).state.terminal and r, 30, "the end"
    )
    assert rec.state is RecordState.FAILED and rec.attempt == 2
    assert rec.failures == tuple(f"attempt {i + 1}: {n} died" for i, n in enumerate(killed))


def test_status_answers_within_a_second_naming_a_stopped_worker_unresponsive(cluster, tmp_path):
    """A worker stopped with SIGSTOP is alive but silent. `tandem status` is what an SRE runs
    then: it answers within its 1 s deadline, and names that worker unresponsive, with its
    last known figures, rather than waiting for it."""
    import json

    from client import status_to_dict

    async def status():  # with a 1 s deadline: past it, gRPC fails the call
        return status_to_dict(await cluster.client.admin.Status(pb.StatusRequest(), timeout=1.0))

    prefill = cluster.status()["prefill"][0]
    os.kill(prefill["pid"], signal.SIGSTOP)
    try:
        shown = None
        for _ in range(20):  # the first status after the stop may still have its answer
            s = cluster.run(status())
            [shown] = [w for w in s["prefill"] if w["name"] == prefill["name"]]
            if shown["unresponsive_s"] > 0:
                break
        assert shown["alive"] and shown["unresponsive_s"] > 0
        assert shown["kv_blocks_total"] == prefill["kv_blocks_total"]  # its last answer
        assert all(w["unresponsive_s"] == 0 for w in s["decode"])
        cli = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "status", "--address", cluster.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        [line] = [ln for ln in cli.stdout.splitlines() if ln.startswith(prefill["name"])]
        assert "UNRESPONSIVE" in line
        as_json = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "status", "--address", cluster.address, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        [w] = [w for w in json.loads(as_json.stdout)["prefill"] if w["name"] == prefill["name"]]
        assert w["unresponsive_s"] > 0
    finally:
        os.kill(prefill["pid"], signal.SIGCONT)
