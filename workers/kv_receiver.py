"""The decode side of the KV handoff, as workers/kv_sender.py is the prefill side: the
worker's rendezvous store, one pair group per prefill worker (rebuilt under a new generation
after a failure), each transfer's receive into the blocks its request reserved, and the
quarantine of blocks that a failed transfer may still write.

Per push, the prefill worker calls `receive` (the worker's `receive_kv`) as the step that
completes the request's KV begins: each layer lands in the reserved blocks as the prefill
computes it (in place where they lie in runs, through a staging buffer and a scatter
otherwise), then the first tokens arrive in the trailer, and the request is admitted.

A cancel or a failure report that comes while a request's KV is landing is held until the
transfer is over: its blocks must not be freed under the bytes still arriving.

It never touches the requests its worker holds: it asks for them through a `Landing`, each of
whose calls runs on the worker's engine loop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import torch

from kv_transfer.channel import PagedBlocks, StagingBuffers, recv_kv
from kv_transfer.layout import KVLayout, LayoutMismatch
from kv_transfer.protocol import TransferAborted, TransferError
from kv_transfer.torch_dist import PairGroup, store_server
from workers.messages import FirstToken, PushResult, RequestSpec, decode_first

log = logging.getLogger(__name__)


class Landing(Protocol):
    """What the receiver asks of the requests its worker holds. Each call runs on the
    worker's engine loop and returns its result, except `fail` and `release`, which are
    queued there and not waited for."""

    def reserved(self, rid: str, attempt: int) -> tuple[list[int], object] | None:
        """The attempt's reserved blocks and the event to wait on before writing them."""

    def admit(self, spec: RequestSpec, first: tuple[FirstToken, ...], landed) -> None: ...

    def fail(self, rid: str, attempt: int, message: str, landed=None) -> None:
        """`landed`, here and in `cancel`: a completed transfer's event, which the engine
        waits on before the blocks it wrote are given back (staged layers are scattered
        into them on the transfer's stream, perhaps still running)."""

    def cancel(self, rid: str, notify: bool, attempt: int | None, landed=None) -> bool: ...

    def hold(self, blocks: list[int]) -> None:
        """An extra reference on blocks (RuntimeError if nothing holds them any more)."""

    def release(self, blocks: list[int]) -> None: ...


