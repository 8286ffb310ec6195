"""Shared by the fault tests: a workload of concurrent streams, a way to strike while they run,
and the checks every fault test ends with (whole streams, free blocks, terminal records)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

from client import StreamResult, TandemClient, to_proto
from tests.integration.harness import CHATS, greedy
from workers.completion import GenerationRequest


def workload(n: int = 16, max_tokens: int = 80, sampled: int = 2) -> list[GenerationRequest]:
    """n chat streams, long enough to be cut mid-way; the last `sampled` are seeded and
    sampled at temperature 0.8, the rest greedy."""
    reqs = [
        greedy(CHATS[i % len(CHATS)] + f" ({i})", max_tokens, ignore_eos=True) for i in range(n)
    ]
    for i in range(n - sampled, n):
        sp = replace(reqs[i].sampling, temperature=0.8, seed=1000 + i)
        reqs[i] = replace(reqs[i], sampling=sp)
    return reqs


async def run_with_fault(
    client: TandemClient, requests, strike, when_tokens: int = 8, timeout_s: float = 300
) -> tuple[list[StreamResult], float]:
    """Start every request; once some stream has `when_tokens` tokens, call strike() (which
    may be async, and runs on the client's event loop: it must not block on it); return the
    results and the moment of the strike."""
    counts = [0] * len(requests)

    def counter(i):
        def on_chunk(m):
            counts[i] += len(m.token_ids)

        return on_chunk

    tasks = [
        asyncio.create_task(client.generate(to_proto(r), timeout_s=timeout_s, on_chunk=counter(i)))
        for i, r in enumerate(requests)
    ]
    deadline = time.monotonic() + timeout_s
    while max(counts) < when_tokens:
        assert time.monotonic() < deadline, "no stream got going"
        assert not all(t.done() for t in tasks), "every stream ended before the strike"
        await asyncio.sleep(0.01)
    t_strike = time.monotonic()
    out = strike()
    if asyncio.iscoroutine(out):
        await out
    return list(await asyncio.gather(*tasks)), t_strike


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


async def live_workers(client: TandemClient, pool: str) -> list[dict]:
    """The pool's live workers, as `tandem status --json` shows them (for use in strikes)."""
    from client import status_to_dict

    return [w for w in status_to_dict(await client.status())[pool] if w["alive"]]


def assert_whole(results: list[StreamResult], reference: list[list[int]]) -> None:
    """Every stream ended as a success, with exactly the tokens of the no-fault run."""
    for i, (r, want) in enumerate(zip(results, reference)):
        assert r.status == "OK", f"stream {i}: {r.status}: {r.error}"
        assert r.finish_reason in ("length", "stop"), f"stream {i}: {r.finish_reason}"
        assert r.token_ids == want, f"stream {i} differs from the no-fault run"


def wait_for(check, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f} s"
        time.sleep(0.2)


def assert_clean(status, active_ids, timeout_s: float = 60.0) -> dict:
    """G3: every live worker holds no KV block; and no request record is left non-terminal.
    `status` and `active_ids` are callables (read through whichever router survives)."""

    def all_free():
        s = status()
        workers = [w for w in s["prefill"] + s["decode"] if w["alive"]]
        done = all(
            w["kv_blocks_free"] == w["kv_blocks_total"] and w["running"] == 0 and w["reserved"] == 0
            for w in workers
        )
        return s if done else None

    s = wait_for(all_free, timeout_s, "all KV blocks free")
    wait_for(lambda: not active_ids(), timeout_s, "every record terminal")
    return s


def replayed_through_a_kill(cluster, requests, want, pid_of, pool: str = "decode") -> None:
    """The pool's lone worker struck mid-stream by killing `pid_of(worker)` (its own pid, or
    one of its tp ranks'): every stream ends whole and equal to `want` (G1, G2), the pool
    restarts once, and nothing is left held (G3)."""
    restarts = cluster.status()["pools"][pool]["restarts"]

    async def strike():
        [only] = await live_workers(cluster.client, pool)
        kill(pid_of(only))

    results, _ = cluster.run(run_with_fault(cluster.client, requests, strike), timeout=600)
    assert_whole(results, want)
    wait_for(
        lambda: cluster.status()["pools"][pool]["restarts"] == restarts + 1,
        240,
        f"the {pool} pool restarted once",
    )
    assert_clean(cluster.status, lambda: cluster.run(cluster.store.active()))
