"""A small gRPC client for Tandem: what `tandem generate --address` and the benchmarks use.
It imports no torch.

Given several router addresses, a stream that breaks with UNAVAILABLE (its router died, or
the connection did) resumes on the next one from the last offset received: Resume if the
request is known, Generate again with the same request id if it never got recorded. A request
that failed for good (retries exhausted, bad input) is reported as it failed.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass, field

import grpc

from client.channel import open_channel
from router.api import tandem_pb2 as pb
from router.api import tandem_pb2_grpc as pb_grpc
from router.edge.convert import status_to_dict, tenants_to_dict
from router.edge.tls import ClientTLS
from router.errors import FINAL_KEY
from workers.completion import Completion, GenerationRequest
from workers.engine.constraint import Constraint, ConstraintKind
from workers.engine.request import SamplingParams

__all__ = [
    "TandemClient",
    "StreamResult",
    "to_proto",
    "status_to_dict",
    "tenants_to_dict",
    "fetch_status",
]


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
        top_logprobs=sp.top_logprobs,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        logit_bias=dict(sp.logit_bias),
        min_tokens=sp.min_tokens,
        n=sp.n,
    )
    if sp.seed is not None:
        sampling.seed = sp.seed
    if sp.constraint is not None:
        sampling.constraint.CopyFrom(constraint_to_proto(sp.constraint))
    msg = pb.GenerateRequest(request_id=request_id, sampling=sampling, priority=req.priority)
    if req.prompt is not None:
        msg.prompt = req.prompt
    else:
        msg.prompt_ids.extend(req.prompt_ids)
    return msg


def constraint_to_proto(c: Constraint) -> pb.Constraint:
    if c.kind is ConstraintKind.CHOICE:
        return pb.Constraint(choice=pb.Choices(values=list(c.choices)))
    if c.kind is ConstraintKind.JSON_OBJECT:
        return pb.Constraint(json_object=True)
    return pb.Constraint(**{c.kind.value: c.text})


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
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # seconds since submission
    resumes: int = 0  # how many times the stream moved to another router (or reconnected)
    index: int = 0  # which of the request's n choices

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.status != "OK"

    def completion(self, index: int) -> Completion:
        """As the offline API gives it: `index` is the request's place in its batch."""
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
            self.logprobs or None,
            self.top_logprobs or None,
            choice=self.index,
        )


