"""The HTTP front's answers in OpenAI's shapes: one request's whole response, or its stream of
server-sent events (a role delta first for chats, a delta per chunk, a usage event with
`stream_options.include_usage`); with n > 1, one choice per completion, by index. Tool calls
come back as `tool_calls`, whole, once their text closes. Logprobs follow each API's shape
(chat: per-token entries with their alternatives; completions: parallel lists)."""

from __future__ import annotations

import json
import time

from router.admission.request import Admission
from router.edge.tools import CallStream, Tools, parse_calls
from router.requests.stream import Chunk


class Reply:
    """One request's answer in OpenAI's shapes: a whole response, or stream events; with
    n > 1, one choice per completion, by index."""

    def __init__(
        self,
        model_name: str,
        tokenizer,
        adm: Admission,
        chat: bool,
        body: dict,
        prompt_tokens: int,
        client_id: str,
        tools: Tools | None = None,
    ):
        self.model_name, self.chat = model_name, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + client_id
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        # Chat: logprobs is a flag; completions: the number of alternatives (0 included).
        logprobs = body.get("logprobs")
        want_logprobs = bool(logprobs) if chat else logprobs is not None
        options = body.get("stream_options") or {}
        self.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        self.choices = [
            _Choice(i, chat, want_logprobs, tokenizer, tools) for i in range(adm.sampling.n)
        ]

    @property
    def usage(self) -> dict:
        completion = sum(c.completion_tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def add(self, chunk: Chunk) -> dict | None:
        return self.choices[chunk.index].add(chunk)

    def _head(self, chunked: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        if self.chat and chunked:
            kind += ".chunk"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model_name,
        }

    def whole(self) -> dict:
        choices = [c.whole() for c in self.choices]
        return {**self._head(False), "choices": choices, "usage": self.usage}

    def opening(self) -> list[dict]:
        """Chat streams open with the assistant's role (per choice), as OpenAI's do."""
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [
            self._event({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
            for c in self.choices
        ]

    def delta(self, chunk: Chunk) -> list[dict]:
        """The stream events of one chunk (a tool call's text may make none until it closes)."""
        logprobs = self.add(chunk)
        reason = chunk.finish_reason if chunk.finished else None
        i = chunk.index
        if self.chat and self.choices[i].calls is not None:  # tools: content or whole calls
            calls = self.choices[i].calls
            deltas = calls.feed(chunk.text) + (calls.finish() if chunk.finished else [])
            if chunk.finished and calls.calls and reason == "stop":
                reason = "tool_calls"
            deltas = deltas or [{}]
            events = [
                {"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas
            ]
            events[-1].update(logprobs=logprobs, finish_reason=reason)
            return [self._event(e) for e in events]
        if self.chat:
            delta = {"content": chunk.text} if chunk.text or not chunk.finished else {}
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": i, "text": chunk.text, "logprobs": logprobs, "finish_reason": reason}
        return [self._event(choice)]

    def usage_event(self) -> dict:
        return {**self._head(True), "choices": [], "usage": self.usage}

    def _event(self, choice: dict) -> dict:
        event = {**self._head(True), "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event


class _Choice:
    """One completion's text, end and logprobs, as its chunks arrive."""

    def __init__(
        self, index: int, chat: bool, want_logprobs: bool, tokenizer, tools: Tools | None = None
    ) -> None:
        self.index, self.chat, self.want_logprobs = index, chat, want_logprobs
        self.names = tools.names if tools is not None else None
        self.calls = CallStream(self.names) if tools is not None else None  # streamed calls
        self.tokenizer = tokenizer
        self.completion_tokens = 0
        self.text = ""
        self.finish_reason = None
        self.content: list[dict] = []  # chat logprobs, per token
        self.tokens: list[str] = []  # completions logprobs
        self.token_logprobs: list[float] = []
        self.top: list[dict | None] = []
        self.offsets: list[int] = []
        self._offset = 0

    def add(self, chunk: Chunk) -> dict | None:
        """Take a chunk in; returns the logprobs of its tokens (None without logprobs)."""
        self.completion_tokens += len(chunk.token_ids)
        self.text += chunk.text
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
        if not self.want_logprobs or not chunk.token_ids:
            return None
        tok = self.tokenizer
        tops = chunk.top_logprobs or ((),) * len(chunk.token_ids)
        if self.chat:
            entries = [
                {
                    **token_entry(tok.token_text(t), lp),
                    "top_logprobs": [token_entry(tok.token_text(a), alp) for a, alp in top],
                }
                for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops)
            ]
            self.content += entries
            return {"content": entries}
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in zip(chunk.token_ids, chunk.logprobs, tops):
            text = tok.token_text(t)
            part["tokens"].append(text)
            part["token_logprobs"].append(lp)
            part["top_logprobs"].append({tok.token_text(a): alp for a, alp in top} or None)
            part["text_offset"].append(self._offset)
            self._offset += len(text)
        self.tokens += part["tokens"]
        self.token_logprobs += part["token_logprobs"]
        self.top += part["top_logprobs"]
        self.offsets += part["text_offset"]
        return part

    def whole(self) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": self.text}
            calls = parse_calls(self.text, self.names) if self.calls is not None else None
            if calls:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
            reason = "tool_calls" if calls and self.finish_reason == "stop" else self.finish_reason
            return {
                "index": self.index,
                "message": message,
                "logprobs": {"content": self.content} if self.want_logprobs else None,
                "finish_reason": reason,
            }
        logprobs = None
        if self.want_logprobs:
            logprobs = {
                "tokens": self.tokens,
                "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top,
                "text_offset": self.offsets,
            }
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason,
        }


def token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def sse(event: dict) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(event)}\n\n".encode()
