import pytest

from tests.unit.sched_helpers import (
    EOS,
    assert_no_leak,
    make_request,
    make_scheduler,
    run_step,
)
from workers.engine.request import RequestStatus


def test_new_requests_join_a_running_batch():
    s = make_scheduler()
    s.add_request(make_request("a", max_tokens=5))
    out, _ = run_step(s)
    assert [r.request_id for r in out.prefills] == ["a"]
    s.add_request(make_request("b", max_tokens=5))
    out, _ = run_step(s)
    assert [r.request_id for r in out.decodes] == ["a"]
    assert [r.request_id for r in out.prefills] == ["b"]


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    s = make_scheduler(prefill_chunk_size=4)
    s.add_request(make_request("a", prompt_len=10))
    chunks = []
    for _ in range(3):
        out, results = run_step(s)
        chunks.append((out.prefills[0].num_tokens, out.prefills[0].sample))
    assert chunks == [(4, False), (4, False), (2, True)]
    assert s.requests["a"].output_token_ids == [7]


def test_token_budget_is_respected_and_decodes_go_first():
    s = make_scheduler(max_num_batched_tokens=8, prefill_chunk_size=8)
    s.add_request(make_request("a", prompt_len=3))
    run_step(s)
    s.add_request(make_request("b", prompt_len=20))
    out, _ = run_step(s)
    assert out.num_batched_tokens == 8
    assert out.decodes[0].request_id == "a" and out.prefills[0].num_tokens == 7


def test_unchunked_prompt_waits_for_a_step_with_room():
    s = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add_request(make_request("a", prompt_len=3))
    s.add_request(make_request("b", prompt_len=9))
    out, _ = run_step(s)
    assert [r.request_id for r in out.prefills] == ["a"]  # b's 9 tokens exceed 10 - 3
    out, _ = run_step(s)
    assert [r.request_id for r in out.prefills] == ["b"] and out.prefills[0].num_tokens == 9


def test_finish_reasons_eos_length_stop_token_and_ignore_eos():
    s = make_scheduler()
    s.add_request(make_request("eos", max_tokens=10))
    s.add_request(make_request("stop", max_tokens=10, stop_token_ids=(EOS,)))
    s.add_request(make_request("ign", max_tokens=2, ignore_eos=True))
    out, results = run_step(s, token=EOS)
    status = {r.request_id: r.status for r, _ in results}
    assert status["eos"] == RequestStatus.FINISHED_STOPPED
    assert status["stop"] == RequestStatus.FINISHED_STOPPED
    assert status["ign"] == RequestStatus.RUNNING
    _, results = run_step(s, token=EOS)
    ((req, new),) = results
    assert req.request_id == "ign" and new == [EOS] and req.output_token_ids == [EOS, EOS]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


def test_preemption_takes_the_newest_and_it_resumes_with_its_outputs():
    # 6 blocks of 4 tokens; two requests of 8-token prompts grow until one must be preempted.
    s = make_scheduler(num_blocks=6, block_size=4)
    reqs = [make_request("old", prompt_len=8, max_tokens=12)]
    reqs.append(make_request("new", prompt_len=8, max_tokens=12))
    for r in reqs:
        s.add_request(r)
    preempted, ran_after = [], set()
    for _ in range(80):
        out, _ = run_step(s)
        ran_after |= {r.request_id for r in out.scheduled if r.request_id in preempted}
        preempted += out.preempted_ids
        if not s.has_unfinished():
            break
    assert preempted and preempted[0] == "new"
    assert "new" in ran_after, "the preempted request never ran again"
    for r in reqs:  # both ran to their full length, the victim with its outputs kept
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 12, r
    assert reqs[1].num_preemptions >= 1
    assert_no_leak(s)


def test_max_tokens_ends_with_length():
    s = make_scheduler()
    s.add_request(make_request("len", max_tokens=2))
    run_step(s)
    _, [(req, _)] = run_step(s)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [7, 7]


