"""Cluster configuration: one frozen dataclass, read from a YAML or TOML file, overridden by
command-line flags, validated once with errors that name the field."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from workers.engine.config import DTYPES


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    mode: str = "disaggregated"  # or "colocated"
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: str = "./tandem-data"
    redis_url: str | None = None  # None: an embedded redis-server in data_dir
    ray_address: str | None = None  # None: start a local Ray
    ray_num_cpus: int | None = None  # logical CPUs of a local Ray (default: what the pools need)
    dashboard: bool = True
    auth_token: str | None = None
    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    enable_chunked_prefill: bool = True
    cpus_per_worker: float = 1.0
    # torch threads per worker on CPU (default: cpus_per_worker). Prefill is bursty: letting
    # it use more threads than its share speeds long prompts while decode waits less.
    prefill_threads: int | None = None
    decode_threads: int | None = None
    gpus_per_worker: float = 0.0
    transfer_timeout_s: float = 10.0
    max_in_flight: int = 256
    max_queue: int = 1024

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"config field {name}={getattr(self, name)!r}: {why}")

        if self.mode not in ("disaggregated", "colocated"):
            raise bad("mode", "choose disaggregated or colocated")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"choose from {', '.join(DTYPES)}")
        if self.mode == "disaggregated" and self.prefill < 1:
            raise bad("prefill", "a disaggregated cluster needs at least one prefill worker")
        if self.decode < 1:
            raise bad("decode", "at least one decode worker is needed")
        if not 0 <= self.port < 65536:
            raise bad("port", "must be a TCP port (0 picks a free one)")
        for name in ("cpus_per_worker", "transfer_timeout_s", "kv_cache_gb"):
            if getattr(self, name) <= 0:
                raise bad(name, "must be positive")

    @property
    def workers_cpus(self) -> float:
        n = self.decode + (self.prefill if self.mode == "disaggregated" else 0)
        return n * self.cpus_per_worker

    def engine_config(self, pool: str = "decode") -> dict:
        threads = self.prefill_threads if pool == "prefill" else self.decode_threads
        if threads is None:
            threads = max(1, int(self.cpus_per_worker))
        return {
            "model": self.model,
            "dtype": self.dtype,
            "device": self.device,
            "block_size": self.block_size,
            "kv_cache_memory_gb": self.kv_cache_gb,
            "num_kv_blocks": self.num_kv_blocks,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "prefill_chunk_size": self.prefill_chunk_size,
            "enable_chunked_prefill": self.enable_chunked_prefill,
            "num_threads": threads if self.device == "cpu" else None,
        }


def load_config(path: str | None, overrides: dict) -> ClusterConfig:
    """File values first, then every override that is not None."""
    values: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"{p}: no such config file")
        text = p.read_text()
        try:
            values = tomllib.loads(text) if p.suffix == ".toml" else (yaml.safe_load(text) or {})
        except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
            raise ValueError(f"{p}: cannot parse ({e})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{p}: expected a mapping of config fields")
    known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{path}: unknown config field(s) {', '.join(sorted(unknown))}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ClusterConfig(**values)
