"""One request's stream on the router. Token events arrive from several places (the first
token from the prefill worker, the rest from the decode worker's polls, and again from a
replay, which starts over from a known offset) and possibly out of order. They leave in order,
once each, as chunks of token ids with text deltas that never split a character, to every
consumer following the stream (the Generate call, and any Resume calls on this router)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from workers.engine.request import FinishReason
from workers.messages import Status, TokenEvent
from workers.model.tokenizer import TextStream


@dataclass(frozen=True)
class Chunk:
    """What goes to the client: tokens with their text, and the final state on the last one."""

    offset: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    status: Status = Status.OK  # not OK: the request failed (the gRPC call ends with it)
    error: str = ""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # per token, best first
    index: int = 0  # which of the request's n choices


@dataclass
class RequestStream:
    request_id: str
    text: TextStream
    index: int = 0  # the choice this stream carries (n > 1), on each of its chunks
    tokens: list[int] = field(default_factory=list)  # sent, in order
    chunks: list[Chunk] = field(default_factory=list)
    finished: bool = False
    _held: dict[int, TokenEvent] = field(default_factory=dict)
    _waiter: asyncio.Future | None = None

    @classmethod
    def open(
        cls, request_id: str, tokenizer, stops=(), prior: list[int] = (), index: int = 0
    ) -> RequestStream:
        """`prior`: tokens its client already has (a replay adopted from another router)."""
        s = cls(request_id, TextStream(tokenizer, tuple(stops)), index)
        if prior:
            s.text.push(list(prior), None, False)
            s.tokens = list(prior)
        return s

    @property
    def next_offset(self) -> int:
        return len(self.tokens)

    def put(self, event: TokenEvent) -> None:
        """Accept one event of the request's output. Tokens already sent (a replay
        overlapping what went out) are dropped, which is what makes replays exactly-once."""
        if self.finished:
            return
        if event.offset < self.next_offset:
            skip = self.next_offset - event.offset
            if skip >= len(event.token_ids) and not event.finished:
                return
            event = dataclasses.replace(
                event,
                offset=self.next_offset,
                token_ids=event.token_ids[skip:],
                logprobs=event.logprobs[skip:] if event.logprobs else None,
                top_logprobs=event.top_logprobs[skip:] if event.top_logprobs else None,
            )
        self._held.setdefault(event.offset, event)
        while self.next_offset in self._held:
            e = self._held.pop(self.next_offset)
            delta = self.text.push(list(e.token_ids), e.text, e.finished)
            self.tokens += e.token_ids
            self._emit(
                Chunk(
                    e.offset,
                    e.token_ids,
                    delta,
                    e.logprobs or (),
                    e.finished,
                    e.finish_reason,
                    top_logprobs=e.top_logprobs or (),
                    index=self.index,
                )
            )
            if e.finished:
                self.finished = True
                break
            if not e.token_ids:
                break

    def end(self, status: Status, finish_reason: FinishReason | None, error: str = "") -> None:
        """End the stream now (cancelled, failed), after whatever was already sent."""
        if self.finished:
            return
        self.finished = True
        tail = self.text.push([], None, True)
        end = Chunk(self.next_offset, (), tail, (), True, finish_reason, status, error)
        self._emit(dataclasses.replace(end, index=self.index))

    def _emit(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._waiter = None

    async def follow(self, start: int = 0) -> AsyncIterator[Chunk]:
        """Every chunk from index `start` on, as they come, until the last one."""
        i = start
        while True:
            while i < len(self.chunks):
                yield self.chunks[i]
                i += 1
            if self.finished:
                return
            if self._waiter is None:
                self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._waiter)


async def follow_all(streams: list[RequestStream]) -> AsyncIterator[Chunk]:
    """The chunks of several streams (an n > 1 request's choices) as each comes, until every
    stream has ended; each chunk carries its stream's index."""
    if len(streams) == 1:
        async for c in streams[0].follow():
            yield c
        return
    merged: asyncio.Queue[Chunk] = asyncio.Queue()

    async def pump(s: RequestStream) -> None:
        async for c in s.follow():
            merged.put_nowait(c)

    pumps = [asyncio.get_running_loop().create_task(pump(s)) for s in streams]
    try:
        left = len(streams)
        while left:
            c = await merged.get()
            left -= c.finished
            yield c
    finally:
        for t in pumps:
            t.cancel()
