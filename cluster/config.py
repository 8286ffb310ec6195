"""The cluster's configuration: one tree of frozen dataclasses. `ClusterConfig` nests the
engine's, each pool's, the router's and Redis's; the scheduler's derives from the engine's.
The config file (YAML or TOML) and the flags of `tandem up` are both generated from these
fields (cluster/config_io.py), and validated once, with errors that name the field.

    mode: disaggregated
    engine: {dtype: bfloat16, kv_cache_gb: 1.0}
    prefill: {replicas: 1, threads: 2, engine: {prefill_chunk_size: 1024}}
    decode: {replicas: 1, engine: {max_num_seqs: 128}}
    router: {port: 50051}
    redis: {url: null}          # null: an embedded redis-server in data_dir
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, replace

from cluster import config_io
from router.config import Mode, RouterConfig
from workers.engine.config import EngineConfig, described
from workers.messages import Pool

# The signals a pool may scale on, and each one's default target (per worker).
SIGNALS = {
    Pool.PREFILL: {"queued_prefill_tokens": 2048.0, "ttft_p90": 1.0},
    Pool.DECODE: {"kv_blocks_used": 0.7, "tpot_p90": 0.1},
}


@dataclass(frozen=True)
class AutoscaleConfig:
    """Off unless enabled. Every second the controller router reads the pool's signal; once
    three readings in a row call for the same change, the pool is sized to ceil(workers x
    signal / target) within [min_replicas, max_replicas], shrinking one worker at a time (by
    draining), and never within cooldown_s of its last change (or of the controller's
    start)."""

    enabled: bool = field(default=False, metadata=described("size the pool on its signal"))
    min_replicas: int = field(default=1, metadata=described("fewest workers"))
    max_replicas: int = field(default=4, metadata=described("most workers"))
    signal: str = field(
        default="",
        metadata=described(
            "prefill: queued_prefill_tokens (per worker) or ttft_p90 (s); decode: "
            "kv_blocks_used (fraction) or tpot_p90 (s) (default: the first)"
        ),
    )
    target: float = field(
        default=0.0,
        metadata=described("the signal's value to hold (default: 2048 tokens, 1 s, 0.7, 0.1 s)"),
    )
    cooldown_s: float = field(
        default=60.0,
        metadata=described("seconds between two changes of the pool (against flapping)"),
    )
    drain_timeout_s: float = field(
        default=300.0,
        metadata=described("how long a worker being removed may finish its requests before replay"),
    )

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas}, max_replicas={self.max_replicas}: "
                "need 1 <= min_replicas <= max_replicas"
            )
        if self.target < 0 or self.cooldown_s < 0 or self.drain_timeout_s <= 0:
            raise ValueError(
                f"target={self.target}, cooldown_s={self.cooldown_s}: must be >= 0; "
                f"drain_timeout_s={self.drain_timeout_s}: must be > 0"
            )

    def resolved(self, pool: Pool) -> tuple[str, float]:
        """(signal, target) with the pool's defaults filled in."""
        signal = self.signal or next(iter(SIGNALS[pool]))
        return signal, self.target or SIGNALS[pool][signal]


# Engine fields a pool cannot set for itself: the cluster serves one model, and a pool's
# device follows from its GPUs.
CLUSTER_WIDE = ("model", "device")
# What a KV handoff carries blocks of: the two pools of a disaggregated cluster must agree.
KV_LAYOUT = ("dtype", "kv_cache_dtype", "block_size")


def _engine_overrides() -> type:
    """`EngineOverrides`: each engine field but CLUSTER_WIDE's, unset (None) by default, for
    a pool's `engine:` section, which overrides the shared one field by field."""
    hints = typing.get_type_hints(EngineConfig)
    fields = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in CLUSTER_WIDE:
            continue
        meta = dict(f.metadata)
        meta["help"] = f"{meta.get('help', '')} (this pool's; default: engine.{f.name})"
        fields.append((f.name, hints[f.name] | None, field(default=None, metadata=meta)))
    cls = dataclasses.make_dataclass("EngineOverrides", fields, frozen=True)
    cls.__module__ = __name__  # where pickle finds it (a config crosses to Ray actors)
    return cls


EngineOverrides = _engine_overrides()


