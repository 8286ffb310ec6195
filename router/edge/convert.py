"""Protobuf <-> the cluster's own types, in one place: the router's edge. Nothing past it sees
a protobuf message. (Requests come in through router/edge/validation.py, which checks them as it
converts.) No torch here: the client uses `status_to_dict`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.api import tandem_pb2 as pb
from workers.messages import PoolStatus, WorkerStatus

if TYPE_CHECKING:  # the stream pulls in the tokenizer; clients import this module without it
    from router.requests.stream import Chunk
    from router.tenant_policy import Tenant


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


def tenant_policy(t: Tenant) -> pb.TenantPolicy:
    return pb.TenantPolicy(
        name=t.name,
        weight=t.weight,
        max_concurrency=t.max_concurrency,
        tokens_per_minute=t.tokens_per_minute,
        tier=t.tier,
        max_wait_s=t.max_wait_s or 0.0,
    )


def tenant_changes(p: pb.TenantPolicy) -> dict:
    """The fields a TenantsRequest sets (max_wait_s 0: unset, back to the router's)."""
    from router.tenant_policy import POLICY_FIELDS

    changes = {name: getattr(p, name) for name in POLICY_FIELDS if p.HasField(name)}
    if changes.get("max_wait_s") == 0:
        changes["max_wait_s"] = None
    return changes


def tenant_state(s) -> pb.TenantState:
    return pb.TenantState(
        policy=tenant_policy(s.policy),
        running=s.running,
        waiting=s.waiting,
        served=s.served,
        quota_left=-1.0 if s.quota_left is None else s.quota_left,
    )


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
        kv_bytes_per_token=s.kv_bytes_per_token,
        rank_pids=list(s.rank_pids),
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
            "kv_bytes_per_token": w.kv_bytes_per_token,
            "rank_pids": list(w.rank_pids),
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
        "tenants": tenants_to_dict(s.tenants),
    }


def tenants_to_dict(tenants) -> list[dict]:
    return [
        {
            "name": t.policy.name,
            "weight": t.policy.weight,
            "max_concurrency": t.policy.max_concurrency,
            "tokens_per_minute": t.policy.tokens_per_minute,
            "tier": t.policy.tier,
            "max_wait_s": t.policy.max_wait_s or None,
            "running": t.running,
            "waiting": t.waiting,
            "served": round(t.served, 1),
            "quota_left": None if t.quota_left < 0 else round(t.quota_left, 1),
        }
        for t in tenants
    ]
