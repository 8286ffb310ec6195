"""How one worker of a pool is made: a named, detached Ray actor with its pool's resources, its
status calls and its engine-loop calls each in a concurrency group of its own. The pool
manager (cluster/pools.py) decides when; this module, how."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

import ray

from workers.engine.config import EngineConfig
from workers.messages import Pool, TokenLog

STATUS, LOOP = "status", "loop"  # the concurrency groups of WorkerBase.STATUS_CALLS, LOOP_CALLS


def actor_class(cls: type) -> type:
    """The worker class as its actor runs it: its status calls, and its calls that wait for
    the engine loop, each in a concurrency group of their own, on threads that its long calls
    (up to max_concurrency of them) cannot hold."""

    def grouped(fn, group: str):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            return fn(self, *args, **kwargs)

        return ray.method(concurrency_group=group)(call)

    methods = {name: grouped(getattr(cls, name), STATUS) for name in cls.STATUS_CALLS}
    methods |= {name: grouped(getattr(cls, name), LOOP) for name in cls.LOOP_CALLS}
    return type(cls.__name__, (cls,), {**methods, "__qualname__": cls.__qualname__})


@dataclass(frozen=True)
class PoolSpec:
    """How each worker of one pool is made."""

    replicas: int
    engine: EngineConfig
    cpus: float = 1.0
    gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()  # custom Ray resources per worker
    max_replicas: int = 64  # the most workers the pool may have


def create_actor(
    pool: Pool,
    name: str,
    spec: PoolSpec,
    namespace: str,
    token_log: TokenLog | None,
    transfer_host: str,
    transfer_timeout_s: float,
):
    """A new worker of `pool`, named, detached, with the spec's resources (ValueError if the
    name is taken)."""
    from workers.decode import DecodeWorker
    from workers.prefill import PrefillWorker

    kwargs = {
        "name": name,
        "engine_config": spec.engine,
        "transfer_host": transfer_host,
        "transfer_timeout_s": transfer_timeout_s,
    }
    if pool is Pool.DECODE:
        kwargs["token_log"] = token_log
    cls = PrefillWorker if pool is Pool.PREFILL else DecodeWorker
    return (
        ray.remote(concurrency_groups={STATUS: 2, LOOP: 8})(actor_class(cls))
        .options(
            name=name,
            namespace=namespace,
            lifetime="detached",
            num_cpus=spec.cpus,
            num_gpus=spec.gpus,
            resources=dict(spec.resources) or None,
            max_concurrency=64,
            max_restarts=0,
        )
        .remote(**kwargs)
    )


async def resources_free(spec: PoolSpec, pending_ok: bool, wait_s: float = 5.0) -> bool:
    """True once the Ray cluster has the resources a worker needs free. Past `wait_s` (a
    worker just stopped frees its resources a moment later): False when workers may wait for
    resources (`pending_ok`), else a ValueError naming the shortfall."""
    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources()
        needs = [("CPU", spec.cpus), ("GPU", spec.gpus), *spec.resources]
        short = [(k, n) for k, n in needs if n > 0 and free.get(k, 0.0) + 1e-9 < n]
        if not short:
            return True
        if time.monotonic() > deadline:
            if pending_ok:
                return False
            key, need = short[0]
            raise ValueError(
                f"not enough {key} in the Ray cluster for another worker: it needs "
                f"{need:g}, {free.get(key, 0.0):g} is free; add nodes or lower the "
                "pool's cpus/gpus/resources"
            )
        await asyncio.sleep(0.2)
