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

The uniforms are computed on the host (`row_uniforms`, in NumPy) and reach the device with
the step's other inputs: one small column instead of a hundred tiny kernels per step.

Top-k and top-p look at each row's best candidates (`topk`), not a sort of the whole
vocabulary; a row whose nucleus is wider than the candidates falls back to the full sort.
What the filters need to know ahead (how many candidates, whether a sort may be needed) is
planned on the host from the rows' parameters (`FilterPlan`), so that a step on a GPU never
waits for the device to decide; there, a batch with an uncapped nucleus sorts at once rather
than asking whether the candidates sufficed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.request import GREEDY_BELOW

_MASK32 = 0xFFFFFFFF
# Top-p looks at this many best candidates first; a row whose nucleus is wider sorts all.
_CANDIDATES = 1024


@dataclass
class Penalties:
    """For the rows `rows` of the batch, which ask for a penalty."""

    rows: torch.Tensor  # [R] int64
    presence: torch.Tensor  # [R] float
    frequency: torch.Tensor  # [R] float
    repetition: torch.Tensor  # [R] float
    output_counts: torch.Tensor  # [R, V] float: times each token was output so far
    in_prompt: torch.Tensor  # [R, V] bool


@dataclass(frozen=True)
class FilterPlan:
    """What top-k and top-p need to know before they run, from the rows' host-side values."""

    width: int  # candidates each row's cut is looked for among
    any_uncut: bool  # some row's top-k cuts nothing: it is normalised over its whole row
    nucleus_only: bool  # some row has top-p < 1 and no top-k: its cut may lie past `width`
    sort_all: bool  # such a batch sorts whole rows at once (no device-side check first)

    @classmethod
    def of(
        cls, top_k: Sequence[int], top_p: Sequence[float], vocab: int, sort_all: bool = False
    ) -> FilterPlan | None:
        """The plan for these rows (top_k <= 0: none), or None when no row filters.
        `sort_all`: never ask the device whether the candidates sufficed (a GPU's step)."""
        ks = [k if 0 < k < vocab else vocab for k in top_k]
        top_p = [float(np.float32(p)) for p in top_p]  # as the device holds them
        if all(k >= vocab and p >= 1 for k, p in zip(ks, top_p)):
            return None
        nucleus_only = any(k >= vocab and p < 1 for k, p in zip(ks, top_p))
        widest_k = max((k for k in ks if k < vocab), default=1)
        width = min(vocab, max(widest_k, _CANDIDATES if nucleus_only else 1))
        return cls(width, any(k >= vocab for k in ks), nucleus_only, sort_all)


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # [N] float; 0 for greedy rows
    top_k: torch.Tensor  # [N] int64; 0 disables
    top_p: torch.Tensor  # [N] float; 1 disables
    uniforms: torch.Tensor  # [N] float64: each row's draw, `row_uniforms` of its seed and index
    all_greedy: bool
    filters: FilterPlan | None  # None: no row sets top-k or top-p
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


def _fmix32(x: np.ndarray) -> np.ndarray:
    # murmur3's finaliser on uint64 values kept in [0, 2^32): products wrap past 2^64, but the
    # low 32 bits, which are all we keep, stay exact.
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x85EBCA6B)) & np.uint64(_MASK32)
        x = x ^ (x >> np.uint64(13))
        x = (x * np.uint64(0xC2B2AE35)) & np.uint64(_MASK32)
        return x ^ (x >> np.uint64(16))


def _uint64(values) -> np.ndarray:
    """Integers modulo 2**64, as uint64 (an integer array's two's complement as it is)."""
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.astype(np.uint64)
    return np.array([int(v) & 0xFFFFFFFFFFFFFFFF for v in values], dtype=np.uint64)


def row_uniforms(seeds: Sequence[int], counters: Sequence[int]) -> np.ndarray:
    """[N] float64 uniforms, a pure function of (seed, counter), computed on the host: (2k +
    1) / 2**53 for a 52-bit k from two independent 32-bit hashes of them. 2k + 1 < 2**53 is
    exact in float64, so every value lies in [2**-53, 1 - 2**-53]: never 0 or 1. Seeds are
    taken modulo 2**64 (a negative seed as its two's complement)."""
    seeds, counters = _uint64(seeds), _uint64(counters)
    m = np.uint64(_MASK32)
    lo32, hi32 = seeds & m, (seeds >> np.uint64(32)) & m
    with np.errstate(over="ignore"):
        c = _fmix32((counters * np.uint64(0x9E3779B1)) & m)
    a = _fmix32(_fmix32(lo32 ^ _fmix32(hi32)) ^ c)
    b = _fmix32(
        _fmix32(hi32 ^ _fmix32(lo32 ^ np.uint64(0x27D4EB2F))) ^ _fmix32(c ^ np.uint64(0x165667B1))
    )
    k = (a << np.uint64(20)) | (b >> np.uint64(12))  # 32 + 20 bits
    return (k.astype(np.float64) * 2.0 + 1.0) * 2.0**-53


def _apply_filters(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, plan: FilterPlan
) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus to -inf: top-p within the
    top-k, renormalized; the most likely token always stays; a token tied with the last one
    kept stays too. Each row's cut is a logit threshold computed in float64 from its own
    values only, the same whether it comes from the candidates or a full sort, so a row's
    mask never depends on the rows batched with it."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    unfiltered = (k >= vocab) & (top_p >= 1)
    # A row its top-k does not cut is normalized over the whole row, computed once here so
    # that the candidates and a full sort place the same cut.
    uncut = k >= vocab
    whole = logits.double().logsumexp(dim=-1) if plan.any_uncut else None
    if plan.nucleus_only and plan.sort_all:
        thr, _ = _cut(logits.sort(dim=-1, descending=True).values, k, top_p, uncut, whole)
    else:
        vals = logits.topk(plan.width, dim=-1).values
        thr, settled = _cut(vals, k, top_p, uncut, whole)
        # A row whose nucleus reaches past the candidates: only a full sort places its cut.
        # Rows with a top-k are always settled (width covers it): ask only for the others.
        if plan.nucleus_only and not bool((settled | unfiltered).all()):
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
        if t.filters is not None:
            scaled = _apply_filters(scaled, t.top_k, t.top_p, t.filters)
        cdf = scaled.softmax(dim=-1).double().cumsum(dim=-1)
        # The first token whose cumulative mass exceeds u * total: one of positive
        # probability, since u * total lies strictly inside (0, total).
        target = t.uniforms * cdf[:, -1]
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
