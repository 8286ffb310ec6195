"""`tandem up`: start (or join) Ray, Redis, the pools and a router; stop on Ctrl-C/SIGTERM.
`tandem router`: serve one more router for a running cluster, on the cluster's config (its
own file and flags, checked against the cluster's copy in Redis); stopping it leaves the
cluster running."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from cluster.config import REDIS_URL_ENV

# What `tandem up` and `tandem router` print on stdout once they serve: then the address.
SERVING = "tandem serving on "
JOIN_PORT = 50052  # a joining router's default gRPC port, beside the first router's 50051


def add_up_parser(sub) -> None:
    from cluster.config import add_flags

    up = sub.add_parser(
        "up",
        help="start a cluster serving a model",
        description="Every config file field has a flag; flags win over the file.",
    )
    up.add_argument("--config", help="YAML or TOML file of cluster config fields")
    add_flags(up)
    up.set_defaults(func=cmd_up)


def add_router_parser(sub) -> None:
    from cluster.config import add_flags

    r = sub.add_parser(
        "router",
        help="serve another router for a running cluster",
        description="Joins the Ray cluster and the Redis of a cluster that `tandem up` "
        "started, finds its workers, and serves gRPC. Routers share the work: any of them "
        "resumes any request, and one of them at a time heals the pools and replays the "
        "requests of a router that died. It takes its config as `tandem up` does, from its "
        "own file and flags (give it the same): never from Redis, whose copy is only checked "
        "against it. --ray-address and --redis-url (or TANDEM_REDIS_URL, which keeps a "
        "password out of ps) are required.",
    )
    r.add_argument("--config", help="YAML or TOML file of cluster config fields")
    add_flags(r)
    r.set_defaults(func=cmd_router)


def cmd_up(args: argparse.Namespace) -> int:
    from cluster.config import load_config

    try:
        cfg = load_config(args.config, args)
    except ValueError as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg, join=False))


def cmd_router(args: argparse.Namespace) -> int:
    from cluster.config import load_config

    try:
        cfg = load_config(args.config, args)
    except ValueError as e:
        print(f"tandem router: {e}", file=sys.stderr)
        return 2
    # Where it listens is its own, never the file's (the first router's): --port (default
    # 50052) and --http-port (default none).
    given = vars(args)
    port = cfg.router.port if "cfg__router__port" in given else JOIN_PORT
    http_port = cfg.router.http_port if "cfg__router__http_port" in given else None
    cfg = replace(cfg, router=replace(cfg.router, port=port, http_port=http_port))
    if not cfg.ray_address:
        print("tandem router: give --ray-address, the cluster's Ray", file=sys.stderr)
        return 2
    if not (cfg.redis.url or os.environ.get(REDIS_URL_ENV)):
        print(f"tandem router: give --redis-url or {REDIS_URL_ENV}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg, join=True))


async def _serve(cfg, join: bool) -> int:
    from cluster.cluster import Cluster

    def say(msg: str) -> None:
        print(f"[tandem] {msg}", file=sys.stderr, flush=True)

    cluster = Cluster(cfg, join=join)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        await cluster.start(progress=say)
    except Exception as e:
        say(f"start failed: {type(e).__name__}: {e}")
        await cluster.stop()
        return 1
    # After ray.init, which installs handlers of its own that would kill us mid-shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if cluster._started_ray and cfg.dashboard:
        say(
            "Ray dashboard: http://127.0.0.1:8265 (it asks for Ray's token: "
            "`ray get-auth-token` prints it)"
        )
    print(f"{SERVING}{cluster.address} ({cluster.cfg.mode}); Ctrl-C to stop", flush=True)
    await stop.wait()
    say("shutting down")
    await cluster.stop()
    say("stopped")
    return 0


def spawn(argv: list[str], log_path: Path, timeout_s: float = 600.0, cwd=None):
    """Run `tandem ARGV` (up or router) in a process of its own, its stderr to `log_path`
    and its stdout beside it (`.out`); return the process and its address once it serves.
    RuntimeError if it exits or does not serve within timeout_s (then it is killed)."""
    log_path = Path(log_path)
    out_path = log_path.with_suffix(".out")
    with open(log_path, "w") as err, open(out_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", *argv], stdout=out, stderr=err, cwd=cwd
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in out_path.read_text().splitlines():
            if line.startswith(SERVING):
                return proc, line[len(SERVING) :].split()[0]
        if proc.poll() is not None:
            raise RuntimeError(f"tandem {argv[0]} exited with {proc.returncode}; see {log_path}")
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"tandem {argv[0]} did not serve within {timeout_s:.0f} s; see {log_path}")
