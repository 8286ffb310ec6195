"""The router's admission order (router/admission/fair.py) on scripted arrivals, with a clock of the
test's own: slots kept for a wide request, fair share by tokens and weight, tiers, caps,
aging and max wait, SJF by prediction, slack and reject_if_late; and tenants' quotas."""

import asyncio

import pytest

from router.admission.fair import FairQueue, Shed, Ticket
from router.admission.tenants import TenantTable, TokenBucket
from router.errors import RouterError
from router.tenant_policy import TenantsConfig
from workers.messages import Status


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queue(total=1, tenants=None, clock=None, **kw):
    return FairQueue(total, TenantTable(tenants or TenantsConfig()), clock=clock or Clock(), **kw)


async def served_order(q, tickets, tokens_each=0):
    """Queue every ticket behind one that holds all the slots, then free them one request
    at a time (each served `tokens_each` output tokens): the order they got their slots."""
    holder = Ticket("holder", q.total)
    await q.acquire(holder)
    order, tasks = [], []

    async def want(t):
        await q.acquire(t)
        order.append(t)

    for t in tickets:
        tasks.append(asyncio.create_task(want(t)))
        await asyncio.sleep(0)
    q.release(holder)
    for _ in tickets:
        await asyncio.sleep(0)
        done = order[-1]
        q.served(done.tenant, tokens_each)
        q.release(done)
    await asyncio.gather(*tasks)
    return order


def names(order):
    return [f"{t.tenant}{t.priority}" for t in order]


def test_a_wide_request_keeps_its_place_and_narrow_ones_wait_behind_it():
    async def go():
        q = queue(4)
        first = Ticket("a", 3)
        await q.acquire(first)
        wide, narrow = Ticket("a", 4), Ticket("a", 1)
        tw = asyncio.create_task(q.acquire(wide))
        await asyncio.sleep(0)
        tn = asyncio.create_task(q.acquire(narrow))
        await asyncio.sleep(0)
        assert q.free == 1 and not tw.done() and not tn.done()  # 1 free, kept for wide
        q.release(first)
        await tw
        q.release(wide)
        await tn
        return q.free

    assert asyncio.run(go()) == 3


def test_a_waiter_that_goes_away_takes_nothing_and_one_given_slots_gives_them_back():
    async def go():
        q = queue(2)
        held = Ticket("a", 2)
        await q.acquire(held)
        wide, narrow = Ticket("a", 2), Ticket("a", 1)
        tw = asyncio.create_task(q.acquire(wide))
        await asyncio.sleep(0)
        tn = asyncio.create_task(q.acquire(narrow))
        await asyncio.sleep(0)
        tw.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tw
        q.release(held)  # narrow gets one...
        tn.cancel()  # ...and is cancelled before it runs: it gives it back
        with pytest.raises(asyncio.CancelledError):
            await tn
        return q.free, q.depth

    assert asyncio.run(go()) == (2, 0)


def test_more_choices_than_slots_or_than_the_tenants_cap_are_refused():
    tenants = TenantsConfig(max_concurrency={"capped": 2})
    for t, why in ((Ticket("a", 5), "router.max_in_flight"), (Ticket("capped", 3), "max_concurr")):
        with pytest.raises(RouterError, match=why) as e:
            asyncio.run(queue(4, tenants).acquire(t))
        assert e.value.status is Status.INVALID_ARGUMENT


