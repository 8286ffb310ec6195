"""OpenAI's structured-output and tool fields as one Tandem constraint, and a model's tool
calls read back into OpenAI's shape.

- `response_format` (`json_object`, `json_schema`), and vLLM's `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`: the matching `Constraint` kind.
- `tools` with `tool_choice`: the model writes each call as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (the Hermes format, which
  Qwen's and Hermes' chat templates use). `required` constrains the output to one or more
  such calls (one with `parallel_tool_calls: false`), each naming a declared function with
  arguments valid for its parameters (closed to other keys, as OpenAI's strict mode); a
  named function to one call of it; `auto` to either calls or plain text (text that does
  not begin with `<`); `none` leaves the output free and the tools unmentioned. A chat
  template that takes `tools` renders them; for one that does not, they are described in a
  system message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from router.api import tandem_pb2 as pb
from workers.engine.grammar import JSON_STYLE, closed_objects

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class FieldError(ValueError):
    """A body field that cannot be served as given; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Tools:
    """The declared functions ({"name", "description", "parameters"}) and how the model may
    use them: "auto" (calls or text), "required" (calls), or `named` (one call of it)."""

    functions: tuple[dict, ...]
    choice: str  # "auto" or "required"
    parallel: bool = True  # several calls in one answer (OpenAI's parallel_tool_calls)
    named: str | None = None  # tool_choice named this function: one call of it

    def grammar(self) -> str:
        """The output's grammar (Lark, with llguidance's %json for each call's object)."""
        allowed = [f for f in self.functions if self.named in (None, f["name"])]
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": closed_objects(f["parameters"]),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in allowed
            ],
            "x-guidance": JSON_STYLE,  # as the engine writes JSON
        }
        rules = [
            'calls: call ("\\n" call)*' if self.parallel else "calls: call",
            f"call: {json.dumps(CALL_OPEN)} body {json.dumps(CALL_CLOSE)}",
            f"body: %json {json.dumps(call)}",
        ]
        if self.choice == "auto" and self.named is None:
            return "\n".join(["start: calls | TEXT", *rules, r"TEXT: /[^<\s][\s\S]*/"])
        return "\n".join(["start: calls", *rules])

    def system_prompt(self) -> str:
        listed = "\n".join(
            json.dumps({"type": "function", "function": f}, ensure_ascii=False)
            for f in self.functions
        )
        return (
            "You can call these functions:\n<tools>\n"
            f"{listed}\n</tools>\n"
            "To call one, reply with a JSON object of its name and arguments within tags:\n"
            f'{CALL_OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}{CALL_CLOSE}'
        )

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    def openai_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions]


