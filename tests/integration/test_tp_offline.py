"""The tensor-parallel engine on SmolLM2 with real rank processes (shared-memory collectives,
gloo step messages): tp 2's greedy tokens equal tp 1's up to a near-tie, seeded draws are
the same, a rank killed mid-stream fails the engine's requests at once rather than hanging
it, and `tandem generate --offline --tp 2` serves from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.gpu_check import compare
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import FinishReason, SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPTS = [
    "Name three rivers in Africa and say where each one ends.",
    "Write a short limerick about a lighthouse keeper.",
    "What is 17 times 23? Show the steps.",
]


def engine(tp: int, **more) -> LLMEngine:
    return LLMEngine(EngineConfig(device="cpu", dtype="float32", tp=tp, num_kv_blocks=256, **more))


@pytest.fixture(scope="module")
def engines():
    """tp 1, and tp 2 with overlap on: a step launched before the last one landed takes its
    tokens from rank 0's sampled ids on every rank (off, the CLI and the kill tests)."""
    one, two = engine(1), engine(2, overlap="on")
    yield one, two
    two.close()


def prompt_ids(e: LLMEngine) -> list[list[int]]:
    ids = [e.tokenizer.encode_chat(p) for p in PROMPTS]
    # One prompt past a prefill chunk (512): its prefill spans steps, beside others' decodes.
    long = e.tokenizer.encode_chat(" ".join(PROMPTS * 16) + " Summarise all of that.")
    assert len(long) > 600
    return ids + [long]


def run(e: LLMEngine, prompts, sampling) -> list[list[tuple[int, dict]]]:
    ids = [e.add_request(p, sampling) for p in prompts]
    out: dict[str, list] = {i: [] for i in ids}
    for _ in range(2000):  # bounded: every request ends well within this many steps
        if not e.has_unfinished():
            break
        for o in e.step():
            assert o.error is None, o.error
            tops = o.new_top_logprobs or [()] * len(o.new_token_ids)
            out[o.request_id] += [(t, dict(top)) for t, top in zip(o.new_token_ids, tops)]
    assert e.pool.num_free_blocks == e.pool.num_blocks, "KV blocks leaked"
    return [out[i] for i in ids]


def test_tp2_greedy_equals_tp1_up_to_a_near_tie(engines):
    one, two = engines
    prompts = prompt_ids(one)
    sampling = SamplingParams(max_tokens=32, temperature=0, logprobs=True, top_logprobs=5)
    overlapped = two.overlapped_steps
    ref, got = run(one, prompts, sampling), run(two, prompts, sampling)
    for i, (a, b) in enumerate(zip(ref, got)):
        ok, why, _, _ = compare(a, b, lp_tol=1e-3, tie_tol=1e-3)
        assert ok, f"prompt {i}: {why}"
    assert two.overlapped_steps > overlapped  # PENDING rows read rank 0's ids on every rank


def test_tp2_seeded_draws_equal_tp1s(engines):
    one, two = engines
    prompts = prompt_ids(one)[:3]
    sampling = SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, seed=1234, logprobs=True, top_logprobs=5
    )
    ref, got = run(one, prompts, sampling), run(two, prompts, sampling)
    for i, (a, b) in enumerate(zip(ref, got)):
        ok, why, _, _ = compare(a, b, lp_tol=1e-3, tie_tol=None)
        assert ok, f"prompt {i}: {why}"


def test_a_rank_killed_mid_stream_fails_the_requests_at_once_and_leaves_nothing():
    e = engine(2)
    shm = e.followers.settings.shm
    assert shm is not None and not os.path.exists(shm)  # unlinked once every rank had it
    ids = [e.add_request(p, SamplingParams(max_tokens=200)) for p in prompt_ids(e)[:3]]
    for _ in range(3):
        e.step()
    e.followers.procs[0].kill()
    t0 = time.monotonic()
    ended: dict[str, FinishReason] = {}
    for _ in range(50):
        if not e.has_unfinished():
            break
        for o in e.step():
            if o.finished:
                ended[o.request_id] = o.finish_reason
    assert time.monotonic() - t0 < 30  # the dead rank is seen at its first missed collective
    assert set(ended) == set(ids)
    assert set(ended.values()) == {FinishReason.ERROR}
    # The ranks are out of step for good: a later request is refused at once, by name.
    late = e.add_request(prompt_ids(e)[0], SamplingParams(max_tokens=4))
    [out] = [o for o in e.step() if o.request_id == late]
    assert out.finish_reason is FinishReason.ERROR and "tp 2 engine is down" in out.error
    e.close()
    assert all(p.poll() is not None for p in e.followers.procs)


def test_generate_offline_tp2_from_the_command_line(engines):
    one, _ = engines
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "--offline", "--tp", "2"]
    cmd += ["--dtype", "float32", "--device", "cpu", "--max-tokens", "12", "--json", PROMPTS[1]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    got = json.loads(line)["token_ids"]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    [ref] = run(one, [one.tokenizer.encode_chat(PROMPTS[1])], greedy)
    assert got == [t for t, _ in ref]