def test_max_model_len_ends_with_length():
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("ctx", prompt_len=6, max_tokens=100))
    for _ in range(5):
        run_step(s)
    assert not s.has_unfinished()


def test_preempted_request_recomputes_prompt_and_outputs():
    s = make_scheduler(num_blocks=4, block_size=4, prefix_caching=False)
    # 16 token slots: each request alone fits (4 + 10 tokens), the two together do not.
    s.add_request(make_request("a", prompt_len=4, max_tokens=10))
    s.add_request(make_request("b", prompt_len=4, max_tokens=10))
    for _ in range(50):
        out, _ = run_step(s)
        if out.preempted_ids:
            break
    victim = s.requests[out.preempted_ids[0]]
    produced = victim.num_output_tokens
    assert victim.num_computed_tokens == 0 and produced > 0
    # When it runs again, its first chunk covers prompt and earlier outputs.
    rerun = None
    for _ in range(50):
        out, _ = run_step(s)
        mine = [r for r in out.scheduled if r.request_id == victim.request_id]
        if mine:
            rerun = mine[0]
            break
    assert rerun is not None, "the preempted request was never admitted again"
    assert rerun.start_position == 0 and rerun.num_tokens == 4 + produced
    assert rerun.token_ids == victim.all_token_ids[: rerun.num_tokens]
    assert rerun.num_output_tokens == produced  # the sampler continues at its own position
    for _ in range(100):
        run_step(s)
        if not s.has_unfinished():
            break
    assert victim.status == RequestStatus.FINISHED_LENGTH and victim.num_output_tokens == 10
    assert_no_leak(s)


def test_cancel_frees_blocks_at_once():
    s = make_scheduler(num_blocks=8)
    s.add_request(make_request("a", prompt_len=12))
    run_step(s)
    assert s.pool.num_free_blocks < 8
    s.finish_request("a", RequestStatus.FINISHED_CANCELLED)
    assert s.pool.num_free_blocks == 8 and not s.has_unfinished()


def test_cancel_during_a_step_drops_its_output():
    s = make_scheduler()
    s.add_request(make_request("a"))
    out = s.schedule()
    s.finish_request("a", RequestStatus.FINISHED_CANCELLED)
    assert s.update_from_output(out, []) == []
    assert_no_leak(s)


def test_static_batching_admits_a_new_group_only_when_the_last_is_done():
    s = make_scheduler(max_num_seqs=2, batching="static")
    s.add_request(make_request("a", max_tokens=1))
    s.add_request(make_request("b", max_tokens=4))
    s.add_request(make_request("c", max_tokens=1))
    out, _ = run_step(s)
    assert {r.request_id for r in out.prefills} == {"a", "b"}
    for _ in range(3):
        assert "a" in s.kv.tables  # a has ended, but its blocks stay until the group ends
        out, results = run_step(s)
        # c waits for the group; a still occupies its slot as padding.
        assert [r.request_id for r in out.scheduled] == ["b", "a"]
        assert [r.request_id for r, _ in results] == ["b"]
    assert "a" not in s.kv.tables and not s.padding
    out, _ = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["c"]
    assert not s.padding


def test_priority_policy_admits_urgent_first_and_preempts_least_urgent():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_request("low", priority=5))
    s.add_request(make_request("high", priority=-1))
    out, _ = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["high"]


def _prefill_steps_until_first_token(s, rid, limit=50):
    for step in range(1, limit + 1):
        out, results = run_step(s)
        if any(r.request_id == rid for r, _ in results):
            return step
    raise AssertionError(f"{rid} made no token in {limit} steps")


