"""Constrained decoding through llguidance: a `Constraint` compiled into a grammar (checked and
cached by `GrammarCompiler`, on the router and in the engine), and per-sequence matchers that
give each step's token mask (`GrammarMasks`, the engine's).

A matcher's state is a pure function of the constraint and the tokens the sequence emitted.
So it is never shipped: wherever a sequence runs (the prefill worker drawing its first token,
the decode worker it moves to, a replay from the token log, a recompute after preemption), its
matcher is rebuilt from the constraint and caught up on the tokens it already has, and the
next draw is the one an uninterrupted run would make.

Why llguidance (measured on this CPU, SmolLM2's 49k vocabulary): xgrammar fills a mask in
about 1.4 us against llguidance's 13 us (median over a JSON schema's tokens), but compiled the
schema `{"type": "string", "pattern": "^[a-z]{1,50000}$"}` for 210 s, where llguidance, whose
lexer runs on bounded fuel, took 4 ms. A request's schema is the client's: the router must not
stall on it. Both are far below a decode step (17 ms at batch 1 here).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.engine.constraint import Constraint, ConstraintKind

log = logging.getLogger(__name__)

# JSON as json.dumps writes it (", " and ": "), no free whitespace: a model that may put any
# whitespace anywhere can loop on newlines until max_tokens.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept, by constraint


class GrammarError(ValueError):
    """A constraint that does not compile: the message names the problem."""


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise GrammarError(f"constrained decoding needs llguidance ({e})") from None
    return llguidance


def grammar_text(c: Constraint) -> str:
    """The constraint as llguidance's grammar (not yet checked)."""
    try:
        return _grammar_text(c)
    except GrammarError:
        raise
    except Exception as e:  # the converters raise their own error types
        raise GrammarError(f"constraint.{c.kind.value}: {_first_line([e])}") from None


def _grammar_text(c: Constraint) -> str:
    M = _llguidance().LLMatcher
    if c.kind is ConstraintKind.JSON_SCHEMA:
        schema = json.loads(c.text)
        if schema is False:
            raise GrammarError("constraint.json_schema: false allows nothing")
        schema = closed_objects({} if schema is True else schema)
        return M.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
    if c.kind is ConstraintKind.JSON_OBJECT:
        return M.grammar_from_json_schema('{"type": "object"}', defaults=JSON_STYLE)
    if c.kind is ConstraintKind.REGEX:
        return M.grammar_from_regex(c.text)
    if c.kind is ConstraintKind.CHOICE:
        return M.grammar_from_lark(
            "start: " + " | ".join(json.dumps(x, ensure_ascii=False) for x in c.choices)
        )
    from llguidance.gbnf_to_lark import any_to_lark

    return M.grammar_from_lark(any_to_lark(c.text))


# Where closing an object keeps the schema's meaning: not inside allOf (its branches may split
# one object's properties between them), not, if/then/else or contains.
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_ONE = ("items", "additionalProperties")


