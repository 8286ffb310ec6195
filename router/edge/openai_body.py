"""An OpenAI request body, read for the HTTP front (router/edge/http.py): its fields checked,
its chat put through the model's template, its sampling and scheduling fields turned into the
GenerateRequest the gRPC edge receives. Every fault is an HttpError that names the field.

Sampling fields are the gRPC ones by OpenAI's and vLLM's names (`max_tokens`, `temperature`,
`top_p`, `top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`,
`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`, `min_tokens`,
`logprobs`, `top_logprobs`, `n`). Chat content is a string or a list of text parts. Fields
that would change the answer and are not served (`functions`, `echo`, `suffix`, `best_of` >
1, `prompt_logprobs`) are refused naming the field; `tools` and `response_format` are served
(router/edge/tools.py).
"""

from __future__ import annotations

import json
import math

from aiohttp import web

from router.api import tandem_pb2 as pb
from router.edge.tools import Tools, call_text, with_system
from router.edge.validation import InvalidRequest, check_prompt_text
from router.errors import RouterError
from workers.messages import Status

MAX_MESSAGES = 1024  # a chat's turns, each adding the template's own tokens

HTTP_STATUS = {
    Status.INVALID_ARGUMENT: 400,
    Status.UNAUTHENTICATED: 401,
    Status.NOT_FOUND: 404,
    Status.ALREADY_EXISTS: 409,
    Status.FAILED_PRECONDITION: 400,
    Status.RESOURCE_EXHAUSTED: 429,
    Status.CANCELLED: 499,
    Status.INTERNAL: 500,
    Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
_ERROR_TYPE |= {409: "conflict_error", 429: "rate_limit_error"}


# Request fields copied as they are into the proto's SamplingParams.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "n",
)


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, e: RouterError) -> HttpError:
        return cls(HTTP_STATUS.get(e.status, 500), e.message, retry_after_s=e.retry_after_s)

    def body(self) -> dict:
        kind = _ERROR_TYPE.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}

    def response(self) -> web.Response:
        headers = None
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(math.ceil(self.retry_after_s))}
        return web.json_response(self.body(), status=self.status, headers=headers)


class BodyReader:
    """Reads bodies for one model: its tokenizer and its context length."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def check_text(self, name: str, texts) -> None:
        try:
            check_prompt_text(name, texts, self.max_model_len)
        except InvalidRequest as e:
            raise HttpError(400, str(e), name) from None

    def prompt_ids(self, body: dict, chat: bool, tools: Tools | None = None) -> list[int]:
        """The prompt's token ids: a chat's messages through the model's template (with its
        tools, natively or as a system prompt), or a completion's text or ids."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise HttpError(400, "messages: give a non-empty list of messages", "messages")
            if len(messages) > MAX_MESSAGES:
                raise HttpError(
                    400, f"messages: {len(messages)}, at most {MAX_MESSAGES}", "messages"
                )
            turns = []
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
                    raise HttpError(400, "messages: each needs a role and content", "messages")
                turns.append(_turn(m, native=tools is not None and self.tokenizer.takes_tools))
            self.check_text("messages", [t["role"] + t["content"] for t in turns])
            try:
                if tools is None:
                    return self.tokenizer.encode_messages(turns)
                if self.tokenizer.takes_tools:
                    return self.tokenizer.encode_messages(turns, tools=tools.openai_tools())
                return self.tokenizer.encode_messages(with_system(turns, tools.system_prompt()))
            except Exception as e:  # no template, or the template refuses these roles
                raise HttpError(400, f"messages: {e}", "messages") from None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            self.check_text("prompt", prompt)
            return self.tokenizer.encode(_check_unicode(prompt, "prompt"))
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return prompt
        raise HttpError(400, "prompt: give one non-empty string or one list of token ids", "prompt")

    def sampling(self, body: dict, chat: bool, prompt_len: int) -> pb.SamplingParams:
        """The sampling fields, by OpenAI's and vLLM's names, as the proto's."""
        sp = pb.SamplingParams()
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:  # chat: up to the context, as vLLM; completions: 16
            max_tokens = max(self.max_model_len - prompt_len, 1) if chat else 16
        fields = {name: body[name] for name in _SAMPLING if body.get(name) is not None}
        fields["max_tokens"] = max_tokens
        stop = body.get("stop")
        if stop is not None:
            fields["stop"] = [stop] if isinstance(stop, str) else stop
        if body.get("logit_bias") is not None:
            bias = body["logit_bias"]
            try:
                fields["logit_bias"] = {int(k): v for k, v in bias.items()}
            except (AttributeError, ValueError):
                raise HttpError(400, "logit_bias: map token ids to biases", "logit_bias") from None
        logprobs = body.get("logprobs")
        if chat:  # logprobs: bool, top_logprobs: int
            fields["logprobs"] = bool(logprobs)
            if body.get("top_logprobs") is not None:
                fields["top_logprobs"] = body["top_logprobs"]
        elif logprobs is not None:  # completions: logprobs is the number of alternatives
            fields["logprobs"] = True
            fields["top_logprobs"] = logprobs
        for name, value in fields.items():
            try:
                if isinstance(value, list):
                    getattr(sp, name).extend(value)
                elif isinstance(value, dict):
                    getattr(sp, name).update(value)
                else:
                    setattr(sp, name, value)
            except (TypeError, ValueError, AttributeError) as e:
                raise HttpError(400, f"{name}={value!r}: wrong type ({e})", name) from None
        return sp


