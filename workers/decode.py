"""The decode worker (a Ray actor, named `decode-N`).

A request reaches it in three calls:
1. `reserve(id, attempt, tokens, router)`: blocks for the KV, before any prefill starts, so a
   transfer never lands in a full cache (a reservation not filled in time is given back);
2. `open_pair(prefill, generation, layout)` once per prefill worker (and per rebuild): the
   layout handshake, then the two-rank process group over this worker's TCPStore;
3. `receive_kv(prefill, generation, spec)`: called by the prefill worker as the step that
   completes the request's KV begins; receives each layer into the reserved blocks as the
   prefill computes it, then the first tokens (the transfer's trailer), and admits the request.

Then the engine loop decodes it with the rest of the batch, and the TokenRelay carries each
step's tokens to the router that follows the request (`poll`) and to the token log. A failed
transfer frees the reservation and ends the attempt with UNAVAILABLE, which the router replays.
In colocated mode `submit(spec)` runs both phases here.

A request with n > 1 choices is reserved and received once, under its own id; once admitted,
its choices share the prompt's blocks and each is held, followed and cancelled under its own
id (`choice_id`), as a request of its own.

Requests are keyed by id and attempt: a call for an older attempt than the one held is refused,
and a newer attempt replaces what an older one left here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kv_transfer.channel import PagedBlocks, StagingBuffers, recv_kv
from kv_transfer.layout import KVLayout, LayoutMismatch
from kv_transfer.protocol import TransferAborted, TransferError
from kv_transfer.torch_dist import PairGroup, store_server
from workers.engine.engine import RequestOutput
from workers.engine.request import FinishReason, choice_id, choice_index
from workers.engine.scheduler_output import SampledToken
from workers.messages import (
    DecodeEndpoint,
    FirstToken,
    Pool,
    PushResult,
    RequestSpec,
    Reservation,
    Status,
    TokenEvent,
    TokenLog,
    WorkerInfo,
    decode_first,
    first_event,
)
from workers.token_relay import TokenRelay
from workers.worker_common import WorkerBase

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A request this worker holds: reserved (awaiting its KV) or generating."""

    attempt: int
    offset: int = 0  # output index of the next token it emits
    reserved_until: float | None = None  # while only reserved
    # While reserved: the engine stream's event after which its blocks may be written (a
    # step still running may read them for the request that held them last; None on CPU).
    writable: object | None = None
    # n > 1, while reserved: choices cancelled before the KV landed (not forked when it does)
    dropped: set[int] = field(default_factory=set)


def _sampled(cid: str, first: FirstToken) -> SampledToken:
    return SampledToken(cid, first.token_id, first.logprob, first.top_logprobs)


