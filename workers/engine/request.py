"""Request types: sampling parameters, lifecycle status, finish reasons and the request itself."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from workers.engine.constraint import Constraint

# The output token a step in flight is drawing: the scheduler counts it (positions, lengths,
# max_tokens) before its value is on the host, and the model runner reads the value from the
# previous step's sampled ids on the device (engine.py, "overlap").
PENDING = -1


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


class FinishReason(enum.StrEnum):
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


class ErrorKind(str, enum.Enum):
    """Why a request ended in error, for whoever maps it to a status (never its message)."""

    TOO_BIG = "too_big"  # needs more KV blocks than the worker has in all
    STEP_FAILED = "step_failed"  # the model step it was in raised
    GRAMMAR = "grammar"  # its constraint failed here (fuel spent, or it does not compile)


MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM's default
MAX_N = 64  # parallel samples of one prompt


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with n > 1: seed + index, as vLLM derives it,
    so that choice i equals a lone request seeded seed + i, and a replay redraws each."""
    return (seed + index) & (2**63 - 1)


# Temperatures below this are greedy, as in vLLM: dividing by one would overflow the logits.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's meanings: temperature 0 (or under GREEDY_BELOW) is greedy; top_k 0 or -1, top_p 1
    and min_p 0 disable filtering; ignore_eos lets EOS be emitted like any other token without
    ending the request.

    Penalties, as vLLM applies them: `repetition_penalty` divides the positive logits (and
    multiplies the negative ones) of every token seen in the prompt or the output;
    `frequency_penalty` is subtracted once per time a token was already output and
    `presence_penalty` once if it was. `logit_bias` adds to the logits of the token ids it
    names. Until `min_tokens` tokens are out, EOS and `stop_token_ids` cannot be drawn and stop
    strings do not end the request. `top_logprobs` (with `logprobs`) returns that many most
    likely alternatives with each token. Logprobs are those of the raw model distribution,
    before any penalty, bias or temperature. `n` > 1 draws that many completions of one
    prompt, which is computed once; choice i is seeded `choice_seed(seed, i)`. `constraint`
    restricts every draw to tokens that keep the output within it, after bias and penalties.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs, sorted; a dict {id: bias} is accepted and normalized.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    n: int = 1
    # The output must match it (grammar.py); EOS is drawn only where it may end, and then ends
    # the request even with ignore_eos or before min_tokens.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "constraint", Constraint.of(self.constraint))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            norm = tuple(sorted((int(t), float(b)) for t, b in pairs))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias={bias!r}: must map token ids to numbers") from None
        object.__setattr__(self, "logit_bias", norm)
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(name, "must be a finite number")
            return v

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", "must be a positive integer")
        if number("temperature") < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not (0.0 < number("top_p") <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if not (0.0 <= number("min_p") <= 1.0):
            raise bad("min_p", "must be in [0, 1] (0 disables it)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids (integers >= 0)")
        if not isinstance(self.top_logprobs, int) or not (
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "needs logprobs=true")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise bad(name, "must be in [-2, 2] (0 disables it)")
        if number("repetition_penalty") <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        for token, b in self.logit_bias:
            if token < 0:
                raise bad("logit_bias", f"token id {token} is negative")
            if not (math.isfinite(b) and -100.0 <= b <= 100.0):
                raise bad("logit_bias", f"the bias of token {token} must be in [-100, 100]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be at most max_tokens={self.max_tokens}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether a draw depends on the tokens seen so far (prompt and output)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}#{index}"


def split_choice(choice: str) -> tuple[str, int]:
    """(the request's id, the index) that a `choice_id` names; a request's own id is its
    choice 0. The one place a choice id is taken apart."""
    parent, sep, index = choice.rpartition("#")
    if sep and index.isdigit() and int(index) > 0:
        return parent, int(index)
    return choice, 0


def choice_index(choice: str) -> int:
    return split_choice(choice)[1]


@dataclass(frozen=True)
class Tenancy:
    """Whose a request is and what it was promised, as the router set them: the engine's
    fair share orders by the tenant's tokens served for its weight within its tier, and
    pacing keeps the request's own TPOT target."""

    tenant: str = ""
    weight: float = 1.0
    tier: int = 1
    predicted_tokens: float | None = None  # output tokens the router predicts
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        assert self.weight > 0, "a tenant's weight is positive"


NO_TENANCY = Tenancy()  # a request of no tenant in particular (offline, no keys)


@dataclass(eq=False)  # one request is one object: compared by identity, never field by field
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
    # With top_logprobs: per output token, its most likely (token id, logprob) alternatives.
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at last admission
    num_preemptions: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None
    # End the request, as if max_tokens were reached, once it has this many output tokens
    # (a prefill worker samples one token past what it was given, then hands the KV on).
    # Such a request draws with every sampling parameter but never ends on EOS, a stop
    # token or a stop string: the decode worker decides that.
    stop_after: int | None = None
    # On a natural end, hold the blocks of every computed token instead of freeing them: a
    # prefill's KV stays readable until the worker that sends it calls `release_kv`.
    keep_kv: bool = False
    kept_blocks: list[int] | None = None
    # n > 1: choice 0 is the request itself; choice i > 0 is forked from it once the prompt
    # is computed, with id `choice_id(request_id, i)` and the prompt's blocks shared.
    parent_id: str | None = None
    index: int = 0
    # (clock, output tokens) when it made its first token on this engine: its pace since.
    paced_since: tuple[float, int] | None = None
    tenancy: Tenancy = field(default_factory=Tenancy)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"

    def fork(self, index: int) -> Request:
        """Choice `index` of this request, once its prompt is computed: a running sequence
        with the prompt's KV (the scheduler shares its blocks), seeded for its index."""
        child = Request(
            request_id=choice_id(self.request_id, index),
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            arrival_time=self.arrival_time,
            tenancy=self.tenancy,
            seed=choice_seed(self.seed, index),
            parent_id=self.request_id,
            index=index,
            # A prefill's choices end with their first token as it does; only the parent
            # holds the prompt's KV for the transfer.
            stop_after=self.stop_after,
        )
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.paced_since = self.paced_since
        child.status = RequestStatus.RUNNING
        return child

    @property
    def forks_pending(self) -> bool:
        """Its next sampled token is its first, and its siblings draw theirs beside it."""
        return self.sampling.n > 1 and self.parent_id is None and not self.output_token_ids

    @property
    def is_decoding(self) -> bool:
        """Its next step computes one token: the last one sampled."""
        return bool(self.output_token_ids) and self.num_computed_tokens >= self.num_tokens - 1

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
    def pending(self) -> bool:
        """Its last output token is still being drawn by a step in flight."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason.of(self.status) if self.is_finished else None

    # -- as an order sees it (orders.Work) ----------------------------------------------------
    @property
    def arrival(self) -> float:
        return self.arrival_time

    @property
    def prompt_left(self) -> int:
        """Tokens to compute before its next draw: its prompt's (or a recompute's) rest."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_left(self) -> float:
        """Output tokens the router predicts it still has to make (without a prediction,
        its max_tokens)."""
        predicted = self.tenancy.predicted_tokens
        total = self.sampling.max_tokens if predicted is None else predicted
        return max(0.0, total - self.num_output_tokens)

    deadline = None  # the engine orders by no deadline


def drop(requests: list[Request], req: Request) -> bool:
    """Take `req` out of `requests` (found by identity); whether it was there."""
    for i, r in enumerate(requests):
        if r is req:
            del requests[i]
            return True
    return False


def stop_status(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The status that `token`, just drawn, ends `req` with; None if it goes on."""
    sp = req.sampling
    # Before min_tokens, EOS and stop tokens are never drawn, nor do they end a request.
    # A prefill (stop_after) draws with them but leaves ending to the decode worker.
    if req.stop_after is None and req.num_output_tokens >= sp.min_tokens:
        if token in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    # A constrained sequence draws EOS only where its grammar may end: it ends there.
    if req.stop_after is None and sp.constraint is not None and token in req.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    return RequestStatus.FINISHED_LENGTH if ends_by_length(req, max_model_len) else None


def ends_by_length(req: Request, max_model_len: int) -> bool:
    """Whether its tokens so far end it whatever the last one is: max_tokens, the context,
    or a prefill's stop_after reached. Known before a pending token's value is."""
    n = req.num_output_tokens
    return (
        n >= req.sampling.max_tokens
        or req.num_tokens >= max_model_len
        or (req.stop_after is not None and n >= req.stop_after)
    )
