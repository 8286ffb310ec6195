"""The prefill side of the KV handoff to one decode worker: a thread that pushes one
request's KV at a time over that pair's process group.

For each push, in order: open the pair group if there is none (the layout handshake first),
ask the decode worker to receive (`receive_kv`, with the KVAdmission), send the header and the
layers (each gathered out of the cache while the one before is on the wire), wait for the
receiver's answer. The sender never touches the engine: it is handed a `gather` function for
the layers and a `release` function for the blocks, called exactly once per push, whatever
happens.

A failed push closes the pair (the next push rebuilds it under a new generation) and tells
the decode worker, which frees the reservation and reports the attempt as failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.channel import send_kv
from kv_transfer.layout import KVLayout
from kv_transfer.protocol import TransferDescriptor, TransferError
from kv_transfer.torch_dist import PairGroup, store_client
from workers.messages import DecodeEndpoint, KVAdmission, PushResult

log = logging.getLogger(__name__)


@dataclass
class Push:
    admission: KVAdmission
    blocks: list[int]  # held in the prefill worker's cache until `release` is called
    desc: TransferDescriptor
    cancelled: bool = False

    @property
    def request_id(self) -> str:
        return self.desc.request_id


class KVSender:
    def __init__(
        self,
        source: str,
        target: DecodeEndpoint,
        layout: KVLayout,
        device: torch.device,
        bind_host: str,
        timeout_s: float,
        gather: Callable[[int, list[int]], torch.Tensor],
        release: Callable[[list[int]], None],
        on_done: Callable[[Push, PushResult], None],
    ) -> None:
        self.source, self.target = source, target
        self.layout, self.device, self.bind_host = layout, device, bind_host
        self.timeout_s = timeout_s
        self.gather, self.release, self.on_done = gather, release, on_done
        self.group: PairGroup | None = None
        self.generation = 0
        self.queue: queue.Queue[Push | None] = queue.Queue()
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"{source}->{target.name}"
        )
        self.thread.start()

    def submit(self, push: Push) -> None:
        self.queue.put(push)

    def stop(self) -> None:
        self.queue.put(None)
        if self.group is not None:
            self.group.close()

    def _run(self) -> None:
        while (push := self.queue.get()) is not None:
            try:
                result = self._push(push)
            finally:
                self.release(push.blocks)
            self.on_done(push, result)

    def _push(self, push: Push) -> PushResult:
        import ray

        rid, handle = push.request_id, self.target.handle
        if push.cancelled:
            return PushResult(rid, False, error="cancelled")
        try:
            t0 = time.perf_counter()
            self._ensure_group()
            ref = handle.receive_kv.remote(self.source, self.generation, push.admission)
            layers = (self.gather(i, push.blocks) for i in range(self.layout.num_layers))
            send_kv(self.group, push.desc, layers, self.timeout_s)
            received: PushResult = ray.get(ref, timeout=self.timeout_s + 5)
            if not received.ok:
                raise TransferError(received.error or "the receiver failed")
            return PushResult(rid, True, time.perf_counter() - t0)
        except Exception as e:
            message = f"KV push {self.source} -> {self.target.name} failed: {e}"
            log.warning("request %s: %s", rid, message)
            if self.group is not None:
                self.group.close()
                self.group = None  # rebuilt, with a new generation, at the next push
            try:  # the decode worker frees the reservation and reports the attempt failed
                ray.get(
                    handle.fail_request.remote(rid, push.admission.spec.attempt, message),
                    timeout=self.timeout_s,
                )
            except Exception as e2:  # it may be the one that died; the router sees that too
                log.warning("request %s: could not tell %s (%s)", rid, self.target.name, e2)
            return PushResult(rid, False, error=message)

    def _ensure_group(self) -> None:
        import ray

        if self.group is not None:
            return
        handle, timeout = self.target.handle, self.timeout_s
        # The handshake: a layout mismatch is refused here, before any group or bytes.
        ray.get(handle.check_layout.remote(self.source, self.layout.to_dict()), timeout=timeout)
        self.generation += 1
        ref = handle.open_pair.remote(self.source, self.generation, self.layout.to_dict())
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
