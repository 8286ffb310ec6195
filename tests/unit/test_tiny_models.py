"""The decoder against transformers on tiny random Llama, Llama-3-scaled and Qwen2 (qkv bias)
checkpoints, loaded through the safetensors folder loader."""

import torch

from tests.reference import engine_logits, hf_greedy, hf_logits, hf_model, run_engine
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314],
    [1, 22007, 6463, 314, 702, 253, 2066, 23410, 338, 2573, 4364, 28, 19556, 17, 1073, 416, 339],
    [9690, 198],
    list(range(100, 140)),
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_engine(folder, **kw):
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            num_kv_blocks=kw.pop("num_kv_blocks", 128),
            block_size=kw.pop("block_size", 4),
            **kw,
        )
    )


def test_teacher_forced_logits_match(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    ref = hf_model(engine.source)
    for p in PROMPTS:
        ours, theirs = engine_logits(engine, p), hf_logits(ref, p)
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_greedy_matches_batched_chunked_and_preempted(tiny_model_dir):
    ref = hf_model(make_engine(tiny_model_dir, num_kv_blocks=8).source)
    expected = [hf_greedy(ref, p, GREEDY.max_tokens, eos=None) for p in PROMPTS]
    configs = {
        "batched": {},
        "chunked by 5": dict(prefill_chunk_size=5),
        "unchunked": dict(enable_chunked_prefill=False),
        # 10 blocks of 4 tokens cannot hold all four sequences at once: preemption happens.
        "preempted": dict(num_kv_blocks=20),
    }
    for name, kw in configs.items():
        engine = make_engine(tiny_model_dir, **kw)
        got = run_engine(engine, PROMPTS, GREEDY)
        assert got == expected, name
        assert engine.pool.num_free_blocks == engine.pool.num_blocks, name
        if name == "preempted":
            assert engine.scheduler.num_preemptions > 0


def test_bfloat16_runs_close_to_float32(tiny_llama_dir):
    p = PROMPTS[1]
    f32 = engine_logits(make_engine(tiny_llama_dir), p)
    bf16 = engine_logits(make_engine(tiny_llama_dir, dtype="bfloat16"), p)
    assert (f32.argmax(-1) == bf16.argmax(-1)).float().mean() > 0.8
    assert (f32 - bf16).abs().max() < 0.25 * f32.abs().max()