def test_fair_share_alternates_where_fcfs_serves_the_flood_first():
    # a floods first, then b arrives: FCFS serves all of a; fair share takes turns.
    def tickets():
        return [Ticket("a", priority=i) for i in range(3)] + [
            Ticket("b", priority=i) for i in range(3)
        ]

    fair = asyncio.run(served_order(queue(fair_share=True), tickets(), tokens_each=10))
    fcfs = asyncio.run(served_order(queue(fair_share=False), tickets(), tokens_each=10))
    assert names(fcfs) == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert names(fair) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_tenant_under_its_share_is_not_kept_waiting_by_a_flood_holding_every_slot():
    async def go(fair_share, b_tier=1):
        tenants = TenantsConfig(tier={"b": b_tier})
        q = queue(4, tenants, fair_share=fair_share)
        flood = [Ticket("a") for _ in range(4)]
        for t in flood:
            await q.acquire(t)
        more_a = asyncio.create_task(q.acquire(Ticket("a")))
        await asyncio.sleep(0)
        b1, b2, b3 = Ticket("b"), Ticket("b"), Ticket("b")
        got = [asyncio.create_task(q.acquire(t)) for t in (b1, b2, b3)]
        await asyncio.sleep(0)
        admitted = [t.done() for t in got]
        running = dict(q.running)
        q.release(flood[0])  # still 5 held of 4: the flood's next one waits
        await asyncio.sleep(0)
        a_waits = not more_a.done()
        for t in flood[1:]:
            q.release(t)
        await asyncio.gather(more_a, *got)
        return admitted, running, a_waits

    # b's share of 4 slots is 2 (weights 1:1): two of its requests go in at once, past the
    # flood's waiting one; its third waits, as the flood's does until it is back under 4.
    assert asyncio.run(go(True)) == ([True, True, False], {"a": 4, "b": 2}, True)
    # FCFS shares nothing, and under fair share a lower tier is owed nothing.
    assert asyncio.run(go(False))[0] == [False, False, False]
    assert asyncio.run(go(True, b_tier=2))[0] == [False, False, False]


def test_slots_owed_never_pass_room_kept_for_a_wide_request_nor_go_past_twice_the_total():
    async def wide_waits(max_wait_s):
        clock = Clock()
        q = queue(6, clock=clock, max_wait_s=max_wait_s)
        held = {"b": [], "c": []}
        for t in ("b", "c") * 3:
            held[t].append(Ticket(t))
            await q.acquire(held[t][-1])
        wide = asyncio.create_task(q.acquire(Ticket("a", 5)))
        await asyncio.sleep(0)
        queued = [asyncio.create_task(q.acquire(Ticket(t))) for t in ("b", "c") * 10]
        await asyncio.sleep(0)
        rounds = 0
        while not wide.done() and rounds < 50:  # b and c end one request a round, in turn
            rounds += 1
            clock.now += 1.0
            tenant = "bc"[rounds % 2]
            if held[tenant]:
                q.release(held[tenant].pop(0))
            await asyncio.sleep(0)
        for t in queued:
            t.cancel()
        await asyncio.gather(*queued, return_exceptions=True)
        return wide.done()

    # b and c, under their share each time one of theirs ends, would take the freed slot
    # back for ever; the room kept for a's 5 fills instead.
    assert asyncio.run(wide_waits(None)) and asyncio.run(wide_waits(5.0))

    async def tenants_one_after_another():
        q = queue(16)
        for i in range(12):
            for _ in range(16):
                task = asyncio.create_task(q.acquire(Ticket(f"t{i}")))
                await asyncio.sleep(0)
                if not task.done():
                    task.cancel()
                    break
        return q.total - q.free

    assert 16 < asyncio.run(tenants_one_after_another()) <= 32


def test_a_deadline_is_judged_by_the_slots_owed_not_by_the_floods_queue():
    async def go():
        clock = Clock()
        q = queue(4, clock=clock)
        q.hold_s.add(10, 5.0)  # slots have been held 5 s each
        for _ in range(4):
            await q.acquire(Ticket("a", predicted_tokens=10))
        flood = [asyncio.create_task(q.acquire(Ticket("a"))) for _ in range(8)]
        await asyncio.sleep(0)
        b = Ticket("b", prompt_tokens=10, ttft_deadline=1.0, reject_if_late=True)
        await q.acquire(b)  # owed a slot: not refused for the 8 of a's waiting ahead of it
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        return q.running["b"]

    assert asyncio.run(go()) == 1


