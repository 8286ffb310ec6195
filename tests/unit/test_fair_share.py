"""The engine's fair share (workers/engine/policy.py): the tenant served least for its weight
is admitted first and preempted last; tiers come first; an old request goes ahead under
max_wait_s; decode-first limits prompt chunks beside decodes."""

from tests.unit.sched_helpers import make_request, make_scheduler, run_step
from workers.engine.request import Tenancy

A, B = Tenancy("a"), Tenancy("b")


def first_scheduled(s, steps=200):
    order = []
    for _ in range(steps):
        if not s.has_unfinished():
            break
        out, _ = run_step(s)
        for r in out.scheduled:
            if r.request_id not in order:
                order.append(r.request_id)
    return order


def add(s, rid, tenancy, prompt=6, max_tokens=4, **kw):
    s.add_request(make_request(rid, prompt, max_tokens, tenancy=tenancy, **kw))


def test_a_tenant_served_more_waits_behind_one_served_less():
    for fair, want in ((True, ["a1", "b1", "a2", "a3"]), (False, ["a1", "a2", "a3", "b1"])):
        s = make_scheduler(max_num_seqs=1, fair_share=fair)
        for rid in ("a1", "a2", "a3"):
            add(s, rid, A)
        add(s, "b1", B)
        assert first_scheduled(s) == want, fair


def test_weights_share_the_seats_in_their_ratio():
    s = make_scheduler(max_num_seqs=1)
    heavy = Tenancy("h", weight=2.0)
    for i in range(6):
        add(s, f"h{i}", heavy)
        add(s, f"l{i}", Tenancy("l"))
    order = first_scheduled(s, steps=400)[:9]
    # Served the same tokens per request, h (weight 2) gets two seats for l's one.
    assert sum(r.startswith("h") for r in order) == 6, order


def test_the_tenant_over_its_share_is_the_one_preempted():
    victims = {}
    for fair in (True, False):
        s = make_scheduler(num_blocks=9, max_num_seqs=3, fair_share=fair)
        add(s, "a1", A, prompt=4, max_tokens=40)
        add(s, "a2", A, prompt=4, max_tokens=40)
        add(s, "b1", B, prompt=4, max_tokens=40)
        for _ in range(40):
            out, _ = run_step(s)
            if out.preempted_ids:
                victims[fair] = out.preempted_ids[0]
                break
    # a runs two sequences to b's one: past its share, it gives way, not the latest arrival.
    assert victims == {True: "a2", False: "b1"}


def test_a_lower_tier_goes_first_whatever_it_was_served():
    s = make_scheduler(max_num_seqs=1)
    add(s, "x1", Tenancy("x", tier=1))
    add(s, "g1", Tenancy("g", tier=0))
    add(s, "g2", Tenancy("g", tier=0))
    assert first_scheduled(s) == ["g1", "g2", "x1"]


def test_priority_aging_and_max_wait_let_no_request_wait_for_ever():
    s = make_scheduler(max_num_seqs=1, policy="priority", aging_per_s=1.0)
    low = make_request("low", priority=5)
    low.arrival_time = -10.0  # waited 10 s: aged from 5 to about -5
    s.add_request(low)
    add(s, "urgent", Tenancy(), priority=0)
    assert first_scheduled(s)[0] == "low"
    s = make_scheduler(max_num_seqs=1, policy="priority", max_wait_s=5.0)
    low = make_request("low", priority=5)
    low.arrival_time = -6.0  # past max_wait_s: first, whatever its priority
    s.add_request(low)
    add(s, "urgent", Tenancy(), priority=0)
    assert first_scheduled(s)[0] == "low"


def test_sjf_orders_by_predicted_output_not_by_max_tokens():
    s = make_scheduler(max_num_seqs=1, policy="sjf", fair_share=False)
    s.add_request(make_request("long", 6, 50, tenancy=Tenancy(predicted_tokens=40)))
    s.add_request(make_request("short", 6, 50, tenancy=Tenancy(predicted_tokens=3)))
    assert first_scheduled(s, steps=400)[:2] == ["short", "long"]


def test_decode_first_limits_prompt_tokens_beside_decodes():
    s = make_scheduler(max_num_batched_tokens=64, prefill_chunk_size=64, prefill_share=0.25)
    add(s, "d", Tenancy(), prompt=4, max_tokens=20)
    run_step(s)  # d's prompt; from now on it decodes
    add(s, "p", Tenancy(), prompt=60, max_tokens=2)
    out, _ = run_step(s)
    prompt_tokens = sum(r.num_tokens for r in out.prefills)
    assert [r.request_id for r in out.decodes] == ["d"] and prompt_tokens == 16


