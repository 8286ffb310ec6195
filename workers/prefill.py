"""The prefill worker (a Ray actor, named `prefill-N`).

A request passes through:
1. `prefill(job)`: queued into the engine, which batches and chunks prompts across waiting
   requests; the call returns a PrefillResult as soon as the first token is sampled (TTFT).
   A replay's job carries the tokens already sent: they are computed with the prompt (most
   of which is usually still in this worker's prefix cache) and the token after them is
   sampled at its own position. An n > 1 request is prefilled once; each choice draws its
   first token from the same logits with its own seed.
2. as the step that completes its KV begins, a Push holding its blocks is queued on the
   KVSender for the job's decode worker, which sends each layer as the model computes it,
   then the first tokens once they are sampled (see workers/kv_sender.py);
3. the sender gives the blocks back; they remain as prefix cache.

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
from workers.engine.grammar import GrammarError
from workers.engine.outputs import RequestOutput
from workers.engine.request import FinishReason
from workers.kv_sender import KVSender, LayerProgress, NoFirstToken, Push, Unsent
from workers.messages import (
    DecodeEndpoint,
    FirstToken,
    Phase,
    Pool,
    PrefillJob,
    PrefillResult,
    PushResult,
    Status,
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

    def __init__(
        self, name, engine_config, transfer_host=None, transfer_timeout_s=10.0, stream_kv=True
    ):
        """stream_kv=False holds the layers back until the step that completes the KV is
        over (for comparison; the transfer still opens as that step begins, so a step must
        not take longer than transfer_timeout_s)."""
        super().__init__(name, engine_config, transfer_host, transfer_timeout_s)
        self.stream_kv = stream_kv
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # being prefilled
        self._pushes: dict[str, tuple[Push, Future]] = {}  # queued or on the wire
        self._push_results: OrderedDict[str, PushResult] = OrderedDict()  # the latest few
        self._senders: dict[str, KVSender] = {}
        self._queued_tokens = 0
        self._streaming: dict[str, Push] = {}  # the loop thread's: pushes awaiting first tokens
        self.engine.on_kv_completing = self._kv_completing
        self.start_loop(self._on_outputs)

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
        except GrammarError as e:  # its constraint does not compile (the router checks first)
            return PrefillResult(rid, attempt, Status.INVALID_ARGUMENT, error=str(e))
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
            tenancy=spec.tenancy,
        )

    def cancel(self, request_id: str, notify: bool = False, attempt: int | None = None) -> bool:
        """Drop a request here (`notify` and `attempt` are the decode worker's: no stream
        follows a prefill worker, and it holds one attempt of a request at a time)."""
        found = self.on_loop(self.engine.abort, request_id)
        with self._lock:
            entry = self._jobs.get(request_id)
            push = self._pushes.get(request_id)
        if push is not None:
            push[0].cancelled = True  # not sent if it has not started; else it completes
        if entry is not None and not entry.result.done():
            entry.result.set_result(PrefillResult(request_id, entry.attempt, Status.CANCELLED))
        return found or push is not None or entry is not None

    def phase(self, request_id: str, attempt: int) -> Phase:
        """Where this attempt of the request stands here: prefilling, pushing (its KV is
        queued or on the wire), or absent."""
        with self._lock:
            entry = self._jobs.get(request_id)
            push = self._pushes.get(request_id)
        if entry is not None and entry.attempt == attempt and not entry.result.done():
            return Phase.PREFILLING
        if push is not None and push[0].spec.attempt == attempt:
            return Phase.PUSHING
        return Phase.ABSENT

    def push_result(self, request_id: str, timeout_s: float = 60.0) -> PushResult:
        """Wait for a request's KV push to end."""
        with self._lock:
            push = self._pushes.get(request_id)
            done = self._push_results.get(request_id)
        if push is not None:
            return push[1].result(timeout_s)
        return done or PushResult(request_id, False, error="no such push")

    # -- on the loop thread ---------------------------------------------------------------
    def _kv_completing(self, done: list[tuple[str, list[int], int]]):
        """A step that completes these requests' KV begins: start their pushes now, so each
        layer leaves while the next ones compute. Returns the model's per-layer callback."""
        progress = LayerProgress(self.layout.num_layers, self.device)
        started = False
        for rid, blocks, num_tokens in done:
            with self._lock:
                entry = self._jobs.get(rid)
            if entry is None or entry.result.done() or entry.job.spec.num_tokens != num_tokens:
                # Cancelled, or an older attempt whose job was replaced (the new one is
                # queued on the loop): _finished gives its blocks back.
                continue
            self._streaming[rid] = self._start_push(entry, blocks, progress)
            started = True
        return progress.mark if started and self.stream_kv else None

    def _start_push(self, entry: _Job, blocks: list[int], progress: LayerProgress) -> Push:
        spec = entry.job.spec
        self.engine.hold_kv(blocks)  # the push's own reference, given back by the sender
        desc = TransferDescriptor(spec.request_id, self.layout, len(blocks), spec.num_tokens)
        push = Push(spec, blocks, desc, progress)
        with self._lock:
            self._pushes[spec.request_id] = (push, Future())
        self._sender(entry.job.decode).submit(push)
        return push

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        # The step is over: every layer of its KV is written (a push that was not streamed,
        # or a model that marks no layers, sends them all now; after a failed step the
        # trailer aborts what went out).
        for push in self._streaming.values():
            push.progress.mark(self.layout.num_layers - 1)
        # An n > 1 request's choices draw their first tokens, and end, in the same step.
        ended: dict[str, list[RequestOutput]] = {}
        for o in outputs:
            if o.finished:
                ended.setdefault(o.request_id, []).append(o)
        try:
            for outs in ended.values():
                try:
                    self._finished(sorted(outs, key=lambda o: o.index))
                except Exception:  # one request's trouble must not strand the others
                    log.exception("request %s: handling its prefill output failed", outs[0])
        finally:
            for push in self._streaming.values():  # never left without a verdict
                push.resolve(NoFirstToken(Unsent.NO_FIRST_TOKEN))
            self._streaming.clear()

    def _finished(self, outs: list[RequestOutput]) -> None:
        o = outs[0]  # choice 0: it holds the KV
        push = self._streaming.pop(o.request_id, None)
        try:
            self._resolve(outs, push)
        finally:
            if o.kv_blocks:  # a push holds its own reference
                self.engine.release_kv(o.kv_blocks)

    def _resolve(self, outs: list[RequestOutput], push: Push | None) -> None:
        """The prefill is over: answer its caller, and give its push the first tokens or
        the reason there are none."""
        o = outs[0]
        with self._lock:
            entry = self._jobs.get(o.request_id)
        if entry is None or entry.result.done():  # cancelled or superseded meanwhile
            if push is not None:
                push.resolve(NoFirstToken(Unsent.CANCELLED))
            return
        if push is not None and push.spec.attempt != entry.attempt:
            # An older attempt's prefill: its job was replaced while it ran, and the new one
            # is queued on the loop and answers for itself.
            push.resolve(NoFirstToken(Unsent.SUPERSEDED))
            return
        spec = entry.job.spec
        drawn = [c for c in outs if c.new_token_ids]
        if o.kv_blocks is None or len(drawn) != spec.choices:  # failed, maybe never stepped
            error = next((c.error for c in outs if c.error), "")
            if push is not None:
                push.resolve(NoFirstToken(Unsent.FAILED, error))
            kind = next((c.error_kind for c in outs if c.error_kind), None)
            status = (
                Status.CANCELLED
                if o.finish_reason is FinishReason.CANCELLED
                else Status.of_error(kind)
            )
            failed = PrefillResult(spec.request_id, spec.attempt, status, error=error)
            entry.result.set_result(failed)
            return
        if push is None:  # an older attempt's KV (see _kv_completing): not this job's
            return
        first = tuple(
            FirstToken(
                c.new_token_ids[0],
                c.new_logprobs[0] if c.new_logprobs else None,
                c.new_top_logprobs[0] if c.new_top_logprobs else None,
            )
            for c in drawn
        )
        push.resolve(first)
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
                cache_layer=self.engine.kv_cache_layer,
                release=lambda blocks: self.loop.call(self.engine.release_kv, blocks),
                on_done=self._push_done,
                read_blocks=self.engine.read_kv_blocks,
            )
        return s

    def _push_done(self, push: Push, result: PushResult) -> None:
        if not (push.cancelled or push.first_failed):  # only real transfers count
            per_block = self.layout.bytes_per_block
            plan = push.plan
            staged = plan.staged_either * per_block if plan else 0
            self.metrics.transfer(len(push.blocks) * per_block, result.seconds, result.ok, staged)
        with self._lock:
            entry = self._pushes.get(push.request_id)
            if entry is not None and entry[0] is push:  # not a newer attempt's
                del self._pushes[push.request_id]
            else:
                entry = None
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