def test_a_request_predicted_to_wait_past_the_shed_bound_is_refused_with_when_to_retry():
    """Overload is refused at the door, not queued to time out: slots held 5 s each, two of
    them, both taken. A third request waits 2.5 s (in, under a 3 s bound), a fourth 5 s
    (refused, retry in 2 s, nothing left queued); another tenant, owed its share, goes in."""

    async def go():
        q = queue(2, shed_wait_s=3.0)
        q.hold_s.add(10, 5.0)
        for _ in range(2):
            await q.acquire(Ticket("a", predicted_tokens=10))
        third = asyncio.create_task(q.acquire(Ticket("a", predicted_tokens=10)))
        await asyncio.sleep(0)
        with pytest.raises(Shed) as refused:
            await q.acquire(Ticket("a", predicted_tokens=10))
        assert q.depth == 1  # the third, still waiting; the refused one left no trace
        await q.acquire(Ticket("b", predicted_tokens=10))  # owed: in past a's flood
        assert q.running["b"] == 1
        third.cancel()
        await asyncio.gather(third, return_exceptions=True)
        return refused.value

    e = asyncio.run(go())
    assert e.status is Status.RESOURCE_EXHAUSTED and not e.final
    assert e.retry_after_s == pytest.approx(2.0) and "admission_shed_wait_s" in e.message


def test_without_a_shed_bound_every_request_queues():
    async def go():
        q = queue(1)
        q.hold_s.add(10, 60.0)
        await q.acquire(Ticket("a", predicted_tokens=10))
        waiting = [asyncio.create_task(q.acquire(Ticket("a"))) for _ in range(5)]
        await asyncio.sleep(0)
        depth = q.depth
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return depth

    assert asyncio.run(go()) == 5


def test_weights_give_slots_in_their_ratio():
    tenants = TenantsConfig(weight={"a": 2})
    tickets = [Ticket(t, priority=i) for i in range(4) for t in ("a", "b")]
    order = asyncio.run(served_order(queue(tenants=tenants), tickets, tokens_each=10))
    assert [t.tenant for t in order[:6]].count("a") == 4  # 2:1 while both wait


def test_a_tenant_back_from_idle_has_banked_nothing():
    async def go():
        q = queue(1)
        q.ledger.counters.update({"a": 1000.0, "b": 0.0})  # b was quiet while a was served
        await q.acquire(a := Ticket("a"))
        b = Ticket("b")
        task = asyncio.create_task(q.acquire(b))
        await asyncio.sleep(0)
        q.release(a)
        await task
        return q.ledger.counters["b"]

    assert asyncio.run(go()) == 1000.0  # lifted to a's count, not 1000 tokens ahead


def test_a_lower_tier_goes_first_and_a_capped_tenant_waits_while_others_pass():
    tenants = TenantsConfig(tier={"gold": 0}, max_concurrency={"capped": 1})
    order = asyncio.run(
        served_order(queue(tenants=tenants), [Ticket("x"), Ticket("gold"), Ticket("x", priority=1)])
    )
    assert names(order) == ["gold0", "x0", "x1"]

    async def capped():
        q = queue(3, tenants)
        await q.acquire(Ticket("capped"))
        second = asyncio.create_task(q.acquire(Ticket("capped")))
        await asyncio.sleep(0)
        other = Ticket("x")
        await q.acquire(other)  # slots are free, and capped's wait does not hold x
        return second.done(), q.free

    assert asyncio.run(capped()) == (False, 1)


def test_aging_and_max_wait_bring_an_old_request_to_the_head():
    async def go(**kw):
        clock = Clock()
        q = queue(clock=clock, policy="priority", **kw)
        holder = Ticket("h")
        await q.acquire(holder)
        old = Ticket("a", priority=5)
        t_old = asyncio.create_task(q.acquire(old))
        await asyncio.sleep(0)
        clock.now = 10.0
        new = Ticket("b", priority=0)
        t_new = asyncio.create_task(q.acquire(new))
        await asyncio.sleep(0)
        q.release(holder)
        await asyncio.sleep(0)
        first = "old" if t_old.done() else "new"
        for t in (t_old, t_new):
            t.cancel()
        await asyncio.gather(t_old, t_new, return_exceptions=True)
        return first

    assert asyncio.run(go(fair_share=False)) == "new"  # priority alone: 0 before 5
    assert asyncio.run(go(fair_share=False, aging_per_s=1.0)) == "old"  # 5 - 10 s < 0
    assert asyncio.run(go(max_wait_s=5.0)) == "old"  # waited past max_wait_s


