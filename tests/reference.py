"""Reference outputs from transformers on the same checkpoint, for correctness tests."""

from __future__ import annotations

import torch


def hf_model(source, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    if source.is_gguf:
        return AutoModelForCausalLM.from_pretrained(
            str(source.folder), gguf_file=source.path.name, dtype=dtype
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_logits(model, prompt_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt_ids])).logits[0].float()


@torch.inference_mode()
def engine_logits(engine, prompt_ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits at every position, through the engine's paged-cache path."""
    return engine.prompt_logits(prompt_ids)


def run_engine(engine, prompts: list[list[int]], sampling) -> list[list[int]]:
    """Submit all at once, step to the end; token ids per prompt, in order."""
    ids = [engine.add_request(p, sampling) for p in prompts]
    out = {i: [] for i in ids}
    for _ in range(100000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert not engine.has_unfinished(), "engine did not drain"
    return [out[i] for i in ids]
