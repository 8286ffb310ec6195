"""The offline interface: run a list of requests through one in-process engine.

    llm = LLM(EngineConfig(dtype="bfloat16"))
    request = GenerationRequest(prompt="Hi!", sampling=SamplingParams(max_tokens=32))
    for c in llm.generate([request]):
        print(c.text, c.finish_reason)

Times are seconds since the request was submitted: all requests are submitted at the start.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from workers.completion import Completion, GenerationRequest
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.model.tokenizer import TextStream

__all__ = ["LLM", "Completion", "GenerationRequest"]


DeltaCallback = Callable[[int, str, bool], None]  # (index, text delta, finished)


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop a tp > 1 engine's other ranks (they also stop when this process exits)."""
        self.engine.close()

    def encode(self, req: GenerationRequest) -> list[int]:
        if req.prompt_ids is not None:
            return list(req.prompt_ids)
        return self.tokenizer.encode_chat(req.prompt)

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        on_delta: DeltaCallback | None = None,
        on_progress: Callable[[int, int, int], None] | None = None,
    ) -> list[Completion]:
        """Runs every request to its end: one Completion per request and choice (n > 1 gives
        n, even when rejected), in input order, then choice order. Invalid requests end with
        finish_reason "error" and do not disturb the rest. on_delta gets (slot, text delta,
        finished), a slot being a completion's position in the result; on_progress gets
        (finished, total, output tokens)."""
        engine = self.engine
        t0 = time.perf_counter()
        slots: list[Completion] = []
        by_id: dict[tuple[str, int], Completion] = {}
        streams: dict[int, TextStream] = {}
        for i, r in enumerate(requests):
            try:
                ids = self.encode(r)
                rid = engine.add_request(ids, r.sampling, priority=r.priority)
            except ValueError as e:
                for choice in range(r.sampling.n):
                    c = Completion(
                        i, f"rejected-{i}", [], finish_reason="error", error=str(e), e2e_s=0.0
                    )
                    c.choice = choice
                    slots.append(c)
                    if on_delta:
                        on_delta(len(slots) - 1, "", True)
                continue
            for choice in range(r.sampling.n):
                c = Completion(
                    i,
                    rid,
                    ids,
                    logprobs=[] if r.sampling.logprobs else None,
                    top_logprobs=[] if r.sampling.top_logprobs else None,
                    choice=choice,
                )
                by_id[rid, choice] = c
                slots.append(c)
                if on_delta:
                    streams[len(slots) - 1] = TextStream(self.tokenizer, r.sampling.stop)
        slot_of = {id(c): n for n, c in enumerate(slots)}
        done = sum(c.finish_reason is not None for c in slots)
        generated = 0
        while engine.has_unfinished():
            for out in engine.step():
                c = by_id[out.request_id, out.index]
                now = time.perf_counter() - t0
                if out.new_token_ids and c.ttft_s is None:
                    c.ttft_s = now
                c.token_ids += out.new_token_ids
                if c.logprobs is not None and out.new_logprobs:
                    c.logprobs += out.new_logprobs
                if c.top_logprobs is not None and out.new_top_logprobs:
                    c.top_logprobs += out.new_top_logprobs
                generated += len(out.new_token_ids)
                if on_delta:
                    slot = slot_of[id(c)]
                    delta = streams[slot].push(out.new_token_ids, out.text, out.finished)
                    on_delta(slot, delta, out.finished)
                if out.finished:
                    c.e2e_s = now
                    c.finish_reason = out.finish_reason.value
                    c.error = out.error
                    c.text = (
                        out.text if out.text is not None else self.tokenizer.decode(c.token_ids)
                    )
                    done += 1
                    if on_progress:
                        on_progress(done, len(slots), generated)
        return slots