def test_sjf_orders_by_predicted_cost():
    tickets = [
        Ticket("a", prompt_tokens=10, predicted_tokens=500, priority=0),
        Ticket("a", prompt_tokens=400, predicted_tokens=10, priority=1),
        Ticket("a", prompt_tokens=10, predicted_tokens=20, priority=2),
    ]
    order = asyncio.run(served_order(queue(policy="sjf"), tickets))
    assert names(order) == ["a2", "a1", "a0"]


def test_slack_orders_by_deadline_and_reject_if_late_refuses_what_cannot_make_it():
    clock = Clock()
    tickets = [
        Ticket("a", ttft_deadline=None, priority=0),
        Ticket("a", ttft_deadline=9.0, priority=1),
        Ticket("a", ttft_deadline=2.0, priority=2),
    ]
    order = asyncio.run(served_order(queue(clock=clock, policy="slack"), tickets))
    assert names(order) == ["a2", "a1", "a0"]

    async def late():
        q = queue(clock=clock, policy="slack")
        q.first_token_s.add(100, 0.5)  # a first token takes about 0.5 s
        holder = Ticket("h", predicted_tokens=10)
        await q.acquire(holder)
        # Slots have been held 5 s each: one deadline 1 s away cannot be met.
        q.hold_s.add(10, 5.0)
        with pytest.raises(RouterError) as e:
            await q.acquire(Ticket("a", prompt_tokens=100, ttft_deadline=1.0, reject_if_late=True))
        assert e.value.status is Status.RESOURCE_EXHAUSTED and "reject_if_late" in str(e.value)
        # One that could make it waits; past its latest start, it is refused while waiting.
        t = Ticket("a", prompt_tokens=100, ttft_deadline=0.6, reject_if_late=True)
        q.hold_s = type(q.hold_s)(prior=0.0)
        task = asyncio.create_task(q.acquire(t))
        await asyncio.sleep(0.3)
        clock.now = 0.2
        with pytest.raises(RouterError, match="reject_if_late"):
            await task
        return q.depth

    assert asyncio.run(late()) == 0


def test_a_quota_refills_at_its_rate_and_says_when_to_retry():
    clock = Clock()
    bucket = TokenBucket(600, clock)  # 10 tokens a second
    assert bucket.wait_s(600) == 0
    bucket.take(700)  # output counted past the level: a debt
    assert bucket.wait_s(100) == pytest.approx(20.0)
    clock.now = 5.0
    assert bucket.wait_s(100) == pytest.approx(15.0)
    assert bucket.wait_s(10_000) == pytest.approx(65.0)  # more than a minute's: a full bucket
    table = TenantTable(TenantsConfig(tokens_per_minute={"default": 60, "free": 0}), clock)
    table.charge("someone", 60)
    assert table.quota_wait_s("someone", 30) == pytest.approx(30.0)
    assert table.quota_wait_s("free", 10**9) == 0  # 0: no quota


def test_tenants_config_names_the_bad_field_and_changes_at_run_time():
    with pytest.raises(ValueError, match="weight"):
        TenantsConfig(weight={"a": 0})
    with pytest.raises(ValueError, match="tier_ttft_slo_ms"):
        TenantsConfig(tier_ttft_slo_ms={"x": 5})
    table = TenantTable(TenantsConfig(weight={"default": 2}))
    assert table.policy("anyone").weight == 2
    table.update("gold", tier=0, weight=4)
    assert (table.policy("gold").tier, table.policy("gold").weight) == (0, 4)
    table.update("gold", weight=None)  # back to the default entry
    assert table.policy("gold").weight == 2
    with pytest.raises(ValueError, match="max_concurrency"):
        table.update("gold", max_concurrency=-1)
    assert table.names() == ["gold"]