def test_a_flood_that_took_every_seat_gives_another_tenant_its_share():
    s = make_scheduler(num_blocks=256, max_num_seqs=4)
    for i in range(6):
        add(s, f"a{i}", A, prompt=4, max_tokens=2000)
    for _ in range(5):
        run_step(s)
    assert len(s.running) == 4 and s.num_preemptions == 0  # alone, a takes every seat
    for i in range(3):
        add(s, f"b{i}", B, prompt=4, max_tokens=2000)
    out, _ = run_step(s)
    running = [r.request_id for r in s.running]
    # b gets its share (2 of 4) at once, from a's newest requests; no further change.
    assert sorted(r[0] for r in running) == ["a", "a", "b", "b"]
    assert s.num_preemptions == 2 and {"a2", "a3"}.isdisjoint(running)
    for _ in range(10):
        run_step(s)
    assert s.num_preemptions == 2


def test_a_tenant_under_its_share_gets_its_first_token_from_a_step_without_the_flood():
    def first_token_step(fair, b_tier=1):
        s = make_scheduler(num_blocks=256, max_num_seqs=8, fair_share=fair)
        for i in range(5):
            add(s, f"a{i}", A, prompt=4, max_tokens=2000)
        for _ in range(3):
            run_step(s)
        add(s, "b", Tenancy("b", tier=b_tier), prompt=6, max_tokens=20)
        out, _ = run_step(s)
        after, _ = run_step(s)
        return [r.request_id for r in out.scheduled], [r.request_id for r in after.scheduled]

    # a holds 5 of 8 seats, over its share of 4: its decodes wait the one step of b's prompt.
    step, after = first_token_step(True)
    assert step == ["b"] and sorted(after) == ["a0", "a1", "a2", "a3", "a4", "b"]
    # Without fair share, or for a tenant of a lower tier, nobody waits.
    assert sorted(first_token_step(False)[0]) == ["a0", "a1", "a2", "a3", "a4", "b"]
    assert sorted(first_token_step(True, b_tier=2)[0]) == ["a0", "a1", "a2", "a3", "a4", "b"]


def test_a_decode_that_ran_since_it_last_waited_waits_again_when_asked():
    clock = [100.0]
    s = make_scheduler(num_blocks=256, max_num_seqs=8, clock=lambda: clock[0])
    for i in range(5):
        add(s, f"a{i}", A, prompt=4, max_tokens=2000)
    for _ in range(3):
        run_step(s)
    for rid in ("b1", "b2"):
        add(s, rid, B, prompt=6, max_tokens=2)
        out, _ = run_step(s)
        assert [r.request_id for r in out.scheduled] == [rid]
        for _ in range(40):  # 2 s of steps: longer than any hold, all of a's decodes run
            clock[0] += 0.05
            out, _ = run_step(s)
            assert len(out.decodes) >= 5


def test_nobody_waits_for_a_request_that_cannot_get_in_this_step():
    def decodes_when_b_comes(num_blocks, **b):
        s = make_scheduler(num_blocks=num_blocks, max_num_seqs=8)
        for i in range(5):
            add(s, f"a{i}", A, prompt=4, max_tokens=2000)
        for _ in range(3):
            run_step(s)
        add(s, "b", B, **b)
        return [len(run_step(s)[0].decodes) for _ in range(3)]

    assert decodes_when_b_comes(256, prompt=6, max_tokens=20) == [0, 6, 6]  # it gets in
    # 4 choices and 3 seats free: it waits for seats, a's decodes do not wait with it.
    assert decodes_when_b_comes(256, prompt=6, max_tokens=20, n=4) == [5, 5, 5]
    # Its prompt needs more blocks than are free.
    assert decodes_when_b_comes(16, prompt=40, max_tokens=20) == [5, 5, 5]


