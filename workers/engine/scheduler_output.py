"""What the scheduler hands the model runner for one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.request import Request, SamplingParams


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens whose KV is computed this step
    start_position: int  # absolute position of token_ids[0] (= tokens already in the cache)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # this chunk reaches the end of the known tokens, so a token is sampled
    sampling: SamplingParams
    seed: int
    num_output_tokens: int  # output tokens before this step: the sampler's counter
    # The request's own lists (not copies), read by penalties and min_tokens while it samples.
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    # n > 1, at the prompt's last chunk: the choice indices that draw their first token from
    # this row's logits beside it (see request.choice_id and choice_seed).
    forks: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledRequest] = field(default_factory=list)  # one token each
    # Chunks of several tokens, or of one at a prompt position: prompts, and a replay's or a
    # preempted sequence's tokens computed again.
    prefills: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # lost their blocks this step
    # (request, error): ended without being scheduled.
    failed: list[tuple[Request, str]] = field(default_factory=list)
    # (source, destination) blocks to copy before the step runs: copy-on-write of a shared
    # last block that a sequence writes this step.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Set by Scheduler.advance: the requests it advanced, by id. Landing the step touches
    # only these very objects: an id ended and taken again meanwhile is another request.
    advanced: dict[str, Request] = field(default_factory=dict)

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Decodes first, then prefills: the row order of the model's flattened batch."""
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return len(self.decodes) + sum(p.num_tokens for p in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.failed


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # (token id, logprob), best first