def test_run_time_changes_sit_on_the_config_and_a_reset_takes_them_off():
    table = TenantTable(TenantsConfig(weight={"gold": 3}, max_wait_s={"gold": 5}))
    table.set_overrides(table.with_changes({"gold": {"weight": 6, "max_wait_s": None}}))
    assert (table.policy("gold").weight, table.policy("gold").max_wait_s) == (6, None)
    changed = table.with_changes({"gold": {"tier": 0}})  # merged, field by field
    assert changed == {"gold": {"weight": 6, "max_wait_s": None, "tier": 0}}
    assert table.policy("gold").tier == 1  # with_changes only says what would be
    with pytest.raises(ValueError, match="unknown field"):
        table.with_changes({"gold": {"colour": "red"}})
    table.set_overrides(table.with_changes({}, resets=["gold"]))
    assert (table.policy("gold").weight, table.policy("gold").max_wait_s) == (3, 5)
    # Overrides another version wrote: the bad entries are left out, named, the rest kept.
    bad = table.set_overrides({"a": {"weight": 2}, "b": {"weight": "x"}, "c": "garbage"})
    assert set(bad) == {"b", "c"} and table.overrides == {"a": {"weight": 2}}
    assert table.policy("a").weight == 2


def test_counts_of_idle_tenants_do_not_grow_without_bound():
    from workers.engine.fairness import MAX_IDLE_COUNTS

    async def go():
        q = queue(2)
        held = Ticket("busy")
        await q.acquire(held)
        for i in range(MAX_IDLE_COUNTS + 50):  # a router without keys: any name comes
            t = Ticket(f"t{i}", prompt_tokens=3)
            await q.acquire(t)
            q.release(t)
        return len(q.ledger.counters), "busy" in q.ledger.counters

    n, kept = asyncio.run(go())
    assert n <= MAX_IDLE_COUNTS and kept  # the active tenant's count is never dropped


def test_a_waiter_cancelled_in_the_same_turn_as_a_release_takes_nothing():
    async def go(fair_share, tenants):
        q = queue(2, fair_share=fair_share)
        held = Ticket("a", 2)
        await q.acquire(held)
        waiters = [Ticket(t) for t in tenants]
        tasks = [asyncio.create_task(q.acquire(t)) for t in waiters]
        await asyncio.sleep(0)
        tasks[0].cancel()  # its future is cancelled now, its handler runs later
        q.release(held)  # in the same turn: must not grant the cancelled one
        await asyncio.gather(*tasks, return_exceptions=True)
        return q.free, dict(q.running), q.depth

    assert asyncio.run(go(False, "bc")) == (1, {"c": 1}, 0)
    # Under fair share, with waiters of the holder's own tenant (owed nothing beyond it).
    assert asyncio.run(go(True, "aa")) == (1, {"a": 1}, 0)


def test_a_cap_lowered_below_a_waiters_choices_refuses_it_and_changes_are_all_or_none():
    from router.admission.control import AdmissionControl
    from router.config import RouterConfig
    from router.metrics import RouterMetrics

    async def go():
        adm = AdmissionControl(RouterConfig(max_in_flight=4), RouterMetrics("t"))
        await adm.slots.acquire(held := Ticket("a", 4))
        wide = Ticket("a", 3)
        task = asyncio.create_task(adm.slots.acquire(wide))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="weight"):
            adm.update({"a": {"tier": 0}, "b": {"weight": -1}})
        assert adm.tenants.policy("a").tier == 1  # the first change was undone
        adm.update({"a": {"max_concurrency": 2}})
        with pytest.raises(RouterError, match="max_concurrency") as e:
            await task
        adm.release(held)
        return e.value.status, adm.slots.free

    assert asyncio.run(go()) == (Status.INVALID_ARGUMENT, 4)