def _set_fields(overrides) -> list[str]:
    """The fields a pool's engine section sets (None: the shared section's value)."""
    return [f.name for f in dataclasses.fields(overrides) if getattr(overrides, f.name) is not None]


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = field(
        default=1, metadata=described("workers in the pool", aliases=("--{section}",))
    )
    cpus: float = field(default=1.0, metadata=described("Ray CPUs each worker declares"))
    gpus: float = field(
        default=0.0,
        metadata=described(
            "Ray GPUs each worker declares: 0, or whole GPUs (a worker on CUDA needs one of "
            "its own; with engine.device auto, gpus >= 1 puts the pool on CUDA)"
        ),
    )
    threads: int | None = field(
        default=None, metadata=described("torch threads per worker on CPU (default: its cpus)")
    )
    resources: dict[str, float] = field(
        default_factory=dict,
        metadata=described(
            "custom Ray resources each worker needs, e.g. prefill=1 (name=value,...)"
        ),
    )
    max_replicas: int = field(
        default=64,
        metadata=described(
            "the most workers the pool may have: a larger Scale is refused, and a larger "
            "target found in the store is cut to it"
        ),
    )
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    engine: EngineOverrides = field(default_factory=EngineOverrides)

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas={self.replicas}: must be >= 0")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas={self.max_replicas}: must be >= 1")
        if self.replicas > self.max_replicas:
            raise ValueError(
                f"replicas={self.replicas}: more than max_replicas={self.max_replicas}"
            )
        if self.autoscale.enabled and self.autoscale.max_replicas > self.max_replicas:
            raise ValueError(
                f"autoscale.max_replicas={self.autoscale.max_replicas}: more than "
                f"max_replicas={self.max_replicas}"
            )
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError(f"cpus={self.cpus}, gpus={self.gpus}: must be >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads}: must be >= 1")
        for k, v in self.resources.items():
            if v < 0:
                raise ValueError(f"resources[{k!r}]={v}: must be >= 0")


REDIS_URL_ENV = "TANDEM_REDIS_URL"


@dataclass(frozen=True)
class RedisConfig:
    url: str | None = field(
        default=None,
        metadata=described(
            "redis:// or rediss:// URL, with a password if it needs one (default: the "
            "TANDEM_REDIS_URL environment variable, which keeps the password out of files and "
            "ps; else an embedded redis-server with AOF in data_dir)"
        ),
    )
    ttl_s: int = field(default=3600, metadata=described("how long ended requests stay in Redis"))
    timeout_s: float = field(default=5.0, metadata=described("socket timeout of every Redis call"))

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url={self.url!r}: use redis://, rediss:// or unix://")
        if self.ttl_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"ttl_s={self.ttl_s}, timeout_s={self.timeout_s}: must be positive")