def closed_objects(schema):
    """The schema with `additionalProperties: false` on every object that lists its
    properties and says nothing of others (as OpenAI's strict mode requires, and as xgrammar
    does by default): what it generates validates against the schema as given, and a model
    is not free to ramble on in keys of its own invention."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    combined = any(k in out for k in ("allOf", "patternProperties", "unevaluatedProperties"))
    if "properties" in out and "additionalProperties" not in out and not combined:
        out["additionalProperties"] = False
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_objects(s) for k, s in out[key].items()}
    return out


class GrammarCompiler:
    """Constraints to checked grammars, for one tokenizer: an invalid one raises GrammarError
    naming the problem. Compiling is bounded by llguidance's lexer fuel, not by the schema's
    size, and cached (LRU) by constraint. Thread-safe."""

    def __init__(self, hf_tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        llg = _llguidance()
        self.tokenizer = llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        # By constraint: its grammar and a matcher at its start, copied for each sequence (its
        # lexer built once).
        self._cache: OrderedDict[Constraint, tuple[str, object]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.compiles = 0
        self.compile_seconds = 0.0

    def grammar(self, c: Constraint) -> str:
        return self._compiled(c)[0]

    def matcher(self, c: Constraint):
        """A matcher at the constraint's start, of the sequence's own."""
        return self._compiled(c)[1].deep_copy()

    def _compiled(self, c: Constraint) -> tuple[str, object]:
        with self._lock:
            entry = self._cache.get(c)
            if entry is not None:
                self._cache.move_to_end(c)
                self.hits += 1
                return entry
        started = time.perf_counter()
        entry = self._check(c, grammar_text(c))
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - started
            self._cache[c] = entry
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return entry

    def _check(self, c: Constraint, text: str) -> tuple[str, object]:
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self.tokenizer)
        if failed:
            raise GrammarError(f"constraint.{c.kind.value}: {_first_line(messages)}")
        # The first mask builds the lexer: a grammar that runs out of fuel doing so is refused
        # here, not on a worker's loop.
        pristine = llg.LLMatcher(self.tokenizer, text)
        probe = pristine.deep_copy()
        mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error():
            raise GrammarError(f"constraint.{c.kind.value}: {_first_line([probe.get_error()])}")
        if not mask.any():
            raise GrammarError(f"constraint.{c.kind.value}: no token can begin it")
        return text, pristine


def _first_line(messages) -> str:
    """llguidance's messages as one line: the source excerpts and carets left out."""
    lines = [x.strip() for m in messages for x in str(m).splitlines()]
    kept = [x for x in lines if x and set(x) != {"^"} and not re.match(r"^\d+ \|", x)]
    return " ".join(kept)[:500] or "invalid"


@dataclass
class _Track:
    """One sequence's matcher and the tokens it has consumed."""

    constraint: Constraint
    matcher: object | None  # None: its constraint does not compile here
    source: list[int]  # the output list it follows (the sequence's own)
    tokens: list[int] = field(default_factory=list)


