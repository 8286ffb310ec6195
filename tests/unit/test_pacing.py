"""Decode pacing (workers/engine/pacing.py): prompt chunks sized to the running sequences'
slack against target_tpot_ms, with a cost model fitted to the steps run."""

import numpy as np
import pytest

from tests.unit.sched_helpers import make_request, make_scheduler
from workers.engine.config import EngineConfig, SchedulerConfig
from workers.engine.pacing import HORIZON_TOKENS, DecodePacer, StepCostModel
from workers.engine.request import SamplingParams
from workers.engine.scheduler_output import SampledToken


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced_scheduler(target_ms=50.0, chunk=64, **cfg):
    clock = Clock()
    s = make_scheduler(
        num_blocks=4096,
        block_size=4,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=256,
        target_tpot_ms=target_ms,
        clock=clock,
        **cfg,
    )
    return s, clock


def teach(s, decode_s=0.010, per_decode_s=0.001, chunk_s=0.005, per_token_s=0.001, steps=40):
    """Fit the scheduler's cost model to a machine with these costs."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        d, p = int(rng.integers(0, 9)), int(rng.integers(0, 3)) * int(rng.integers(1, 65))
        t = decode_s + per_decode_s * d + (chunk_s + per_token_s * p if p else 0.0)
        s.gates.pacer.observe(d, p, t, s.clock())


def step_for(s, clock, seconds):
    """One scheduled step that takes `seconds` of the fake clock."""
    out = s.schedule()
    clock.now += seconds  # the next schedule() times this step by it
    sampled = [SampledToken(r.request_id, 7) for r in out.scheduled if r.sample]
    s.update_from_output(out, sampled)
    return out


def prompt_tokens(out) -> int:
    return sum(p.num_tokens for p in out.prefills)


def test_cost_model_recovers_the_step_costs_and_follows_a_change():
    m = StepCostModel()
    rng = np.random.default_rng(1)

    def feed(a, b, c, e, n=60, sizes=(0, 17)):
        for _ in range(n):
            d = int(rng.integers(*sizes))
            p = int(rng.integers(0, 2)) * int(rng.integers(1, 257))
            m.observe(d, p, a + b * d + ((c + e * p) if p else 0.0))

    feed(0.012, 0.0008, 0.006, 0.0007, n=120)
    assert m.ready
    assert m.decode_seconds(8) == pytest.approx(0.012 + 8 * 0.0008, rel=1e-3)
    assert abs(m.prompt_tokens_within(0.006 + 100.5 * 0.0007) - 100) <= 2
    assert m.prompt_tokens_within(0.005) == 0  # less than a chunk's own cost: nothing fits
    # Twice as slow (another tenant came), at the batch sizes running now.
    feed(0.024, 0.0016, 0.012, 0.0014, n=400, sizes=(6, 11))
    assert m.decode_seconds(8) == pytest.approx(2 * (0.012 + 8 * 0.0008), rel=0.05)
    assert abs(m.prompt_tokens_within(0.012 + 100.5 * 0.0014) - 100) <= 5


def test_no_run_of_steps_makes_a_smaller_batch_look_slower_than_a_larger_one():
    # Every size for a while, then only full batches of 8 for thousands of noisy steps (a
    # flood): a fitted line's slope would wander; here a one-sequence step is never taken
    # for slower than a full one, so pacing still tries it, and learns it again at once.
    m = StepCostModel()
    rng = np.random.default_rng(2)
    for _ in range(200):
        d, p = int(rng.integers(1, 9)), int(rng.integers(0, 2)) * 64
        m.observe(d, p, 0.010 + 0.001 * d + (0.004 + 0.0002 * p if p else 0.0))
    for _ in range(3000):
        p = int(rng.integers(0, 2)) * int(rng.integers(16, 81))
        m.observe(8, p, (0.018 + (0.004 + 0.0002 * p if p else 0.0)) * rng.uniform(0.8, 1.2))
    costs = [m.decode_seconds(n) for n in range(1, 9)]
    assert costs == sorted(costs) and costs[0] <= 0.011
    for _ in range(3):
        m.observe(1, 0, 0.011)
    assert m.decode_seconds(1) == pytest.approx(0.011)
    # One slow step of a size seen once (a hiccup) is bounded by the larger sizes seen.
    m.observe(2, 0, 0.050)
    assert m.decode_seconds(2) <= m.decode_seconds(8)
    # A size never seen errs low: below the smallest, in proportion; above, on the line.
    fresh = StepCostModel()
    for _ in range(5):
        fresh.observe(8, 0, 0.016)
    assert fresh.decode_seconds(2) == pytest.approx(0.004)
    assert fresh.decode_seconds(10) == pytest.approx(0.020)


def test_without_running_decodes_prompts_take_full_chunks():
    s, clock = paced_scheduler()
    teach(s)
    s.add_request(make_request("long", prompt_len=200, max_tokens=4))
    out = step_for(s, clock, 0.08)
    assert prompt_tokens(out) == 64


def run_machine(s, clock, steps, tpots=None):
    """Steps that take what this machine's costs say: 10 ms + 1 ms a decode, and a prompt
    chunk 5 ms + 1 ms a token (what `teach` fits). Returns each step's prompt tokens; the
    mean time per token of each request that ends goes into `tpots`."""
    chunks = []
    for _ in range(steps):
        out = s.schedule()
        p = prompt_tokens(out)
        seconds = 0.010 + 0.001 * len(out.decodes) + ((0.005 + 0.001 * p) if p else 0.0)
        clock.now += seconds  # the next schedule() times this step by it
        sampled = [SampledToken(r.request_id, 7) for r in out.scheduled]
        for req, _ in s.update_from_output(out, sampled):
            if req.is_finished and tpots is not None:
                since, made = req.paced_since
                tpots[req.request_id] = (clock.now - since) / (req.num_output_tokens - made)
        chunks.append(p)
    return chunks


@pytest.mark.parametrize("paced", [True, False])
def test_a_long_prompt_gets_what_the_decodes_can_spare_and_they_stay_on_target(paced):
    target = 0.050
    s, clock = paced_scheduler(target_ms=target * 1000 if paced else None, chunk=128)
    if paced:
        teach(s)
    for i in range(4):
        s.add_request(make_request(f"chat{i}", prompt_len=8, max_tokens=60, first_token=i + 1))
    run_machine(s, clock, 1)  # their prompts, and their first tokens
    s.add_request(make_request("long", prompt_len=8000, max_tokens=2, first_token=30))
    tpots: dict[str, float] = {}
    chunks = run_machine(s, clock, 60, tpots)
    assert sorted(tpots) == [f"chat{i}" for i in range(4)]  # all ended, the prompt did not
    if not paced:  # full chunks: 147 ms steps, three times the target
        assert chunks == [128] * 60 and min(tpots.values()) > 2 * target
        return
    # Each ends on target: a sequence borrows against its next few tokens, never its last.
    assert max(tpots.values()) <= target * 1.001, tpots
    assert min(chunks) < 128  # held back at times ...
    assert sum(chunks) >= 60 * 16  # ... yet moving: the slack goes to the prompt


def test_a_sequence_too_far_behind_does_not_hold_prompts_back():
    s, clock = paced_scheduler()
    teach(s)
    s.add_request(make_request("late", prompt_len=8, max_tokens=10))
    step_for(s, clock, 0.02)
    clock.now += 5.0  # it stalled: 10 tokens at 50 ms can never bring it back under target
    s.add_request(make_request("long", prompt_len=200, max_tokens=2, first_token=20))
    out = step_for(s, clock, 0.08)
    assert prompt_tokens(out) == 64


def test_a_prompt_held_back_past_the_horizon_advances_by_a_block():
    pacer = DecodePacer(0.050, block_size=4)
    for _ in range(40):  # decode 11 ms, a chunk 5 ms + 1 ms a token
        pacer.observe(1, 0, 0.011, 0.0)
        pacer.observe(1, 16, 0.032, 0.0)
    fresh = make_request("fresh", prompt_len=8, max_tokens=100)
    fresh.num_computed_tokens = 8
    fresh.output_token_ids = [7]
    now, seen = 0.0, []
    for _ in range(2 * HORIZON_TOKENS):
        # First token 280 ms ago: 8 tokens at 50 ms, the 7 after the next at 11, leave 43 ms
        # for the next step; less the decode's 11 and a chunk's own 5 ms: 27 tokens. 330 ms
        # ago, it leaves none: as if a fresh arrival kept it so at every step.
        fresh.paced_since = (now - 0.330, 1)
        allowance = pacer.prompt_allowance([fresh], now, 8192)
        seen.append(allowance)
        if allowance:
            pacer.observe(1, allowance, 0.011 + 0.005 + 0.001 * allowance, now)
        now += 0.050
    fresh.paced_since = (now - 0.280, 1)
    assert pacer.prompt_allowance([fresh], now + 0.001, 8192) == 24  # 27, whole blocks
    assert seen[:HORIZON_TOKENS] == [0] * HORIZON_TOKENS  # held up to 8 x 50 ms ...
    assert set(seen[HORIZON_TOKENS:]) == {0, 4}  # ... then a block, and held again


def test_a_lone_decode_and_a_paced_prompt_wait_for_blocks_a_reservation_holds():
    """A lone decode short of a block waits while a KV transfer's reservation holds the rest
    of the cache (it comes back); the prompt that pacing held back waits too. Neither is
    failed as unfittable. Once the reservation goes, the decode goes on."""
    s, clock = paced_scheduler()
    teach(s)
    s.add_request(make_request("r", prompt_len=8, max_tokens=500))
    step_for(s, clock, 0.02)  # its prompt fills 2 blocks; its next token needs a third
    assert s.reserve("held", 4 * s.pool.num_free_blocks) is not None  # every other block
    s.gates.pacer.prompt_allowance = lambda decoding, now, max_model_len: 0 if decoding else None
    s.add_request(make_request("w", prompt_len=4, max_tokens=2, first_token=9))
    out = s.schedule()  # r needs a block the reservation holds: r and w wait
    assert out.failed == [] and not out.decodes and not out.prefills
    assert s.requests["r"] in s.running and s.requests["w"] in s.waiting
    s.kv.release("held")
    out = step_for(s, clock, 0.02)
    assert [d.request_id for d in out.decodes] == ["r"] and out.failed == []
    assert s.requests["w"] in s.waiting  # still paced while r decodes, never failed


def test_preemption_starts_a_sequences_pace_afresh():
    s, clock = paced_scheduler()
    s.add_request(make_request("a", prompt_len=8, max_tokens=50))
    step_for(s, clock, 0.02)
    r = s.requests["a"]
    assert r.paced_since == (pytest.approx(100.02), 1)
    s._preempt(r)
    assert r.paced_since is None  # re-armed by the first token after its recompute
    step_for(s, clock, 0.02)
    assert r.paced_since == (pytest.approx(100.04), 2)


def test_target_needs_chunked_prefill_and_a_positive_value():
    with pytest.raises(ValueError, match="target_tpot_ms"):
        SchedulerConfig(target_tpot_ms=0)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        EngineConfig(target_tpot_ms=40, enable_chunked_prefill=False)
    assert EngineConfig(target_tpot_ms=40).scheduler(2048).target_tpot_ms == 40


def test_engine_paced_greedy_output_equals_unpaced(tiny_llama_dir):
    """Pacing only sizes prompt chunks: with the allowance held at one block (4 tokens) the
    greedy tokens are those of full 32-token chunks."""
    from tests.reference import run_engine
    from workers.engine.engine import LLMEngine

    results, chunks = {}, []
    for target in (None, 40.0):
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                num_kv_blocks=128,
                block_size=4,
                prefill_chunk_size=32,
                target_tpot_ms=target,
            )
        )
        sched = engine.scheduler
        if target:
            sched.gates.pacer.prompt_allowance = lambda decoding, now, max_model_len: 4
            schedule = sched.schedule

            def record(schedule=schedule):
                out = schedule()
                chunks.extend(p.num_tokens for p in out.prefills)
                return out

            sched.schedule = record
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        results[target] = run_engine(engine, [list(range(5, 15)), list(range(40, 140))], sp)
        assert [len(t) for t in results[target]] == [12, 12]
    assert chunks and max(chunks) == 4 and sum(chunks) == 110  # both prompts, 4 at a time
    assert results[None] == results[40.0]


def test_a_requests_own_tpot_target_holds_back_decodes_without_one():
    from workers.engine.pacing import MAX_DECODE_PAUSE_S
    from workers.engine.request import Tenancy

    clock = Clock()
    s = make_scheduler(num_blocks=4096, block_size=4, max_num_batched_tokens=256, clock=clock)
    # A decode step costs 10 ms + 2 ms per decode: 8 decodes take 26 ms.
    teach(s, decode_s=0.010, per_decode_s=0.002, chunk_s=0.005, per_token_s=0.001)
    for i in range(7):
        s.add_request(make_request(f"bulk{i}", 4, 200, tenancy=Tenancy("a")))
    s.add_request(make_request("chat", 4, 200, tenancy=Tenancy("b", tpot_slo_ms=20.0)))
    step_for(s, clock, 0.03)  # the prompts
    out = step_for(s, clock, 0.02)
    rows = [r.request_id for r in out.decodes]
    # 0.9 x 20 ms = 18 ms: 4 decodes (as fitted, 3 or 4), the one with the target first.
    assert rows[0] == "chat" and 3 <= len(rows) <= 4
    # None held back for longer than MAX_DECODE_PAUSE_S: every one advances.
    made = {f"bulk{i}": 0 for i in range(7)}
    for _ in range(int(MAX_DECODE_PAUSE_S / 0.02) * 3):
        for r in step_for(s, clock, 0.02).decodes:
            made[r.request_id] = made.get(r.request_id, 0) + 1
    assert all(n > 0 for n in made.values()), made
    # Without a target anywhere, nothing is held back.
    s2 = make_scheduler(num_blocks=4096, block_size=4, max_num_batched_tokens=256, clock=clock)
    teach(s2, decode_s=0.010, per_decode_s=0.002)
    for i in range(8):
        s2.add_request(make_request(f"r{i}", 4, 200))
    step_for(s2, clock, 0.03)
    assert len(step_for(s2, clock, 0.02).decodes) == 8


def test_a_target_out_of_reach_holds_nobody_back():
    from workers.engine.request import Tenancy

    def decodes_beside(target_ms):
        clock = Clock()
        s = make_scheduler(num_blocks=4096, block_size=4, max_num_batched_tokens=256, clock=clock)
        teach(s, decode_s=0.010, per_decode_s=0.002)  # one decode alone: 12 ms
        for i in range(6):
            s.add_request(make_request(f"bulk{i}", 4, 200, tenancy=Tenancy("a")))
        s.add_request(make_request("chat", 4, 200, tenancy=Tenancy("b", tpot_slo_ms=target_ms)))
        step_for(s, clock, 0.010 + 0.005 + 0.001 * 28)  # the 7 prompts, as the machine taught
        return len(step_for(s, clock, 0.02).decodes)

    # 0.01 ms: no batch can make it, so holding the others back would only cost them.
    assert decodes_beside(0.01) == 7
    # 12.5 ms: alone it makes it, if not with the headroom: every other decode waits.
    assert decodes_beside(12.5) == 1
