"""The decode worker (a Ray actor, named `decode-N`): a thin shell over three rooms, each
owning its own state and called from one kind of thread:

- `HeldRequests` (workers/held_requests.py): the requests held here and what becomes of
  them, on the engine's loop thread alone;
- `KVReceiver` (workers/kv_receiver.py): pair groups, receives and quarantine, from Ray's
  threads, under its own lock;
- `TokenRelay` (workers/token_relay.py): events out to the routers' polls, tokens into the
  log, on its own thread.

A request reaches it in three calls:
1. `reserve(id, attempt, tokens, router)`: blocks for the KV, before any prefill starts, so a
   transfer never lands in a full cache (a reservation not filled in time is given back);
2. `open_pair(prefill, generation, layout)` once per prefill worker (and per rebuild): the
   layout handshake, then the two-rank process group over this worker's TCPStore;
3. `receive_kv(prefill, generation, spec)`: called by the prefill worker as the step that
   completes the request's KV begins; the KV lands, then the request is admitted.

Then the engine loop decodes it with the rest of the batch, and each step's tokens go to the
router that follows the request (`poll`) and to the token log. A failed transfer frees the
reservation and ends the attempt with UNAVAILABLE, which the router replays. In colocated
mode `submit(spec)` runs both phases here.

Threads: Ray's (every actor call; `status` and friends on groups of their own), the engine
loop (HeldRequests, the engine), the relay's, an expiry thread (reservations past their TTL,
through the loop) and the receiver's quarantine threads.
"""

from __future__ import annotations

import logging
import threading

from kv_transfer.layout import KVLayout
from workers.held_requests import HeldRequests
from workers.kv_receiver import KVReceiver
from workers.messages import (
    DecodeEndpoint,
    FirstToken,
    Phase,
    Pool,
    PushResult,
    RequestSpec,
    Reservation,
    TokenEvent,
    TokenLog,
)
from workers.token_relay import TokenRelay
from workers.worker_common import WorkerBase

log = logging.getLogger(__name__)
EXPIRY_INTERVAL_S = 1.0


