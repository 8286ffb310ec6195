"""Request state in Redis: one hash per request, an append-only token log, atomic state
transitions, and a TTL on finished records.

    tandem:req:<id>          hash: prompt_ids, sampling, tenant, state, prefill, decode,
                             attempts, created, updated, finish_reason, error
    tandem:req:<id>:tokens   list of output token ids, in order, written by the decode worker

Every call has a socket timeout (G6): a Redis that stops answering raises, it never hangs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

QUEUED, PREFILLING, DECODING = "QUEUED", "PREFILLING", "DECODING"
FINISHED, FAILED, CANCELLED = "FINISHED", "FAILED", "CANCELLED"
TERMINAL = (FINISHED, FAILED, CANCELLED)

# Set the state only if the current one is among ARGV[2..]; returns the state found.
_TRANSITION = """
local cur = redis.call('HGET', KEYS[1], 'state')
if not cur then return false end
for i = 2, #ARGV do
  if ARGV[i] == cur then
    redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated', tostring(redis.call('TIME')[1]))
    return ARGV[1]
  end
end
return cur
"""


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    state: str
    prompt_ids: list[int]
    sampling: dict
    tenant: str
    finish_reason: str | None
    error: str | None
    attempts: int


class StateStore:
    def __init__(self, url: str, ttl_s: int = 3600, timeout_s: float = 5.0) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.r = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self._transition = self.r.register_script(_TRANSITION)

    @staticmethod
    def key(request_id: str) -> str:
        return f"tandem:req:{request_id}"

    def ping(self) -> bool:
        return bool(self.r.ping())

    def create(self, request_id: str, prompt_ids: list[int], sampling: dict, tenant: str) -> bool:
        """Write a new QUEUED record; False if the id already exists."""
        now = str(time.time())
        created = self.r.hsetnx(self.key(request_id), "state", QUEUED)
        if not created:
            return False
        self.r.hset(
            self.key(request_id),
            mapping={
                "prompt_ids": json.dumps(prompt_ids),
                "sampling": json.dumps(sampling),
                "tenant": tenant,
                "attempts": 0,
                "created": now,
                "updated": now,
            },
        )
        return True

    def transition(self, request_id: str, to: str, allowed: tuple[str, ...]) -> str | None:
        """Atomically move to `to` if the state is in `allowed`; returns the resulting state."""
        return self._transition(keys=[self.key(request_id)], args=[to, *allowed])

    def assign(self, request_id: str, **workers: str) -> None:
        self.r.hset(self.key(request_id), mapping=workers)
        self.r.hincrby(self.key(request_id), "attempts", 1)

    def finish(self, request_id: str, state: str, finish_reason: str, error: str = "") -> None:
        key = self.key(request_id)
        with self.r.pipeline() as p:
            p.hset(
                key,
                mapping={
                    "state": state,
                    "finish_reason": finish_reason,
                    "error": error,
                    "updated": str(time.time()),
                },
            )
            p.expire(key, self.ttl_s)
            p.expire(key + ":tokens", self.ttl_s)
            p.execute()

    def append_tokens(self, batch: dict[str, list[int]]) -> None:
        """One pipelined write for a whole decode step: every request's new tokens."""
        if not batch:
            return
        with self.r.pipeline(transaction=False) as p:
            for request_id, tokens in batch.items():
                if tokens:
                    p.rpush(self.key(request_id) + ":tokens", *tokens)
            p.execute()

    def tokens(self, request_id: str, start: int = 0) -> list[int]:
        return [int(t) for t in self.r.lrange(self.key(request_id) + ":tokens", start, -1)]

    def get(self, request_id: str) -> RequestRecord | None:
        h = self.r.hgetall(self.key(request_id))
        if not h:
            return None
        return RequestRecord(
            request_id=request_id,
            state=h.get("state", ""),
            prompt_ids=json.loads(h.get("prompt_ids", "[]")),
            sampling=json.loads(h.get("sampling", "{}")),
            tenant=h.get("tenant", ""),
            finish_reason=h.get("finish_reason") or None,
            error=h.get("error") or None,
            attempts=int(h.get("attempts", 0)),
        )