@dataclass(frozen=True)
class ClusterConfig:
    mode: Mode = field(
        default=Mode.DISAGGREGATED,
        metadata=described("split prefill and decode into two pools, or run both in one"),
    )
    data_dir: str = field(
        default="./tandem-data", metadata=described("where the embedded Redis keeps its AOF")
    )
    ray_address: str | None = field(
        default=None, metadata=described("join this Ray cluster (default: start a local one)")
    )
    ray_num_cpus: int | None = field(
        default=None,
        metadata=described("logical CPUs of a local Ray (default: what the pools need)"),
    )
    dashboard: bool = field(default=True, metadata=described("start the Ray dashboard"))
    metrics_export_port: int | None = field(
        default=None,
        metadata=described(
            "port of a local Ray's Prometheus endpoint, Tandem's series included "
            "(default: one Ray picks; a joined Ray keeps its own)"
        ),
    )
    transfer_timeout_s: float = field(
        default=10.0, metadata=described("longest wait of any KV rendezvous, send or receive")
    )
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"config field {name}: {why}")

        if self.mode not in tuple(Mode):
            raise bad("mode", f"{self.mode!r}: choose {' or '.join(Mode)}")
        object.__setattr__(self, "mode", Mode(self.mode))  # a name given in code, as a Mode
        if self.mode is Mode.DISAGGREGATED and self.prefill.replicas < 1:
            raise bad("prefill.replicas", "a disaggregated cluster needs a prefill worker")
        if self.decode.replicas < 1:
            raise bad("decode.replicas", "at least one decode worker is needed")
        if self.transfer_timeout_s <= 0:
            raise bad("transfer_timeout_s", "must be positive")
        for pool in (Pool.PREFILL, Pool.DECODE):
            a = self.pool(pool).autoscale
            if a.signal and a.signal not in SIGNALS[pool]:
                raise bad(
                    f"{pool.value}.autoscale.signal",
                    f"{a.signal!r}: choose {' or '.join(SIGNALS[pool])}",
                )
        if self.metrics_export_port is not None and not 0 < self.metrics_export_port < 65536:
            raise bad("metrics_export_port", "must be a TCP port")
        engines = self._pool_engines(bad)
        self._check_devices(engines, bad)
        self._check_layouts(engines, bad)

    def _pool_engines(self, bad) -> dict[Pool, EngineConfig]:
        """Each pool's engine, the shared section with its own fields over it, checked (an
        error names the pool's section if it sets anything, else the shared one); tp > 1 in
        colocated mode only."""
        if self.mode is not Mode.DISAGGREGATED and _set_fields(self.prefill.engine):
            raise bad(
                "prefill.engine",
                f"{', '.join(_set_fields(self.prefill.engine))}: a colocated cluster has no "
                "prefill pool (its one pool is decode's: set decode.engine)",
            )
        engines = {}
        for pool in self.pools:
            try:
                engines[pool] = self.engine_for(pool)
            except ValueError as e:
                where = f"{pool.value}.engine" if _set_fields(self.pool(pool).engine) else "engine"
                raise bad(where, str(e)) from None
            tp = engines[pool].tp
            own = self.pool(pool).engine.tp is not None
            name = f"{pool.value}.engine.tp" if own else "engine.tp"
            if tp > 1 and self.mode is Mode.DISAGGREGATED:
                raise bad(
                    name,
                    f"{tp}: a disaggregated cluster's workers run one rank each for now (the "
                    "KV handoff between rank layouts is not built); tp > 1 runs in colocated "
                    "mode and offline (tandem generate --offline --tp N)",
                )

        return engines

    def _check_layouts(self, engines: dict[Pool, EngineConfig], bad) -> None:
        """The two pools of a disaggregated cluster agree on what the KV handoff carries."""
        if self.mode is not Mode.DISAGGREGATED:
            return
        prefill, decode = engines[Pool.PREFILL], engines[Pool.DECODE]
        for name in KV_LAYOUT:
            mine, theirs = getattr(prefill, name), getattr(decode, name)
            if mine != theirs:
                # Named where it was set: the pool that set it (prefill's, if both did).
                pool = "prefill" if getattr(self.prefill.engine, name) is not None else "decode"
                other = "decode" if pool == "prefill" else "prefill"
                here, there = (mine, theirs) if pool == "prefill" else (theirs, mine)
                raise bad(
                    f"{pool}.engine.{name}",
                    f"{here!r} against the {other} pool's {there!r}: a KV handoff carries "
                    f"blocks of one layout, so both pools need one {name} (set engine.{name})",
                )

    def _check_devices(self, engines: dict[Pool, EngineConfig], bad) -> None:
        """Each worker's device follows from the engine's and its pool's GPUs. A CUDA worker
        needs a whole GPU of its own: Ray hides GPUs from an actor that declares none (or, in
        some versions, shows it every GPU, so that all of them use GPU 0), and two ranks of a
        KV pair on one GPU are refused by NCCL ("Duplicate GPU detected"). Both pools must
        land on the same kind of device: a pair group is NCCL or gloo on both sides."""
        device = self.engine.device
        kinds = {}
        for pool in self.pools:
            gpus = self.pool(pool).gpus
            name = f"{pool.value}.gpus"
            if gpus and (gpus < 1 or not float(gpus).is_integer()):
                raise bad(
                    name,
                    f"{gpus:g}: GPUs are whole per worker (a fraction shares a GPU, and NCCL "
                    "refuses two ranks of a pair on one GPU)",
                )
            if device.startswith("cuda") and gpus < 1:
                raise bad(name, f"{gpus:g}: engine.device={device!r} needs gpus >= 1 per worker")
            tp = engines[pool].tp
            if gpus > 1 and tp == 1:
                raise bad(
                    name,
                    f"{gpus:g}: a worker of tp 1 runs its model on one GPU, so it would hold "
                    "GPUs it never uses; add workers instead"
                    + (" (or set its engine.tp)" if self.mode is not Mode.DISAGGREGATED else ""),
                )
            if device == "cpu" and gpus:
                raise bad(name, f"{gpus:g}: engine.device='cpu' would hold GPUs it never uses")
            if tp > 1 and gpus and gpus != tp:
                raise bad(name, f"{gpus:g}: a worker of tp {tp} runs a rank per GPU: {tp}")
            if tp > 1 and not gpus and self.pool(pool).cpus < tp:
                raise bad(
                    f"{pool.value}.cpus",
                    f"{self.pool(pool).cpus:g}: a worker of tp {tp} runs {tp} processes on the "
                    f"CPU, so it declares at least {tp} CPUs",
                )
            index = int(device.partition(":")[2] or 0)
            if device.startswith("cuda") and index + tp > gpus:
                raise bad(
                    "engine.device",
                    f"{device!r}: a worker sees only the {gpus:g} GPU(s) Ray gives it, as "
                    f"cuda:0..{gpus - 1:g} ({name})"
                    + (f", and its {tp} ranks take {tp} from its index on" if tp > 1 else ""),
                )
            kinds[pool] = engines[pool].device.partition(":")[0]
        if len(set(kinds.values())) > 1:
            raise bad(
                "decode.gpus",
                f"the prefill pool runs on {kinds[Pool.PREFILL]} and the decode pool on "
                f"{kinds[Pool.DECODE]}: both must be on one kind of device (give both pools "
                "GPUs, or neither)",
            )

    def engine_for(self, pool: Pool) -> EngineConfig:
        """The engine config a worker of this pool runs: the shared `engine:` section with
        the pool's own `engine:` fields over it; device and block size resolved
        (device auto: CUDA if the pool declares GPUs), threads on CPU, no decode graphs on
        prefill workers. A dtype left auto on CUDA stays so: the worker picks it for its own
        GPU (bf16 from sm80, else fp16), which the machine reading the config may not have."""
        p = self.pool(pool)
        own = {k: getattr(p.engine, k) for k in _set_fields(p.engine)}
        shared = replace(self.engine, **own) if own else self.engine
        engine = shared.resolve(cuda=p.gpus >= 1)
        if engine.device != "cpu" and shared.dtype == "auto":
            engine = replace(engine, dtype="auto")
        if pool is Pool.PREFILL and self.mode is Mode.DISAGGREGATED:
            # A prefill worker stops each request at its first token: it never runs a step of
            # decodes alone, and graphs captured for one would hold memory for nothing.
            engine = replace(engine, cuda_graphs=False)
            if engine.device != "cpu":
                # Nor has it decodes to pace: on a GPU a whole prompt (up to the step's token
                # budget) goes in one step, one pass over the weights, at the matmuls' pace.
                # On a CPU a long prompt's step would hold the short ones behind it for
                # seconds: there its chunks stay as configured.
                whole = max(engine.prefill_chunk_size, engine.max_num_batched_tokens)
                engine = replace(engine, prefill_chunk_size=whole)
        if engine.device != "cpu":
            return engine
        if engine.tp > 1:  # num_threads is per rank; the worker's threads are shared out
            per_rank = engine.num_threads or max(1, (p.threads or int(p.cpus)) // engine.tp)
            return replace(engine, num_threads=per_rank)
        return replace(engine, num_threads=p.threads or engine.num_threads or max(1, int(p.cpus)))

    def pool(self, pool: Pool) -> PoolConfig:
        return self.prefill if pool is Pool.PREFILL else self.decode

    @property
    def pools(self) -> tuple[Pool, ...]:
        return (Pool.PREFILL, Pool.DECODE) if self.mode is Mode.DISAGGREGATED else (Pool.DECODE,)

    @property
    def workers_cpus(self) -> float:
        return sum(self.pool(p).replicas * self.pool(p).cpus for p in self.pools)


# Sections whose flags carry no prefix: `--block-size`, `--port` (engine and router fields).
FLAT = frozenset({"engine", "router"})


def add_flags(parser) -> None:
    config_io.add_flags(parser, ClusterConfig, FLAT, title="cluster config (file fields)")


def load_config(path: str | None, args=None) -> ClusterConfig:
    """The file's values, then the flags given (if any): validated once."""
    overrides = config_io.overrides_from_args(ClusterConfig, args) if args is not None else {}
    return config_io.load(ClusterConfig, path, overrides)
