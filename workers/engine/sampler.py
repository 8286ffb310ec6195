"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

A draw is inverse-CDF sampling with one uniform per (request, output index): the uniform is
a counter-based hash of (seed, index), and the token is the first whose cumulative
probability (summed in float64) exceeds it. A request's draws therefore depend only on its
own seed, position and distribution, never on which other requests share its batch, and no
per-request generator loop is needed. The uniform is (2k + 1) / 2**53 for a 52-bit k: exact
in float64, never 0 or 1, so a token of probability 0 (outside top-k or top-p) is never
drawn.

Top-k and top-p look at each row's best candidates (`topk`), not a sort of the whole
vocabulary; a row whose nucleus is wider than the candidates falls back to the full sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [N] float; 0 for greedy rows
    top_k: torch.Tensor  # [N] int64; 0 disables
    top_p: torch.Tensor  # [N] float; 1 disables
    seeds: torch.Tensor  # [N] int64
    counters: torch.Tensor  # [N] int64: index of the token being drawn
    all_greedy: bool
    any_filter: bool
    want_logprobs: bool


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float: log p(token) under the raw model distribution


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on values kept in [0, 2^32) inside int64: products may wrap past
    # 2^63, but the low 32 bits, which are all we keep, stay exact.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[N] float64 uniforms, a pure function of (seed, counter): (2k + 1) / 2**53 for the
    52-bit k hashed from them. 2k + 1 < 2**53 is exact in float64, so every value lies in
    [2**-53, 1 - 2**-53]: never 0 or 1."""
    s = _fmix32((seeds & _MASK32) ^ _fmix32((seeds >> 32) & _MASK32))
    hi = _fmix32(s ^ _fmix32((counters * 0x9E3779B1) & _MASK32))
    lo = _fmix32(hi ^ 0x27D4EB2F)
    k = (hi << 20) | (lo >> 12)  # 32 + 20 bits
    return (k.double() * 2.0 + 1.0) * 2.0**-53


# Top-p looks at this many best candidates first; a row whose nucleus is wider sorts all.
_CANDIDATES = 1024


def _apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask everything outside each row's top-k and top-p nucleus to -inf (top-p within the
    top-k, renormalized; the most likely token always stays). Rows with neither filter are
    returned as they are."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    unfiltered = (k >= vocab) & (top_p >= 1)
    # Enough candidates for every row's top-k, and for a nucleus not cut by a top-k.
    nucleus_only = bool(((k >= vocab) & (top_p < 1)).any())
    widest_k = int(k[k < vocab].max()) if bool((k < vocab).any()) else 1
    width = min(vocab, max(widest_k, _CANDIDATES if nucleus_only else 1))
    vals, idx = logits.topk(width, dim=-1)
    ranks = torch.arange(width, device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    # Each row's normalizer: over its top-k (all inside the candidates), or the whole row.
    inside = vals.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
    norm = torch.where(k < vocab, inside, logits.logsumexp(dim=-1))
    probs = (vals - norm[:, None]).exp().masked_fill(drop, 0.0)
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    # A row that keeps tokens past the candidates: its top-k is wider than them, and their
    # mass is short of top_p. Only a full sort can place its cut.
    short = (k > width) & (probs.sum(dim=-1) < top_p) & ~unfiltered
    if bool(short.any()):
        return torch.where(unfiltered[:, None], logits, _apply_filters_sorted(logits, k, top_p))
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(-1, idx, vals.masked_fill(drop, float("-inf")))
    return torch.where(unfiltered[:, None], logits, out)


def _apply_filters_sorted(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor):
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p; the first token always stays.
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits: [N, V] float32, one row per request that samples this step."""
    greedy_ids = logits.argmax(dim=-1)
    logprobs = None
    if t.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = t.temperature == 0
        temp = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
        scaled = logits / temp[:, None]
        if t.any_filter:
            scaled = _apply_filters(scaled, t.top_k, t.top_p)
        cdf = scaled.softmax(dim=-1).double().cumsum(dim=-1)
        # The first token whose cumulative mass exceeds u * total: one of positive
        # probability, since u * total lies strictly inside (0, total).
        target = row_uniforms(t.seeds, t.counters) * cdf[:, -1]
        drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
        drawn = drawn.clamp(max=logits.shape[-1] - 1)
        token_ids = torch.where(greedy, greedy_ids, drawn)
    if t.want_logprobs:
        logprobs = logits.log_softmax(dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
