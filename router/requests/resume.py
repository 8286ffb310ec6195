"""Resume: a request's output from an offset, then on to its end, for a client whose stream
broke (its router died, or the connection did). From this router's own stream when it drives
the request; otherwise from the store's token log, polled until the record is terminal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from router.errors import RouterError
from router.records.store import RequestRecord
from router.requests.driving import RequestLog
from router.requests.stream import Chunk, RequestStream
from workers.messages import Status
from workers.model.tokenizer import TextStream

_POLL_S = 0.05


class _Text:
    """Text deltas for tokens from `offset` on, primed with those the client already has;
    with stop strings, the final text is cut at the first one, as the engine cuts it."""

    def __init__(self, tokenizer, stops: tuple[str, ...], prior: list[int]) -> None:
        self.stream = TextStream(tokenizer, stops)
        self.stops = stops
        self.stream.push(list(prior), None, False)
        self.stream.emitted = len(self.stream.detok.text)

    def push(self, ids: list[int], finished: bool) -> str:
        if not finished:
            return self.stream.push(ids, None, False)
        delta = self.stream.push(ids, None, False)
        text = self.stream.detok.text
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return delta + self.stream.push([], text[: min(cuts)] if cuts else text, True)


async def from_stream(
    stream: RequestStream, offset: int, tokenizer, stops: tuple[str, ...], index: int = 0
) -> AsyncIterator[Chunk]:
    text: _Text | None = None
    async for c in stream.follow():
        end = c.offset + len(c.token_ids)
        if end < offset and not c.finished:
            continue
        if text is None:
            text = _Text(tokenizer, stops, stream.tokens[:offset])
        start = max(offset, c.offset)
        ids = list(c.token_ids[start - c.offset :])
        yield Chunk(
            start,
            tuple(ids),
            text.push(ids, c.finished),
            (),
            c.finished,
            c.finish_reason,
            c.status,
            c.error,
            index=index,
        )
        offset = max(offset, end)


async def tail_log(
    log: RequestLog, tokenizer, rec: RequestRecord, offset: int, stall: float, index: int = 0
) -> AsyncIterator[Chunk]:
    """The logged tokens from `offset`, polled until the record is terminal; UNAVAILABLE
    (not final) if nothing moves for `stall` seconds."""
    rid, stops = rec.request_id, rec.sampling.stop
    text: _Text | None = None
    cursor, last_progress = offset, time.monotonic()
    while True:
        rec = await log.read(rid)
        if rec is None:
            raise RouterError(Status.NOT_FOUND, f"request {rid} expired while followed")
        done = rec.state.terminal
        if text is None:  # wait for the log to hold what the client has, to prime the text
            logged = await log.tokens(rid, 0)
            tokens = []
            if len(logged) >= offset or done:
                text = _Text(tokenizer, stops, logged[:offset])
                tokens = logged[offset:]
        else:
            tokens = await log.tokens(rid, cursor)
        if text is not None and (tokens or done):
            yield Chunk(
                cursor,
                tuple(tokens),
                text.push(tokens, done),
                (),
                done,
                rec.finish_reason if done else None,
                rec.status if done else Status.OK,
                rec.error if done else "",
                index=index,
            )
            cursor += len(tokens)
            last_progress = time.monotonic()
        if done:
            return
        if time.monotonic() - last_progress > stall:
            raise RouterError(
                Status.UNAVAILABLE, f"request {rid} made no progress for {stall:.0f} s", final=False
            )
        await asyncio.sleep(_POLL_S)
