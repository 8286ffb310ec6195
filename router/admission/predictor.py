"""Predictions the router schedules by, learned online from the requests it served:

- `LengthPredictor`: a request's output tokens, from its tenant, its prompt's length and its
  `max_tokens`. Shortest-job-first orders by it, and admission estimates service time with it;
- `LinearFit`: seconds as a + b * x, for the time from a slot to the first token (x: prompt
  tokens) and a slot's holding time, for slack ordering and `reject_if_late`.

Both forget slowly (exponential weights), so they follow a workload that changes. Used from
the router's event loop alone.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

# Until a key has this many completions, its estimate leans on the wider one (tenant, then
# every tenant): a new tenant's first request is not predicted from one sample.
MIN_SAMPLES = 4
FORGET = 0.98  # each new completion's weight against the past's
RUNS_OUT = 0.9  # mean output / max_tokens past which a key's outputs scale with max_tokens
MAX_KEYS = 16384  # (tenant, prompt octave) and tenant keys kept, the least recently seen dropped


@dataclass
class _Mean:
    total: float = 0.0
    weight: float = 0.0
    count: int = 0

    def add(self, x: float) -> None:
        self.total = self.total * FORGET + x
        self.weight = self.weight * FORGET + 1
        self.count += 1

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight else None


class LengthPredictor:
    """Output tokens as a count and as a fraction of `max_tokens`, per (tenant, prompt-length
    octave), per tenant and overall; the narrowest key with enough samples answers: its
    count, or where outputs run to their limit, that fraction of this max_tokens; capped at
    max_tokens."""

    def __init__(self, prior_tokens: float = 64.0) -> None:
        self.prior = prior_tokens
        # key -> (output tokens, output / max_tokens), the least recently observed first
        self._means: OrderedDict[tuple, tuple[_Mean, _Mean]] = OrderedDict()
        self.abs_error = _Mean()  # |predicted - actual|, over completions
        self.observed = 0

    @staticmethod
    def _keys(tenant: str, prompt_tokens: int) -> list[tuple]:
        octave = int(math.log2(prompt_tokens + 1))
        return [(tenant, octave), (tenant,), ()]

    def predict(self, tenant: str, prompt_tokens: int, max_tokens: int) -> float:
        for key in self._keys(tenant, prompt_tokens):
            count, fraction = self._means.get(key, (None, None))
            if count is not None and count.count >= MIN_SAMPLES:
                # Outputs that (nearly) always run to max_tokens scale with it; others are
                # as long as they are, whatever the request allows.
                run_out = fraction.value >= RUNS_OUT
                guess = fraction.value * max_tokens if run_out else count.value
                return max(1.0, min(float(max_tokens), guess))
        return max(1.0, min(float(max_tokens), self.prior))

    def observe(self, tenant: str, prompt_tokens: int, max_tokens: int, predicted: float,
                actual: int) -> None:  # fmt: skip
        """A completed choice: `actual` output tokens, `predicted` at its admission."""
        for key in self._keys(tenant, prompt_tokens):
            count, fraction = self._means.pop(key, None) or (_Mean(), _Mean())
            count.add(actual)
            fraction.add(actual / max(1, max_tokens))
            self._means[key] = count, fraction  # the most recent last
        while len(self._means) > MAX_KEYS:  # a router without keys: any tenant name comes
            self._means.popitem(last=False)
        self.abs_error.add(abs(predicted - actual))
        self.observed += 1

    @property
    def mean_abs_error(self) -> float | None:
        """Recent mean absolute error of the predictions, in tokens (None: none yet)."""
        return self.abs_error.value


class LinearFit:
    """y ~ a + b * x by exponentially weighted least squares; `prior` until two distinct x."""

    def __init__(self, prior: float, forget: float = FORGET) -> None:
        self.prior = prior
        self.forget = forget
        self._s = [0.0] * 5  # weight, sum x, sum y, sum xx, sum xy

    def add(self, x: float, y: float) -> None:
        f = self.forget
        w, sx, sy, sxx, sxy = self._s
        self._s = [w * f + 1, sx * f + x, sy * f + y, sxx * f + x * x, sxy * f + x * y]

    def __call__(self, x: float) -> float:
        w, sx, sy, sxx, sxy = self._s
        if w == 0:
            return self.prior
        det = w * sxx - sx * sx
        if det <= 1e-9 * max(1.0, w * sxx):  # one x only: the mean
            return max(0.0, sy / w)
        b = (w * sxy - sx * sy) / det
        a = (sy - b * sx) / w
        if b < 0:  # noise: a longer prompt cannot take less time
            return max(0.0, sy / w)
        return max(0.0, a + b * x)
