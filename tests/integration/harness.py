"""Runs a real cluster (Ray, Redis, gRPC on loopback) on a background event loop, so that
plain synchronous tests can drive it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from types import SimpleNamespace

from client import TandemClient, to_proto
from cluster.cluster import Cluster
from cluster.config import ClusterConfig
from workers.completion import GenerationRequest
from workers.engine.request import SamplingParams


def cluster_config(**values) -> ClusterConfig:
    """A ClusterConfig from nested values, as a config file would give them."""
    from cluster import config_io

    return config_io.build(ClusterConfig, values, "test config")


def one_by_one(
    data_dir: str, engine: dict | None = None, key: str | None = None, tls=None, **router
) -> ClusterHarness:
    """One prefill and one decode worker with 256 KV blocks each, the router on free ports
    (plus `engine` and `router` fields, e.g. http_port=0); the harness's client sends `key`,
    over `tls` (a ClientTLS) if given."""
    return ClusterHarness(
        cluster_config(
            router={"port": 0, **router},
            dashboard=False,
            engine={"num_kv_blocks": 256, **(engine or {})},
            data_dir=data_dir,
        ),
        key,
        tls,
    )


class ClusterHarness:
    def __init__(self, cfg: ClusterConfig, key: str | None = None, tls=None) -> None:
        self.key, self.tls = key, tls
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cluster = Cluster(cfg)
        self.run(self.cluster.start(progress=lambda m: None), timeout=600)
        self.client = self.run(self._client())

    async def _client(self) -> TandemClient:
        return TandemClient(self.cluster.address, self.key, self.tls)

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
        from client import status_to_dict

        return status_to_dict(self.run(self.client.status()))

    @property
    def store(self):
        return self.cluster.store

    def ended(self, request_id: str, timeout_s: float = 30.0):
        """The request's record once it is terminal (the router writes a request's records
        behind its stream: a client may see the end before the store does), or the last one
        seen past the timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            rec = self.run(self.store.get(request_id))
            if (rec is not None and rec.state.terminal) or time.monotonic() > deadline:
                return rec
            time.sleep(0.05)

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


@contextlib.contextmanager
def fuzz_cluster(data_dir):
    """A cluster for hostile input (benchmarks/fuzz.py): keys for tenants a and b and an
    admin, the OpenAI front on, and a few of tenant a's requests already run (their ids are
    what tenant b's calls probe). Yields (harness, (a's key, b's key, the admin's), a's ids)."""
    from router.api import tandem_pb2 as pb
    from router.edge.keys import key_hash

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    keys = SimpleNamespace(a="tdm-fuzz-a", b="tdm-fuzz-b", admin="tdm-fuzz-admin")
    key_file = data_dir / "keys.yaml"
    key_file.write_text(
        "keys:\n"
        f"  - {{sha256: {key_hash(keys.a)}, tenant: a, scopes: [generate]}}\n"
        f"  - {{sha256: {key_hash(keys.b)}, tenant: b, scopes: [generate]}}\n"
        f"  - {{sha256: {key_hash(keys.admin)}, tenant: ops, scopes: [generate, admin]}}\n"
    )
    h = one_by_one(
        str(data_dir / "cluster"), key=keys.admin, api_keys_file=str(key_file), http_port=0
    )
    ids = [f"a-job-{i}" for i in range(3)]

    async def run_as_a():
        a = TandemClient(h.address, keys.a)  # made on the harness's loop, as gRPC asks
        try:
            for rid in ids:
                msg = pb.GenerateRequest(
                    request_id=rid, prompt="Hi", sampling=pb.SamplingParams(max_tokens=4)
                )
                assert (await a.generate(msg, timeout_s=120)).status == "OK"
        finally:
            await a.close()

    try:
        h.run(run_as_a())
        yield h, (keys.a, keys.b, keys.admin), ids
    finally:
        h.stop()
