"""The router's edge: a GenerateRequest message becomes an internal Admission, or an
InvalidRequest naming the field and what to do about it (sent as INVALID_ARGUMENT)."""

from __future__ import annotations

import math
import random
import re
import struct
import threading
import time
import uuid

from router.admission.request import Admission
from router.api import tandem_pb2 as pb
from workers.engine.constraint import Constraint, ConstraintKind
from workers.engine.grammar import GrammarCompiler, GrammarError
from workers.engine.request import SamplingParams

# Ids: no ":" (Redis's key separator), "/" (a tenant's scope) or "#" (a choice's index).
_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# What one request may ask, each limit named in its refusal. Every stop string is matched
# against every token of the request on the decode loop, and every stop id checked: bounded
# so that one request cannot stall the loop it shares.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
# A prompt's text is refused unread past this many bytes per token of the model's context:
# no text that long could fit it, and tokenizing it would hold the router's event loop.
MAX_PROMPT_BYTES_PER_TOKEN = 64
MAX_SLO_MS = 3_600_000.0  # an hour: past it, a target means nothing


def prompt_bytes_limit(max_model_len: int) -> int:
    """The longest prompt text, in UTF-8 bytes, a router reads for this context."""
    return MAX_PROMPT_BYTES_PER_TOKEN * max_model_len


def message_bytes_limit(max_model_len: int) -> int:
    """The largest request message or body a router takes for this context: the longest
    prompt (as text, or as ids of at most 5 bytes each) and its sampling parameters."""
    return max(prompt_bytes_limit(max_model_len), 5 * max_model_len) + (1 << 20)


class InvalidRequest(ValueError):
    pass


def decimal_of_float32(x: float) -> float:
    """The shortest decimal that rounds to the float32 `x`: what the client most likely wrote
    (0.8 arrives as 0.800000011920929). Sampling with it gives the offline engine's draws,
    which take the parameters as Python floats."""
    if not math.isfinite(x):
        return x
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        y = float(f"{x:.{digits}g}")
        if struct.unpack("f", struct.pack("f", y))[0] == x:
            return y
    return x


class GrammarCheck:
    """Compiles a request's constraint before any worker sees it (a bad one is refused with
    its problem named), bounded by llguidance's lexer fuel and cached by constraint. The
    compiler is made with the first constrained request. Thread-safe: `validate` runs off the
    event loop."""

    def __init__(self, tokenizer, vocab_size: int, metrics=None) -> None:
        """`metrics`: a RouterMetrics to count constrained requests and compiles in."""
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._metrics = metrics
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer.hf, self._vocab_size)
            return self._compiler

    def __call__(self, c: Constraint) -> None:
        """Compile `c` (InvalidRequest naming its problem) and count the request."""
        hit, seconds = self.compile(c)
        m = self._metrics
        if m is not None:
            m.constrained.inc(1, {**m.tags, "kind": c.kind.value})
            if hit:
                m.grammar_cache_hits.inc(1, m.tags)
            else:
                m.grammar_compile.observe(seconds, m.tags)

    def compile(self, c: Constraint) -> tuple[bool, float]:
        """Compile `c`, uncounted: (whether it was cached, seconds)."""
        compiler = self.compiler
        hits, started = compiler.hits, time.perf_counter()
        try:
            compiler.grammar(c)
        except GrammarError as e:
            raise InvalidRequest(f"sampling.{e}") from None
        return compiler.hits > hits, time.perf_counter() - started


def constraint_of(s: pb.SamplingParams) -> Constraint | None:
    """The proto's constraint, checked for shape and size (not yet compiled)."""
    if not s.HasField("constraint"):
        return None
    c = s.constraint
    kind = c.WhichOneof("kind")
    try:
        if kind is None:
            raise ValueError(
                "constraint: set one of json_schema, json_object, regex, choice, grammar"
            )
        if kind == "choice":
            return Constraint(ConstraintKind.CHOICE, choices=tuple(c.choice.values))
        if kind == "json_object":
            if not c.json_object:
                return None
            return Constraint(ConstraintKind.JSON_OBJECT)
        return Constraint(ConstraintKind(kind), getattr(c, kind))
    except ValueError as e:
        raise InvalidRequest(f"sampling.{e}") from None


