"""The prefill worker (a Ray actor, named `prefill-N`).

A request passes through:
1. `prefill(job)`: queued into the engine, which batches and chunks prompts across waiting
   requests; it returns as soon as the first token is sampled (that is TTFT);
2. the export: as the request ends in the engine, its prompt blocks are copied out (the
   blocks themselves stay behind as prefix cache) and queued for its decode worker;
3. the push: one sender thread per decode worker, in order: open the pair group if needed
   (layout handshake first), ask the decode worker to `receive_kv`, send, wait for its ack.

A failed push closes that pair (the next push rebuilds it, with a new generation) and the
decode worker ends the request with an error; nothing waits longer than the transfer timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

from kv_transfer.channel import send_kv
from kv_transfer.protocol import TransferDescriptor, TransferError
from kv_transfer.torch_dist import PairGroup, store_client
from workers.engine.engine import RequestOutput
from workers.engine.request import Request, RequestStatus, SamplingParams
from workers.worker_common import WorkerBase, sampling_from_dict

log = logging.getLogger(__name__)


@dataclass
class _Push:
    job: dict
    blocks: list[int]  # held in the pool until the push ends
    desc: TransferDescriptor
    first_logprob: float | None = None
    done: Future = field(default_factory=Future)


class PrefillWorker(WorkerBase):
    def __init__(
        self,
        name: str,
        engine_config: dict,
        transfer_host: str = "127.0.0.1",
        transfer_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(name, engine_config, transfer_host, transfer_timeout_s)
        self.jobs: dict[str, dict] = {}
        self.first: dict[str, Future] = {}
        self.pushes: dict[str, _Push] = {}  # in flight
        self.push_results: OrderedDict[str, dict] = OrderedDict()  # the latest few, for callers
        self.senders: dict[str, _Sender] = {}
        self.queued_tokens = 0
        self.engine.scheduler.before_free = self._export
        self.start_loop(self._on_outputs)

    def info(self) -> dict:
        return {"name": self.name, "layout": self.layout.to_dict()}

    def status(self) -> dict:
        return {**super().status(), "queued_prefill_tokens": self.queued_tokens}

    def prefill(self, job: dict, timeout_s: float = 300.0) -> dict:
        """job: request_id, prompt_ids, sampling, seed, priority, decode {name, host, port,
        handle}. Returns {first_token, first_logprob} once sampled, or {error}."""
        rid = job["request_id"]
        sp = sampling_from_dict(job["sampling"])
        # Prefill samples exactly one token, whatever ends the request later on decode.
        first_only = SamplingParams(
            max_tokens=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            seed=job["seed"],
            ignore_eos=True,
            logprobs=sp.logprobs,
        )
        fut: Future = Future()
        self.first[rid] = fut
        self.jobs[rid] = job
        self.queued_tokens += len(job["prompt_ids"])
        try:
            self.loop.call(
                self.engine.add_request, job["prompt_ids"], first_only, rid, job.get("priority", 0)
            ).result(10)
            return fut.result(timeout_s)
        except Exception as e:
            self.loop.call(self.engine.abort, rid)
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            self.first.pop(rid, None)
            self.queued_tokens -= len(job["prompt_ids"])

    def cancel(self, request_id: str) -> bool:
        found = self.loop.call(self.engine.abort, request_id).result(10)
        push = self.pushes.get(request_id)
        if push is not None:
            push.job["cancelled"] = True
        fut = self.first.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.set_result({"error": "cancelled"})
        return found or push is not None

    # -- on the loop thread ---------------------------------------------------------------
    def _export(self, req: Request, block_ids: list[int]) -> None:
        """As a prefill ends, hold its prompt blocks for the push (they are read layer by
        layer while sending, then released into the prefix cache)."""
        job = self.jobs.pop(req.request_id, None)
        if job is None or req.status != RequestStatus.FINISHED_LENGTH:
            return
        n = -(-req.num_prompt_tokens // self.layout.block_size)
        blocks = list(block_ids[:n])
        self.engine.pool.hold(blocks)
        desc = TransferDescriptor(
            req.request_id, self.layout, n, req.num_prompt_tokens, req.output_token_ids[0]
        )
        lp = req.output_logprobs[0] if req.output_logprobs else None
        push = _Push(job, blocks, desc, lp)
        self.pushes[req.request_id] = push
        self._sender(job["decode"]).submit(push)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            fut = self.first.get(o.request_id)
            if fut is None or fut.done() or not o.finished:
                continue
            if o.new_token_ids:
                lp = o.new_logprobs[0] if o.new_logprobs else None
                fut.set_result({"first_token": o.new_token_ids[0], "first_logprob": lp})
            else:
                fut.set_result({"error": o.error or (o.finish_reason and o.finish_reason.value)})

    def _sender(self, decode: dict) -> _Sender:
        s = self.senders.get(decode["name"])
        if s is None:
            s = self.senders[decode["name"]] = _Sender(self, decode)
        return s

    def push_result(self, request_id: str, timeout_s: float = 60.0) -> dict:
        """Wait for a request's KV push to finish: {ok, seconds} or {ok: False, error}."""
        push = self.pushes.get(request_id)
        if push is not None:
            return push.done.result(timeout_s)
        return self.push_results.get(request_id, {"ok": False, "error": "no such push"})

    def _push_done(self, push: _Push, result: dict) -> None:
        self.push_results[push.desc.request_id] = result
        while len(self.push_results) > 1024:
            self.push_results.popitem(last=False)
        self.pushes.pop(push.desc.request_id, None)
        push.done.set_result(result)

    def shutdown(self) -> None:
        self.loop.stop()
        for s in self.senders.values():
            s.stop()


