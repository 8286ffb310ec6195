"""`tandem up`: start (or join) Ray, Redis, the pools and the router; stop on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from cluster.config import load_config


def add_up_parser(sub) -> None:
    up = sub.add_parser("up", help="start a cluster serving a model")
    up.add_argument("--config", help="YAML or TOML file of cluster config fields")
    up.add_argument("--model")
    up.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    up.add_argument("--device")
    up.add_argument("--prefill", type=int, help="prefill workers (default 1)")
    up.add_argument("--decode", type=int, help="decode workers (default 1)")
    up.add_argument("--mode", choices=("disaggregated", "colocated"))
    up.add_argument("--host")
    up.add_argument("--port", type=int, help="router port (default 50051; 0 picks one)")
    up.add_argument("--data-dir", dest="data_dir")
    up.add_argument("--redis-url", dest="redis_url")
    up.add_argument("--ray-address", dest="ray_address")
    up.add_argument("--no-dashboard", dest="dashboard", action="store_const", const=False)
    up.add_argument("--cpus-per-worker", dest="cpus_per_worker", type=float)
    up.add_argument("--kv-cache-gb", dest="kv_cache_gb", type=float)
    up.add_argument("--block-size", dest="block_size", type=int)
    up.add_argument("--auth-token", dest="auth_token")
    up.set_defaults(func=cmd_up)


_FIELDS = (
    "model",
    "dtype",
    "device",
    "prefill",
    "decode",
    "mode",
    "host",
    "port",
    "data_dir",
    "redis_url",
    "ray_address",
    "dashboard",
    "cpus_per_worker",
    "kv_cache_gb",
    "block_size",
    "auth_token",
)


def cmd_up(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, {k: getattr(args, k) for k in _FIELDS})
    except ValueError as e:
        print(f"tandem up: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg))


async def _serve(cfg) -> int:
    from cluster.cluster import Cluster

    def say(msg: str) -> None:
        print(f"[tandem] {msg}", file=sys.stderr, flush=True)

    cluster = Cluster(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        await cluster.start(progress=say)
    except Exception as e:
        say(f"start failed: {e}")
        await cluster.stop()
        return 1
    # After ray.init, which installs handlers of its own that would kill us mid-shutdown.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"tandem serving on {cluster.address} ({cfg.mode}); Ctrl-C to stop", flush=True)
    await stop.wait()
    say("shutting down")
    await cluster.stop()
    say("stopped")
    return 0