def validate(
    msg: pb.GenerateRequest,
    tokenizer,
    max_model_len: int,
    vocab_size: int,
    grammars: GrammarCheck | None = None,
) -> Admission:
    """`grammars` compiles a constrained request's constraint; without it such a request is
    refused."""
    rid = msg.request_id or uuid.uuid4().hex
    if not _ID.match(rid):
        raise InvalidRequest("request_id: use 1-64 characters from letters, digits and . _ -")
    if msg.prompt and msg.prompt_ids:
        raise InvalidRequest("give either prompt or prompt_ids, not both")
    _check_costs(msg, max_model_len)
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

    def opt(name: str, default):
        return getattr(s, name) if s.HasField(name) else default

    def real(name: str, default: float) -> float:
        return decimal_of_float32(opt(name, default))

    bad_bias = [t for t in s.logit_bias if not 0 <= t < vocab_size]
    if bad_bias:
        raise InvalidRequest(
            f"sampling.logit_bias: token {bad_bias[0]} is outside the vocabulary [0, {vocab_size})"
        )
    if s.n < 0:
        raise InvalidRequest(f"sampling.n={s.n}: give the number of completions, 1 or more")
    # A seed is always fixed here and recorded: a replay then draws exactly the tokens the
    # first attempt would have, whether or not the client chose the seed.
    seed = s.seed if s.HasField("seed") else random.getrandbits(63)
    constraint = constraint_of(s)
    if constraint is not None:
        if grammars is None:
            raise InvalidRequest("sampling.constraint: this front does not compile constraints")
        grammars(constraint)
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=real("temperature", 1.0),
            top_p=real("top_p", 1.0),
            top_k=opt("top_k", 0),
            min_p=real("min_p", 0.0),
            seed=seed,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs,
            top_logprobs=s.top_logprobs,
            presence_penalty=real("presence_penalty", 0.0),
            frequency_penalty=real("frequency_penalty", 0.0),
            repetition_penalty=real("repetition_penalty", 1.0),
            logit_bias={t: decimal_of_float32(b) for t, b in s.logit_bias.items()},
            min_tokens=s.min_tokens,
            n=max(s.n, 1),
            constraint=constraint,
        )
    except ValueError as e:  # SamplingParams names the field and the rule
        raise InvalidRequest(f"sampling.{e}") from None
    slo = {}
    for name in ("ttft_slo_ms", "tpot_slo_ms"):
        if msg.HasField(name):
            value = getattr(msg, name)
            if not (math.isfinite(value) and 0 < value <= MAX_SLO_MS):
                raise InvalidRequest(f"{name}={value}: must be in (0, {MAX_SLO_MS:.0f}] ms")
            slo[name] = decimal_of_float32(value)
    late, tenant = msg.reject_if_late, msg.tenant
    if tenant and not _ID.match(tenant):
        raise InvalidRequest("tenant: use 1-64 characters from letters, digits and . _ -")
    return Admission(rid, tuple(ids), sampling, msg.priority, tenant, **slo, reject_if_late=late)


def check_prompt_text(name: str, texts: str | list[str], max_model_len: int) -> None:
    """Refuse prompt text (one string, or a chat's contents) too long to fit the context,
    before it is tokenized."""
    limit = prompt_bytes_limit(max_model_len)
    parts = [texts] if isinstance(texts, str) else texts
    if (
        sum(len(t) for t in parts) > limit
        or sum(len(t.encode("utf-8", "surrogatepass")) for t in parts) > limit
    ):
        raise InvalidRequest(
            f"{name}: over {limit} bytes, more than fits the model's context of "
            f"{max_model_len} tokens (limit: {MAX_PROMPT_BYTES_PER_TOKEN} bytes a token)"
        )


def _check_costs(msg: pb.GenerateRequest, max_model_len: int) -> None:
    """Refuse, before any work, what would cost without bound: each limit named."""
    check_prompt_text("prompt", msg.prompt, max_model_len)
    s = msg.sampling
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"sampling.stop: {len(s.stop)} strings, at most {MAX_STOP_STRINGS} (max_stop_strings)"
        )
    long = [x for x in s.stop if len(x) > MAX_STOP_CHARS]
    if long:
        raise InvalidRequest(
            f"sampling.stop: a string of {len(long[0])} characters, at most {MAX_STOP_CHARS} "
            "(max_stop_chars)"
        )
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"sampling.stop_token_ids: {len(s.stop_token_ids)} ids, at most "
            f"{MAX_STOP_TOKEN_IDS} (max_stop_token_ids)"
        )
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"sampling.logit_bias: {len(s.logit_bias)} entries, at most {MAX_LOGIT_BIAS} "
            "(max_logit_bias)"
        )
