"""The decode worker (a Ray actor, named `decode-N`).

A request reaches it in three calls:
1. `reserve(id, prompt_len)`: blocks for the prompt's KV, before any prefill starts, so a
   transfer never lands in a full cache;
2. `open_pair(prefill, generation, layout)` once per prefill worker (and per rebuild): the
   layout handshake, then the two-rank process group over this worker's TCPStore;
3. `receive_kv(prefill, generation, admission)`: called by the prefill worker just before it
   sends; receives the KV into the reserved blocks and admits the request with its first token.

Then the engine loop decodes it with the rest of the batch. Each step's tokens are appended
to Redis in one pipelined write and queued for the router, which long-polls `poll()`.
A failed transfer frees the reservation and ends the request with an error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from kv_transfer.channel import StagingBuffers, recv_kv
from kv_transfer.layout import KVLayout, LayoutMismatch
from kv_transfer.protocol import TransferError
from kv_transfer.torch_dist import PairGroup, store_server
from workers.engine.engine import RequestOutput
from workers.worker_common import WorkerBase, sampling_from_dict

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    def __init__(
        self,
        name: str,
        engine_config: dict,
        redis_url: str | None = None,
        transfer_host: str = "127.0.0.1",
        transfer_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(name, engine_config, transfer_host, transfer_timeout_s)
        self.store = store_server(transfer_host)
        self.pairs: dict[str, tuple[int, PairGroup]] = {}
        self.staging: dict[str, StagingBuffers] = {}  # per pair: receive buffers, reused
        # Blocks being written by a transfer must not be freed under it: a cancel that
        # arrives mid-transfer is applied once the transfer ends.
        self._receiving: set[str] = set()
        self._cancel_after_receive: set[str] = set()
        self._pair_lock = threading.Lock()
        self._outputs: list[dict] = []
        self._cond = threading.Condition()
        # (token batch, events) from the engine loop, logged to Redis and then published by
        # the relay thread: no Redis round trip inside the decode loop, and a token reaches
        # the router only once it is in the log.
        self._relay: queue.Queue = queue.Queue()
        self._tokens_logged: dict[str, int] = {}
        self.state = None
        if redis_url:
            from cluster.state import StateStore

            self.state = StateStore(redis_url)
        threading.Thread(target=self._relay_forever, name=f"{name}-relay", daemon=True).start()
        self.start_loop(self._on_outputs)

    # -- identity and status ----------------------------------------------------------------
    def info(self) -> dict:
        return {
            "name": self.name,
            "host": self.transfer_host,
            "port": self.store.port,
            "layout": self.layout.to_dict(),
            "block_size": self.layout.block_size,
        }

    # -- the handoff ------------------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int) -> list[int] | None:
        if self.draining:
            return None
        return self.loop.call(self.engine.reserve, request_id, num_prompt_tokens).result(10)

    def release(self, request_id: str) -> bool:
        return self.loop.call(self.engine.release, request_id).result(10)

    def check_layout(self, prefill: str, layout: dict) -> None:
        """The handshake: raises LayoutMismatch, naming every differing field."""
        try:
            self.layout.check_compatible(KVLayout.from_dict(layout))
        except LayoutMismatch as e:
            raise LayoutMismatch(f"{prefill} -> {self.name}: {e}") from None

    def fail_request(self, request_id: str, message: str) -> None:
        """The sender gave up on this request's KV: free its reservation, report the error."""
        self.loop.call(self._fail_reserved, request_id, message).result(10)

    def open_pair(self, prefill: str, generation: int, layout: dict) -> None:
        """Rank 1 of a new pair group with `prefill`; returns once both ranks have joined."""
        self.check_layout(prefill, layout)
        group = PairGroup(
            self.store,
            f"pair/{prefill}/{generation}",
            1,
            self.device,
            self.transfer_host,
            self.transfer_timeout_s,
        )
        with self._pair_lock:
            old = self.pairs.get(prefill)
            self.pairs[prefill] = (generation, group)
        if old is not None:
            old[1].close()

    def receive_kv(self, prefill: str, generation: int, admission: dict) -> dict:
        """Receive one request's KV on the pair with `prefill`, then admit the request."""
        rid = admission["request_id"]
        with self._pair_lock:
            current = self.pairs.get(prefill)
        try:
            if current is None or current[0] != generation:
                raise TransferError(f"no pair group {prefill}/{generation} on {self.name}")
            blocks = self.loop.call(
                lambda: (
                    list(self.engine.scheduler.kv.block_table(rid))
                    if rid in self.engine.scheduler.reserved
                    else None
                )
            ).result(10)
            if blocks is None:
                raise TransferError(f"{rid} has no reservation on {self.name}")
            with self._pair_lock:
                self._receiving.add(rid)
            t0 = time.perf_counter()
            runner = self.engine.runner
            # Each layer goes straight into the reserved blocks as it lands; nothing reads
            # reserved blocks until the request is admitted below.
            desc, _ = recv_kv(
                current[1],
                self.layout,
                self.transfer_timeout_s,
                self.device,
                accept=lambda d: d.request_id == rid and d.num_blocks <= len(blocks),
                staging=self.staging.setdefault(prefill, StagingBuffers()),
                on_layer=lambda i, t: runner.import_layer(i, blocks[: t.shape[1]], t),
            )
            seconds = time.perf_counter() - t0
            if self._done_receiving(rid):
                self.loop.call(self.engine.release, rid).result(10)
                return {"ok": True, "seconds": seconds, "finished": True}
            out = self.loop.call(self._admit, admission, desc.first_token).result(10)
            return {"ok": True, "seconds": seconds, "finished": out is not None}
        except Exception as e:
            message = f"KV transfer {prefill} -> {self.name} failed: {e}"
            log.warning("%s", message)
            if current is not None and isinstance(e, TransferError):
                self._drop_pair(prefill, current[0])
            self._done_receiving(rid)
            self.loop.call(self._fail_reserved, rid, message)
            return {"ok": False, "error": message}

    def _done_receiving(self, rid: str) -> bool:
        """The transfer for rid is over; True if it was cancelled meanwhile."""
        with self._pair_lock:
            self._receiving.discard(rid)
            if rid in self._cancel_after_receive:
                self._cancel_after_receive.discard(rid)
                return True
            return False

    def _admit(self, admission: dict, first_token: int) -> RequestOutput | None:
        rid = admission["request_id"]
        if rid not in self.engine.scheduler.reserved:
            return None  # cancelled while the KV was in flight
        self._publish([], {rid: [first_token]})
        self._tokens_logged[rid] = 1
        out = self.engine.add_prefilled(
            rid,
            admission["prompt_ids"],
            first_token,
            sampling_from_dict(admission["sampling"]),
            admission["seed"],
            admission.get("priority", 0),
            admission.get("first_logprob"),
        )
        if out is not None:
            self._on_outputs([out])
        return out

    def _fail_reserved(self, rid: str, message: str) -> None:
        if self.engine.release(rid):
            self._publish(
                [
                    {
                        "request_id": rid,
                        "offset": 1,
                        "token_ids": [],
                        "finished": True,
                        "finish_reason": "error",
                        "error": message,
                    }
                ]
            )

    def _drop_pair(self, prefill: str, generation: int) -> None:
        with self._pair_lock:
            cur = self.pairs.get(prefill)
            if cur is not None and cur[0] == generation:
                del self.pairs[prefill]
                cur[1].close()

    # -- requests -----------------------------------------------------------------------------
    def submit(self, job: dict) -> None:
        """Colocated mode: prefill and decode the request here, chunked prefill mixed into
        the decode batches. Its tokens stream from offset 0."""
        rid = job["request_id"]
        self._tokens_logged[rid] = 0
        sampling = sampling_from_dict({**job["sampling"], "seed": job["seed"]})
        self.loop.call(
            self.engine.add_request, job["prompt_ids"], sampling, rid, job.get("priority", 0)
        ).result(10)

    def cancel(self, request_id: str) -> bool:
        with self._pair_lock:
            if request_id in self._receiving:
                self._cancel_after_receive.add(request_id)
                return True
        return self.loop.call(self.engine.abort, request_id).result(10)

    # -- outputs ------------------------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        batch, events = {}, []
        for o in outputs:
            offset = self._tokens_logged.get(o.request_id, 1)
            if o.new_token_ids:
                batch[o.request_id] = o.new_token_ids
                self._tokens_logged[o.request_id] = offset + len(o.new_token_ids)
            events.append(
                {
                    "request_id": o.request_id,
                    "offset": offset,
                    "token_ids": o.new_token_ids,
                    "logprobs": o.new_logprobs,
                    "finished": o.finished,
                    "finish_reason": o.finish_reason.value if o.finish_reason else None,
                    "error": o.error,
                    "text": o.text,
                }
            )
            if o.finished:
                self._tokens_logged.pop(o.request_id, None)
        self._publish(events, batch)

    def _publish(self, events: list[dict], tokens: dict[str, list[int]] | None = None) -> None:
        self._relay.put((tokens or {}, events))

    def _relay_forever(self) -> None:
        while (item := self._relay.get()) is not None:
            items = [item]
            while not self._relay.empty():  # whatever queued meanwhile: one write for all
                nxt = self._relay.get_nowait()
                if nxt is None:
                    self._relay.put(None)
                    break
                items.append(nxt)
            batch: dict[str, list[int]] = {}
            for tokens, _ in items:
                for rid, ids in tokens.items():
                    batch.setdefault(rid, []).extend(ids)
            if self.state is not None and batch:
                try:
                    self.state.append_tokens(batch)  # one pipelined write
                except Exception:
                    log.exception("token log write to Redis failed")
            with self._cond:
                for _, events in items:
                    self._outputs.extend(events)
                self._cond.notify_all()

    def poll(self, timeout_s: float = 1.0) -> list[dict]:
        """Everything produced since the last poll; waits up to timeout_s for something."""
        with self._cond:
            if not self._outputs:
                self._cond.wait(timeout_s)
            out, self._outputs = self._outputs, []
        return out

    def shutdown(self) -> None:
        self.loop.stop()
        self._relay.put(None)
        with self._pair_lock:
            for _, g in self.pairs.values():
                g.close()
            self.pairs.clear()