@pytest.mark.parametrize("policy, steps", [("fcfs", 6), ("shortest-first", 1)])
def test_a_short_prompt_waits_behind_long_prefills_only_under_fcfs(policy, steps):
    # Two long prompts are mid-prefill, and each step's budget fits one chunk: FCFS makes the
    # short prompt wait for every chunk left; shortest-first admits it ahead, at once.
    s = make_scheduler(
        num_blocks=256, policy=policy, max_num_batched_tokens=16, prefill_chunk_size=16
    )
    for first, rid in enumerate(("long1", "long2"), start=100):  # no shared prefix
        s.add_request(make_request(rid, prompt_len=48, max_tokens=1, first_token=first))
    run_step(s)
    s.add_request(make_request("short", prompt_len=5, max_tokens=1))
    assert _prefill_steps_until_first_token(s, "short") == steps
    while s.has_unfinished():  # the long prompts still finish
        run_step(s)
    assert_no_leak(s)


def test_shortest_first_keeps_a_long_chunk_out_of_a_step_that_ends_short_prompts():
    s = make_scheduler(
        num_blocks=256, policy="shortest-first", max_num_batched_tokens=32, prefill_chunk_size=16
    )
    s.add_request(make_request("long", prompt_len=48, max_tokens=1, first_token=100))
    out, _ = run_step(s)
    assert [(p.request_id, p.num_tokens) for p in out.prefills] == [("long", 16)]
    s.add_request(make_request("short", prompt_len=5, max_tokens=1))
    out, _ = run_step(s)  # the budget had room for a chunk, but the step stays short
    assert [p.request_id for p in out.prefills] == ["short"]
    out, _ = run_step(s)
    assert [(p.request_id, p.num_tokens) for p in out.prefills] == [("long", 16)]
    out, _ = run_step(s)  # its last chunk does end a prompt, and it comes alone
    assert [(p.request_id, p.num_tokens, p.sample) for p in out.prefills] == [("long", 16, True)]
    assert not s.has_unfinished()


def test_shortest_first_advances_one_long_prompt_a_step():
    s = make_scheduler(
        num_blocks=256, policy="shortest-first", max_num_batched_tokens=64, prefill_chunk_size=16
    )
    s.add_request(make_request("a", prompt_len=48, max_tokens=1, first_token=100))
    s.add_request(make_request("b", prompt_len=40, max_tokens=1, first_token=200))
    chunks = [[(p.request_id, p.num_tokens) for p in run_step(s)[0].prefills] for _ in range(6)]
    # The shorter first, one chunk a step, though the budget had room for four.
    assert chunks == [[("b", 16)], [("b", 16)], [("b", 8)], [("a", 16)], [("a", 16)], [("a", 16)]]
    assert not s.has_unfinished()


def test_shortest_first_ages_a_long_prompt_ahead_of_fresh_short_ones():
    s = make_scheduler(
        num_blocks=256, policy="shortest-first", max_num_batched_tokens=16, prefill_chunk_size=16
    )
    old = make_request("old-long", prompt_len=48, max_tokens=1)
    old.arrival_time -= 11.0  # waited longer than starve_after_s
    s.add_request(old)
    for i in range(3):
        s.add_request(make_request(f"short{i}", prompt_len=5, max_tokens=1))
    out, _ = run_step(s)
    assert out.prefills[0].request_id == "old-long"


def test_shortest_first_never_starves_a_long_prompt(monkeypatch):
    # A short prompt arrives every step, forever; the long one still ends, once it has aged.
    import workers.engine.policy as policy_module

    clock = [1000.0]
    monkeypatch.setattr(policy_module.time, "monotonic", lambda: clock[0])
    s = make_scheduler(
        num_blocks=256, policy="shortest-first", max_num_batched_tokens=8, prefill_chunk_size=8
    )
    long = make_request("long", prompt_len=40, max_tokens=1, first_token=100)
    long.arrival_time = clock[0]
    s.add_request(long)
    for step in range(200):
        short = make_request(f"s{step}", prompt_len=8, max_tokens=1)
        short.arrival_time = clock[0]
        s.add_request(short)
        _, results = run_step(s)
        if any(r.request_id == "long" for r, _ in results):
            break
        clock[0] += 0.25
    else:
        raise AssertionError("the long prompt starved")
    # The short ones went first until the long one had waited 10 s (step 40); then its five
    # chunks of 8 ran, one a step.
    assert step == 40 + 5 - 1


