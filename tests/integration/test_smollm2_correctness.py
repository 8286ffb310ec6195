"""G4 on the real default model: SmolLM2-135M-Instruct (GGUF), fp32, against transformers
loading the same file (and bf16 against both). One checkpoint load is shared by every fp32
engine in this module."""

import json
import subprocess
import sys

import pytest
import torch

from tests.integration.harness import CHATS
from tests.reference import engine_logits, hf_greedy, hf_logits, hf_model, run_engine
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams

pytestmark = pytest.mark.integration

MAX_NEW = 40


@pytest.fixture(scope="module")
def shared():
    first = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=256))
    model = first.runner.model
    prompts = [first.tokenizer.encode_chat(c) for c in CHATS]
    ref = hf_model(first.source)
    eos = first.tokenizer.eos_token_id
    expected = [hf_greedy(ref, p, MAX_NEW, eos) for p in prompts]
    return {
        "first": first,
        "model": model,
        "tok": first.tokenizer,
        "prompts": prompts,
        "expected": expected,
        "ref": ref,
    }


def engine_with(shared, **kw):
    cfg = EngineConfig(dtype="float32", **{"num_kv_blocks": 256, **kw})
    return LLMEngine(cfg, tokenizer=shared["tok"], model=shared["model"])


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


def test_teacher_forced_logits_match_transformers(shared):
    long_prompt = sum(shared["prompts"], [])  # ~400 tokens across many blocks
    for p in [shared["prompts"][0], long_prompt]:
        ours, theirs = engine_logits(shared["first"], p), hf_logits(shared["ref"], p)
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_singly_matches_transformers(shared):
    engine = engine_with(shared)
    for p, want in zip(shared["prompts"], shared["expected"]):
        assert run_engine(engine, [p], GREEDY)[0] == want


@pytest.mark.parametrize(
    "name, kw",
    [
        ("batched mixed lengths", {}),
        ("chunked prefill by 16", {"prefill_chunk_size": 16, "max_num_batched_tokens": 64}),
        ("chunked prefill off", {"enable_chunked_prefill": False}),
        ("no prefix cache", {"enable_prefix_caching": False}),
    ],
)
def test_greedy_batched_matches_transformers(shared, name, kw):
    engine = engine_with(shared, **kw)
    assert run_engine(engine, shared["prompts"], GREEDY) == shared["expected"], name
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # G3


def test_greedy_under_forced_preemption(shared):
    # 8 sequences of ~60-100 tokens need ~45 blocks of 16; 16 blocks force recompute.
    engine = engine_with(shared, num_kv_blocks=16)
    assert run_engine(engine, shared["prompts"], GREEDY) == shared["expected"]
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_greedy_with_prefix_cache_hits(shared):
    engine = engine_with(shared)
    run_engine(engine, shared["prompts"], GREEDY)
    hits_before = engine.pool.num_prefix_hits
    # Same prompts again: every full prompt block is served from the cache.
    assert run_engine(engine, shared["prompts"], GREEDY) == shared["expected"]
    full_blocks = sum((len(p) - 1) // 16 for p in shared["prompts"])
    assert engine.pool.num_prefix_hits - hits_before >= full_blocks


def test_bf16_follows_transformers_and_a_sequence_ignores_its_batch(shared):
    # bf16 runs on the CPU's bf16 kernels where it has them (linear layers, attention). Its
    # logits cannot equal fp32's, but nearly every argmax must; and a sequence's tokens must
    # not depend on what it is batched with, so the cluster's equal the offline engine's.
    # (The prefix cache is off: a prompt found there is computed in another order.)
    cfg = EngineConfig(dtype="bfloat16", num_kv_blocks=256, enable_prefix_caching=False)
    engine = LLMEngine(cfg, tokenizer=shared["tok"])
    long_prompt = sum(shared["prompts"], [])
    ours, theirs = engine_logits(engine, long_prompt), hf_logits(shared["ref"], long_prompt)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree
    alone = [run_engine(engine, [p], GREEDY)[0] for p in shared["prompts"]]
    assert run_engine(engine, shared["prompts"], GREEDY) == alone
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_cli_offline_json(shared, tmp_path):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text(
        "".join(
            json.dumps({"prompt": c, "max_tokens": MAX_NEW, "temperature": 0}) + "\n"
            for c in CHATS[:3]
        )
        + json.dumps(
            {"prompt_ids": shared["prompts"][3], "max_tokens": 5, "temperature": 0.8, "seed": 7}
        )
        + "\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cluster.cli",
            "generate",
            "--offline",
            "--requests",
            str(reqs),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2, 3]
    for x, want in zip(lines[:3], shared["expected"]):
        assert x["token_ids"] == want
        assert x["finish_reason"] in ("stop", "length")
        assert x["text"] == shared["tok"].decode(want)
        assert 0 < x["ttft_s"] <= x["e2e_s"]
    assert lines[3]["finish_reason"] == "length" and len(lines[3]["token_ids"]) == 5
    assert "requests done" in proc.stderr  # progress on stderr, results on stdout


def test_cli_reports_bad_input_clearly(tmp_path):
    reqs = tmp_path / "r.jsonl"
    reqs.write_text('{"prompt": "hi", "top_p": 0}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "--offline", "--requests", str(reqs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "r.jsonl:1: top_p=0: must be in (0, 1]" in proc.stderr
