"""Decode pacing: prompt chunks sized so that running sequences keep a target time per token.

A prompt chunk in the same step as the decodes delays each of their tokens by as long as the
chunk takes. With `target_tpot_ms` (T) set, each step's prompt tokens are limited to the time
the running sequences can spare:

- a sequence that has made k tokens since its first one here, over e seconds, is on target
  while e <= T*k. It may borrow against its next h = min(8, tokens it may still make)
  tokens: the next step may take T*(k+h) - e - (h-1)*d, where d is the decode-only step,
  and the h-1 steps after it, at d, bring it back to T. That is its slack; short steps bank
  more. Its last tokens borrow nothing, so a sequence ends on target;
- a step may take the smallest slack of the sequences still able to meet T. One that cannot,
  even if every token it may still make came at the decode-only pace, is not protected:
  holding prompts back would not save it, only cost the prompts;
- a cost model fitted online to the steps actually run (`StepCostModel`) turns that time
  into prompt tokens, in whole blocks; what is too little for a block waits, and the slack
  banked meanwhile makes a larger, cheaper chunk later;
- while prompts wait, one block of them runs at least every 8*T whatever the slack (the
  policy picks whose), so prompts always advance.

Requests with a TPOT target of their own (`tpot_slo_ms`) beside requests with none: the
step's decode batch is also bounded (`decode_cap`), the decodes without a target (in the
policy's order: under fair share, the tenant most over its share last) held back a step,
none for longer than MAX_DECODE_PAUSE_S.

Sarathi-Serve derives one chunk size from the TPOT SLO ahead of time; sizing each step from
the sequences' own pace spends the slack that short steps leave, so long prompts still move
in large chunks while the batch runs ahead of its target. The target is the engine's own
measure: a client also sees the stream's delivery, so set it somewhat under the SLO.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from workers.engine.request import Request

# Steps observed, at least one with prompt tokens, before the model sizes chunks.
MIN_OBSERVATIONS = 3
# A sequence may borrow against this many of its coming tokens: one long step now, repaid by
# the decode-only steps after it. Bounded, so a sequence that ends early (EOS) owes little.
HORIZON_TOKENS = 8
# The weight of a decode-only step in its batch size's average: a size's own steps come in
# runs, so it follows a change within a few dozen of them.
DECODE_WEIGHT = 0.1
# A batch size not run for this many steps is forgotten: the contexts, and the load beside
# the engine, have moved on since.
STALE_STEPS = 200
# Decodes without a target are held back so that a step takes at most this share of the
# tightest target: the stream's delivery takes the rest.
DECODE_HEADROOM = 0.9
# A decode held back this long runs whatever the targets: it always advances, well within
# any stall timeout.
MAX_DECODE_PAUSE_S = 1.0


class StepCostModel:
    """Step seconds ~ decode(n) for n decodes, + (c + d * prompt tokens if any).

    decode(n) is what the last decode-only steps of n sequences took (an average per batch
    size, each step of that size weighing DECODE_WEIGHT once it has a few), never more than
    for a larger size, read between the sizes seen in the last STALE_STEPS steps along
    straight lines. One fitted line through all sizes cannot be trusted: a batch that stays
    one size for minutes (a flood's full batch) leaves the line's slope unexcited, and
    recursive least squares with forgetting lets it wander with the noise, until a step of
    one sequence is predicted slower than a full one. Per size, an estimate may only err
    low for long: one too high would keep pacing from running that size again to correct
    it. So a size is never taken for slower than a larger one, a size not seen for a while
    is read from the sizes around it instead, and below the smallest size seen decode(n)
    runs straight down to zero.

    `c` + `d` * tokens, what a prompt chunk adds to a step (`c` whatever its size: its own
    kernels, its attention over the context before it: why a few large chunks beat many
    small ones), is fitted by recursive least squares with exponential forgetting to what
    steps with decodes and a chunk took beyond decode(n): it follows the machine as load and
    contexts change."""

    TOKENS = 256.0  # prompt tokens in units that keep the feature near 1

    def __init__(self, forgetting: float = 0.97) -> None:
        self.forgetting = forgetting
        self._decode: dict[int, float] = {}  # batch size -> seconds: the average
        self._steps: dict[int, int] = {}  # batch size -> steps seen
        self._seen_at: dict[int, int] = {}  # batch size -> the observation it was last seen
        self._sizes: list[int] = []  # its keys, sorted
        self._bound: list[float] = []  # by _sizes: the least average at that size or above
        self._reset_prompt()
        self.observations = 0

    def _reset_prompt(self) -> None:
        self.theta = np.zeros(2)  # c, d (per TOKENS)
        self.cov = np.eye(2) * 1e3
        self.prompt_observations = 0

    def observe(self, decodes: int, prompt_tokens: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.observations += 1
        if not prompt_tokens:
            if decodes not in self._decode:
                self._decode[decodes], self._steps[decodes] = 0.0, 0
                bisect.insort(self._sizes, decodes)
            self._steps[decodes] += 1
            self._seen_at[decodes] = self.observations
            weight = max(DECODE_WEIGHT, 1 / self._steps[decodes])  # a plain mean at first
            self._decode[decodes] += weight * (seconds - self._decode[decodes])
            old = self.observations - STALE_STEPS
            for n in [n for n, at in self._seen_at.items() if at < old]:
                del self._decode[n], self._steps[n], self._seen_at[n]
                self._sizes.remove(n)
            bound, least = [], math.inf
            for n in reversed(self._sizes):
                least = min(least, self._decode[n])
                bound.append(least)
            self._bound = bound[::-1]
            return
        if not decodes or not self._sizes:
            return  # a chunk alone: its step's fixed cost is not one a decode step shares
        x = np.array([1.0, prompt_tokens / self.TOKENS])
        extra = seconds - self.decode_seconds(decodes)
        px = self.cov @ x
        gain = px / (self.forgetting + x @ px)
        self.theta += gain * (extra - x @ self.theta)
        cov = (self.cov - np.outer(gain, px)) / self.forgetting
        self.cov = (cov + cov.T) / 2
        # Forgetting inflates the covariance along a direction no step excites (through a
        # run of chunks of one size); bounded, it adapts fast, not wildly.
        trace = np.trace(self.cov)
        if trace > 1e6:
            self.cov *= 1e6 / trace
        if not (np.isfinite(self.theta).all() and np.isfinite(self.cov).all()):
            self._reset_prompt()  # start the fit over rather than size chunks from garbage
            return
        self.prompt_observations += 1

    @property
    def ready(self) -> bool:
        return (
            self.observations >= MIN_OBSERVATIONS
            and self.prompt_observations > 0
            and self.theta[1] > 0
        )

    def decode_seconds(self, decodes: int) -> float:
        sizes, bound = self._sizes, self._bound
        if not sizes:
            return 0.0
        i = bisect.bisect_left(sizes, decodes)
        if i < len(sizes) and sizes[i] == decodes:
            return bound[i]
        if i == 0:  # below every size seen: straight down to zero
            return bound[0] * max(0, decodes) / sizes[0] if sizes[0] else bound[0]
        if i == len(sizes):  # above: on along the last two sizes' line, or in proportion
            hi = sizes[-1]
            if len(sizes) > 1:
                slope = max(0.0, (bound[-1] - bound[-2]) / (hi - sizes[-2]))
            else:
                slope = bound[-1] / hi if hi else 0.0
            return bound[-1] + slope * (decodes - hi)
        lo, hi = sizes[i - 1], sizes[i]
        return bound[i - 1] + (bound[i] - bound[i - 1]) * (decodes - lo) / (hi - lo)

    def prompt_tokens_within(self, seconds: float) -> int:
        """Prompt tokens a step can add and take at most `seconds` longer."""
        spare = seconds - max(0.0, float(self.theta[0]))
        return int(spare / self.theta[1] * self.TOKENS) if spare > 0 else 0


class DecodePacer:
    def __init__(self, target_tpot_s: float | None, block_size: int) -> None:
        self.target = target_tpot_s  # a request's own tpot_slo_ms comes first; None: no target
        self.block_size = block_size
        self.model = StepCostModel()
        self._last_prompt_step: float | None = None

    def target_of(self, r: Request) -> float | None:
        slo = r.tenancy.tpot_slo_ms
        return slo / 1000 if slo else self.target

    def observe(self, decodes: int, prompt_tokens: int, seconds: float, now: float) -> None:
        self.model.observe(decodes, prompt_tokens, seconds)
        if prompt_tokens or self._last_prompt_step is None:
            self._last_prompt_step = now

    def slack(self, decoding: list[Request], now: float, max_model_len: int) -> float:
        """Seconds the next step may take with every protected sequence of `decoding` (the
        running sequences past their prompts) still on its target; inf when there is none,
        or none can still meet it."""
        step = self.model.decode_seconds(len(decoding))
        slack = math.inf
        for r in decoding:
            target = self.target_of(r)
            if r.paced_since is None or target is None:
                continue
            since, made = r.paced_since
            k = r.num_output_tokens - made
            elapsed = now - since
            left = max(
                1,
                min(r.sampling.max_tokens - r.num_output_tokens, max_model_len - r.num_tokens),
            )
            if elapsed + left * step > target * (k + left):
                continue  # too far behind to get back under the target
            # On target after its next h tokens, the later ones at the decode-only pace.
            h = min(left, HORIZON_TOKENS)
            slack = min(slack, target * (k + h) - elapsed - (h - 1) * step)
        return slack

    def decode_cap(self, decoding: list[Request]) -> int | None:
        """How many decodes of requests with no TPOT target a step may run beside those with
        one and still keep the tightest target (with DECODE_HEADROOM); None: no limit. A
        batch's decode step grows with its size: a tenant's own TPOT target is kept by
        holding others' decodes back a step, not by failing it."""
        if self.model.observations < MIN_OBSERVATIONS:
            return None
        targets = [t for t in map(self.target_of, decoding) if t is not None]
        if not targets or len(targets) == len(decoding):
            return None
        tight = DECODE_HEADROOM * min(targets)
        if self.model.decode_seconds(len(decoding)) <= tight:
            return None
        if self.model.decode_seconds(len(targets)) > min(targets):
            return None  # out of reach whatever others do: holding them back would not help
        # Within the target, if not its headroom: the fewest others run, the nearest it gets.
        size = len(targets)
        while size < len(decoding) and self.model.decode_seconds(size + 1) <= tight:
            size += 1
        return size - len(targets)

    def prompt_allowance(self, decoding: list[Request], now: float, max_model_len: int):
        """Prompt tokens the next step may compute beside `decoding` (as for `slack`); None
        for no limit."""
        if not self.model.ready:
            return None
        slack = self.slack(decoding, now, max_model_len)
        if math.isinf(slack):
            return None
        spare = slack - self.model.decode_seconds(len(decoding))
        tokens = self.model.prompt_tokens_within(spare)
        tokens = tokens // self.block_size * self.block_size
        held = self._last_prompt_step is not None and now - self._last_prompt_step
        # Without a step with prompt tokens for HORIZON_TOKENS of the tightest target, one
        # block runs whatever the slack: prompts always advance.
        targets = [t for t in map(self.target_of, decoding) if t is not None]
        max_hold_s = HORIZON_TOKENS * min(targets, default=math.inf)
        if tokens == 0 and held and held > max_hold_s:
            return self.block_size
        return tokens
