"""KV handoff failures with real Ray actors and real processes killed: a layout mismatch is
refused before any bytes move, and a transfer to a dead peer is reported within its
timeout, never hung. Uses a tiny random Llama so workers start in seconds."""

import os
import signal
import time

import pytest
import ray

from workers.decode import DecodeWorker
from workers.engine.config import EngineConfig
from workers.engine.request import FinishReason, SamplingParams
from workers.messages import DecodeEndpoint, PrefillJob, RequestSpec, Status
from workers.prefill import PrefillWorker

pytestmark = [pytest.mark.fault, pytest.mark.integration]
TIMEOUT = 3.0


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(
        num_cpus=4, include_dashboard=False, namespace="tandem-fault-tests", log_to_driver=False
    )
    yield
    ray.shutdown()


def engine_cfg(folder, block_size=4):
    return EngineConfig(model=str(folder), num_kv_blocks=64, block_size=block_size, num_threads=1)


def start(cls, name, folder, block_size=4):
    kwargs = {
        "name": name,
        "engine_config": engine_cfg(folder, block_size),
        "transfer_host": "127.0.0.1",
        "transfer_timeout_s": TIMEOUT,
    }
    actor = ray.remote(cls).options(name=name, num_cpus=1, max_concurrency=16).remote(**kwargs)
    info = ray.get(actor.info.remote(), timeout=120)
    if info.endpoint is None:
        return actor, None
    return actor, DecodeEndpoint(name, info.endpoint.host, info.endpoint.port, actor)


def job(rid, endpoint, n=10):
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, seed=1)
    return PrefillJob(RequestSpec(rid, tuple(range(100, 100 + n)), sp, router_id="test"), endpoint)


def reserve(decode, rid, n=10):
    return ray.get(decode.reserve.remote(rid, 1, n, "test", 60.0))


def drain_events(decode, rid, timeout=30):
    deadline = time.monotonic() + timeout
    events = []
    while time.monotonic() < deadline:
        events += [e for e in ray.get(decode.poll.remote("test", 0.5)) if e.request_id == rid]
        if any(e.finished for e in events):
            return events
    raise AssertionError(f"no final event for {rid} in {timeout} s")


def all_free(actor) -> bool:
    s = ray.get(actor.status.remote(), timeout=10)
    return s.kv_blocks_free == s.kv_blocks_total and s.idle


def test_handoff_succeeds_then_layout_mismatch_is_refused(tiny_llama_dir):
    prefill, _ = start(PrefillWorker, "p-layout", tiny_llama_dir)
    decode, dinfo = start(DecodeWorker, "d-ok", tiny_llama_dir)
    assert reserve(decode, "ok-1") is not None
    first = ray.get(prefill.prefill.remote(job("ok-1", dinfo)), timeout=60)
    assert first.ok and len(first.first) == 1
    assert ray.get(prefill.push_result.remote("ok-1"), timeout=30).ok
    events = drain_events(decode, "ok-1")
    tokens = [t for e in events for t in e.token_ids]
    assert tokens[0] == first.first[0].token_id and len(tokens) == 5  # the first, then 4 decoded
    assert [e.offset for e in events] == sorted(e.offset for e in events)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert all_free(decode) and all_free(prefill)

    odd, oinfo = start(DecodeWorker, "d-odd", tiny_llama_dir, block_size=8)
    assert reserve(odd, "mm-1") is not None
    ray.get(prefill.prefill.remote(job("mm-1", oinfo)), timeout=60)
    result = ray.get(prefill.push_result.remote("mm-1"), timeout=30)
    assert not result.ok and "block_size: 8 here, 4 there" in result.error
    final = drain_events(odd, "mm-1")[-1]
    assert final.status is Status.UNAVAILABLE and "KV layouts differ" in final.error
    assert all_free(odd)  # the refused reservation was given back
    assert all_free(prefill)  # and the sender released the blocks it held for the push
    for a in (prefill, decode, odd):
        ray.kill(a)


def test_transfer_to_a_killed_peer_times_out_and_is_reported(tiny_llama_dir):
    prefill, _ = start(PrefillWorker, "p-kill", tiny_llama_dir)
    decode, dinfo = start(DecodeWorker, "d-kill", tiny_llama_dir)
    assert reserve(decode, "k-1") is not None
    ray.get(prefill.prefill.remote(job("k-1", dinfo)), timeout=60)
    assert ray.get(prefill.push_result.remote("k-1"), timeout=30).ok  # the pair is formed
    os.kill(ray.get(decode.status.remote()).pid, signal.SIGKILL)

    t0 = time.monotonic()
    first = ray.get(prefill.prefill.remote(job("k-2", dinfo)), timeout=60)
    assert first.ok  # prefill itself does not depend on the peer
    result = ray.get(prefill.push_result.remote("k-2", 60), timeout=90)
    elapsed = time.monotonic() - t0
    assert not result.ok and "d-kill" in result.error
    assert elapsed < 4 * TIMEOUT + 10, f"took {elapsed:.1f} s"
    # The prefill worker is still healthy and holds no block for the failed request: the
    # blocks it kept for the push went back (they stay only as evictable prefix cache).
    assert all_free(prefill)
    again = ray.get(prefill.prefill.remote(job("k-3", dinfo)), timeout=60)
    assert again.ok and again.first == first.first
    ray.kill(prefill)
