"""The JSONL request file shared by `tandem generate` (offline and against a cluster) and the
benchmarks: one request per line, `{"prompt": str}` or `{"prompt_ids": [int]}`, with optional
max_tokens, temperature, top_p, top_k, seed, ignore_eos, stop, stop_token_ids, logprobs and
priority."""

from __future__ import annotations

import json
from pathlib import Path

from workers.completion import GenerationRequest
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
}
# "kind" labels a request for benchmarks (e.g. chat / long) and is otherwise ignored.
_FIELDS = {"prompt", "prompt_ids", "priority", "kind", *_SAMPLING_FIELDS}


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
        kwargs[name] = value
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
