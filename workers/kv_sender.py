"""The prefill side of the KV handoff to one decode worker: a thread that pushes one
request's KV at a time over that pair's process group.

A push starts as the step that completes its request's KV begins, not after it: the model
marks each layer done (LayerProgress) and the sender puts that layer on the wire, straight
out of the cache where the blocks lie in runs, while the model computes the next ones. By
the time the first token is sampled, only the last layer and the trailer (which carries the
first tokens) are left, so the handoff adds almost nothing to the time to first token.

For each push, in order: open the pair group if there is none (the layout handshake first),
ask the decode worker to receive (`receive_kv`, with the request's spec), send the header and
each layer as it is computed, then the trailer: the first tokens, or, if the prefill failed or
was cancelled, an abort that the receiver drops (the pair stays in step). Once the receiver
acks, the next push goes out while the decode worker admits this one: requests prefilled in
one step do not each wait for a decode step before the next one's KV leaves. The sender never
touches the engine: it is handed a `cache_layer` function (layer i's cache tensor) and a
`release` function for the blocks, called exactly once per push, whatever happens.

A failed push closes the pair (the next push rebuilds it under a new generation) and tells
the decode worker, which frees the reservation and reports the attempt as failed.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from kv_transfer.channel import PagedBlocks, StagingBuffers, TransferPlan, send_kv
from kv_transfer.layout import KVLayout
from kv_transfer.protocol import TransferAborted, TransferDescriptor, TransferError
from kv_transfer.streams import StreamOps, device_streams
from kv_transfer.torch_dist import PairGroup, store_client
from workers.messages import DecodeEndpoint, FirstToken, PushResult, RequestSpec, encode_first

log = logging.getLogger(__name__)


class LayerProgress:
    """How far one step's forward has got: the model calls `mark(i)` (on the engine's loop
    thread) once layer i has queued its KV writes, and the worker marks the last layer when
    the step ends, whether it failed or not; senders `wait` for the layer they need next. On
    CUDA each mark records an event on the engine's stream (`event(i)`): the transfer's stream
    waits on that one alone, not on the whole step, and the host never does."""

    def __init__(
        self,
        num_layers: int,
        device: torch.device,
        complete: bool = False,
        streams: StreamOps | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.streams = streams or device_streams(device)
        self._cond = threading.Condition()
        self._done = num_layers if complete else 0
        self._events: list = []

    def mark(self, layer: int) -> None:
        event = self.streams.record()
        with self._cond:
            self._events += [event] * (layer + 1 - len(self._events))  # layers up to this one
            self._done = layer + 1
            self._cond.notify_all()

    def wait(self, layer: int, timeout_s: float) -> None:
        """Until layer `layer` has queued its KV writes; RuntimeError past timeout_s."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done > layer, timeout_s):
                raise RuntimeError(f"layer {layer} not computed within {timeout_s:.0f} s")

    def event(self, layer: int):
        """The event after which layer `layer`'s KV is written (None: already, or the CPU)."""
        with self._cond:
            return self._events[layer] if layer < len(self._events) else None


class Unsent(enum.Enum):
    """Why a push's trailer carries no first tokens (the transfer is then aborted); each
    value is the message sent, `{}` standing for its detail."""

    NO_FIRST_TOKEN = "the prefill step ended without its first token"
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded by a newer attempt"
    FAILED = "the prefill failed: {}"  # the engine's error
    TIMED_OUT = "no first token within {} of the last layer"  # the transfer timeout


@dataclass(frozen=True)
class NoFirstToken:
    why: Unsent
    detail: str = ""

    def __str__(self) -> str:
        return self.why.value.format(self.detail)


@dataclass
class Push:
    spec: RequestSpec
    blocks: list[int]  # held in the prefill worker's cache until `release` is called
    desc: TransferDescriptor
    progress: LayerProgress
    # Each choice's first token once sampled, or why there are none.
    first: Future = field(default_factory=Future)
    computed_at: float = 0.0  # perf_counter when `first` was set: the prefill's end
    cancelled: bool = False
    missing: str = ""  # why a layer went out unfilled; the transfer is then aborted
    plan: TransferPlan | None = None  # how it was cut, once sent

    @property
    def request_id(self) -> str:
        return self.desc.request_id

    @property
    def first_failed(self) -> bool:
        """The prefill gave no first tokens (it failed, or was cancelled or superseded)."""
        return self.first.done() and isinstance(self.first.result(), NoFirstToken)

    def resolve(self, first: tuple[FirstToken, ...] | NoFirstToken) -> None:
        """Called once the prefill step is over: its first tokens, or why it has none.
        Only the first call counts."""
        if self.first.done():
            return
        self.computed_at = time.perf_counter()
        self.first.set_result(first)