@dataclass
class Masks:
    """One step's masks: for the sampled rows `rows`, which tokens each may draw."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), words] int32, bit t of word w: token 32w + t
    accepting: list[bool]  # may end here: EOS allowed
    seconds: float


class GrammarMasks:
    """The engine's matchers, one per constrained sequence (by id), kept in step with the
    sequence's output tokens. Used from the engine's loop thread, and `fill` from one helper
    thread while the model runs (never both at once for one step)."""

    def __init__(self, compiler: GrammarCompiler, eos_token_ids, device: torch.device) -> None:
        self.compiler = compiler
        self.eos_token_ids = list(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.device = device
        self._tracks: dict[str, _Track] = {}
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        # llguidance's thread pool fills rows in parallel where there are cores to spare; on
        # a small CPU it only contends with the model's threads (measured on 2 cores, batch
        # 16: 3.4 ms a step against 0.8 ms one row after another on the helper thread).
        cores = os.cpu_count() or 1
        self._executor = (
            _llguidance().LLExecutor(num_threads=min(8, cores // 2)) if cores > 8 else None
        )
        # Sequences whose grammar broke (a constraint that does not compile here, a token it
        # refuses, its fuel spent): id -> why. The engine ends them in error.
        self.failed: dict[str, str] = {}
        self.constrained_requests = 0  # sequences that got a matcher (lifetime)
        self.mask_steps = 0
        self.mask_seconds = 0.0

    def fill(self, rows: list[tuple[int, str, Constraint, list[int], int]]) -> Masks:
        """Masks for rows (row index, sequence id, constraint, its output list, how many of
        those tokens precede this draw)."""
        started = time.perf_counter()
        words = (self.compiler.vocab_size + 31) // 32
        # numpy: a torch op here could start an OpenMP team beside the model's (see below).
        bits = np.zeros((len(rows), words), dtype=np.int32)
        matchers = []
        for i, (_, seq_id, c, out, n) in enumerate(rows):
            m = self._caught_up(seq_id, c, out, n).matcher
            if m is not None and not m.is_error():
                matchers.append((m, i))
        if self._executor is not None and len(matchers) > 1:
            self._executor.unsafe_compute_mask_ptr(
                matchers, bits.ctypes.data, words * 4, len(matchers)
            )
        else:
            for m, i in matchers:
                m.unsafe_compute_mask_ptr(bits[i].ctypes.data, words * 4)
        # After the masks: filling one may stop the matcher (its fuel spent: EOS alone).
        accepting = [True] * len(rows)  # a failed grammar: EOS alone, and the engine fails it
        for m, i in matchers:
            if m.is_error():
                self._fail(rows[i][1], f"its grammar failed: {m.get_error()}")
            else:
                accepting[i] = m.is_accepting() or m.is_stopped()
        # Unpacked on the loop's thread (`allowed`): torch ops on this one, while the model
        # computes, oversubscribe the CPU's OpenMP threads (a batch-1 step went 17 -> 29 ms).
        masks = Masks([r[0] for r in rows], torch.from_numpy(bits), accepting, 0.0)
        masks.seconds = time.perf_counter() - started
        self.mask_steps += 1
        self.mask_seconds += masks.seconds
        return masks

    def allowed(self, masks: Masks, vocab: int) -> torch.Tensor:
        """[len(masks.rows), vocab] bool on the device: EOS (every id the engine ends on)
        where the grammar may end, and only there."""
        bm = masks.bitmask.to(self.device, non_blocking=True)
        allowed = ((bm.unsqueeze(-1) >> self._shifts) & 1).view(bm.shape[0], -1)[:, :vocab]
        allowed = allowed.bool()
        eos = [t for t in self.eos_token_ids if t < vocab]
        if eos:
            ends = torch.tensor(masks.accepting, device=self.device)
            allowed[:, eos] = ends[:, None]
            # Never a row with nothing to draw (it would draw token 0, or NaN): EOS then.
            allowed[:, eos] |= ~allowed.any(dim=1, keepdim=True)
        return allowed

    def take_failed(self) -> dict[str, str]:
        """The sequences whose grammar broke since the last call, and why."""
        failed, self.failed = self.failed, {}
        return failed

    def advance(self, seq_id: str, token: int) -> None:
        """A sequence drew `token`: its matcher takes it now, so the next mask starts there."""
        tr = self._tracks.get(seq_id)
        if tr is not None:
            self._consume(seq_id, tr, [token])

    def retain(self, live) -> None:
        """Drop the matchers of sequences no longer in `live` (ended, cancelled, moved)."""
        for seq_id in [s for s in self._tracks if s not in live]:
            del self._tracks[seq_id]

    def __len__(self) -> int:
        return len(self._tracks)

    def _caught_up(self, seq_id: str, c: Constraint, out: list[int], n: int) -> _Track:
        tr = self._tracks.get(seq_id)
        done = len(tr.tokens) if tr is not None else 0
        if tr is not None and (
            done > n or tr.constraint != c or (tr.source is not out and out[:done] != tr.tokens)
        ):
            tr = None  # not this sequence's history (a new request under an old id)
        if tr is None:
            try:
                matcher = self.compiler.matcher(c)
            except Exception as e:  # the router compiled it: only another install gets here
                matcher = None
                self._fail(seq_id, f"its constraint does not compile here: {e}")
            tr = self._tracks[seq_id] = _Track(c, matcher, out)
            self.constrained_requests += 1
            done = 0
        tr.source = out
        if n > done:
            self._consume(seq_id, tr, out[done:n])
        return tr

    def _consume(self, seq_id: str, tr: _Track, tokens: list[int]) -> None:
        for t in tokens:
            tr.tokens.append(t)
            if tr.matcher is None or tr.matcher.is_error() or t in self._eos:
                continue  # failed already; EOS ends the sequence, whichever id it is
            if not tr.matcher.consume_token(t):
                self._fail(seq_id, f"token {t} breaks its grammar ({tr.matcher.get_error()})")

    def _fail(self, seq_id: str, why: str) -> None:
        if seq_id not in self.failed:
            log.error("%s: %s; it ends in error", seq_id, why)
            self.failed[seq_id] = why
