"""One request's stream on the router: token events arrive from two places (the first token
from the prefill worker, the rest from the decode worker's polls) and possibly out of order;
they leave in order, once each, as text deltas that never split a character."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from workers.model.tokenizer import TextStream

END_NOW = -1  # an Event offset that ends the stream at once (cancel, a dead worker)


@dataclass
class Event:
    offset: int  # index of token_ids[0] among the request's output tokens
    token_ids: list[int]
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None  # decode's text so far, cut at a stop string (stop requests only)

    @classmethod
    def from_dict(cls, d: dict) -> Event:
        return cls(
            d["offset"],
            list(d["token_ids"]),
            d.get("logprobs"),
            d["finished"],
            d.get("finish_reason"),
            d.get("error"),
            d.get("text"),
        )


@dataclass
class Chunk:
    """What goes to the client: tokens with their text, and the final state on the last one."""

    offset: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    def __init__(self, request_id: str, tokenizer, stops: tuple[str, ...]) -> None:
        self.request_id = request_id
        self.text = TextStream(tokenizer, stops)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.next_offset = 0
        self.tokens: list[int] = []
        self._held: dict[int, Event] = {}
        self.finished = False
        self.decode_worker: str | None = None
        self.prefill_worker: str | None = None

    def put(self, event: Event) -> None:
        self.queue.put_nowait(event)

    def end_now(self, finish_reason: str, error: str | None = None) -> None:
        self.put(Event(END_NOW, [], finished=True, finish_reason=finish_reason, error=error))

    def order(self, event: Event) -> list[Chunk]:
        """Accept one event; return the chunks now ready to send, in order. Duplicates (an
        offset already sent) are dropped, which is what makes replays exactly-once."""
        if self.finished:
            return []
        if event.offset == END_NOW:
            self.finished = True
            return [
                Chunk(
                    self.next_offset,
                    [],
                    self.text.push([], None, True),
                    [],
                    True,
                    event.finish_reason,
                    event.error,
                )
            ]
        if event.offset < self.next_offset and event.token_ids:
            skip = self.next_offset - event.offset  # a replay overlapping what was sent
            if skip >= len(event.token_ids) and not event.finished:
                return []
            event = Event(
                self.next_offset,
                event.token_ids[skip:],
                event.logprobs[skip:] if event.logprobs else None,
                event.finished,
                event.finish_reason,
                event.error,
                event.text,
            )
        self._held.setdefault(event.offset, event)
        chunks = []
        while self.next_offset in self._held:
            e = self._held.pop(self.next_offset)
            delta = self.text.push(e.token_ids, e.text, e.finished)
            self.tokens += e.token_ids
            self.next_offset += len(e.token_ids)
            chunks.append(
                Chunk(
                    e.offset,
                    e.token_ids,
                    delta,
                    e.logprobs or [],
                    e.finished,
                    e.finish_reason,
                    e.error,
                )
            )
            if e.finished:
                self.finished = True
                break
            if not e.token_ids:
                break
        return chunks