class KVSender:
    def __init__(
        self,
        source: str,
        target: DecodeEndpoint,
        layout: KVLayout,
        device: torch.device,
        bind_host: str,
        timeout_s: float,
        cache_layer: Callable[[int], torch.Tensor],
        release: Callable[[list[int]], None],
        on_done: Callable[[Push, PushResult], None],
        read_blocks: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """`read_blocks(cache, ids, out)` gathers blocks to be staged (PagedBlocks.gather)."""
        self.source, self.target = source, target
        self.read_blocks = read_blocks
        self.layout, self.device, self.bind_host = layout, device, bind_host
        self.timeout_s = timeout_s
        self.cache_layer, self.release, self.on_done = cache_layer, release, on_done
        self.group: PairGroup | None = None
        self.staging = StagingBuffers()  # for blocks not in runs; a push waits for its sends
        self.generation = 0
        self.queue: queue.Queue[Push | None] = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"{source}->{target.name}"
        )
        self.thread.start()

    def submit(self, push: Push) -> None:
        with self._lock:
            if not self._stopped:
                self.queue.put(push)
                return
        self._never_sent(push)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self.queue.put(None)
        if self.group is not None:
            self.group.close()

    def _run(self) -> None:
        while (push := self.queue.get()) is not None:
            try:
                outcome = self._push(push)
            except Exception as e:  # a bug, not a transfer failure: this push alone fails
                log.exception("request %s: KV push crashed", push.request_id)
                outcome = PushResult(push.request_id, False, error=f"KV push crashed: {e}")
            self.release(push.blocks)  # acked or failed: the blocks are read for good
            if isinstance(outcome, PushResult):
                self._done(push, outcome)
            else:  # landed; the decode worker admits it while the next push goes out
                outcome.future().add_done_callback(lambda f, p=push: self._admitted(p, f))
        while True:  # stopped: whatever is still queued never leaves
            try:
                push = self.queue.get_nowait()
            except queue.Empty:
                return
            if push is not None:
                self._never_sent(push)

    def _never_sent(self, push: Push) -> None:
        self.release(push.blocks)
        self._done(push, PushResult(push.request_id, False, error="sender stopped"))

    def _done(self, push: Push, result: PushResult) -> None:
        try:
            self.on_done(push, result)
        except Exception:  # the sender thread must outlive a broken callback
            log.exception("request %s: push result handler failed", push.request_id)

    def _push(self, push: Push):
        """Sends one push; returns its PushResult if it is over, or, once the receiver has
        acked every byte, the ref of its `receive_kv` call, which resolves on admission."""
        import ray

        rid, handle = push.request_id, self.target.handle
        if push.cancelled:
            return PushResult(rid, False, error=str(NoFirstToken(Unsent.CANCELLED)))
        try:
            self._ensure_group()
            ref = handle.receive_kv.remote(self.source, self.generation, push.spec)
            push.plan = send_kv(
                self.group,
                push.desc,
                PagedBlocks(
                    push.blocks,
                    lambda i: self._layer(push, i),
                    gather=self.read_blocks,
                    ready=push.progress.event,
                ),
                self.timeout_s,
                verdict=lambda: self._verdict(push),
                staging=self.staging,
            )
            return ref
        except TransferAborted as e:  # the receiver dropped it and reported the attempt
            log.info("request %s: KV push aborted (%s)", rid, e)
            return PushResult(rid, False, error=str(e))
        except Exception as e:
            message = f"KV push {self.source} -> {self.target.name} failed: {e}"
            log.warning("request %s: %s", rid, message)
            if self.group is not None:
                self.group.close()
                self.group = None  # rebuilt, with a new generation, at the next push
            try:  # the decode worker frees the reservation and reports the attempt failed
                ray.get(
                    handle.fail_request.remote(rid, push.spec.attempt, message),
                    timeout=self.timeout_s,
                )
            except Exception as e2:  # it may be the one that died; the router sees that too
                log.warning("request %s: could not tell %s (%s)", rid, self.target.name, e2)
            return PushResult(rid, False, error=message)

    def _admitted(self, push: Push, done) -> None:
        """The receiver's answer, after its ack: it has admitted the request, or has failed
        it (and reported that itself)."""
        rid = push.request_id
        try:
            received: PushResult = done.result()
        except Exception as e:  # the decode worker died; the router sees that too
            received = PushResult(rid, False, error=f"{self.target.name}: {e}")
        if received.ok:
            received = PushResult(rid, True, time.perf_counter() - push.computed_at)
        else:
            log.warning("request %s: not admitted: %s", rid, received.error)
        self._done(push, received)

    def _layer(self, push: Push, i: int) -> torch.Tensor:
        """Layer i's cache once the model has written the layer. If the step fails, the
        rest go out as they are (the trailer then aborts the transfer), so the pair stays in
        step."""
        if not push.missing:
            try:
                push.progress.wait(i, self.timeout_s)
            except RuntimeError as e:
                push.missing = f"layer {i} of its KV was never computed: {e}"
        return self.cache_layer(i)

    def _verdict(self, push: Push) -> tuple[bool, bytes]:
        if push.missing:
            return False, push.missing.encode()
        try:
            first = push.first.result(self.timeout_s)
        except FutureTimeout:
            first = NoFirstToken(Unsent.TIMED_OUT, f"{self.timeout_s:.0f} s")
        if isinstance(first, NoFirstToken):
            return False, str(first).encode()
        return True, encode_first(first)

    def _ensure_group(self) -> None:
        import ray

        if self.group is not None:
            return
        handle, timeout = self.target.handle, self.timeout_s
        # The handshake: a layout mismatch is refused here, before any group or bytes.
        ray.get(handle.check_layout.remote(self.source, self.layout), timeout=timeout)
        self.generation += 1
        ref = handle.open_pair.remote(self.source, self.generation, self.layout)
        store = store_client(self.target.host, self.target.port, timeout)
        try:
            group = PairGroup(
                store,
                f"pair/{self.source}/{self.generation}",
                0,
                self.device,
                self.bind_host,
                timeout,
            )
        except TransferError:
            ray.get(ref, timeout=timeout)  # surfaces a layout mismatch as the cause
            raise
        ray.get(ref, timeout=timeout)
        self.group = group