def status_of(o: RequestOutput) -> Status:
    if o.finish_reason is FinishReason.CANCELLED:
        return Status.CANCELLED
    if o.finish_reason is FinishReason.ERROR:
        return Status.RESOURCE_EXHAUSTED if o.error and "KV blocks" in o.error else Status.INTERNAL
    return Status.OK


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
        self.store = store_server(self.transfer_host)
        self.pairs: dict[str, tuple[int, PairGroup]] = {}
        self.staging: dict[str, StagingBuffers] = {}  # per pair: receive buffers, reused
        # Blocks being written by a transfer must not be freed under it: a cancel that
        # arrives mid-transfer is applied once the transfer ends.
        self._receiving: set[str] = set()
        # request id: (notify, attempt) of a cancel that came while its KV was arriving
        self._cancel_after_receive: dict[str, tuple[bool, int | None]] = {}
        self._fail_after_receive: dict[str, tuple[int, str]] = {}  # the sender gave up meanwhile
        self._pair_lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # the loop thread's alone
        self.relay = TokenRelay(name, token_log, on_fenced=self._fenced)
        self.start_loop(self._on_outputs)
        self._stop = threading.Event()
        threading.Thread(target=self._expire_forever, name=f"{name}-expiry", daemon=True).start()

    def info(self) -> WorkerInfo:
        endpoint = DecodeEndpoint(self.name, self.transfer_host, self.store.port)
        return WorkerInfo(
            self.name,
            self.pool,
            self.pid,
            self.node,
            endpoint,
            self.transfer_host,
            self.liveness.port,
        )

    # -- the handoff ------------------------------------------------------------------------
    def reserve(
        self, request_id: str, attempt: int, num_tokens: int, router_id: str, ttl_s: float
    ) -> Reservation | None:
        """Blocks for `num_tokens` tokens of KV, or None (no room, draining, or a newer
        attempt is already here). Given back if no KV arrives within ttl_s."""
        if self.draining:
            return None
        return self.on_loop(self._reserve, request_id, attempt, num_tokens, router_id, ttl_s)

    def _reserve(self, rid: str, attempt: int, num_tokens: int, router_id: str, ttl_s: float):
        held = self._held.get(rid)
        if held is not None:
            if held.attempt >= attempt:
                return None
            with self._pair_lock:
                if rid in self._receiving:  # the older attempt's KV is still landing
                    return None
            self._drop(rid)
        n = self.engine.reserve(rid, num_tokens)
        if n is None:
            return None
        self._held[rid] = _Held(
            attempt, reserved_until=time.monotonic() + ttl_s, writable=self.streams.record()
        )
        self.relay.follow(rid, router_id)
        return Reservation(rid, attempt, n)

    def check_layout(self, prefill: str, layout: dict) -> None:
        """The handshake: raises LayoutMismatch, naming every differing field."""
        try:
            self.layout.check_compatible(KVLayout.from_dict(layout))
        except LayoutMismatch as e:
            raise LayoutMismatch(f"{prefill} -> {self.name}: {e}") from None

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

    def receive_kv(self, prefill: str, generation: int, spec: RequestSpec) -> PushResult:
        """Receive one request's KV and first tokens on the pair with `prefill`, then admit
        the request."""
        rid = spec.request_id
        blocks = None
        with self._pair_lock:
            current = self.pairs.get(prefill)
            self._receiving.add(rid)
        try:
            if current is None or current[0] != generation:
                raise TransferError(f"no pair group {prefill}/{generation} on {self.name}")
            reserved = self.on_loop(self._reserved_blocks, rid, spec.attempt)
            if reserved is None:
                raise TransferError(f"{rid} (attempt {spec.attempt}) has no reservation here")
            blocks, writable = reserved
            t0 = time.perf_counter()
            side = None

            def target(d):
                nonlocal side
                if d.request_id != rid or d.num_blocks > len(blocks):
                    return None
                side = PagedBlocks(
                    blocks[: d.num_blocks],
                    self.engine.kv_cache_layer,
                    self.engine.write_kv_blocks,
                    writable=writable,
                )
                return side

            # The KV lands in the reserved blocks, in place where they lie in runs; nothing
            # reads reserved blocks until the request is admitted below.
            _, payload = recv_kv(
                current[1],
                self.layout,
                self.transfer_timeout_s,
                self.device,
                target=target,
                staging=self.staging.setdefault(prefill, StagingBuffers()),
            )
            first = decode_first(payload)
            seconds = time.perf_counter() - t0
            cancelled, failed = self._done_receiving(rid)
            if failed is not None:  # the sender gave up meanwhile: its report stands
                self.on_loop(self._fail, rid, *failed)
                return PushResult(rid, False, error=failed[1])
            if cancelled is not None:
                self.on_loop(self._cancel, rid, *cancelled)
                return PushResult(rid, True, seconds)
            self.on_loop(self._admit, spec, first, side.landed)
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
            self._done_receiving(rid)
            self.loop.call(self._fail, rid, spec.attempt, message)
            return PushResult(rid, False, error=message)

    def _quarantine(self, rid: str, prefill: str, group, blocks, pending) -> None:
        """A transfer failed with receives still posted, and gloo does not cancel them: late
        bytes may yet land in the reserved blocks or in the pair's staging buffers. The
        blocks are held (an extra reference, so failing the request does not free them) until
        those receives can no longer write; the staging buffers are left to them."""
        with self._pair_lock:
            self.staging.pop(prefill, None)
        if blocks is None:  # the staging buffers stay with the receives
            return
        try:
            self.on_loop(self.engine.hold_kv, blocks)
        except RuntimeError as e:  # not held any more: nothing to keep
            log.warning("request %s: cannot hold its KV blocks after a failed transfer: %s", rid, e)
            return

        def release() -> None:
            try:
                group.settle(pending, self.transfer_timeout_s)
            except TransferError as e:  # still being written: held for good, not reused
                log.error("request %s: %d KV blocks stay held: %s", rid, len(blocks), e)
                return
            self.loop.call(self.engine.release_kv, blocks)
            log.info("request %s: %d quarantined KV blocks released", rid, len(blocks))

        threading.Thread(target=release, name=f"{self.name}-quarantine", daemon=True).start()

    def fail_request(self, request_id: str, attempt: int, message: str) -> None:
        """The sender gave up on this attempt's KV: free the reservation, report UNAVAILABLE.
        If the KV is still arriving, that happens once the transfer is over: its blocks may
        still be written until then."""
        with self._pair_lock:
            if request_id in self._receiving:
                self._fail_after_receive[request_id] = (attempt, message)
                return
        self.on_loop(self._fail, request_id, attempt, message)

    def _reserved_blocks(self, rid: str, attempt: int) -> tuple[list[int], object] | None:
        """Where this attempt's KV goes, and the event to wait on before writing there."""
        held = self._held.get(rid)
        if held is None or held.attempt != attempt or held.reserved_until is None:
            return None
        held.reserved_until = float("inf")  # the KV is arriving: no longer expires
        return self.engine.reserved_blocks(rid), held.writable

    def _done_receiving(
        self, rid: str
    ) -> tuple[tuple[bool, int | None] | None, tuple[int, str] | None]:
        """The transfer for rid is over: the cancel that came meanwhile, if any (its `notify`
        and `attempt`), and the failure
        its sender reported meanwhile (attempt, message), if any."""
        with self._pair_lock:
            self._receiving.discard(rid)
            cancelled = self._cancel_after_receive.pop(rid, None)
            return cancelled, self._fail_after_receive.pop(rid, None)

    # -- on the loop thread -----------------------------------------------------------------
    def _admit(self, spec: RequestSpec, first: tuple[FirstToken, ...], landed=None) -> None:
        """`landed`: the transfer stream's event after which the KV is in its blocks; the
        engine's stream waits on it before any step reads them."""
        rid = spec.request_id
        held = self._held.get(rid)
        if held is None or held.attempt != spec.attempt or held.reserved_until is None:
            return  # cancelled or superseded while the KV was in flight
        self.streams.wait(landed)
        if len(first) != spec.choices:
            self._fail(rid, spec.attempt, f"{rid}: {len(first)} first tokens, not {spec.choices}")
            return
        token = first[0].token_id
        outputs = [*spec.output_ids, token]
        # Choices cancelled before the KV landed, or already here under a newer attempt (a
        # lone replay of theirs), are not forked.
        # (index, id) of each choice to run here; a replayed choice is a request of its own.
        run = [(0, rid)] + [
            (i, choice_id(rid, i))
            for i in range(1, spec.choices)
            if i not in held.dropped and choice_id(rid, i) not in self._held
        ]
        ended = self.engine.add_prefilled(
            rid,
            list(spec.prompt_ids),
            outputs,
            spec.sampling,
            spec.sampling.seed,
            spec.priority,
            first[0].logprob,
            first[0].top_logprobs,
            siblings=tuple(_sampled(cid, first[i]) for i, cid in run[1:]),
        )
        # From here each choice is followed, and logged, under its own id.
        events = []
        for i, cid in run:
            self._held[cid] = _Held(spec.attempt, offset=len(outputs))
            self.relay.begin(cid, spec.attempt, spec.router_id, list(spec.output_ids))
            events.append(first_event(spec, first[i], i))
        for out in ended:  # a first token that already ends its choice
            cid = choice_id(rid, out.index)
            events.append(self._event(out, cid, spec.attempt, self._held.pop(cid).offset))
        self.relay.emit(events)

    def _fail(self, rid: str, attempt: int, message: str) -> None:
        held = self._held.get(rid)
        if held is None or held.attempt != attempt:
            return
        self._end_here(rid, attempt, Status.UNAVAILABLE, FinishReason.ERROR, message)

    def _end_here(
        self, rid: str, attempt: int, status: Status, reason: FinishReason, message: str
    ) -> None:
        """End a request here, telling whoever follows it (its router, which may not be the
        one that asked) with a last event, and drop it."""
        self.relay.emit(
            [
                TokenEvent(
                    cid,
                    attempt,
                    held.offset,
                    finish_reason=reason,
                    status=status,
                    error=message,
                )
                for cid in [rid, *self._unforked(rid)]
                if (held := self._held.get(cid)) is not None
            ]
        )
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        """Forget a request (or one choice of it) here at once: reservation or running, its
        blocks are free. A colocated n > 1 request not yet forked takes its choices along."""
        for cid in [rid, *self._unforked(rid)]:
            self._held.pop(cid, None)
            self.relay.end(cid)
        self.engine.abort(rid, choices=False)

    def _unforked(self, rid: str) -> list[str]:
        """The ids of a colocated request's choices that its prompt has not forked yet."""
        ids = (choice_id(rid, i) for i in range(1, self.engine.unforked_choices(rid) + 1))
        return [cid for cid in ids if cid in self._held]

    def _fenced(self, rid: str) -> None:
        """The log refused this worker's attempt: a newer one runs elsewhere. Stop, and say so
        to whoever still follows this attempt (it should not, but must not wait for it)."""

        def fail_here():
            held = self._held.get(rid)
            if held is not None:
                self._fail(rid, held.attempt, f"{self.name}: a newer attempt of it runs elsewhere")

        self.loop.call(fail_here)

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, held in list(self._held.items()):
            if held.reserved_until is not None and now > held.reserved_until:
                log.warning("request %s: reservation expired with no KV; freeing it", rid)
                self._drop(rid)

    def _expire_forever(self) -> None:
        while not self._stop.wait(1.0):
            self.loop.call(self._expire)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        events = []
        for o in outputs:
            cid = choice_id(o.request_id, o.index)
            held = self._held.get(cid)
            if held is None:
                continue
            events.append(self._event(o, cid, held.attempt, held.offset))
            held.offset += len(o.new_token_ids)
            if o.finished:
                del self._held[cid]
        if events:
            self.relay.emit(events)

    @staticmethod
    def _event(o: RequestOutput, cid: str, attempt: int, offset: int) -> TokenEvent:
        return TokenEvent(
            cid,
            attempt,
            offset,
            tuple(o.new_token_ids),
            tuple(o.new_logprobs) if o.new_logprobs is not None else None,
            o.finish_reason,
            status_of(o),
            o.error or "",
            o.text,
            tuple(o.new_top_logprobs) if o.new_top_logprobs is not None else None,
        )

    # -- requests ---------------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> bool:
        """Colocated mode: prefill and decode the request here, chunked prefill mixed into
        the decode batches. False if a newer attempt is already here."""
        return self.on_loop(self._submit, spec)

    def _submit(self, spec: RequestSpec) -> bool:
        rid = spec.request_id
        held = self._held.get(rid)
        if held is not None:
            if held.attempt >= spec.attempt:
                return False
            self._drop(rid)
        self.engine.add_request(
            list(spec.prompt_ids),
            spec.sampling,
            rid,
            spec.priority,
            output_ids=spec.output_ids,
        )
        for i in range(spec.choices):  # n > 1: the engine forks them once the prompt is in
            cid = choice_id(rid, i)
            self._held[cid] = _Held(spec.attempt, offset=len(spec.output_ids))
            self.relay.begin(cid, spec.attempt, spec.router_id, list(spec.output_ids))
        return True

    def cancel(self, request_id: str, notify: bool = False, attempt: int | None = None) -> bool:
        """Drop a request here. `notify`: a client's cancel, which may come through another
        router than the one following the request: that one is told with a last event, and
        ends its stream now rather than wait for tokens and replay a cancelled request. (A
        router cleaning up after an attempt, or after a reservation it gave up on, tells no
        one: the request may be running elsewhere.) `attempt`: drop it only if what is held
        here is of that attempt or older, not a newer one that came meanwhile."""
        with self._pair_lock:
            if request_id in self._receiving:
                before = self._cancel_after_receive.get(request_id, (False, attempt))
                self._cancel_after_receive[request_id] = (notify or before[0], attempt)
                return True
        return self.on_loop(self._cancel, request_id, notify, attempt)

    def _cancel(self, rid: str, notify: bool = False, attempt: int | None = None) -> bool:
        held = self._held.get(rid)
        if held is not None and attempt is not None and held.attempt > attempt:
            return False  # a newer attempt of the request, not the one this cancel means
        if held is None and choice_index(rid) > 0:  # a choice whose request's KV is on its way
            parent = self._held.get(rid.rpartition("#")[0])
            if parent is not None and parent.reserved_until is not None:
                parent.dropped.add(choice_index(rid))
                return True
        if held is not None and notify:
            self._end_here(rid, held.attempt, Status.CANCELLED, FinishReason.CANCELLED, "cancelled")
        else:
            self._drop(rid)
        return held is not None

    def phase(self, request_id: str, attempt: int) -> str:
        """Where this attempt of the request stands here: "running", "reserved" (its KV has
        not landed), or "" (not here)."""
        return self.on_loop(self._phase, request_id, attempt)

    def _phase(self, rid: str, attempt: int) -> str:
        held = self._held.get(rid)
        if held is None or held.attempt != attempt:
            return ""
        return "reserved" if held.reserved_until is not None else "running"

    def poll(self, router_id: str, timeout_s: float = 1.0) -> list[TokenEvent]:
        """This router's events since its last poll; waits up to timeout_s for one."""
        return self.relay.poll(router_id, timeout_s)

    def _drop_pair(self, prefill: str, generation: int) -> None:
        with self._pair_lock:
            cur = self.pairs.get(prefill)
            if cur is not None and cur[0] == generation:
                del self.pairs[prefill]
                cur[1].close()

    def forget_prefill(self, name: str) -> None:
        """A prefill worker left the pool: close our pair with it."""
        with self._pair_lock:
            cur = self.pairs.pop(name, None)
            self.staging.pop(name, None)
        if cur is not None:
            cur[1].close()

    def shutdown(self) -> None:
        self._stop.set()
        self.loop.stop()
        self.relay.stop()
        with self._pair_lock:
            for _, g in self.pairs.values():
                g.close()
            self.pairs.clear()