class KVReceiver:
    """Called from Ray's threads (the worker's actor calls, several at once) and from the
    quarantine threads it starts; all its state is under `_lock`."""

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        device: torch.device,
        host: str,
        timeout_s: float,
        landing: Landing,
        cache_layer,
        write_blocks,
    ) -> None:
        """`cache_layer(i)`: layer i's cache; `write_blocks(cache, ids, rows)`: staged blocks
        into it (the engine's; safe from a transfer thread for reserved blocks)."""
        self.name, self.layout, self.device = name, layout, device
        self.host, self.timeout_s = host, timeout_s
        self.landing = landing
        self.cache_layer, self.write_blocks = cache_layer, write_blocks
        self.store = store_server(host)
        self._lock = threading.Lock()
        self._pairs: dict[str, tuple[int, PairGroup]] = {}  # by prefill worker
        self._staging: dict[str, StagingBuffers] = {}  # per pair: receive buffers, reused
        self._receiving: set[str] = set()  # request ids whose KV is landing
        # request id: (notify, attempt) of a cancel that came while its KV was arriving
        self._cancel_after: dict[str, tuple[bool, int | None]] = {}
        self._fail_after: dict[str, tuple[int, str]] = {}  # the sender gave up meanwhile

    @property
    def port(self) -> int:
        return self.store.port

    def receiving(self, rid: str) -> bool:
        with self._lock:
            return rid in self._receiving

    # -- pairs -------------------------------------------------------------------------------
    def check_layout(self, prefill: str, layout: KVLayout) -> None:
        """The handshake: raises LayoutMismatch, naming every differing field."""
        try:
            self.layout.check_compatible(layout)
        except LayoutMismatch as e:
            raise LayoutMismatch(f"{prefill} -> {self.name}: {e}") from None

    def open_pair(self, prefill: str, generation: int, layout: KVLayout) -> None:
        """Rank 1 of a new pair group with `prefill`; returns once both ranks have joined."""
        self.check_layout(prefill, layout)
        group = PairGroup(
            self.store,
            f"pair/{prefill}/{generation}",
            1,
            self.device,
            self.host,
            self.timeout_s,
        )
        with self._lock:
            old = self._pairs.get(prefill)
            self._pairs[prefill] = (generation, group)
        if old is not None:
            old[1].close()

    def forget(self, prefill: str) -> None:
        """A prefill worker left the pool: close our pair with it."""
        with self._lock:
            cur = self._pairs.pop(prefill, None)
            self._staging.pop(prefill, None)
        if cur is not None:
            cur[1].close()

    def close(self) -> None:
        with self._lock:
            groups = [g for _, g in self._pairs.values()]
            self._pairs.clear()
        for g in groups:
            g.close()

    # -- a transfer --------------------------------------------------------------------------
    def receive(self, prefill: str, generation: int, spec: RequestSpec) -> PushResult:
        """Receive one request's KV and first tokens on the pair with `prefill`, then admit
        the request. Until it is admitted, failed or cancelled here, a cancel or a failure
        that comes for it waits (`defer_cancel`, `defer_fail`), and is applied after."""
        rid = spec.request_id
        blocks = side = None
        with self._lock:
            current = self._pairs.get(prefill)
            self._receiving.add(rid)
            staging = self._staging.setdefault(prefill, StagingBuffers())
        try:
            if current is None or current[0] != generation:
                raise TransferError(f"no pair group {prefill}/{generation} on {self.name}")
            reserved = self.landing.reserved(rid, spec.attempt)
            if reserved is None:
                raise TransferError(f"{rid} (attempt {spec.attempt}) has no reservation here")
            blocks, writable = reserved
            t0 = time.perf_counter()
            side = PagedBlocks([], self.cache_layer, self.write_blocks, writable=writable)

            def target(d):
                if d.request_id != rid or d.num_blocks > len(blocks):
                    return None
                side.block_ids = blocks[: d.num_blocks]
                return side

            # The KV lands in the reserved blocks, in place where they lie in runs; nothing
            # reads reserved blocks until the request is admitted below.
            _, payload = recv_kv(
                current[1], self.layout, self.timeout_s, self.device, target, staging
            )
            first = decode_first(payload)
            seconds = time.perf_counter() - t0
            # Whatever ends it here waits on the landing: staged layers may still be being
            # scattered into the blocks on the transfer's stream.
            cancelled, failed = self._deferred(rid)
            if failed is not None:  # the sender gave up meanwhile: its report stands
                self.landing.fail(rid, *failed, landed=side.landed)
                return PushResult(rid, False, error=failed[1])
            if cancelled is not None:
                self.landing.cancel(rid, *cancelled, landed=side.landed)
                return PushResult(rid, True, seconds)
            self.landing.admit(spec, first, side.landed)
            return PushResult(rid, True, seconds)
        except Exception as e:
            message = f"KV transfer {prefill} -> {self.name} failed: {e}"
            log.warning("request %s: %s", rid, message)
            broken = isinstance(e, TransferError) and not isinstance(e, TransferAborted)
            if current is not None and broken:
                self._drop_pair(prefill, current[0])
            pending = getattr(e, "pending", None)
            if pending and current is not None:
                self._quarantine(rid, prefill, current[1], blocks, pending)
            # An aborted transfer landed whole (and its landing event was recorded).
            landed = side.landed if side is not None else None
            cancelled, _ = self._deferred(rid)
            if cancelled is not None:  # the client's cancel stands: CANCELLED, not a replay
                self.landing.cancel(rid, *cancelled, landed=landed)
            else:
                self.landing.fail(rid, spec.attempt, message, landed=landed)
            return PushResult(rid, False, error=message)
        finally:
            # What came after the request was admitted, failed or cancelled here applies to
            # it as it now is.
            cancelled, failed = self._done(rid)
            if failed is not None:
                self.landing.fail(rid, *failed)
            if cancelled is not None:
                self.landing.cancel(rid, *cancelled)

    def defer_cancel(self, rid: str, notify: bool, attempt: int | None) -> bool:
        """If rid's KV is landing now, hold the cancel until it has (True); else False: the
        caller cancels at once."""
        with self._lock:
            if rid not in self._receiving:
                return False
            before = self._cancel_after.get(rid, (False, attempt))
            self._cancel_after[rid] = (notify or before[0], attempt)
            return True

    def defer_fail(self, rid: str, attempt: int, message: str) -> bool:
        """The sender gave up on rid: if its KV is landing now, the failure is applied once
        the transfer is over (True); else False: the caller fails it at once."""
        with self._lock:
            if rid not in self._receiving:
                return False
            self._fail_after[rid] = (attempt, message)
            return True

    def _deferred(self, rid: str) -> tuple[tuple[bool, int | None] | None, tuple[int, str] | None]:
        """The cancel that came for rid while its KV landed, if any (its `notify` and
        `attempt`), and the failure its sender reported meanwhile (attempt, message); taken,
        while rid stays among those landing."""
        with self._lock:
            return self._cancel_after.pop(rid, None), self._fail_after.pop(rid, None)

    def _done(self, rid: str) -> tuple[tuple[bool, int | None] | None, tuple[int, str] | None]:
        """The transfer for rid is over, and it is admitted, failed or cancelled here: what
        was deferred since `_deferred`, now to apply as to any request here."""
        with self._lock:
            self._receiving.discard(rid)
            return self._cancel_after.pop(rid, None), self._fail_after.pop(rid, None)

    def _drop_pair(self, prefill: str, generation: int) -> None:
        with self._lock:
            cur = self._pairs.get(prefill)
            if cur is None or cur[0] != generation:
                return
            del self._pairs[prefill]
        cur[1].close()

    def _quarantine(self, rid: str, prefill: str, group, blocks, pending) -> None:
        """A transfer failed with receives still posted, and gloo does not cancel them: late
        bytes may yet land in the reserved blocks or in the pair's staging buffers. The
        blocks are held (an extra reference, so failing the request does not free them) until
        those receives can no longer write; the staging buffers are left to them."""
        with self._lock:
            self._staging.pop(prefill, None)
        if blocks is None:  # the staging buffers stay with the receives
            return
        try:
            self.landing.hold(blocks)
        except RuntimeError as e:  # not held any more: nothing to keep
            log.warning("request %s: cannot hold its KV blocks after a failed transfer: %s", rid, e)
            return

        def release() -> None:
            try:
                group.settle(pending, self.timeout_s)
            except TransferError as e:  # still being written: held for good, not reused
                log.error("request %s: %d KV blocks stay held: %s", rid, len(blocks), e)
                return
            self.landing.release(blocks)
            log.info("request %s: %d quarantined KV blocks released", rid, len(blocks))

        threading.Thread(target=release, name=f"{self.name}-quarantine", daemon=True).start()
