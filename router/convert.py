"""Protobuf <-> the cluster's own types, in one place: the router's edge. Nothing past it sees
a protobuf message. (Requests come in through router/validation.py, which checks them as it
converts.) No torch here: the client uses `status_to_dict`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.api import tandem_pb2 as pb
from workers.messages import PoolStatus, WorkerStatus

if TYPE_CHECKING:  # the stream pulls in the tokenizer; clients import this module without it
    from router.stream import Chunk


def response(request_id: str, chunk: Chunk, prompt_tokens: int, completion_tokens: int):
    msg = pb.GenerateResponse(
        request_id=request_id,
        offset=chunk.offset,
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=chunk.logprobs,
        top_logprobs=[
            pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
            for top in chunk.top_logprobs
        ],
        index=chunk.index,
    )
    if chunk.finished:
        msg.final.CopyFrom(
            pb.Final(
                finish_reason=chunk.finish_reason or "",
                error=chunk.error,
                usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
            )
        )
    return msg


def worker_status(s: WorkerStatus) -> pb.WorkerStatus:
    return pb.WorkerStatus(
        name=s.name,
        pid=s.pid,
        node=s.node,
        alive=s.alive,
        kv_blocks_total=s.kv_blocks_total,
        kv_blocks_free=s.kv_blocks_free,
        running=s.running,
        waiting=s.waiting,
        draining=s.draining,
        reserved=s.reserved,
        queued_prefill_tokens=s.queued_prefill_tokens,
        steps=s.steps,
        preemptions=s.preemptions,
        prefix_hit_blocks=s.prefix_hit_blocks,
        unresponsive_s=s.unresponsive_s,
    )


def pool_status(p: PoolStatus) -> pb.PoolStatus:
    return pb.PoolStatus(
        pool=p.pool.value,
        target=p.target,
        live=p.live,
        starting=p.starting,
        restarts=p.restarts,
        autoscale=p.autoscale,
    )


def status_to_dict(s: pb.StatusResponse) -> dict:
    """A StatusResponse as plain JSON-ready data (what `tandem status --json` prints)."""

    def worker(w: pb.WorkerStatus) -> dict:
        return {
            "name": w.name,
            "pid": w.pid,
            "node": w.node,
            "alive": w.alive,
            "kv_blocks_total": w.kv_blocks_total,
            "kv_blocks_free": w.kv_blocks_free,
            "running": w.running,
            "waiting": w.waiting,
            "reserved": w.reserved,
            "queued_prefill_tokens": w.queued_prefill_tokens,
            "draining": w.draining,
            "steps": w.steps,
            "preemptions": w.preemptions,
            "prefix_hit_blocks": w.prefix_hit_blocks,
            "unresponsive_s": round(w.unresponsive_s, 1),
        }

    r = s.router
    return {
        "prefill": [worker(w) for w in s.prefill],
        "decode": [worker(w) for w in s.decode],
        "pools": {
            p.pool: {
                "target": p.target,
                "live": p.live,
                "starting": p.starting,
                "restarts": p.restarts,
                "autoscale": p.autoscale,
            }
            for p in s.pools
        },
        "router": {
            "router_id": r.router_id,
            "controller": r.controller,
            "queue_depth": r.queue_depth,
            "in_flight": r.in_flight,
            "mode": r.mode,
            "replays_in_flight": r.replays_in_flight,
            "replays_total": r.replays_total,
            "replays_recovered": r.replays_recovered,
            "recovery_p50_s": round(r.recovery_p50_s, 3),
            "recovery_max_s": round(r.recovery_max_s, 3),
            "store_available": r.store_available,
        },
    }