class DecodeWorker(WorkerBase):
    pool = Pool.DECODE

    def __init__(
        self,
        name: str,
        engine_config,
        token_log: TokenLog | None = None,
        transfer_host: str | None = None,
        transfer_timeout_s: float = 10.0,
    ) -> None:
        super().__init__(name, engine_config, transfer_host, transfer_timeout_s)
        # The log refused this worker's attempt of a request (on the relay's thread).
        fenced = lambda rid: self.loop.call(self.held.fenced, rid)  # noqa: E731
        self.relay = TokenRelay(name, token_log, on_fenced=fenced)
        self.receiver = KVReceiver(
            name,
            self.layout,
            self.device,
            self.transfer_host,
            transfer_timeout_s,
            _LoopLanding(self),
            self.engine.kv_cache_layer,
            self.engine.write_kv_blocks,
        )
        self.held = HeldRequests(
            name, self.engine, self.relay, self.streams, self.receiver.receiving
        )
        self.endpoint = DecodeEndpoint(name, self.transfer_host, self.receiver.port)
        self.start_loop(self.held.on_outputs)
        self._stop = threading.Event()
        threading.Thread(
            target=_every,
            args=(EXPIRY_INTERVAL_S, self._stop, lambda: self.loop.call(self.held.expire)),
            name=f"{name}-expiry",
            daemon=True,
        ).start()

    # -- the handoff ------------------------------------------------------------------------
    def reserve(
        self, request_id: str, attempt: int, num_tokens: int, router_id: str, ttl_s: float
    ) -> Reservation | None:
        """Blocks for `num_tokens` tokens of KV, or None (no room, draining, or a newer
        attempt is already here). Given back if no KV arrives within ttl_s."""
        if self.draining:
            return None
        return self.on_loop(self.held.reserve, request_id, attempt, num_tokens, router_id, ttl_s)

    def check_layout(self, prefill: str, layout: KVLayout) -> None:
        """The handshake: raises LayoutMismatch, naming every differing field."""
        self.receiver.check_layout(prefill, layout)

    def open_pair(self, prefill: str, generation: int, layout: KVLayout) -> None:
        """Rank 1 of a new pair group with `prefill`; returns once both ranks have joined."""
        self.receiver.open_pair(prefill, generation, layout)

    def receive_kv(self, prefill: str, generation: int, spec: RequestSpec) -> PushResult:
        """Receive one request's KV and first tokens on the pair with `prefill`, then admit
        the request."""
        return self.receiver.receive(prefill, generation, spec)

    def fail_request(self, request_id: str, attempt: int, message: str) -> None:
        """The sender gave up on this attempt's KV: free the reservation, report UNAVAILABLE.
        If the KV is still arriving, that happens once the transfer is over: its blocks may
        still be written until then."""
        if not self.receiver.defer_fail(request_id, attempt, message):
            self.on_loop(self.held.fail, request_id, attempt, message)

    # -- requests ---------------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> bool:
        """Colocated mode: prefill and decode the request here, chunked prefill mixed into
        the decode batches. False if a newer attempt is already here."""
        return self.on_loop(self.held.submit, spec)

    def cancel(self, request_id: str, notify: bool = False, attempt: int | None = None) -> bool:
        """Drop a request here. `notify`: a client's cancel, which may come through another
        router than the one following the request: that one is told with a last event, and
        ends its stream now rather than wait for tokens and replay a cancelled request. (A
        router cleaning up after an attempt, or after a reservation it gave up on, tells no
        one: the request may be running elsewhere.) `attempt`: drop it only if what is held
        here is of that attempt or older, not a newer one that came meanwhile. A cancel that
        comes while the request's KV is landing waits for the transfer to end."""
        if self.receiver.defer_cancel(request_id, notify, attempt):
            return True
        return self.on_loop(self.held.cancel, request_id, notify, attempt)

    def phase(self, request_id: str, attempt: int) -> Phase:
        """Where this attempt of the request stands here: reserved (its KV has not landed),
        running, or absent."""
        return self.on_loop(self.held.phase, request_id, attempt)

    def poll(self, router_id: str, timeout_s: float = 1.0) -> list[TokenEvent]:
        """This router's events since its last poll; waits up to timeout_s for one."""
        return self.relay.poll(router_id, timeout_s)

    def forget_prefill(self, name: str) -> None:
        """A prefill worker left the pool: close our pair with it."""
        self.receiver.forget(name)

    def shutdown(self) -> None:
        self._stop.set()
        self.loop.stop()
        self.relay.stop()
        self.receiver.close()


class _LoopLanding:
    """The held requests as the KV receiver reaches them: each call on the engine loop."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def reserved(self, rid: str, attempt: int):
        return self.worker.on_loop(self.worker.held.reserved_blocks, rid, attempt)

    def admit(self, spec: RequestSpec, first: tuple[FirstToken, ...], landed) -> None:
        self.worker.on_loop(self.worker.held.admit, spec, first, landed)

    def fail(self, rid: str, attempt: int, message: str, landed=None) -> None:
        self.worker.loop.call(self.worker.held.fail, rid, attempt, message, landed)

    def cancel(self, rid: str, notify: bool, attempt: int | None, landed=None) -> bool:
        return self.worker.on_loop(self.worker.held.cancel, rid, notify, attempt, landed)

    def hold(self, blocks: list[int]) -> None:
        self.worker.on_loop(self.worker.engine.hold_kv, blocks)

    def release(self, blocks: list[int]) -> None:
        self.worker.loop.call(self.worker.engine.release_kv, blocks)


def _every(interval_s: float, stop: threading.Event, fn) -> None:
    while not stop.wait(interval_s):
        fn()
