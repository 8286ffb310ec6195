"""Request types: sampling parameters, lifecycle status, finish reasons and the request itself."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    """Ordered so that `is_finished` is a comparison."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_CANCELLED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"

    @classmethod
    def of(cls, status: RequestStatus) -> FinishReason:
        return {
            RequestStatus.FINISHED_STOPPED: cls.STOP,
            RequestStatus.FINISHED_LENGTH: cls.LENGTH,
            RequestStatus.FINISHED_CANCELLED: cls.CANCELLED,
            RequestStatus.FINISHED_ERROR: cls.ERROR,
        }[status]


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's meanings: temperature 0 is greedy; top_k 0 or -1 and top_p 1 disable filtering;
    ignore_eos lets EOS be emitted like any other token without ending the request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be a positive integer")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise bad("temperature", "must be a finite number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first, as in vLLM
    arrival_time: float = field(default_factory=time.monotonic)
    seed: int = 0  # resolved sampling seed (drawn at admission when the request gave none)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at last admission
    num_preemptions: int = 0
    error: str | None = None
    # End the request, as if max_tokens were reached, once it has this many output tokens
    # (a prefill worker samples one token past what it was given, then hands the KV on).
    stop_after: int | None = None
    # On a natural end, hold the blocks of every computed token instead of freeing them: a
    # prefill's KV stays readable until the worker that sends it calls `release_kv`.
    keep_kv: bool = False
    kept_blocks: list[int] | None = None

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (a decode step needs
        one token; concatenating prompt and outputs each step would cost O(context))."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason.of(self.status) if self.is_finished else None
