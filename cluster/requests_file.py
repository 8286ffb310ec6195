"""The JSONL request file shared by `tandem generate` (offline and against a cluster) and the
benchmarks: one request per line, `{"prompt": str}` or `{"prompt_ids": [int]}`, with optional
sampling fields as SamplingParams names them (max_tokens, temperature, top_p, top_k, min_p,
seed, ignore_eos, stop, stop_token_ids, logprobs, top_logprobs, presence_penalty,
frequency_penalty, repetition_penalty, logit_bias as {"token id": bias}, min_tokens, n),
priority, and a constraint as the proto spells it: {"json_schema": {...}}, {"json_object":
true}, {"regex": "..."}, {"choice": ["...", ...]} or {"grammar": "..."}."""

from __future__ import annotations

import json
from pathlib import Path

from workers.completion import GenerationRequest
from workers.engine.constraint import Constraint, ConstraintKind
from workers.engine.request import SamplingParams

_SAMPLING_FIELDS = {
    "max_tokens": int,
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "seed": int,
    "ignore_eos": bool,
    "stop": (str, list),
    "stop_token_ids": list,
    "logprobs": bool,
    "top_logprobs": int,
    "min_p": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "logit_bias": dict,
    "min_tokens": int,
    "n": int,
}
# "kind" labels a request for benchmarks (e.g. chat / long) and is otherwise ignored.
_FIELDS = {"prompt", "prompt_ids", "priority", "kind", "constraint", *_SAMPLING_FIELDS}


def parse_request(obj: object, where: str = "request") -> GenerationRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    kwargs = {}
    for name, kind in _SAMPLING_FIELDS.items():
        if name not in obj:
            continue
        value = obj[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}: field {name!r} has the wrong type ({value!r})")
        if name == "stop":
            value = (value,) if isinstance(value, str) else tuple(value)
        if name == "stop_token_ids":
            if not all(isinstance(t, int) for t in value):
                raise ValueError(f"{where}: field 'stop_token_ids' must be a list of integers")
            value = tuple(value)
        if name == "logit_bias":
            value = _logit_bias(value, where)
        kwargs[name] = value
    if obj.get("constraint") is not None:
        kwargs["constraint"] = _constraint(obj["constraint"], where)
    prompt, ids = obj.get("prompt"), obj.get("prompt_ids")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"{where}: field 'prompt' must be a string")
    if ids is not None and (
        not isinstance(ids, list)
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise ValueError(f"{where}: field 'prompt_ids' must be a list of integers")
    priority = obj.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"{where}: field 'priority' must be an integer")
    try:
        return GenerationRequest(
            prompt=prompt,
            prompt_ids=tuple(ids) if ids is not None else None,
            sampling=SamplingParams(**kwargs),
            priority=priority,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _logit_bias(value: dict, where: str) -> dict[int, float]:
    """OpenAI's form: token ids as JSON object keys (strings), biases as numbers."""
    out = {}
    for k, v in value.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not (number and str(k).lstrip("-").isdigit()):
            raise ValueError(
                f"{where}: field 'logit_bias' must map token ids to numbers, "
                f'as {{"1234": -100}} (got {k!r}: {v!r})'
            )
        out[int(k)] = float(v)
    return out


def read_requests(path: str | Path) -> list[GenerationRequest]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such request file")
    requests = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        requests.append(parse_request(obj, f"{path}:{n}"))
    if not requests:
        raise ValueError(f"{path}: holds no requests")
    return requests


def _constraint(value: object, where: str) -> Constraint:
    kinds = ", ".join(k.value for k in ConstraintKind)
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"{where}: field 'constraint' is one of {{{kinds}}}: value")
    [(kind, spec)] = value.items()
    if kind == ConstraintKind.JSON_SCHEMA.value and isinstance(spec, (dict, bool)):
        return Constraint.json_schema(spec)
    if kind == ConstraintKind.JSON_OBJECT.value and spec is True:
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == ConstraintKind.CHOICE.value and isinstance(spec, list):
        return Constraint(ConstraintKind.CHOICE, choices=tuple(spec))
    if kind in (ConstraintKind.REGEX.value, ConstraintKind.GRAMMAR.value) and isinstance(spec, str):
        return Constraint(ConstraintKind(kind), spec)
    raise ValueError(f"{where}: field 'constraint': {kind!r} with a value of the wrong type")
