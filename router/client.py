"""A small gRPC client for Tandem: what `tandem generate --address` and the benchmarks use."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from router.api import tandem_pb2 as pb
from router.api import tandem_pb2_grpc as pb_grpc
from workers.engine.request import SamplingParams
from workers.offline import Completion, GenerationRequest


def to_proto(req: GenerationRequest, request_id: str = "") -> pb.GenerateRequest:
    sp: SamplingParams = req.sampling
    sampling = pb.SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs,
    )
    if sp.seed is not None:
        sampling.seed = sp.seed
    msg = pb.GenerateRequest(request_id=request_id, sampling=sampling, priority=req.priority)
    if req.prompt is not None:
        msg.prompt = req.prompt
    else:
        msg.prompt_ids.extend(req.prompt_ids)
    return msg


@dataclass
class StreamResult:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    status: str = "OK"  # the gRPC status name
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # seconds since submission

    def completion(self, index: int) -> Completion:
        return Completion(
            index,
            self.request_id,
            [],
            self.token_ids,
            self.text,
            self.finish_reason or ("error" if self.status != "OK" else None),
            self.error,
            self.ttft_s,
            self.e2e_s,
        )


class TandemClient:
    def __init__(self, address: str, token: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.gen = pb_grpc.GenerationStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.metadata = [("authorization", f"Bearer {token}")] if token else None

    async def close(self) -> None:
        await self.channel.close()

    async def generate(
        self, msg: pb.GenerateRequest, timeout_s: float | None = None, on_chunk=None
    ) -> StreamResult:
        res = StreamResult(request_id=msg.request_id)
        t0 = time.perf_counter()
        call = self.gen.Generate(msg, timeout=timeout_s, metadata=self.metadata)
        try:
            async for r in call:
                now = time.perf_counter() - t0
                res.request_id = r.request_id
                if r.token_ids:
                    if res.ttft_s is None:
                        res.ttft_s = now
                    res.token_ids += r.token_ids
                    res.token_times += [now] * len(r.token_ids)
                res.text += r.text
                if on_chunk is not None:
                    on_chunk(r)
                if r.HasField("final"):
                    res.finish_reason = r.final.finish_reason
                    res.error = r.final.error or None
        except grpc.aio.AioRpcError as e:
            res.status = e.code().name
            res.error = e.details()
        res.e2e_s = time.perf_counter() - t0
        return res

    async def cancel(self, request_id: str) -> bool:
        r = await self.gen.Cancel(
            pb.CancelRequest(request_id=request_id), timeout=30, metadata=self.metadata
        )
        return r.found

    async def status(self) -> pb.StatusResponse:
        return await self.admin.Status(pb.StatusRequest(), timeout=30, metadata=self.metadata)


def status_to_dict(s: pb.StatusResponse) -> dict:
    def worker(w):
        return {
            "name": w.name,
            "pid": w.pid,
            "node": w.node,
            "alive": w.alive,
            "kv_blocks_total": w.kv_blocks_total,
            "kv_blocks_free": w.kv_blocks_free,
            "running": w.running,
            "waiting": w.waiting,
            "draining": w.draining,
        }

    return {
        "prefill": [worker(w) for w in s.prefill],
        "decode": [worker(w) for w in s.decode],
        "router": {
            "queue_depth": s.router.queue_depth,
            "in_flight": s.router.in_flight,
            "mode": s.router.mode,
        },
    }
