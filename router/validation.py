"""The router's edge: a GenerateRequest message becomes an internal Admission, or an
InvalidRequest naming the field and what to do about it (sent as INVALID_ARGUMENT)."""

from __future__ import annotations

import math
import random
import re
import uuid
from dataclasses import dataclass

from router.api import tandem_pb2 as pb
from workers.engine.request import SamplingParams
from workers.messages import RequestSpec

_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class InvalidRequest(ValueError):
    pass


@dataclass(frozen=True)
class Admission:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # its seed resolved: the request's own, or drawn here
    priority: int = 0
    tenant: str = ""

    @property
    def spec(self) -> RequestSpec:
        return RequestSpec(self.request_id, self.prompt_ids, self.sampling, priority=self.priority)


def validate(msg: pb.GenerateRequest, tokenizer, max_model_len: int, vocab_size: int) -> Admission:
    rid = msg.request_id or uuid.uuid4().hex
    if not _ID.match(rid):
        raise InvalidRequest("request_id: use 1-64 characters from letters, digits and . _ : -")
    if msg.prompt and msg.prompt_ids:
        raise InvalidRequest("give either prompt or prompt_ids, not both")
    if msg.prompt_ids:
        ids = list(msg.prompt_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(
                f"prompt_ids: token {bad[0]} is outside the vocabulary [0, {vocab_size})"
            )
    elif msg.prompt.strip():
        ids = tokenizer.encode_chat(msg.prompt)
    else:
        raise InvalidRequest("prompt is empty: send a non-empty prompt or prompt_ids")
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt has {len(ids)} tokens; the model's context is "
            f"{max_model_len} tokens, leaving no room to generate: shorten it"
        )
    s = msg.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else 16
    if max_tokens <= 0:
        raise InvalidRequest(f"sampling.max_tokens={max_tokens}: must be at least 1")
    if len(ids) + max_tokens > max_model_len:
        raise InvalidRequest(
            f"sampling.max_tokens={max_tokens}: with a {len(ids)}-token prompt "
            f"it exceeds the model's context of {max_model_len} tokens "
            f"(at most {max_model_len - len(ids)})"
        )
    temperature = s.temperature if s.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"sampling.temperature={temperature}: must be >= 0 (0 is greedy)")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest(f"sampling.top_p={top_p}: must be in (0, 1]")
    top_k = s.top_k if s.HasField("top_k") else 0
    if top_k < -1:
        raise InvalidRequest(f"sampling.top_k={top_k}: must be >= -1 (0 or -1 disables it)")
    if any(not x for x in s.stop):
        raise InvalidRequest("sampling.stop: stop strings must be non-empty")
    # A seed is always fixed here and recorded: a replay then draws exactly the tokens the
    # first attempt would have, whether or not the client chose the seed.
    seed = s.seed if s.HasField("seed") else random.getrandbits(63)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
    )
    return Admission(rid, tuple(ids), sampling, msg.priority, msg.tenant)
