"""What `tandem up` and `tandem router` run, started in order and stopped in reverse:

    tandem up:     Ray (started, or joined) -> Redis (embedded, or given) -> the two pools
                   -> a router (the first controller)
    tandem router: Ray (joined) -> Redis (given) -> the pools as they are -> another router

`tandem up` writes the cluster's config to Redis (no secret in it); a router that joins runs
on its own config, the same file and flags, and only checks it against that copy. Workers
are detached actors: they outlive any router, and only `tandem up`'s orderly stop removes
them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace
from pathlib import Path

import ray

from cluster import config_io
from cluster.actors import PoolSpec
from cluster.autoscale import Autoscaler
from cluster.config import REDIS_URL_ENV, ClusterConfig
from cluster.pools import NAMESPACE, PoolManager
from cluster.redis_server import EmbeddedRedis
from cluster.state import RedisStore, redact
from router.edge.http import OpenAIFront, start_http
from router.edge.keys import AUTH_TOKEN_ENV, router_keys
from router.edge.server import start_server
from router.edge.tls import ServerTLS
from router.requests.core import Router
from workers.messages import Pool
from workers.model.loader import DEFAULT_MODEL, read_model_config, resolve_model
from workers.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)
CONFIG_KEY = "config"


def init_ray(cfg: ClusterConfig, progress) -> bool:
    """Join cfg.ray_address or start a local Ray; True if this process started it."""
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TANDEM_CPU_KERNELS": os.environ.get("TANDEM_CPU_KERNELS", "1")}}
    if cfg.ray_address:
        progress(f"joining Ray at {cfg.ray_address}")
        _use_ray_token(cfg.ray_address)
        ray.init(address=cfg.ray_address, namespace=NAMESPACE, log_to_driver=True, runtime_env=env)
        return False
    cpus = cfg.ray_num_cpus or max(2, int(cfg.workers_cpus + 0.999))
    progress(f"starting Ray with {cpus} logical CPUs")
    more = {}
    if cfg.metrics_export_port is not None:
        more["_metrics_export_port"] = cfg.metrics_export_port
    for attempt in (1, 2):
        try:
            ray.init(
                num_cpus=cpus,
                include_dashboard=cfg.dashboard,
                namespace=NAMESPACE,
                runtime_env=env,
                **more,
            )
            return True
        except RuntimeError as e:
            # On a loaded machine Ray's GCS may not write its port file in time; its head is
            # then half started. A second start, after a clean shutdown, usually succeeds.
            if attempt == 2 or "Timed out waiting for file" not in str(e):
                raise
            progress(f"Ray's head did not start in time ({e}); starting it once more")
            ray.shutdown()
    raise AssertionError("unreachable")


def _use_ray_token(address: str) -> None:
    """Ray turns token auth on for `address="auto"` when a token exists, but not for an
    explicit address, which its clusters then refuse (InvalidAuthToken). Do the same for both:
    with RAY_AUTH_MODE unset and a token at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token), send it. A cluster without auth accepts it too."""
    if address == "auto" or "RAY_AUTH_MODE" in os.environ:
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if not (os.environ.get("RAY_AUTH_TOKEN") or Path(path).is_file()):
        return
    try:  # what Ray runs for "auto": sets the mode and refreshes its cached config
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except ImportError:  # another Ray version: the environment alone (read at ray.init)
        os.environ["RAY_AUTH_MODE"] = "token"


SECRET = "<not stored>"
# What every router of a cluster must agree on: how its workers run and how requests are
# admitted, placed and replayed. Each router's own address, keys and TLS files are its own.
SHARED_FIELDS = (
    "mode",
    "engine",
    "transfer_timeout_s",
    "prefill.cpus",
    "prefill.gpus",
    "prefill.resources",
    "prefill.max_replicas",
    "decode.cpus",
    "decode.gpus",
    "decode.resources",
    "decode.max_replicas",
    "router.replay",
    "router.max_retries",
    "router.local_prefill_max_tokens",
)


def _differences(theirs: dict, ours: dict, paths) -> list[tuple[str, object, object]]:
    """(path, theirs, ours) of each dotted path whose values differ, leaf by leaf."""
    out = []

    def get(d, path):
        for part in path.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d

    def walk(path, a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(f"{path}.{k}", a.get(k), b.get(k))
        elif a != b:
            out.append((path, a, b))

    for path in paths:
        walk(path, get(theirs, path), get(ours, path))
    return out


def shared_config(cfg: ClusterConfig, redis_url: str) -> dict:
    """The config as routers that join the cluster read it from Redis: no secret in it. The
    Redis URL loses its password (a joining router has its own URL), and the auth token is
    only marked as set, so that a router joining without keys of its own is refused."""
    stored = config_io.to_mapping(replace(cfg, redis=replace(cfg.redis, url=redact(redis_url))))
    # Set in the config or from TANDEM_AUTH_TOKEN alike: only that there is one.
    if stored["router"].get("auth_token") or os.environ.get(AUTH_TOKEN_ENV):
        stored["router"]["auth_token"] = SECRET
    return stored


class Cluster:
    def __init__(self, cfg: ClusterConfig, join: bool = False) -> None:
        """join=False: start the pools (tandem up); True: serve the pools that another
        `tandem up` started, on a config checked against the cluster's (tandem router)."""
        self.cfg = cfg
        self.join = join
        self.redis: EmbeddedRedis | None = None
        self.store: RedisStore | None = None
        self.pools: PoolManager | None = None
        self.router: Router | None = None
        self.server = None
        self.http = None  # the OpenAI-compatible front's runner, when router.http_port is set
        self.http_port: int | None = None
        self.controller = None
        self._tasks: list[asyncio.Task] = []  # the autoscaler's, while it runs
        self.port: int | None = None
        self._started_ray = False

    @property
    def address(self) -> str:
        return f"{self.cfg.router.host}:{self.port}"

    async def start(self, progress=print) -> Cluster:
        cfg = self.cfg
        # Keys and certificates read first: a bad file fails the start before anything runs.
        keys, tls = router_keys(cfg.router), ServerTLS.of(cfg.router)
        redis_url = cfg.redis.url or os.environ.get(REDIS_URL_ENV)
        if self.join:
            if not redis_url:
                raise ValueError("a joining router needs the cluster's --redis-url")
            self.store = RedisStore(redis_url, cfg.redis.ttl_s, cfg.redis.timeout_s)
            await self._check_joined(cfg, redis_url)
        src = resolve_model(cfg.engine.model)  # fail fast on a bad model, before anything
        model_cfg = read_model_config(src)
        self._started_ray = init_ray(cfg, progress)
        if self.store is None:
            if redis_url is None:
                self.redis = EmbeddedRedis(Path(cfg.data_dir) / "redis").start()
                redis_url = self.redis.url
                progress(
                    f"embedded Redis at {redact(redis_url)} (AOF in {self.redis.data_dir}; its "
                    f"URL with the password in {self.redis.url_file}, for `tandem router`)"
                )
            self.store = RedisStore(redis_url, cfg.redis.ttl_s, cfg.redis.timeout_s)
            await self.store.ping()
            await self.store.put_json(CONFIG_KEY, shared_config(cfg, redis_url))
        self.pools = PoolManager(
            {p: self._pool_spec(p) for p in cfg.pools},
            self.store.token_log(),
            # One machine: loopback. Joined to a Ray cluster: each worker's own node address.
            transfer_host=None if cfg.ray_address else _transfer_host(cfg.router.host),
            transfer_timeout_s=cfg.transfer_timeout_s,
            store=self.store,
            # A Ray cluster of several nodes may grow (KubeRay's autoscaler adds a pod for a
            # pending actor): there a worker waits for its resources; on a local Ray it
            # fails at once, naming what is short.
            pending_ok=bool(cfg.ray_address),
        )
        if self.join:
            progress("finding the cluster's workers")
            await self._discover_workers()
        else:
            counts = ", ".join(f"{cfg.pool(p).replicas} {p.value}" for p in cfg.pools)
            progress(f"starting {counts} workers ({cfg.mode})")
            await asyncio.gather(
                *[self.pools.spawn(p) for p in cfg.pools for _ in range(cfg.pool(p).replicas)]
            )
            await self.pools.save()
        self.router = Router(
            self.pools,
            Tokenizer(src),
            cfg.engine_for(Pool.DECODE).block_size,
            self.store,
            cfg.router,
            mode=cfg.mode,
        )
        await self.router.start()
        # The longest sequence the workers take: a longer one is refused here, as invalid.
        max_len = min(
            cfg.engine_for(p).context_len(model_cfg.max_position_embeddings) for p in cfg.pools
        )
        self.server, self.port, self.controller = await start_server(
            self.router,
            cfg.router.port,
            max_len,
            model_cfg.vocab_size,
            cfg.mode,
            keys,
            cfg.router.host,
            tls,
        )
        progress(f"router {self.router.id} listening on {self.address}")
        autoscale = {p: cfg.pool(p).autoscale for p in cfg.pools}
        if any(a.enabled for a in autoscale.values()):
            router = self.router
            scaler = Autoscaler(
                router.fleet.loads,
                router.metrics,
                self.pools,
                autoscale,
                lambda: self.controller.leader,
            )
            self._tasks.append(asyncio.get_running_loop().create_task(scaler.run_forever()))
            for p, a in autoscale.items():
                if a.enabled:
                    signal, target = a.resolved(p)
                    progress(
                        f"autoscaling the {p.value} pool on {signal} (target {target:g}), "
                        f"{a.min_replicas}..{a.max_replicas} workers"
                    )
        if cfg.router.http_port is not None:
            front = OpenAIFront(
                self.router,
                cfg.engine.model or DEFAULT_MODEL,
                max_len,
                model_cfg.vocab_size,
                keys,
            )
            self.http, self.http_port = await start_http(
                front, cfg.router.host, cfg.router.http_port, tls
            )
            scheme = "https" if tls is not None else "http"
            progress(f"OpenAI-compatible HTTP on {scheme}://{cfg.router.host}:{self.http_port}/v1")
        return self

    def _pool_spec(self, pool: Pool) -> PoolSpec:
        p = self.cfg.pool(pool)
        return PoolSpec(
            p.replicas,
            self.cfg.engine_for(pool),
            p.cpus,
            p.gpus,
            tuple(sorted(p.resources.items())),
            p.max_replicas,
        )

    async def _check_joined(self, cfg: ClusterConfig, redis_url: str) -> None:
        """A joining router runs on its own config (file and flags), never on what Redis
        holds, which anyone able to write there could have planted: the cluster's copy is only
        compared with it, and any difference in what the routers must agree on refuses the
        join, naming each field."""
        stored = await self.store.get_json(CONFIG_KEY)
        if stored is None:
            raise ValueError(
                f"no Tandem cluster config in Redis at {redact(redis_url)}: start the "
                "cluster with `tandem up` first, pointing it at this Redis"
            )
        mine = shared_config(cfg, redis_url)
        differ = [
            f"{path}: the cluster's {theirs!r}, this router's {ours!r}"
            for path, theirs, ours in _differences(stored, mine, SHARED_FIELDS)
        ]
        if differ:
            raise ValueError(
                "this router's config differs from the running cluster's (give it the "
                "cluster's config file and flags): " + "; ".join(differ)
            )
        theirs = stored["router"]
        if (theirs.get("auth_token") or theirs.get("api_keys_file")) and router_keys(
            cfg.router
        ) is None:
            raise ValueError(
                "the cluster's routers require API keys: give this one its own "
                "(--api-keys-file, or the TANDEM_AUTH_TOKEN environment variable)"
            )
        if theirs.get("tls_cert") and not cfg.router.tls_cert:
            raise ValueError(
                "the cluster's routers serve TLS: give this one its certificate and key "
                "(--tls-cert, --tls-key), or it would serve in the clear"
            )

    async def _discover_workers(self, timeout_s: float = 120.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            await self.pools.refresh()
            if all(self.pools.members(p) for p in self.cfg.pools):
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"found no live worker of every pool in {timeout_s:.0f} s")

    async def stop(self) -> None:
        if self.join and self.router is not None:
            self.router.leave()  # the cluster goes on: its requests are taken over, not cancelled
        if self.http is not None:
            await self.http.cleanup()
        if self.server is not None:
            await self.server.stop(grace=2)
        for t in self._tasks:
            t.cancel()
        if self.controller is not None:
            await self.controller.stop()
        if self.router is not None:
            await self.router.stop()
        if self.pools is not None and not self.join:
            await self.pools.stop_all()
        if self.store is not None:
            await self.store.close()
        if self.redis is not None:
            self.redis.stop()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _transfer_host(host: str) -> str:
    return host if host not in ("0.0.0.0", "::") else "127.0.0.1"
