"""The prefill worker (a Ray actor, named `prefill-N`).

A request passes through:
1. `prefill(job)`: queued into the engine, which batches and chunks prompts across waiting
   requests; the call returns a PrefillResult as soon as the first token is sampled (TTFT).
   A replay's job carries the tokens already sent: they are computed with the prompt (most
   of which is usually still in this worker's prefix cache) and the token after them is
   sampled at its own position. An n > 1 request is prefilled once; each choice draws its
   first token from the same logits with its own seed.
2. the KV stays held in the engine (keep_kv) and is queued, as a Push, on the KVSender for
   the job's decode worker;
3. the sender pushes it (see workers/kv_sender.py) and gives the blocks back; they remain as
   prefix cache.

A job for a request that this worker still holds under an older attempt replaces it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from kv_transfer.protocol import TransferDescriptor
from workers.engine.engine import RequestOutput
from workers.engine.request import FinishReason
from workers.kv_sender import KVSender, Push
from workers.messages import (
    DecodeEndpoint,
    FirstToken,
    KVAdmission,
    Pool,
    PrefillJob,
    PrefillResult,
    PushResult,
    Status,
    WorkerInfo,
)
from workers.worker_common import WorkerBase

log = logging.getLogger(__name__)


@dataclass
class _Job:
    job: PrefillJob
    result: Future  # of PrefillResult

    @property
    def attempt(self) -> int:
        return self.job.spec.attempt


class PrefillWorker(WorkerBase):
    pool = Pool.PREFILL

    def __init__(self, name, engine_config, transfer_host=None, transfer_timeout_s=10.0):
        super().__init__(name, engine_config, transfer_host, transfer_timeout_s)
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # being prefilled
        self._pushes: dict[str, tuple[Push, Future]] = {}  # queued or on the wire
        self._push_results: OrderedDict[str, PushResult] = OrderedDict()  # the latest few
        self._senders: dict[str, KVSender] = {}
        self._queued_tokens = 0
        self.start_loop(self._on_outputs)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            self.name,
            self.pool,
            self.pid,
            self.node,
            host=self.transfer_host,
            liveness_port=self.liveness.port,
        )

    def queued_prefill_tokens(self) -> int:
        return self._queued_tokens

    # -- requests -------------------------------------------------------------------------
    def prefill(self, job: PrefillJob, timeout_s: float = 300.0) -> PrefillResult:
        spec = job.spec
        rid, attempt = spec.request_id, spec.attempt
        entry = _Job(job, Future())
        with self._lock:
            old = self._jobs.get(rid)
            if old is not None and old.attempt >= attempt:
                return PrefillResult(
                    rid, attempt, Status.ALREADY_EXISTS, error=f"{rid} is already being prefilled"
                )
            self._jobs[rid] = entry
            self._queued_tokens += spec.num_tokens
        if old is not None:
            old.result.set_result(PrefillResult(rid, old.attempt, Status.CANCELLED))
        deadline = time.monotonic() + timeout_s
        try:
            self.on_loop(self._add, job)
            return entry.result.result(max(0.0, deadline - time.monotonic()))
        except ValueError as e:  # the engine refused it: it can never fit here
            return PrefillResult(rid, attempt, Status.RESOURCE_EXHAUSTED, error=str(e))
        except (FutureTimeout, TimeoutError) as e:
            self.loop.call(self.engine.abort, rid)
            why = str(e) or f"the prefill took over {timeout_s:.0f} s"
            return PrefillResult(rid, attempt, Status.UNAVAILABLE, error=why)
        finally:
            with self._lock:
                self._queued_tokens -= spec.num_tokens
                if self._jobs.get(rid) is entry:
                    del self._jobs[rid]

    def _add(self, job: PrefillJob) -> None:
        """On the loop thread."""
        spec = job.spec
        self.engine.abort(spec.request_id)  # an older attempt, if it is still here
        self.engine.add_request(
            list(spec.prompt_ids),
            spec.sampling,
            spec.request_id,
            spec.priority,
            output_ids=spec.output_ids,
            stop_after=len(spec.output_ids) + 1,
            keep_kv=True,
        )

    def cancel(self, request_id: str) -> bool:
        found = self.on_loop(self.engine.abort, request_id)
        with self._lock:
            entry = self._jobs.get(request_id)
            push = self._pushes.get(request_id)
        if push is not None:
            push[0].cancelled = True  # not sent if it has not started; else it completes
        if entry is not None and not entry.result.done():
            entry.result.set_result(PrefillResult(request_id, entry.attempt, Status.CANCELLED))
        return found or push is not None or entry is not None

    def phase(self, request_id: str, attempt: int) -> str:
        """Where this attempt of the request stands here: "prefilling", "pushing" (its KV is
        queued or on the wire), or "" (not here)."""
        with self._lock:
            entry = self._jobs.get(request_id)
            push = self._pushes.get(request_id)
        if entry is not None and entry.attempt == attempt and not entry.result.done():
            return "prefilling"
        if push is not None and push[0].admission.spec.attempt == attempt:
            return "pushing"
        return ""

    def push_result(self, request_id: str, timeout_s: float = 60.0) -> PushResult:
        """Wait for a request's KV push to end."""
        with self._lock:
            push = self._pushes.get(request_id)
            done = self._push_results.get(request_id)
        if push is not None:
            return push[1].result(timeout_s)
        return done or PushResult(request_id, False, error="no such push")

    # -- on the loop thread ---------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        # An n > 1 request's choices draw their first tokens, and end, in the same step.
        ended: dict[str, list[RequestOutput]] = {}
        for o in outputs:
            if o.finished:
                ended.setdefault(o.request_id, []).append(o)
        for outs in ended.values():
            self._finished(sorted(outs, key=lambda o: o.index))

    def _finished(self, outs: list[RequestOutput]) -> None:
        o = outs[0]  # choice 0: it holds the KV
        with self._lock:
            entry = self._jobs.get(o.request_id)
        if entry is None or entry.result.done():  # cancelled or superseded meanwhile
            if o.kv_blocks:
                self.engine.release_kv(o.kv_blocks)
            return
        spec = entry.job.spec
        drawn = [c for c in outs if c.new_token_ids]
        if o.kv_blocks is None or len(drawn) != spec.choices:
            if o.kv_blocks:
                self.engine.release_kv(o.kv_blocks)
            error = next((c.error for c in outs if c.error), "")
            status = (
                Status.CANCELLED
                if o.finish_reason is FinishReason.CANCELLED
                else Status.RESOURCE_EXHAUSTED
                if "KV blocks" in error
                else Status.INTERNAL
            )
            failed = PrefillResult(spec.request_id, spec.attempt, status, error=error)
            entry.result.set_result(failed)
            return
        first = tuple(
            FirstToken(
                c.new_token_ids[0],
                c.new_logprobs[0] if c.new_logprobs else None,
                c.new_top_logprobs[0] if c.new_top_logprobs else None,
            )
            for c in drawn
        )
        desc = TransferDescriptor(
            spec.request_id, self.layout, len(o.kv_blocks), spec.num_tokens, first[0].token_id
        )
        push = Push(KVAdmission(spec, first), list(o.kv_blocks), desc)
        with self._lock:
            self._pushes[spec.request_id] = (push, Future())
        self._sender(entry.job.decode).submit(push)
        entry.result.set_result(PrefillResult(spec.request_id, spec.attempt, Status.OK, first))

    def _sender(self, target: DecodeEndpoint) -> KVSender:
        s = self._senders.get(target.name)
        if s is None:
            s = self._senders[target.name] = KVSender(
                self.name,
                target,
                self.layout,
                self.device,
                self.transfer_host,
                self.transfer_timeout_s,
                gather=self.engine.export_kv_layer,
                release=lambda blocks: self.loop.call(self.engine.release_kv, blocks),
                on_done=self._push_done,
            )
        return s

    def _push_done(self, push: Push, result: PushResult) -> None:
        if result.error != "cancelled":
            nbytes = len(push.blocks) * self.layout.bytes_per_block
            self.metrics.transfer(nbytes, result.seconds, result.ok)
        with self._lock:
            entry = self._pushes.pop(push.request_id, None)
            self._push_results[push.request_id] = result
            while len(self._push_results) > 1024:
                self._push_results.popitem(last=False)
        if entry is not None:
            entry[1].set_result(result)

    def forget_decode(self, name: str) -> None:
        """A decode worker left the pool: close our pair with it."""
        s = self._senders.pop(name, None)
        if s is not None:
            s.stop()

    def shutdown(self) -> None:
        self.loop.stop()
        for s in self._senders.values():
            s.stop()
