"""A valid request as it enters admission: what the edge (router/edge/validation.py) makes of
a GenerateRequest or an OpenAI body, and all the Router and admission control read of it."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.request import SamplingParams
from workers.messages import RequestSpec


@dataclass(frozen=True)
class Admission:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # its seed resolved: the request's own, or drawn here
    priority: int = 0
    tenant: str = ""
    ttft_slo_ms: float | None = None  # None: the tier's default
    tpot_slo_ms: float | None = None
    reject_if_late: bool = False

    @property
    def spec(self) -> RequestSpec:
        return RequestSpec(self.request_id, self.prompt_ids, self.sampling, priority=self.priority)
