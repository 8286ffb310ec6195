"""The requests a decode worker holds, from reservation to their last token, and what happens
to them: admitted once their KV lands, dropped, expired, failed, cancelled, or submitted whole
(colocated). It owns the table of held requests and, through it, which router hears of each
one (the TokenRelay) and what the engine holds for it.

Keyed by id and attempt: a call for an older attempt than the one held is refused, and a
newer attempt replaces what an older one left here. An n > 1 request is reserved and received
once, under its own id; once admitted its choices share the prompt's blocks, and each is held,
followed and cancelled under its own id (`choice_id`), as a request of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.streams import StreamOps
from workers.engine.engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.request import FinishReason, choice_id, split_choice
from workers.engine.scheduler_output import SampledToken
from workers.messages import (
    FirstToken,
    Phase,
    RequestSpec,
    Reservation,
    Status,
    TokenEvent,
    first_event,
)
from workers.token_relay import TokenRelay

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """A request held here: reserved (awaiting its KV) or generating."""

    attempt: int
    offset: int = 0  # output index of the next token it emits
    reserved_until: float | None = None  # while only reserved
    # n > 1, while reserved: choices cancelled before the KV landed (not forked when it does)
    dropped: set[int] = field(default_factory=set)
    # While reserved: the engine stream's event after which its blocks may be written (a
    # step still running may read them for the request that held them last; None on CPU).
    writable: object | None = None


class HeldRequests:
    """Called on the engine's loop thread alone: through `EngineLoop.call` (which runs a
    function between two steps) or as the loop's output handler (`on_outputs`)."""

    def __init__(
        self,
        name: str,
        engine: LLMEngine,
        relay: TokenRelay,
        streams: StreamOps,
        receiving: Callable[[str], bool],
    ) -> None:
        """`receiving(rid)`: whether KV for rid is landing now (a new attempt must wait)."""
        self.name = name
        self.engine, self.relay, self.streams = engine, relay, streams
        self.receiving = receiving
        self._held: dict[str, _Held] = {}

    # -- the handoff ------------------------------------------------------------------------
    def reserve(
        self, rid: str, attempt: int, num_tokens: int, router_id: str, ttl_s: float
    ) -> Reservation | None:
        held = self._held.get(rid)
        if held is not None:
            if held.attempt >= attempt or self.receiving(rid):  # the older KV still lands
                return None
            self.drop(rid)
        n = self.engine.reserve(rid, num_tokens)
        if n is None:
            return None
        until = time.monotonic() + ttl_s
        self._held[rid] = _Held(attempt, reserved_until=until, writable=self.streams.record())
        self.relay.follow(rid, router_id)
        return Reservation(rid, attempt, n)

    def reserved_blocks(self, rid: str, attempt: int) -> tuple[list[int], object] | None:
        """Where this attempt's KV goes, and the event to wait on before writing there. From
        now on the reservation no longer expires: its KV is arriving."""
        held = self._held.get(rid)
        if held is None or held.attempt != attempt or held.reserved_until is None:
            return None
        held.reserved_until = float("inf")
        return self.engine.reserved_blocks(rid), held.writable

    def admit(self, spec: RequestSpec, first: tuple[FirstToken, ...], landed=None) -> None:
        """The KV landed: generate. `landed` is the transfer stream's event after which the
        KV is in its blocks; the engine's stream waits on it before any step reads them."""
        rid = spec.request_id
        held = self._held.get(rid)
        self.streams.wait(landed)
        if held is None or held.attempt != spec.attempt or held.reserved_until is None:
            return  # cancelled or superseded while the KV was in flight
        if len(first) != spec.choices:
            self.fail(rid, spec.attempt, f"{rid}: {len(first)} first tokens, not {spec.choices}")
            return
        outputs = [*spec.output_ids, first[0].token_id]
        # (index, id) of each choice to run here: not those cancelled before the KV landed,
        # nor those already here under a newer attempt (a lone replay of theirs).
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
            tenancy=spec.tenancy,
        )
        # From here each choice is followed, and logged, under its own id.
        events = []
        for i, cid in run:
            self._held[cid] = _Held(spec.attempt, offset=len(outputs))
            self.relay.begin(cid, spec.attempt, spec.router_id, list(spec.output_ids))
            events.append(first_event(spec, first[i], i))
        for out in ended:  # a first token that already ends its choice
            cid = choice_id(rid, out.index)
            events.append(_event(out, cid, spec.attempt, self._held.pop(cid).offset))
        self.relay.emit(events)

    def fail(self, rid: str, attempt: int, message: str, landed=None) -> None:
        """This attempt failed here (its KV never came whole, or a newer attempt runs
        elsewhere): UNAVAILABLE, to be replayed. `landed`: the event after which a transfer
        that did complete has written its blocks; they are not given back before it."""
        self.streams.wait(landed)
        held = self._held.get(rid)
        if held is not None and held.attempt == attempt:
            self._end_here(rid, attempt, Status.UNAVAILABLE, FinishReason.ERROR, message)

    # -- colocated ---------------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> bool:
        """Prefill and decode the request here. False if a newer attempt is already here."""
        rid = spec.request_id
        held = self._held.get(rid)
        if held is not None:
            if held.attempt >= spec.attempt or self.receiving(rid):  # older KV still lands
                return False
            self.drop(rid)
        self.engine.add_request(
            list(spec.prompt_ids),
            spec.sampling,
            rid,
            spec.priority,
            output_ids=spec.output_ids,
            tenancy=spec.tenancy,
        )
        for i in range(spec.choices):  # n > 1: the engine forks them once the prompt is in
            cid = choice_id(rid, i)
            self._held[cid] = _Held(spec.attempt, offset=len(spec.output_ids))
            self.relay.begin(cid, spec.attempt, spec.router_id, list(spec.output_ids))
        return True

    # -- ends --------------------------------------------------------------------------------
    def cancel(
        self, rid: str, notify: bool = False, attempt: int | None = None, landed=None
    ) -> bool:
        """Drop a request (see DecodeWorker.cancel for `notify` and `attempt`; `landed` as
        for `fail`)."""
        self.streams.wait(landed)
        held = self._held.get(rid)
        if held is not None and attempt is not None and held.attempt > attempt:
            return False  # a newer attempt of the request, not the one this cancel means
        parent_of, index = split_choice(rid)
        if held is None and index > 0:  # a choice whose request's KV is on its way
            parent = self._held.get(parent_of)
            if parent is not None and parent.reserved_until is not None:
                parent.dropped.add(index)
                return True
        if held is not None and notify:
            self._end_here(rid, held.attempt, Status.CANCELLED, FinishReason.CANCELLED, "cancelled")
        else:
            self.drop(rid)
        return held is not None

    def drop(self, rid: str) -> None:
        """Forget a request (or one choice of it) here at once: reservation or running, its
        blocks are free. A colocated n > 1 request not yet forked takes its choices along."""
        for cid in [rid, *self._unforked(rid)]:
            self._held.pop(cid, None)
            self.relay.end(cid)
        self.engine.abort(rid, choices=False)

    def fenced(self, rid: str) -> None:
        """The log refused this worker's attempt: a newer one runs elsewhere. Stop, and say so
        to whoever still follows this attempt (it should not, but must not wait for it)."""
        held = self._held.get(rid)
        if held is not None:
            self.fail(rid, held.attempt, f"{self.name}: a newer attempt of it runs elsewhere")

    def expire(self) -> None:
        """Give back every reservation whose KV did not come in time."""
        now = time.monotonic()
        for rid, held in list(self._held.items()):
            if held.reserved_until is not None and now > held.reserved_until:
                log.warning("request %s: reservation expired with no KV; freeing it", rid)
                self.drop(rid)

    def phase(self, rid: str, attempt: int) -> Phase:
        held = self._held.get(rid)
        if held is None or held.attempt != attempt:
            return Phase.ABSENT
        return Phase.RESERVED if held.reserved_until is not None else Phase.RUNNING

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, as token events to whoever follows each request."""
        events = []
        for o in outputs:
            cid = choice_id(o.request_id, o.index)
            held = self._held.get(cid)
            if held is None:
                continue
            events.append(_event(o, cid, held.attempt, held.offset))
            held.offset += len(o.new_token_ids)
            if o.finished:
                del self._held[cid]
        if events:
            self.relay.emit(events)

    def _end_here(
        self, rid: str, attempt: int, status: Status, reason: FinishReason, message: str
    ) -> None:
        """End a request here, telling whoever follows it (its router, which may not be the
        one that asked) with a last event, and drop it."""
        self.relay.emit(
            [
                TokenEvent(
                    cid, attempt, held.offset, finish_reason=reason, status=status, error=message
                )
                for cid in [rid, *self._unforked(rid)]
                if (held := self._held.get(cid)) is not None
            ]
        )
        self.drop(rid)

    def _unforked(self, rid: str) -> list[str]:
        """The ids of a colocated request's choices that its prompt has not forked yet."""
        ids = (choice_id(rid, i) for i in range(1, self.engine.unforked_choices(rid) + 1))
        return [cid for cid in ids if cid in self._held]


def _sampled(cid: str, first: FirstToken) -> SampledToken:
    return SampledToken(cid, first.token_id, first.logprob, first.top_logprobs)


def _event(o: RequestOutput, cid: str, attempt: int, offset: int) -> TokenEvent:
    status = Status.OK
    if o.finish_reason is FinishReason.CANCELLED:
        status = Status.CANCELLED
    elif o.finish_reason is FinishReason.ERROR:
        status = Status.of_error(o.error_kind)
    return TokenEvent(
        cid,
        attempt,
        offset,
        tuple(o.new_token_ids),
        tuple(o.new_logprobs) if o.new_logprobs is not None else None,
        o.finish_reason,
        status,
        o.error or "",
        o.text,
        tuple(o.new_top_logprobs) if o.new_top_logprobs is not None else None,
    )
