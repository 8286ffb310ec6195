"""Tokenizer and chat template through transformers, plus incremental detokenization."""

from __future__ import annotations

import logging
import os

from workers.model.config import CheckpointError
from workers.model.loader import ModelSource


class Tokenizer:
    def __init__(self, src: ModelSource) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub at run time
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            if src.is_gguf:
                tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
            else:
                tok = AutoTokenizer.from_pretrained(str(src.folder))
        except Exception as e:
            raise CheckpointError(f"{src.path}: tokenizer could not be loaded ({e})") from e
        self.hf = tok
        self.eos_token_id = tok.eos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode_chat(self, text: str) -> list[int]:
        """One user message through the chat template, ready for the assistant's turn."""
        if not self.has_chat_template:
            return self.encode(text)
        return self.encode_messages([{"role": "user", "content": text}])

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list itself."""
        return "tools" in (getattr(self.hf, "chat_template", None) or "")

    def encode_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """A conversation ({"role", "content"} dicts) through the chat template, ready for
        the assistant's turn; `tools` (OpenAI's function list) for a template that takes them."""
        if not self.has_chat_template:
            raise ValueError("the model has no chat template: send a plain prompt instead")
        extra = {"tools": tools} if tools else {}
        ids = self.hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


# A UTF-8 character is at most 4 bytes, and a byte-level token at least 1: a delta still
# ending in a replacement character this many tokens on never completes, and is let out as
# it is, so that the window re-decoded at every token (the tokens held, after the previous
# delta's) stays short whatever the model emits.
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without splitting multi-byte characters.

    It re-decodes a short window of recent tokens and holds a delta back while it ends in the
    replacement character, which means a character's bytes are still arriving, for at most
    MAX_HELD_TOKENS tokens (as vLLM bounds its own window).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens already turned into text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.tok.decode(self.ids[self._prefix : self._read])
        after = self.tok.decode(self.ids[self._prefix :])
        held = len(self.ids) - self._read
        if (after.endswith("\ufffd") and held < MAX_HELD_TOKENS) or len(after) < len(before):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta


class TextStream:
    """Text deltas for one request's stream. `cut_text`, when given, is the engine's text so far
    already cut at a stop string; with stop strings, the last few characters are held back until
    they can no longer begin a stop string, so nothing streamed is ever taken back.

    Tokens pushed without `cut_text` (a prefill's first token, streamed by the router before a
    decode worker has matched it against the stops) are shown only up to the first stop they
    complete: the engine's cut of that token comes later, and must not find it shown already."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(stops)
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.emitted = 0

    def push(self, new_ids: list[int], cut_text: str | None, finished: bool) -> str:
        if cut_text is not None:
            full = cut_text
        else:
            self.detok.push(new_ids)
            full = self.detok.text
        visible = len(full) if finished else len(full) - self.holdback
        if cut_text is None and self.stops:
            # Only a stop that ends past what was shown can be new: start the search there.
            starts = (full.find(s, max(0, self.emitted - len(s) + 1)) for s in self.stops)
            visible = min([visible, *(i for i in starts if i >= 0)])
        if visible <= self.emitted:
            return ""
        delta = full[self.emitted : visible]
        self.emitted = visible
        return delta