class _Sender:
    """Pushes to one decode worker, one transfer at a time, over that pair's group."""

    def __init__(self, owner: PrefillWorker, decode: dict) -> None:
        self.owner = owner
        self.decode = decode
        self.group: PairGroup | None = None
        self.generation = 0
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"{owner.name}->{decode['name']}"
        )
        self.thread.start()

    def submit(self, push: _Push) -> None:
        self.queue.put(push)

    def stop(self) -> None:
        self.queue.put(None)
        if self.group is not None:
            self.group.close()

    def _run(self) -> None:
        while (push := self.queue.get()) is not None:
            try:
                self._push(push)
            finally:
                self.owner.loop.call(self.owner.engine.pool.free, push.blocks)

    def _push(self, push: _Push) -> None:
        import ray

        rid = push.desc.request_id
        handle = self.decode["handle"]
        timeout = self.owner.transfer_timeout_s
        if push.job.get("cancelled"):
            self.owner._push_done(push, {"ok": False, "error": "cancelled"})
            return
        try:
            t0 = time.perf_counter()
            self._ensure_group(handle, timeout)
            admission = {
                "request_id": rid,
                "prompt_ids": push.job["prompt_ids"],
                "sampling": push.job["sampling"],
                "seed": push.job["seed"],
                "priority": push.job.get("priority", 0),
                "first_logprob": push.first_logprob,
            }
            ref = handle.receive_kv.remote(self.owner.name, self.generation, admission)
            runner = self.owner.engine.runner
            # Gathered layer by layer while earlier layers are on the wire.
            layers = (
                runner.export_layer(i, push.blocks) for i in range(self.owner.layout.num_layers)
            )
            send_kv(self.group, push.desc, layers, timeout)
            result = ray.get(ref, timeout=timeout + 5)
            if not result.get("ok"):
                raise TransferError(result.get("error", "receiver failed"))
            result["send_seconds"] = time.perf_counter() - t0
            self.owner._push_done(push, result)
        except Exception as e:
            message = f"KV push {self.owner.name} -> {self.decode['name']} failed: {e}"
            log.warning("%s (request %s)", message, rid)
            if self.group is not None:
                self.group.close()
                self.group = None  # rebuilt, with a new generation, at the next push
            try:  # the decode worker frees the reservation and ends the request
                ray.get(handle.fail_request.remote(rid, message), timeout=timeout)
            except Exception:
                log.warning("could not tell %s that %s failed", self.decode["name"], rid)
            self.owner._push_done(push, {"ok": False, "error": message})

    def _ensure_group(self, handle, timeout: float) -> None:
        import ray

        if self.group is not None:
            return
        # The handshake: a layout mismatch is refused here, before any group or bytes.
        ray.get(
            handle.check_layout.remote(self.owner.name, self.owner.layout.to_dict()),
            timeout=timeout,
        )
        self.generation += 1
        ref = handle.open_pair.remote(self.owner.name, self.generation, self.owner.layout.to_dict())
        store = store_client(self.decode["host"], self.decode["port"], timeout)
        try:
            group = PairGroup(
                store,
                f"pair/{self.owner.name}/{self.generation}",
                0,
                self.owner.device,
                self.owner.transfer_host,
                timeout,
            )
        except TransferError:
            ray.get(ref, timeout=timeout)  # surfaces a layout mismatch as the cause
            raise
        ray.get(ref, timeout=timeout)
        self.group = group
