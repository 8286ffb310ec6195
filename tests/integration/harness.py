"""Runs a real cluster (Ray, Redis, gRPC on loopback) on a background event loop, so that
plain synchronous tests can drive it."""

from __future__ import annotations

import asyncio
import threading

from cluster.cluster import Cluster
from cluster.config import ClusterConfig
from router.client import TandemClient, to_proto
from workers.completion import GenerationRequest
from workers.engine.request import SamplingParams


def cluster_config(**values) -> ClusterConfig:
    """A ClusterConfig from nested values, as a config file would give them."""
    from cluster import config_io

    return config_io.build(ClusterConfig, values, "test config")


def one_by_one(
    data_dir: str, engine: dict | None = None, key: str | None = None, **router
) -> ClusterHarness:
    """One prefill and one decode worker with 256 KV blocks each, the router on free ports
    (plus `engine` and `router` fields, e.g. http_port=0); the harness's client sends `key`."""
    return ClusterHarness(
        cluster_config(
            router={"port": 0, **router},
            dashboard=False,
            engine={"num_kv_blocks": 256, **(engine or {})},
            data_dir=data_dir,
        ),
        key,
    )


class ClusterHarness:
    def __init__(self, cfg: ClusterConfig, key: str | None = None) -> None:
        self.key = key
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = Cluster(cfg)
        self.run(self.cluster.start(progress=lambda m: None), timeout=600)
        self.client = self.run(self._client())

    async def _client(self) -> TandemClient:
        return TandemClient(self.cluster.address, self.key)

    @property
    def address(self) -> str:
        return self.cluster.address

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate_many(self, requests: list[GenerationRequest], timeout_s: float = 300):
        async def all_of():
            return await asyncio.gather(
                *[self.client.generate(to_proto(r), timeout_s=timeout_s) for r in requests]
            )

        return self.run(all_of(), timeout=timeout_s + 30)

    def status(self) -> dict:
        from router.client import status_to_dict

        return status_to_dict(self.run(self.client.status()))

    @property
    def store(self):
        return self.cluster.store

    def wait_all_free(self, timeout_s: float = 30.0) -> dict:
        """Status once every worker's free blocks equal its total (G3), or the last one seen."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            s = self.status()
            workers = s["prefill"] + s["decode"]
            if all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in workers):
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.1)

    def stop(self) -> None:
        try:
            self.run(self.client.close())
            self.run(self.cluster.stop(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def greedy(prompt: str, max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0, **kw)
    )


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three uses of a paperclip.",
    "Translate 'good morning' into Spanish and German.",
    "Write a short story about a robot who learns to paint, in about five sentences.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
]


def offline_reference(requests: list[GenerationRequest]) -> list[list[int]]:
    """The same requests through the in-process engine: what G4 compares against."""
    from workers.offline import LLM

    llm = LLM(dtype="float32", num_kv_blocks=512)
    return [c.token_ids for c in llm.generate(requests)]