# Request fields that change what comes back, which Tandem does not serve: a request that
# sets them is refused naming the field, never answered as if it had not (a tool call or a
# JSON object the client waits for would silently not come). Each maps a field to the values
# that mean "off", which pass.
_UNSERVED = {
    "functions": (None, []),  # the older form of tools: send `tools`
    "function_call": (None, "none", "auto"),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "prompt_logprobs": (None, 0),
}


# Extensions of the body (as vLLM's `priority`): the request's place in admission and its
# service targets. The tenant is never among them: it comes from the key.
_SCHEDULING = {
    "priority": int,
    "ttft_slo_ms": float,
    "tpot_slo_ms": float,
    "reject_if_late": bool,
}


def scheduling(body: dict) -> dict:
    """The GenerateRequest fields of the body's scheduling extensions."""
    out = {}
    for name, kind in _SCHEDULING.items():
        value = body.get(name)
        if value is None:
            continue
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            and (kind is float or float(value).is_integer())
        )  # fmt: skip
        if not ok or (kind is int and not -(2**31) <= value < 2**31):
            raise HttpError(400, f"{name}={value!r}: expected {kind.__name__}", name)
        out[name] = kind(value)
    return out


def refuse_unserved(body: dict) -> None:
    for name, off in _UNSERVED.items():
        if name in body and body[name] not in off:
            raise HttpError(400, f"{name}: not served by Tandem (leave it out)", name)


def _content(content) -> str:
    """A message's text: a string, or OpenAI's list of content parts, whose text parts are
    joined by newlines (as vLLM joins them); any other part is refused by its type."""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise HttpError(
                    400, f"messages: only text content parts are served, not {kind!r}", "messages"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise HttpError(400, "messages: content must be text or a list of text parts", "messages")
    return _check_unicode(content, "messages")


def _turn(m: dict, native: bool) -> dict:
    """A message for the chat template. With `native` (a template that takes tools), an
    assistant's tool calls and a tool's result go to it as they are; otherwise they are written
    into the text as the model writes them: calls in tags, results as tool responses."""
    role, calls = m["role"], m.get("tool_calls")
    text = _content(m.get("content")) if m.get("content") is not None or not calls else ""
    if role == "assistant" and calls:
        try:
            parsed = [
                (c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                for c in calls
            ]
        except (KeyError, TypeError, ValueError):
            raise HttpError(
                400, "messages: a tool call needs function.name and JSON arguments", "messages"
            ) from None
        if native:
            fns = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in parsed]
            return {"role": role, "content": text, "tool_calls": fns}
        return {
            "role": role,
            "content": "\n".join([text] * bool(text) + [call_text(*p) for p in parsed]),
        }
    if role == "tool" and not native:
        return {"role": role, "content": f"<tool_response>\n{text}\n</tool_response>"}
    turn = {"role": role, "content": text}
    if role == "tool" and isinstance(m.get("tool_call_id"), str):
        turn["tool_call_id"] = m["tool_call_id"]
    return turn


def _check_unicode(text: str, param: str) -> str:
    """JSON may carry a lone surrogate (`"\\ud800"`), which no tokenizer or protobuf string
    takes: a 400 naming it, not a 500 from deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HttpError(
            400, f"{param}: not valid Unicode ({e.reason} at {e.start})", param
        ) from None
    return text
