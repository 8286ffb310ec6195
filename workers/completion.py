"""What a user hands Tandem and gets back, the same offline and against a cluster: a
`GenerationRequest` in, a `Completion` out. No torch here: the gRPC client and the request-file
reader use these without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.request import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """A text prompt (sent as one user message through the chat template) or raw token ids."""

    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt is empty")


@dataclass
class Completion:
    index: int
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    choice: int = 0  # which of the request's n completions

    def to_json(self) -> dict:
        d = {
            "index": self.index,
            "choice": self.choice,
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
        }
        if self.error:
            d["error"] = self.error
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.top_logprobs is not None:
            d["top_logprobs"] = [[[t, lp] for t, lp in top] for top in self.top_logprobs]
        return d
