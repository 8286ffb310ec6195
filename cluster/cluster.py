"""Everything `tandem up` runs, started in order and stopped in reverse:
Ray (started, or joined), Redis (embedded, or given), the two pools, the router."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import ray

from cluster.config import ClusterConfig
from cluster.pools import PoolConfig, PoolManager
from cluster.redis_server import EmbeddedRedis
from cluster.state import StateStore
from router.core import Router, RouterConfig
from router.server import start_server
from workers.model.loader import read_model_config, resolve_model
from workers.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.redis: EmbeddedRedis | None = None
        self.pools: PoolManager | None = None
        self.router: Router | None = None
        self.server = None
        self.port: int | None = None
        self._started_ray = False

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self, progress=print) -> Cluster:
        cfg = self.cfg
        src = resolve_model(cfg.model)  # fail fast on a bad model, before starting anything
        model_cfg = read_model_config(src)
        if not ray.is_initialized():
            if cfg.ray_address:
                progress(f"joining Ray at {cfg.ray_address}")
                ray.init(address=cfg.ray_address, namespace="tandem", log_to_driver=True)
            else:
                cpus = cfg.ray_num_cpus or max(2, int(cfg.workers_cpus + 0.999))
                progress(f"starting Ray with {cpus} logical CPUs")
                ray.init(
                    num_cpus=cpus,
                    include_dashboard=cfg.dashboard,
                    namespace="tandem",
                    runtime_env={
                        "env_vars": {
                            "TANDEM_CPU_KERNELS": os.environ.get("TANDEM_CPU_KERNELS", "1")
                        }
                    },
                )
            self._started_ray = True
        redis_url = cfg.redis_url
        if redis_url is None:
            self.redis = EmbeddedRedis(Path(cfg.data_dir) / "redis").start()
            redis_url = self.redis.url
            progress(f"embedded Redis at {redis_url} (AOF in {self.redis.data_dir})")
        state = StateStore(redis_url)
        state.ping()
        self.pools = PoolManager(
            PoolConfig(
                engine_configs={p: cfg.engine_config(p) for p in ("prefill", "decode")},
                redis_url=redis_url,
                transfer_host=cfg.host if cfg.host != "0.0.0.0" else "127.0.0.1",
                transfer_timeout_s=cfg.transfer_timeout_s,
                cpus_per_worker=cfg.cpus_per_worker,
                gpus_per_worker=cfg.gpus_per_worker,
            )
        )
        n_prefill = cfg.prefill if cfg.mode == "disaggregated" else 0
        progress(f"starting {n_prefill} prefill and {cfg.decode} decode workers ({cfg.mode})")
        await asyncio.gather(
            *[self.pools.spawn("prefill") for _ in range(n_prefill)],
            *[self.pools.spawn("decode") for _ in range(cfg.decode)],
        )
        tokenizer = Tokenizer(src)
        max_len = model_cfg.max_position_embeddings
        self.router = Router(
            self.pools,
            tokenizer,
            cfg.block_size,
            state,
            RouterConfig(max_in_flight=cfg.max_in_flight, max_queue=cfg.max_queue),
            mode=cfg.mode,
        )
        await self.router.start()
        self.server, self.port = await start_server(
            self.router, cfg.port, max_len, model_cfg.vocab_size, cfg.mode, cfg.auth_token, cfg.host
        )
        progress(f"router listening on {self.address}")
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=2)
        if self.router is not None:
            await self.router.stop()
        if self.pools is not None:
            await self.pools.stop_all()
        if self.redis is not None:
            self.redis.stop()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
