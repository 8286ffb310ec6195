"""The sampling parameters of a step's sampled rows, as columns of its inputs (step_io.py).

Everything the sampler reads is built on the host and sent with the step's one copy: the
parameters, each row's draw (`row_uniforms` of its seed and output index), the sparse logit
edits (logit bias, and the min_tokens ban of EOS and stop tokens), and the penalised rows'
output and prompt tokens as flat indices into a [rows, vocab] table that the device fills
with one `index_add_` (no per-row tensor, no wait). What the sampler must decide ahead (all
greedy, any filter, how many candidates) is decided here, from the host's values.
"""

from __future__ import annotations

import numpy as np
import torch

from workers.engine.sampler import FilterPlan, Penalties, SamplingTensors, row_uniforms
from workers.engine.scheduler_output import ScheduledRequest
from workers.engine.step_io import StepInputs

F32 = torch.float32


class SamplingColumns:
    """Queues the rows' sampling columns on `inputs`; `tensors` reads them back once sent.
    `sort_all`: a batch whose nucleus may pass the candidates sorts at once (a GPU's step
    never asks the device whether it must)."""

    def __init__(
        self,
        inputs: StepInputs,
        reqs: list[ScheduledRequest],
        vocab: int,
        sort_all: bool = False,
    ) -> None:
        params = [s.sampling for s in reqs]
        self.vocab = vocab
        self.all_greedy = all(p.greedy for p in params)
        self.filters = FilterPlan.of(
            [p.top_k for p in params], [p.top_p for p in params], vocab, sort_all
        )
        self.want_logprobs = any(p.logprobs for p in params)
        self.top_logprobs = max((p.top_logprobs for p in params), default=0)
        add = inputs.add
        self.temperature = add([p.temperature for p in params], F32)
        self.top_k = add([max(p.top_k, 0) for p in params])
        self.top_p = add([p.top_p for p in params], F32)
        self.uniforms = add(
            [0.5] * len(reqs)  # greedy rows never draw
            if self.all_greedy
            else row_uniforms(  # int64 arrays: no Python loop over the rows in the hash
                np.array([s.seed & (2**63 - 1) for s in reqs], dtype=np.int64),
                np.array([s.num_output_tokens for s in reqs], dtype=np.int64),
            ),
            torch.float64,
        )
        self.min_p = (
            add([p.min_p for p in params], F32) if any(p.min_p > 0 for p in params) else None
        )
        edits = logit_edits(reqs, vocab)
        self.edits = None
        if edits:
            rows, cols, values = zip(*edits)
            self.edits = (add(rows), add(cols), add(values, F32))
        self.penalized = [i for i, p in enumerate(params) if p.penalized]
        self.penalties = None
        if self.penalized:
            pen = [params[i] for i in self.penalized]
            outputs, prompts = [], []
            for r, i in enumerate(self.penalized):
                s = reqs[i]
                outputs += [r * vocab + t for t in s.output_ids[: s.num_output_tokens]]
                prompts += [r * vocab + t for t in s.prompt_ids]
            self.penalties = (
                add(self.penalized),
                add([p.presence_penalty for p in pen], F32),
                add([p.frequency_penalty for p in pen], F32),
                add([p.repetition_penalty for p in pen], F32),
                add(outputs),
                add(prompts),
            )

    def tensors(self, cols: list[torch.Tensor]) -> SamplingTensors:
        """The SamplingTensors over the sent columns `cols` (StepInputs.send's)."""
        t = SamplingTensors(
            temperature=cols[self.temperature],
            top_k=cols[self.top_k],
            top_p=cols[self.top_p],
            uniforms=cols[self.uniforms],
            all_greedy=self.all_greedy,
            filters=self.filters,
            want_logprobs=self.want_logprobs,
            top_logprobs=self.top_logprobs,
        )
        if self.min_p is not None:
            t.min_p = cols[self.min_p]
        if self.edits is not None:
            t.logit_edits = tuple(cols[i] for i in self.edits)
        if self.penalties is not None:
            rows, presence, frequency, repetition, outputs, prompts = (
                cols[i] for i in self.penalties
            )
            cells = len(self.penalized) * self.vocab
            counts = torch.zeros(cells, dtype=F32, device=rows.device)
            counts.index_add_(0, outputs, torch.ones(outputs.shape, dtype=F32, device=rows.device))
            in_prompt = torch.zeros(cells, dtype=torch.bool, device=rows.device)
            in_prompt.index_fill_(0, prompts, True)
            t.penalties = Penalties(
                rows=rows,
                presence=presence,
                frequency=frequency,
                repetition=repetition,
                output_counts=counts.view(-1, self.vocab),
                in_prompt=in_prompt.view(-1, self.vocab),
            )
        return t


def logit_edits(reqs: list[ScheduledRequest], vocab: int) -> list[tuple[int, int, float]]:
    """(row, token id, value) additions: logit bias, and -inf for what min_tokens bans."""
    edits = []
    for i, s in enumerate(reqs):
        sp = s.sampling
        edits += [(i, token, bias) for token, bias in sp.logit_bias if token < vocab]
        if s.num_output_tokens < sp.min_tokens:
            # A constrained row's grammar alone says where EOS may come.
            free = sp.ignore_eos or sp.constraint is not None
            banned = set(sp.stop_token_ids) | (set() if free else set(s.eos_token_ids))
            edits += [(i, token, float("-inf")) for token in sorted(banned) if token < vocab]
    return edits


def sampling_tensors(
    reqs: list[ScheduledRequest], vocab: int, device, sort_all: bool = False
) -> SamplingTensors:
    """The rows' SamplingTensors on `device`, sent on their own (tests, benchmarks)."""
    inputs = StepInputs(device)
    columns = SamplingColumns(inputs, reqs, vocab, sort_all)
    return columns.tensors(inputs.send())