def test_a_tenant_at_its_share_makes_nobody_wait_for_its_first_token():
    s = make_scheduler(num_blocks=256, max_num_seqs=8)
    for i in range(3):
        add(s, f"a{i}", A, prompt=4, max_tokens=2000)
        add(s, f"b{i}", B, prompt=4, max_tokens=2000)
    for _ in range(3):
        run_step(s)
    add(s, "b9", B, prompt=6, max_tokens=20)  # a and b hold 3 of their 4: neither is over
    out, _ = run_step(s)
    assert len(out.decodes) == 6 and [p.request_id for p in out.prefills] == ["b9"]
    # A prompt that does not end in this step (a long one, chunked) makes nobody wait.
    s = make_scheduler(num_blocks=256, max_num_seqs=8, prefill_chunk_size=8)
    for i in range(5):
        add(s, f"a{i}", A, prompt=4, max_tokens=2000)
    for _ in range(3):
        run_step(s)
    add(s, "b", B, prompt=40, max_tokens=20)
    out, _ = run_step(s)
    assert len(out.decodes) == 5 and out.prefills[0].num_tokens == 8


def test_seats_follow_weights_and_a_tenant_at_its_share_takes_none():
    s = make_scheduler(num_blocks=256, max_num_seqs=3)
    heavy = Tenancy("h", weight=2.0)
    for i in range(3):
        add(s, f"l{i}", Tenancy("l"), prompt=4, max_tokens=2000)
    run_step(s)
    for i in range(3):
        add(s, f"h{i}", heavy, prompt=4, max_tokens=2000)
    run_step(s)
    assert sorted(r.request_id[0] for r in s.running) == ["h", "h", "l"]
    add(s, "l9", Tenancy("l"), prompt=4, max_tokens=2000)  # l is at its share: it waits
    run_step(s)
    assert s.num_preemptions == 2


def test_greedy_outputs_and_blocks_do_not_depend_on_the_policy(tiny_llama_dir):
    """Every policy with fair share, under preemptions and a TPOT target holding decodes:
    the same tokens for every request (greedy and seeded), and every block free after."""
    from workers.engine.config import EngineConfig
    from workers.engine.engine import LLMEngine
    from workers.engine.request import SamplingParams

    def run(**cfg):
        e = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=4,
                                   max_num_seqs=3, prefill_chunk_size=8, **cfg))  # fmt: skip
        ids = {}
        for i in range(8):
            sp = SamplingParams(max_tokens=12 + 3 * i, temperature=0.0 if i % 2 else 0.8,
                                seed=i, ignore_eos=True)  # fmt: skip
            target = 5.0 if i == 3 else None
            tenancy = Tenancy(f"t{i % 3}", 1.0 + i % 3, i % 2, float(i), tpot_slo_ms=target)
            prompt = [1 + (i * 7 + j) % 300 for j in range(5 + 4 * i)]
            rid = e.add_request(prompt, sp, priority=i % 4, tenancy=tenancy)
            ids[rid] = i
        out = {i: [] for i in ids.values()}
        for _ in range(2000):
            if not e.has_unfinished():
                break
            for o in e.step():
                assert o.error is None
                out[ids[o.request_id]] += o.new_token_ids
        assert e.pool.num_free_blocks == e.pool.num_blocks
        return out, e.scheduler.num_preemptions

    base, _ = run(policy="fcfs", fair_share=False)
    preempted = 0
    for policy in ("fcfs", "priority", "shortest-first", "sjf"):  # each with fair share
        got, n = run(policy=policy, aging_per_s=1.0, prefill_share=0.5)
        assert got == base, policy
        preempted += n
    assert preempted > 0  # blocks ran short: recompute was exercised


def test_the_engine_forgets_counts_of_tenants_long_gone():
    from workers.engine.fairness import MAX_IDLE_COUNTS
    from workers.engine.request import RequestStatus

    s = make_scheduler(num_blocks=64, max_num_seqs=2)
    add(s, "stay", Tenancy("stay"), max_tokens=50)
    for i in range(MAX_IDLE_COUNTS + 20):
        add(s, f"r{i}", Tenancy(f"t{i}"))
        s.finish_request(f"r{i}", RequestStatus.FINISHED_CANCELLED)
    counters = s.policy.ledger.counters
    assert len(counters) <= MAX_IDLE_COUNTS and "stay" in counters


def test_keys_do_not_move_while_a_step_is_built():
    s = make_scheduler(max_num_seqs=4)
    add(s, "a1", A, max_tokens=8)
    add(s, "b1", B, max_tokens=8)
    policy = s.policy
    before = {r: policy.key(s.requests[r]) for r in ("a1", "b1")}
    policy.served(s.requests["a1"], 50, decode=True)  # as _emit does, mid-step
    assert {r: policy.key(s.requests[r]) for r in ("a1", "b1")} == before
    policy.end_step()
    assert policy.key(s.requests["a1"]) > before["a1"]
