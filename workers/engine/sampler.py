"""Batched sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Randomness comes from a counter-based hash of (seed, output index, vocab id), turned into
exponential noise for the Gumbel-max trick: argmax(p / E) with E ~ Exp(1) draws from p. A
request's draws therefore depend only on its own seed and position, never on which other
requests share its batch, and no per-request generator loop is needed.
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


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] uniforms strictly inside (0, 1), on a grid of 2**23 points: a pure
    function of (seed, counter, vocab index)."""
    vocab_ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    s = _fmix32((seeds & _MASK32) ^ _fmix32((seeds >> 32) & _MASK32))
    row = _fmix32(s ^ _fmix32((counters * 0x9E3779B1) & _MASK32))
    x = _fmix32((row[:, None] + vocab_ids[None, :] * 0x27D4EB2F) & _MASK32)
    x = _fmix32(x ^ (row[:, None] >> 7))
    # The top 23 bits k give (2k + 1) / 2**24: odd numbers below 2**24 over a power of two,
    # each exact in float32, so the noise lies in [2**-24, 1 - 2**-24] and never rounds to
    # 0 or 1 (more bits would: (x + 0.5) / 2**32 rounds to 1.0 for x near 2**32, and
    # -log(1.0) = 0 makes p / 0 win the argmax whatever p is).
    return ((x >> 9).float() + 0.5) * (1.0 / 8388608.0)


def _apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask everything outside each row's top-k and top-p nucleus to -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
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
        probs = scaled.softmax(dim=-1)
        noise = -torch.log(uniform_noise(t.seeds, t.counters, logits.shape[-1]))
        drawn = (probs / noise).argmax(dim=-1)
        token_ids = torch.where(greedy, greedy_ids, drawn)
    if t.want_logprobs:
        logprobs = logits.log_softmax(dim=-1).gather(-1, token_ids[:, None]).squeeze(-1)
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