class TandemClient:
    def __init__(
        self, address: str | list[str], token: str | None = None, tls: ClientTLS | None = None
    ) -> None:
        """`token`: the API key sent with every call; `tls`: reach the routers over TLS,
        trusting its CA (and presenting its certificate, for a router that asks)."""
        self.addresses = address.split(",") if isinstance(address, str) else list(address)
        # The key goes on every call through the channels themselves (client/channel.py).
        self.channels = [open_channel(a.strip(), token, tls) for a in self.addresses]
        self.current = 0

    @property
    def gen(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channels[self.current])

    def _gen(self, index: int) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channels[index % len(self.channels)])

    @property
    def admin(self) -> pb_grpc.AdminStub:
        return pb_grpc.AdminStub(self.channels[self.current])

    async def close(self) -> None:
        for c in self.channels:
            await c.close()

    async def generate(
        self,
        msg: pb.GenerateRequest,
        timeout_s: float | None = None,
        on_chunk=None,
        max_resumes: int | None = None,
    ) -> StreamResult:
        """Runs a request of one completion to its end (see generate_choices)."""
        if msg.sampling.n > 1:
            raise ValueError(f"n={msg.sampling.n}: use generate_choices, one result per choice")
        return (await self.generate_choices(msg, timeout_s, on_chunk, max_resumes))[0]

    async def generate_choices(
        self,
        msg: pb.GenerateRequest,
        timeout_s: float | None = None,
        on_chunk=None,
        max_resumes: int | None = None,
    ) -> list[StreamResult]:
        """Runs a request to its end: one result per choice (n of them), in index order. If
        the stream breaks, every unfinished choice resumes on the next router from its own
        offset."""
        rid = msg.request_id or uuid.uuid4().hex  # ours, so a broken stream resumes by id
        if not msg.request_id:
            fresh = pb.GenerateRequest()
            fresh.CopyFrom(msg)
            fresh.request_id = rid
            msg = fresh
        results = [StreamResult(request_id=rid, index=i) for i in range(max(msg.sampling.n, 1))]
        t0 = time.perf_counter()
        deadline = None if timeout_s is None else t0 + timeout_s
        tries = max_resumes if max_resumes is not None else 2 * len(self.channels) + 2
        resume, at = False, self.current

        async def take(call) -> None:
            async for r in call:
                self._take(results[r.index], r, t0, on_chunk, msg.sampling)

        while True:
            left = None if deadline is None else max(0.001, deadline - time.perf_counter())
            gen = self._gen(at)
            if resume:
                calls = [
                    gen.Resume(
                        pb.ResumeRequest(request_id=rid, offset=len(r.token_ids), index=r.index),
                        timeout=left,
                    )
                    for r in results
                    if not r.done
                ]
            else:
                calls = [gen.Generate(msg, timeout=left)]
            outcomes = await asyncio.gather(*(take(c) for c in calls), return_exceptions=True)
            errors = [e for e in outcomes if isinstance(e, BaseException)]
            if not errors:
                break
            e = errors[0]
            if not isinstance(e, grpc.aio.AioRpcError):
                raise e
            code = e.code()
            if code == grpc.StatusCode.NOT_FOUND and resume:
                resume = False  # never recorded: submit it again, same id
                continue
            if code != grpc.StatusCode.UNAVAILABLE or tries <= 0 or _router_decided(e):
                for r in results:
                    if not r.done:
                        r.status, r.error = code.name, e.details()
                break
            tries -= 1
            for r in results:
                r.resumes += 1
            at = (at + 1) % len(self.channels)
            self.current = at  # later calls start where this one goes on
            resume = True
            await asyncio.sleep(0.2)
        for r in results:
            r.e2e_s = r.e2e_s or time.perf_counter() - t0
        return results

    @staticmethod
    def _take(res: StreamResult, r: pb.GenerateResponse, t0: float, on_chunk, sampling) -> None:
        now = time.perf_counter() - t0
        if r.token_ids:
            # A resume answers from the offset asked: drop what this client already has.
            drop = max(len(res.token_ids) - r.offset, 0)
            ids = list(r.token_ids)[drop:]
            if ids and res.ttft_s is None:
                res.ttft_s = now
            res.token_ids += ids
            # Tokens a Resume re-sends from the token log come without logprobs: NaN and no
            # alternatives stand in for them, so the lists stay aligned with token_ids.
            n = len(r.token_ids)
            if sampling.logprobs:
                lps = list(r.logprobs)
                res.logprobs += lps[drop:] if len(lps) == n else [math.nan] * len(ids)
            if sampling.top_logprobs:
                tops = [tuple(zip(t.token_ids, t.logprobs)) for t in r.top_logprobs]
                res.top_logprobs += tops[drop:] if len(tops) == n else [()] * len(ids)
            res.token_times += [now] * len(ids)
        res.text += r.text
        if on_chunk is not None:
            on_chunk(r)
        if r.HasField("final"):
            res.finish_reason = r.final.finish_reason
            res.error = r.final.error or None
            res.e2e_s = now

    async def cancel(self, request_id: str) -> bool:
        r = await self.gen.Cancel(pb.CancelRequest(request_id=request_id), timeout=30)
        return r.found

    async def status(self) -> pb.StatusResponse:
        return await self.admin.Status(pb.StatusRequest(), timeout=30)


async def fetch_status(address: str, token: str | None = None, tls=None) -> dict:
    """One router's `Admin.Status` as `tandem status --json` prints it, on a channel of its
    own."""
    client = TandemClient(address, token, tls)
    try:
        return status_to_dict(await client.status())
    finally:
        await client.close()


def _router_decided(e: grpc.aio.AioRpcError) -> bool:
    """The router ended the call itself (the request failed, or was refused), as opposed to
    the connection or the router breaking: routers mark their own statuses."""
    return any(k == FINAL_KEY for k, _ in (e.trailing_metadata() or ()))