def test_a_prompt_served_ahead_of_running_decodes_leaves_them_their_budget(monkeypatch):
    """An aged prompt goes ahead of everything under shortest-first, but its chunk is cut to
    what the running decodes leave of the step's budget: none of them skips the step."""
    import workers.engine.policy as policy_module

    clock = [1000.0]
    monkeypatch.setattr(policy_module.time, "monotonic", lambda: clock[0])
    s = make_scheduler(
        num_blocks=256, policy="shortest-first", max_num_batched_tokens=16, prefill_chunk_size=16
    )
    for i in range(4):
        chat = make_request(f"c{i}", prompt_len=3, max_tokens=50, first_token=i + 1)
        chat.arrival_time = clock[0]
        s.add_request(chat)
    run_step(s)  # the four prompts (12 tokens) and their first tokens
    long = make_request("long", prompt_len=200, max_tokens=1, first_token=100)
    long.arrival_time = clock[0] - 60  # waited past starve_after_s: first in every step
    s.add_request(long)
    for _ in range(5):
        out, _ = run_step(s)
        assert sorted(d.request_id for d in out.decodes) == ["c0", "c1", "c2", "c3"]
        assert [(p.request_id, p.num_tokens) for p in out.prefills] == [("long", 12)]


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(f"r{i}"))
    out, _ = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_prefix_cache_hit_skips_computed_blocks():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", prompt_len=10, max_tokens=1))
    run_step(s)
    s.add_request(make_request("b", prompt_len=10, max_tokens=1))
    out, _ = run_step(s)
    (p,) = out.prefills
    assert p.start_position == 8 and p.num_tokens == 2
    assert s.pool.num_prefix_hits == 2


def test_request_that_outgrows_the_whole_cache_ends_with_an_error():
    s = make_scheduler(num_blocks=3, block_size=4)
    s.add_request(make_request("big", prompt_len=8, max_tokens=50))
    for _ in range(20):
        out = s.schedule()
        if out.failed:
            break
        from workers.engine.scheduler_output import SampledToken

        s.update_from_output(
            out, [SampledToken(r.request_id, 7) for r in out.scheduled if r.sample]
        )
    assert out.failed and out.failed[0][0].request_id == "big" and "3 KV blocks" in out.failed[0][1]
    assert not s.has_unfinished() and s.pool.num_free_blocks == 3


def test_a_step_compares_no_requests_field_by_field(monkeypatch):
    """With 256 running, two tenants trading seats and blocks running out (preemptions),
    schedule() never calls Request.__eq__: a request is found by identity or by its status,
    so a step costs O(B), not O(B^2) comparisons of whole dataclasses."""
    from workers.engine.request import Request, RequestStatus, Tenancy

    calls = []

    def counted(self, other):
        calls.append(1)
        return self is other

    s = make_scheduler(num_blocks=300, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096)
    monkeypatch.setattr(Request, "__eq__", counted)
    for i in range(256):
        s.add_request(make_request(f"a{i}", prompt_len=4, max_tokens=40, tenancy=Tenancy("a")))
    preempted = swapped = most = 0
    for step in range(12):
        if step == 2:  # a second tenant arrives: seats change hands
            for i in range(8):
                s.add_request(make_request(f"b{i}", 4, 40, tenancy=Tenancy("b")))
        most = max(most, len(s.running))
        out, _ = run_step(s)
        preempted += len(out.preempted_ids)
        swapped += any(r.startswith("b") for r in (x.request_id for x in out.scheduled))
        if step == 5:
            s.finish_request("a3", RequestStatus.FINISHED_CANCELLED)
    assert most == 256 and preempted > 0 and swapped > 0, (most, preempted, swapped)
    assert calls == []