def read_tools(body: dict) -> Tools | None:
    """The request's tools, checked; None without tools or with tool_choice "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise FieldError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"give a list of at most {MAX_TOOLS} functions")
    functions = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise FieldError("tools", 'each is {"type": "function", "function": {"name": ...}}')
        if not _NAME.match(f["name"]):
            raise FieldError(
                "tools", f"function name {f['name']!r}: 1-64 of letters, digits, _ . -"
            )
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise FieldError("tools", f"{f['name']}.parameters: a JSON schema object")
        entry = {"name": f["name"], "parameters": params}
        if isinstance(f.get("description"), str):
            entry["description"] = f["description"]
        functions.append(entry)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise FieldError("tools", "function names must be distinct")
    named = None
    if choice is None or choice in ("auto", "required"):
        choice = choice or "auto"
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        named, choice = choice["function"].get("name"), "required"
        if named not in names:
            raise FieldError("tool_choice", f"names {named!r}, which is not among the tools")
    else:
        raise FieldError("tool_choice", 'use "none", "auto", "required" or a named function')
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "true or false")
    # A named function is called once, as OpenAI's forced function call is.
    return Tools(tuple(functions), choice, parallel and named is None, named)


def body_constraint(body: dict, tools: Tools | None) -> pb.Constraint | None:
    """The one constraint the body asks for (several at once are refused)."""
    asked: list[tuple[str, pb.Constraint]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", pb.Constraint(json_object=True)))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise FieldError("response_format", "json_schema needs {name, schema}")
            asked.append(("response_format", pb.Constraint(json_schema=json.dumps(schema))))
        elif kind != "text":
            raise FieldError("response_format", 'type: "text", "json_object" or "json_schema"')
    for name in _GUIDED:
        value = body.get(name)
        if value is None:
            continue
        if name == "guided_json":
            text = value if isinstance(value, str) else json.dumps(value)
            asked.append((name, pb.Constraint(json_schema=text)))
        elif name == "guided_choice":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise FieldError(name, "give a list of strings")
            asked.append((name, pb.Constraint(choice=pb.Choices(values=value))))
        elif not isinstance(value, str):
            raise FieldError(name, "give a string")
        else:
            field = "regex" if name == "guided_regex" else "grammar"
            asked.append((name, pb.Constraint(**{field: value})))
    if tools is not None:
        asked.append(("tools", pb.Constraint(grammar=tools.grammar())))
    if len(asked) > 1:
        raise FieldError(asked[1][0], f"set one constraint at a time (also {asked[0][0]})")
    return asked[0][1] if asked else None


def call_text(name: str, arguments) -> str:
    """One call as the model writes it (for the assistant turns of a conversation)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def with_system(turns: list[dict], text: str) -> list[dict]:
    """The conversation with `text` leading its system message (one made if it has none)."""
    if turns and turns[0]["role"] == "system":
        return [{"role": "system", "content": f"{turns[0]['content']}\n\n{text}"}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


def parse_calls(text: str, names=None) -> list[dict] | None:
    """The tool calls the text holds, in OpenAI's shape, each naming one of `names` (any, if
    None); None when it is not calls (plain text, or calls cut short by max_tokens)."""
    calls, rest = [], text
    while rest:
        if not rest.startswith(CALL_OPEN.strip()):
            return None
        obj, end = _call_object(rest)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        if names is not None and obj["name"] not in names:
            return None
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": json.dumps(obj.get("arguments", {}), ensure_ascii=False),
                },
            }
        )
        rest = rest[end + len(CALL_CLOSE.strip()) :]
        rest = rest[1:] if rest.startswith("\n") else rest  # the separator between calls
    return calls or None


def _call_object(text: str) -> tuple[object, int]:
    """The JSON of the call `text` begins with, and where its closing tag is: the first
    closing tag after which the JSON is whole (one may sit inside an argument's string)."""
    opening, close = CALL_OPEN.strip(), CALL_CLOSE.strip()
    end = text.find(close)
    while end >= 0:
        try:
            return json.loads(text[len(opening) : end]), end
        except ValueError:
            end = text.find(close, end + 1)
    return None, -1


class CallStream:
    """One choice's streamed text turned into chat deltas: content while the output cannot
    be a tool call; each tool call whole, as its closing tag arrives."""

    def __init__(self, names) -> None:
        self.names = frozenset(names)  # the declared functions
        self.text = ""
        self._sent = 0  # text already sent as content or calls
        self._seen = 0  # closing tags before this point end no call
        self.calls = 0
        self._calls_mode: bool | None = None  # None: the first character is yet to come

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self._calls_mode is None and self.text:
            self._calls_mode = self.text.startswith("<")  # as the tools grammar decides
        if self._calls_mode is False:
            out = self.text[self._sent :]
            self._sent = len(self.text)
            return [{"content": out}] if out else []
        deltas = []
        close = CALL_CLOSE.strip()
        while (end := self.text.find(close, max(self._sent, self._seen))) >= 0:
            self._seen = end + len(close)
            block = self.text[self._sent : self._seen]
            calls = parse_calls(block.removeprefix("\n"), self.names)
            if calls is None:
                continue  # a closing tag inside an argument's string: the call goes on
            self._sent = self._seen
            for call in calls:
                deltas.append({"tool_calls": [{"index": self.calls, **call}]})
                self.calls += 1
        return deltas

    def finish(self) -> list[dict]:
        """What is left at the end (calls cut short): as content."""
        rest = self.text[self._sent :]
        self._sent = len(self.text)
        return [{"content": rest}] if rest.strip() else []
