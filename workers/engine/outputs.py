"""What the engine hands back: each step's output for each request it touched, and the
engine's own counts for its worker's status."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.request import ErrorKind, FinishReason


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    new_logprobs: list[float] | None = None  # only for requests that asked for logprobs
    # Set only for requests with stop strings: their text so far, cut at any stop string.
    text: str | None = None
    # keep_kv requests that ended naturally: the blocks now held for them (see release_kv).
    kv_blocks: list[int] | None = None
    # Only for requests that asked for top_logprobs: per new token, (token id, logprob) pairs.
    new_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    index: int = 0  # which of the request's n choices (request_id is the request's own)
    error_kind: ErrorKind | None = None  # with FinishReason.ERROR: why, for a status


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_reservable: int  # the most one request can hold: the total less the watermark
    running: int
    waiting: int
    reserved: int
    preemptions: int
    prefix_hit_blocks: int
    prefix_query_blocks: int = 0  # full prompt blocks looked up in the prefix cache
    kv_bytes_per_token: int = 0  # K and V of one token, every layer, in the cache's dtype
    prefill_tokens: int = 0  # lifetime: tokens computed in prompt chunks
    decode_tokens: int = 0  # lifetime: tokens computed one per sequence per step
    # Constrained decoding, lifetime: sequences given a matcher, steps that built masks and
    # their seconds, constraints compiled (seconds) and found compiled.
    constrained_seqs: int = 0
    grammar_mask_steps: int = 0
    grammar_mask_seconds: float = 0.0
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
