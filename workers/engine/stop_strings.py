"""Stop strings: detokenize as tokens arrive and cut the text where a stop string begins."""

from __future__ import annotations

from workers.model.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = stops
        self.text = ""
        self.stopped: str | None = None

    def push(self, new_ids: list[int], search: bool = True) -> str | None:
        """Feed new tokens; returns the stop string once one appears (text is cut before it).
        With `search` False the text grows but is not searched (min_tokens not yet reached)."""
        if self.stopped is not None:
            return self.stopped
        delta = self.detok.push(new_ids)
        if not delta or not search:
            self.text += delta
            return None
        # Only the tail can hold a new match: the delta plus what each stop string could
        # straddle (a shorter one wholly in text already searched, or never searched before
        # min_tokens, must not match now).
        before = len(self.text)
        self.text += delta
        best = None
        for s in self.stops:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[: best[0]]
            self.stopped = best[1]
        return self.stopped
