"""Chaos: the serving trace at a steady rate while workers and a router are killed.

    python benchmarks/chaos.py [--rate 1.0] [--limit 70] [--kills decode@15,prefill@35,router@55]

The cluster: 1 prefill + 2 decode workers, and two routers, each in its own process, both
joined to a Ray cluster and a Redis that this process runs: router A (`tandem up`, which
starts the pools) and router B (`tandem router`). Clients send to A and resume on B. First
the trace runs with no fault, for the reference outputs; then it runs again while, at set
times, the busiest decode worker, the prefill worker and router A are killed (SIGKILL).

It reports: requests completed whole / total; requests whose tokens differ from the no-fault
run (any token repeated, missing or different: goal none); per kill, the recovery time of
each request it interrupted, from the kill to that request's next token (p50, max), as the
client sees it; the routers' own measure (failure seen -> next token); and a plot of ITL over
time with the kills marked. Greedy, fp32 by default, so outputs are exactly comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, ROOT, export_default_model, log, print_table  # noqa: E402
from benchmarks.serving import load_trace, trace_request  # noqa: E402
from client import fetch_status  # noqa: E402
from cluster.cli_up import spawn  # noqa: E402


async def run_trace(addresses: list[str], trace: list[dict], t0: float, paced: bool) -> list[dict]:
    from client import TandemClient

    client = TandemClient(addresses)

    async def one(i: int, r: dict) -> dict:
        if paced:
            await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
        start = time.perf_counter()
        times: list[float] = []
        msg = trace_request(r, f"chaos-{int(t0)}-{i}")
        res = await client.generate(
            msg,
            timeout_s=900,
            on_chunk=lambda m: times.extend([time.perf_counter()] * len(m.token_ids)),
        )
        return {
            "id": msg.request_id,
            "ok": res.status == "OK",
            "status": res.status,
            "error": res.error,
            "tokens": res.token_ids,
            "times": [t - t0 for t in times],
            "start": start - t0,
            "resumes": res.resumes,
        }

    try:
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
    finally:
        await client.close()


async def strike(kind: str, at: float, t0: float, procs: dict, addr_b: str, out: list) -> None:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    s = await fetch_status(addr_b)
    if kind == "decode":
        victim = max((w for w in s["decode"] if w["alive"]), key=lambda w: w["running"])
        name, pid = victim["name"], victim["pid"]
    elif kind == "prefill":
        victim = next(w for w in s["prefill"] if w["alive"])
        name, pid = victim["name"], victim["pid"]
    else:
        name, pid = "router A", procs["a"].pid
        try:  # what A measured of the earlier kills, before it goes
            out.append({"router_a": (await fetch_status(procs["addr_a"]))["router"]})
        except Exception as e:  # it may already be unreachable
            log(f"could not read router A's status: {e}")
    os.kill(pid, signal.SIGKILL)
    out.append({"kind": kind, "name": name, "at": time.perf_counter() - t0})
    log(f"[chaos] t={time.perf_counter() - t0:5.1f} s: killed {name} (pid {pid})")


def recoveries(kill: dict, records: list[dict], failures: dict[str, list[str]]) -> list[float]:
    """Kill -> next token, for each request the kill interrupted: one that had started and not
    ended at the kill, and (for a worker) whose record names that worker among its failures;
    for a router, every request in flight through it."""
    at, out = kill["at"], []
    for r in records:
        if not r["times"] or r["start"] > at or r["times"][-1] < at:
            continue
        if kill["kind"] != "router" and not any(kill["name"] in f for f in failures[r["id"]]):
            continue
        nxt = next((t for t in r["times"] if t > at), None)
        if nxt is not None:
            out.append(nxt - at)
    return out


async def read_failures(redis_url: str, ids: list[str]) -> dict[str, list[str]]:
    from cluster.state import RedisStore

    store = RedisStore(redis_url)
    try:
        out = {}
        for i in ids:
            rec = await store.get(i)
            out[i] = list(rec.failures) if rec else []
        return out
    finally:
        await store.close()


def plot(records: list[dict], kills: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    for r in records:
        ts = r["times"]
        ax.scatter(ts[1:], [1000 * (b - a) for a, b in zip(ts, ts[1:])], s=2, color="tab:blue")
    for k in kills:
        ax.axvline(k["at"], color="red", alpha=0.6)
        ax.text(
            k["at"],
            0.97,
            f" {k['name']}",
            color="red",
            fontsize=8,
            transform=ax.get_xaxis_transform(),
            va="top",
        )
    ax.set_yscale("log")
    ax.set_xlabel("seconds into the trace")
    ax.set_ylabel("inter-token latency, ms")
    ax.set_title("ITL over time; red: kills (SIGKILL)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def amain(args) -> dict:
    import ray

    from cluster.redis_server import EmbeddedRedis

    model_dir = export_default_model(RESULTS / "smollm2-135m-instruct-hf")
    trace = load_trace(Path(args.workload), model_dir, args.rate, 1.0, args.seed, args.limit)
    log(f"trace: {len(trace)} requests over {trace[-1]['at']:.0f} s at {args.rate}/s")
    data = RESULTS / "chaos-data"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    redis = EmbeddedRedis(data / "redis").start()
    procs: dict = {}
    try:
        gcs = ray.get_runtime_context().gcs_address
        # Both routers get the same config: a joining router checks its own against the
        # cluster's.
        common = ["--ray-address", gcs, "--redis-url", redis.url, "--port", "0",
                  "--model", str(model_dir), "--dtype", args.dtype]  # fmt: skip
        up = ["up", *common, "--decode", "2"]
        procs["a"], procs["addr_a"] = spawn(up, data.parent / "chaos-router-a.log", cwd=ROOT)
        procs["b"], addr_b = spawn(
            ["router", *common], data.parent / "chaos-router-b.log", cwd=ROOT
        )
        addresses = [procs["addr_a"], addr_b]
        log("[chaos] reference run (no fault, all requests at once)")
        reference = await run_trace(addresses, trace, time.perf_counter(), paced=False)
        kills_at = [(k.split("@")[0], float(k.split("@")[1])) for k in args.kills.split(",")]
        log(f"[chaos] chaos run: kills {kills_at}")
        t0 = time.perf_counter()
        kills: list[dict] = []
        strikes = [
            asyncio.create_task(strike(k, at, t0, procs, addr_b, kills)) for k, at in kills_at
        ]
        records = await run_trace(addresses, trace, t0, paced=True)
        await asyncio.gather(*strikes)
        failures = await read_failures(redis.url, [r["id"] for r in records])
        final = await fetch_status(addr_b)
    finally:
        for p in (procs.get("a"), procs.get("b")):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        ray.shutdown()
        redis.stop()
    router_a = next((k["router_a"] for k in kills if "router_a" in k), {})
    kills = [k for k in kills if "kind" in k]
    whole = sum(1 for r, ref in zip(records, reference) if r["ok"] and r["tokens"] == ref["tokens"])
    wrong = sum(1 for r, ref in zip(records, reference) if r["ok"] and r["tokens"] != ref["tokens"])
    result = {
        "requests": len(records),
        "completed_whole": whole,
        "completed_wrong": wrong,
        "failed": [r["error"] for r in records if not r["ok"]],
        "reference_failed": sum(1 for r in reference if not r["ok"]),
        "resumed_streams": sum(1 for r in records if r["resumes"]),
        "kills": [],
        "router_a_measured": router_a,
        "router_b_measured": final["router"],
        "pools_after": final["pools"],
    }
    for k in kills:
        rec = recoveries(k, records, failures)
        result["kills"].append(
            {
                **k,
                "interrupted": len(rec),
                "recovery_p50_s": statistics.median(rec) if rec else None,
                "recovery_max_s": max(rec) if rec else None,
            }
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps({"args": vars(args), **result}, indent=2))
    plot(records, kills, RESULTS / "chaos_itl.png")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default=str(ROOT / "benchmarks/workloads/serving_default.jsonl"))
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--limit", type=int, default=70, help="requests from the workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kills", default="decode@15,prefill@35,router@55")
    args = p.parse_args()
    r = asyncio.run(amain(args))
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(
        f"requests completed whole: {r['completed_whole']}/{r['requests']}; with any token "
        f"repeated, missing or different: {r['completed_wrong']}; failed: {len(r['failed'])}; "
        f"streams resumed on router B: {r['resumed_streams']}"
    )
    print_table(
        ["kill", "at s", "interrupted", "recovery p50 s", "recovery max s"],
        [
            [
                k["name"],
                f"{k['at']:.1f}",
                k["interrupted"],
                fmt(k["recovery_p50_s"]),
                fmt(k["recovery_max_s"]),
            ]
            for k in r["kills"]
        ],
    )
    a = r["router_a_measured"]
    if a:
        print(
            f"router A's own measure (failure seen -> next token): p50 {a['recovery_p50_s']:.2f} s,"
            f" max {a['recovery_max_s']:.2f} s over {a['replays_recovered']} replays"
        )
    b = r["router_b_measured"]
    print(
        f"router B's own measure: p50 {b['recovery_p50_s']:.2f} s, max {b['recovery_max_s']:.2f} s "
        f"over {b['replays_recovered']} replays; pools after: {r['pools_after']}"
    )
    print(f"wrote {RESULTS / 'chaos.json'} and {RESULTS / 'chaos_itl.png'}")


if __name__ == "__main__":
    main()
