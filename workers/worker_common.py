"""What prefill and decode actors share: engine construction from plain config, identity,
the engine loop, and the status every worker reports."""

from __future__ import annotations

import logging
import os
import socket

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams


def build_engine(engine_config: dict) -> LLMEngine:
    return LLMEngine(EngineConfig(**engine_config))


def sampling_from_dict(d: dict) -> SamplingParams:
    d = dict(d)
    for key in ("stop", "stop_token_ids"):
        if key in d:
            d[key] = tuple(d[key])
    return SamplingParams(**d)


def sampling_to_dict(sp: SamplingParams) -> dict:
    return {
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "seed": sp.seed,
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "logprobs": sp.logprobs,
    }


def node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def worker_status(name: str, engine: LLMEngine, draining: bool = False) -> dict:
    sched = engine.scheduler
    return {
        "name": name,
        "pid": os.getpid(),
        "node": node_address(),
        "alive": True,
        "kv_blocks_total": engine.pool.num_blocks,
        "kv_blocks_free": engine.pool.num_free_blocks,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "reserved": len(sched.reserved),
        "draining": draining,
    }


class WorkerBase:
    """A named worker around one engine, driven by one EngineLoop thread. Subclasses set up
    their own state, then call `start_loop` with their output handler."""

    def __init__(
        self, name: str, engine_config: dict, transfer_host: str, transfer_timeout_s: float
    ) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {name}: %(message)s")
        self.name = name
        self.engine = build_engine(engine_config)
        self.layout = self.engine.runner.layout
        self.device = self.engine.runner.device
        self.transfer_host = transfer_host
        self.transfer_timeout_s = transfer_timeout_s
        self.draining = False
        self.loop = None

    def start_loop(self, on_outputs) -> None:
        from workers.engine_loop import EngineLoop

        self.loop = EngineLoop(self.engine, on_outputs, name=f"{self.name}-loop").start()

    def status(self) -> dict:
        return self.loop.call(worker_status, self.name, self.engine, self.draining).result(10)

    def set_draining(self, draining: bool) -> None:
        """A draining worker takes no new requests and finishes the ones it has."""
        self.draining = draining
