"""Fair share's one ledger (workers/engine/fairness.py) and the orders' registry
(workers/engine/orders.py), on their own: the rules the router's slot queue and the engine's
seat policy both apply, tested once here."""

from dataclasses import dataclass

import pytest

from workers.engine import fairness
from workers.engine.fairness import MAX_IDLE_COUNTS, OVERDUE, Ledger, cost
from workers.engine.orders import ORDERS, Side, make_order, order_names


def test_an_output_token_costs_more_than_a_prompt_token():
    assert cost(prompt_tokens=10) == 10 * fairness.PROMPT_COST
    assert cost(output_tokens=10) == 10 * fairness.OUTPUT_COST > cost(prompt_tokens=10)
    assert cost(3, 2) == cost(prompt_tokens=3) + cost(output_tokens=2)


def test_a_count_is_what_was_charged_over_the_weight():
    ledger = Ledger()
    ledger.charge("a", 100.0, weight=1.0)
    ledger.charge("b", 100.0, weight=4.0)
    assert (ledger.count("a"), ledger.count("b"), ledger.count("nobody")) == (100.0, 25.0, 0.0)


def test_charges_made_later_move_the_count_only_when_settled():
    ledger = Ledger()
    ledger.charge_later("a", 30.0, weight=2.0)
    ledger.charge_later("a", 10.0, weight=2.0)
    assert ledger.count("a") == 0.0
    ledger.settle()
    assert ledger.count("a") == 20.0
    ledger.settle()  # nothing left pending: charged once
    assert ledger.count("a") == 20.0


def test_a_returning_tenant_is_lifted_to_the_least_count_of_its_peers_never_lowered():
    ledger = Ledger()
    ledger.counters.update({"busy": 500.0, "busier": 900.0, "rich": 2000.0})
    ledger.lift("quiet", ["busy", "busier"])
    assert ledger.count("quiet") == 500.0  # its quiet spell banked nothing
    ledger.lift("rich", ["busy"])
    assert ledger.count("rich") == 2000.0  # never lowered
    ledger.lift("alone", [], floor=42.0)
    assert ledger.count("alone") == 42.0  # no peers: the floor given
    ledger.lift("first", [])
    assert "first" not in ledger.counters  # no peers and no floor: nothing to lift to


def test_idle_counts_are_forgotten_past_the_bound_the_kept_ones_never():
    ledger = Ledger()
    for i in range(MAX_IDLE_COUNTS):
        ledger.charge(f"t{i}", 1.0, 1.0)
    ledger.prune(keep={"t0"})
    assert len(ledger.counters) == MAX_IDLE_COUNTS  # at the bound: nothing dropped yet
    ledger.charge("one-more", 1.0, 1.0)
    ledger.prune(keep={"t0", "one-more"})
    assert set(ledger.counters) == {"t0", "one-more"}


def test_a_tenants_share_is_its_weight_over_the_active_weights():
    # Of 8 seats, a tenant of weight 1 among weights summing to 4 is owed 2.
    assert fairness.share(1.0, 8, 4.0) == 2.0
    assert fairness.owed(held=1, more=1, weight=1.0, total=8, active_weight=4.0)
    assert not fairness.owed(held=2, more=1, weight=1.0, total=8, active_weight=4.0)
    assert fairness.excess(held=5, weight=1.0, total=8, active_weight=4.0) == 3.0
    assert fairness.excess(held=1, weight=3.0, total=8, active_weight=4.0) == -5.0


def test_the_head_of_the_key_is_max_wait_then_tier_then_count():
    ledger = Ledger()
    ledger.counters.update({"heavy": 1000.0, "light": 1.0})
    overdue = ledger.head("heavy", tier=9, waited_s=6.0, max_wait_s=5.0)
    assert overdue == OVERDUE
    tier0 = ledger.head("heavy", tier=0, waited_s=0.0, max_wait_s=5.0)
    light = ledger.head("light", tier=1, waited_s=0.0, max_wait_s=None)
    heavy = ledger.head("heavy", tier=1, waited_s=0.0, max_wait_s=None)
    assert overdue < tier0 < light < heavy
    ledger.fair = False  # counts kept, but no order made by them
    assert ledger.head("light", 1, 0.0, None) == ledger.head("heavy", 1, 0.0, None)


@dataclass
class Work:
    priority: int = 0
    arrival: float = 0.0
    prompt_left: int = 0
    output_left: float = 0.0
    deadline: float | None = None


def test_each_side_serves_its_orders_and_a_name_it_does_not_is_refused():
    assert order_names(Side.ROUTER) == ("fcfs", "priority", "sjf", "slack")
    assert order_names(Side.ENGINE) == ("fcfs", "priority", "shortest-first", "sjf")
    assert set(ORDERS) == set(order_names(Side.ROUTER)) | set(order_names(Side.ENGINE))
    with pytest.raises(ValueError, match="choose from fcfs, priority, shortest-first, sjf"):
        make_order("slack", Side.ENGINE)
    with pytest.raises(ValueError, match="'lifo' is unknown"):
        make_order("lifo", Side.ROUTER)


def test_the_orders_keys():
    now = 100.0
    fcfs = make_order("fcfs", Side.ROUTER)
    assert fcfs.key(Work(priority=9), now) == fcfs.key(Work(priority=0), now) == ()
    aged = make_order("priority", Side.ENGINE, aging_per_s=1.0)
    # Priority 5, waited 10 s, ages past a fresh priority 0.
    assert aged.key(Work(priority=5, arrival=90.0), now) < aged.key(Work(arrival=now), now)
    sjf = make_order("sjf", Side.ROUTER)
    assert sjf.key(Work(prompt_left=10, output_left=10), now) == (1, cost(10, 10))
    assert sjf.key(Work(prompt_left=100), now) < sjf.key(Work(prompt_left=10, output_left=50), now)
    shortest = make_order("shortest-first", Side.ENGINE, starve_after_s=10.0)
    assert shortest.admits_ahead and not fcfs.admits_ahead
    starved = Work(prompt_left=5000, arrival=now - 10.0)
    assert shortest.key(starved, now) < shortest.key(Work(prompt_left=1, arrival=now), now)
    slack = make_order("slack", Side.ROUTER, first_token_s=lambda tokens: tokens / 1000)
    assert slack.key(Work(prompt_left=500, deadline=now + 2.0), now) == (1.5,)
    assert slack.key(Work(deadline=now + 9.0), now) < slack.key(Work(deadline=None), now)
