"""Whole-cluster failures: a decode worker killed mid-stream, the pool scaled back up, and
`tandem up` stopped with SIGTERM. Tiny random Llama, real Ray, Redis and gRPC."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from cluster.config import ClusterConfig
from router.api import tandem_pb2 as pb
from tests.integration.harness import ClusterHarness

pytestmark = [pytest.mark.fault, pytest.mark.integration]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    h = ClusterHarness(
        ClusterConfig(
            model=str(tiny_llama_dir),
            port=0,
            dashboard=False,
            num_kv_blocks=128,
            block_size=4,
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


def test_killed_decode_worker_ends_streams_with_unavailable_then_scale_recovers(cluster):
    async def go():
        got, code = 0, None
        t_kill = None
        try:
            async for m in cluster.client.gen.Generate(long_request(), timeout=120):
                got += len(m.token_ids)
                if got >= 3 and t_kill is None:
                    pid = (await cluster.client.status()).decode[0].pid
                    os.kill(pid, signal.SIGKILL)
                    t_kill = time.monotonic()
        except Exception as e:  # grpc.aio.AioRpcError
            code = e.code().name
        return got, code, time.monotonic() - t_kill

    got, code, after_kill = cluster.run(go())
    assert code == "UNAVAILABLE" and got < 480
    assert after_kill < 30, f"the stream hung {after_kill:.1f} s after the kill"
    s = cluster.status()
    assert [w["alive"] for w in s["decode"]] == [False]

    r = cluster.run(cluster.client.generate(pb.GenerateRequest(prompt="hi"), timeout_s=30))
    assert r.status == "UNAVAILABLE"

    async def scale():
        return await cluster.client.admin.Scale(
            pb.ScaleRequest(pool="decode", replicas=1), timeout=300
        )

    assert list(cluster.run(scale(), timeout=330).workers) == ["decode-1"]
    r = cluster.run(
        cluster.client.generate(
            pb.GenerateRequest(
                prompt_ids=[5, 6, 7],
                sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            ),
            timeout_s=60,
        )
    )
    assert r.status == "OK" and len(r.token_ids) == 4


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
        except Exception as e:
            too_many = (e.code().name, e.details())
        names = [w.name for w in (await cluster.client.status()).decode if w.alive]
        drained = await admin.Drain(pb.DrainRequest(worker=names[-1], timeout_s=30), timeout=60)
        after = [w.name for w in (await cluster.client.status()).decode if w.alive]
        missing = None
        try:
            await admin.Drain(pb.DrainRequest(worker="decode-99"), timeout=30)
        except Exception as e:
            missing = e.code().name
        return names, drained, after, missing, too_many

    names, drained, after, missing, too_many = cluster.run(go(), timeout=400)
    assert too_many[0] == "RESOURCE_EXHAUSTED" and "not enough CPU" in too_many[1]
    assert len(names) == 2 and drained.drained and names[-1] not in after and len(after) == 1
    assert missing == "NOT_FOUND"
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
