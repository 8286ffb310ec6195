"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, penalties,
logit bias, min_tokens and per-request seeds, in vLLM's order:

1. logprobs (and top alternatives) of the raw model distribution;
2. logit bias, then the min_tokens ban of EOS and stop tokens;
3. repetition, frequency and presence penalties, then a constrained row's grammar mask;
4. greedy rows take the argmax of what that leaves; sampling rows divide by their
   temperature, then min-p, top-k and top-p cut the support, and a token is drawn.

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

from workers.engine.request import GREEDY_BELOW

_MASK32 = 0xFFFFFFFF


@dataclass
class Penalties:
    """For the rows `rows` of the batch, which ask for a penalty."""

    rows: torch.Tensor  # [R] int64
    presence: torch.Tensor  # [R] float
    frequency: torch.Tensor  # [R] float
    repetition: torch.Tensor  # [R] float
    output_counts: torch.Tensor  # [R, V] float: times each token was output so far
    in_prompt: torch.Tensor  # [R, V] bool


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
    min_p: torch.Tensor | None = None  # [N] float, when some row sets it; 0 disables
    top_logprobs: int = 0  # the most alternatives any row asks for
    penalties: Penalties | None = None
    # Sparse additions to the logits, (rows, token ids, values): logit bias, and -inf for
    # the tokens min_tokens bans.
    logit_edits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Constrained rows, (rows [R] int64, allowed [R, V] bool): the tokens each may draw.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] float: log p(token) under the raw model distribution
    top_ids: torch.Tensor | None = None  # [N, top_logprobs] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [N, top_logprobs] float


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on values kept in [0, 2^32) inside int64: products may wrap past
    # 2^63, but the low 32 bits, which are all we keep, stay exact.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def row_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[N] float64 uniforms, a pure function of (seed, counter): (2k + 1) / 2**53 for a
    52-bit k from two independent 32-bit hashes of them. 2k + 1 < 2**53 is exact in
    float64, so every value lies in [2**-53, 1 - 2**-53]: never 0 or 1."""
    lo32, hi32 = seeds & _MASK32, (seeds >> 32) & _MASK32
    c = _fmix32((counters * 0x9E3779B1) & _MASK32)
    a = _fmix32(_fmix32(lo32 ^ _fmix32(hi32)) ^ c)
    b = _fmix32(_fmix32(hi32 ^ _fmix32(lo32 ^ 0x27D4EB2F)) ^ _fmix32(c ^ 0x165667B1))
    k = (a << 20) | (b >> 12)  # 32 + 20 bits
    return (k.double() * 2.0 + 1.0) * 2.0**-53


# Top-p looks at this many best candidates first; a row whose nucleus is wider sorts all.
_CANDIDATES = 1024


def _apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask everything outside each row's top-k and top-p nucleus to -inf: top-p within the
    top-k, renormalized; the most likely token always stays; a token tied with the last one
    kept stays too. Each row's cut is a logit threshold computed in float64 from its own
    values only, the same whether it comes from the candidates or a full sort, so a row's
    mask never depends on the rows batched with it."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    unfiltered = (k >= vocab) & (top_p >= 1)
    # Enough candidates for every row's top-k, and for a nucleus not cut by a top-k.
    nucleus_only = bool(((k >= vocab) & (top_p < 1)).any())
    widest_k = int(k[k < vocab].max()) if bool((k < vocab).any()) else 1
    width = min(vocab, max(widest_k, _CANDIDATES if nucleus_only else 1))
    vals = logits.topk(width, dim=-1).values
    # A row its top-k does not cut is normalized over the whole row, computed once here so
    # that the candidates and a full sort place the same cut.
    uncut = k >= vocab
    whole = logits.double().logsumexp(dim=-1) if bool(uncut.any()) else None
    thr, settled = _cut(vals, k, top_p, uncut, whole)
    # A row whose nucleus reaches past the candidates: only a full sort places its cut.
    if not bool((settled | unfiltered).all()):
        thr, _ = _cut(logits.sort(dim=-1, descending=True).values, k, top_p, uncut, whole)
    thr = thr.masked_fill(unfiltered, float("-inf"))
    return logits.masked_fill(logits < thr[:, None], float("-inf"))


def _cut(vals, k, top_p, uncut: torch.Tensor, whole: torch.Tensor | None):
    """From each row's best `width` logits, sorted: the logit of the last token its top-k
    and top-p keep, and whether the candidates sufficed to tell (False: the nucleus may
    reach past them)."""
    width = vals.shape[-1]
    ranks = torch.arange(width, device=vals.device)
    out_k = ranks[None, :] >= k[:, None]
    v = vals.double()
    # The normalizer: over the top-k (all among the candidates), or the whole row.
    norm = v.masked_fill(out_k, float("-inf")).logsumexp(dim=-1)
    if whole is not None:
        norm = torch.where(uncut, whole, norm)
    probs = (v - norm[:, None]).exp().masked_fill(out_k, 0.0)
    before = probs.cumsum(dim=-1) - probs
    drop = out_k | (before >= top_p[:, None].double())
    drop[:, 0] = False
    last = (~drop).sum(dim=-1) - 1  # kept tokens are a prefix
    settled = (k <= width) | (probs.sum(dim=-1) >= top_p.double())
    return vals.gather(-1, last[:, None]).squeeze(-1), settled


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties on the rows `p.rows`: repetition over prompt and output, frequency
    and presence over the output."""
    x = logits[p.rows]
    output_seen = p.output_counts > 0
    rep = torch.where(p.in_prompt | output_seen, p.repetition[:, None], 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - p.frequency[:, None] * p.output_counts - p.presence[:, None] * output_seen
    out = logits.clone()
    out[p.rows] = x
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely one (min_p 0 keeps
    every token; the most likely always stays)."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def adjust_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 2 and 3 of the module's order, then the grammar masks of constrained rows: what
    both greedy and sampled rows choose from."""
    if t.logit_edits is not None:
        rows, cols, values = t.logit_edits
        logits = logits.index_put((rows, cols), values, accumulate=True)
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    if t.allowed is not None:
        rows, allowed = t.allowed
        if len(rows) == len(logits):  # every row constrained: rows are 0..N-1 in order
            logits = logits.masked_fill(~allowed, float("-inf"))
        else:
            masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
            logits = logits.index_copy(0, rows, masked)
    return logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)`, the same indices; fp32 rows on the CPU go through the compiled
    kernel (cpu_kernels.py), ten times torch's reduction over a 49k vocabulary."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        from workers.model.cpu_kernels import cpu_kernels

        kernels = cpu_kernels()
        if kernels is not None and logits.shape[1] > 0 and logits.stride(1) == 1:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits: [N, V] float32, one row per request that samples this step."""
    raw = logits
    logits = adjust_logits(logits, t)
    greedy_ids = argmax_rows(logits)
    if t.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = t.temperature < GREEDY_BELOW
        temp = torch.where(greedy, torch.ones_like(t.temperature), t.temperature)
        scaled = logits / temp[:, None]
        if t.min_p is not None:
            scaled = apply_min_p(scaled, t.min_p)
        if t.any_filter:
            scaled = _apply_filters(scaled, t.top_k, t.top_p)
        cdf = scaled.softmax(dim=-1).double().cumsum(dim=-1)
        # The first token whose cumulative mass exceeds u * total: one of positive
        # probability, since u * total lies strictly inside (0, total).
        target = row_uniforms(t.seeds, t.counters) * cdf[:, -1]
        drawn = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
        drawn = drawn.clamp(max=logits.shape[-1] - 1)  # NaN logits: a bad id, not a crash
        token_ids = torch.where(greedy, greedy_ids, drawn)
    out = SamplerOutput(token_ids=token_ids, logprobs=None)
    if t.want_logprobs:
        lsm = raw.log_softmax(dim=-1)
        out.logprobs = lsm.gather(-1, token_ids[:, None]).squeeze(-1)
        if t.top_logprobs > 0:
            out.top_logprobs, out.top_ids = lsm.topk(t.top_logprobs, dim=-1)
    return out
