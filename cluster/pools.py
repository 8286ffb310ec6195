"""The prefill and decode pools: named Ray actors with declared resources, spawned, scaled,
drained and stopped here. Names are stable (`prefill-0`, `decode-1`, ...), so the Ray
dashboard tells the pools and their members apart."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import ray

from workers.decode import DecodeWorker
from workers.prefill import PrefillWorker

log = logging.getLogger(__name__)
NAMESPACE = "tandem"
POOLS = ("prefill", "decode")


@dataclass
class WorkerRef:
    name: str
    pool: str
    handle: ray.actor.ActorHandle
    info: dict = field(default_factory=dict)
    alive: bool = True
    draining: bool = False


@dataclass(frozen=True)
class PoolConfig:
    engine_configs: dict  # pool name -> engine config dict
    redis_url: str | None
    transfer_host: str = "127.0.0.1"
    transfer_timeout_s: float = 10.0
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    start_timeout_s: float = 300.0


class PoolManager:
    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.workers: dict[str, dict[str, WorkerRef]] = {p: {} for p in POOLS}
        self.listeners: list = []  # called with (event, WorkerRef): "added" / "removed"

    def members(self, pool: str, include_dead: bool = False) -> list[WorkerRef]:
        return [w for w in self.workers[pool].values() if include_dead or w.alive]

    def get(self, name: str) -> WorkerRef | None:
        for pool in POOLS:
            if name in self.workers[pool]:
                return self.workers[pool][name]
        return None

    async def spawn(self, pool: str) -> WorkerRef:
        if pool not in POOLS:
            raise ValueError(f"pool {pool!r} is unknown (prefill or decode)")
        self._check_resources()
        taken = set(self.workers[pool])
        name = next(f"{pool}-{i}" for i in range(len(taken) + 1) if f"{pool}-{i}" not in taken)
        cls = PrefillWorker if pool == "prefill" else DecodeWorker
        kwargs = {
            "name": name,
            "engine_config": self.cfg.engine_configs[pool],
            "transfer_host": self.cfg.transfer_host,
            "transfer_timeout_s": self.cfg.transfer_timeout_s,
        }
        if pool == "decode":
            kwargs["redis_url"] = self.cfg.redis_url
        actor = (
            ray.remote(cls)
            .options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=self.cfg.cpus_per_worker,
                num_gpus=self.cfg.gpus_per_worker,
                max_concurrency=64,
                max_restarts=0,
            )
            .remote(**kwargs)
        )
        ref = WorkerRef(name, pool, actor)
        self.workers[pool][name] = ref
        try:
            ref.info = await asyncio.wait_for(actor.info.remote(), self.cfg.start_timeout_s)
        except Exception:
            del self.workers[pool][name]
            ray.kill(actor, no_restart=True)
            raise
        ref.info["handle"] = actor
        log.info("started %s", name)
        for fn in self.listeners:
            fn("added", ref)
        return ref

    def _check_resources(self) -> None:
        """Fail now, naming the shortfall, rather than leave an actor pending for resources."""
        free = ray.available_resources()
        for key, need in (("CPU", self.cfg.cpus_per_worker), ("GPU", self.cfg.gpus_per_worker)):
            if need > 0 and free.get(key, 0.0) + 1e-9 < need:
                raise ValueError(
                    f"not enough {key} in the Ray cluster for another worker: it needs "
                    f"{need:g}, {free.get(key, 0.0):g} is free; add nodes or lower "
                    "cpus_per_worker/gpus_per_worker"
                )

    async def scale(self, pool: str, replicas: int, drain_timeout_s: float = 60.0) -> list[str]:
        if replicas < 0:
            raise ValueError(f"replicas={replicas}: must be >= 0")
        live = self.members(pool)
        if replicas > len(live):
            await asyncio.gather(*(self.spawn(pool) for _ in range(replicas - len(live))))
        for w in sorted(live, key=lambda w: w.name, reverse=True)[: max(0, len(live) - replicas)]:
            await self.drain(w.name, drain_timeout_s)
        return [w.name for w in self.members(pool)]

    async def drain(self, name: str, timeout_s: float) -> tuple[bool, str]:
        """Stop routing to a worker, wait for its requests to end, then stop it."""
        w = self.get(name)
        if w is None:
            return False, f"no worker named {name}"
        w.draining = True
        await w.handle.set_draining.remote(True)
        deadline = asyncio.get_running_loop().time() + timeout_s
        idle = False
        while asyncio.get_running_loop().time() < deadline:
            s = await w.handle.status.remote()
            if s["running"] == 0 and s["waiting"] == 0 and s.get("reserved", 0) == 0:
                idle = True
                break
            await asyncio.sleep(0.2)
        await self.remove(name)
        return (
            idle,
            "drained" if idle else f"stopped with requests still running after {timeout_s}s",
        )

    async def remove(self, name: str) -> None:
        w = self.get(name)
        if w is None:
            return
        w.alive = False
        del self.workers[w.pool][name]
        for fn in self.listeners:
            fn("removed", w)
        try:
            await asyncio.wait_for(w.handle.shutdown.remote(), 10)
        except Exception:
            pass
        ray.kill(w.handle, no_restart=True)

    def mark_dead(self, name: str) -> None:
        w = self.get(name)
        if w is not None and w.alive:
            w.alive = False
            log.warning("%s is dead", name)
            for fn in self.listeners:
                fn("dead", w)

    async def stop_all(self) -> None:
        for pool in POOLS:
            for name in list(self.workers[pool]):
                await self.remove(name)
