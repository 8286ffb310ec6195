"""The autoscaler's decisions on given signals, without Ray: grow to ceil(workers x signal /
target) within bounds, shrink one drained worker at a time, hold during a change and its
cool-down, and say why."""

import asyncio
from types import SimpleNamespace

from cluster.autoscale import CONFIRM, Autoscaler
from cluster.config import AutoscaleConfig
from router.fleet.routing import WorkerLoad
from workers.messages import Pool


class FakePools:
    def __init__(self, sizes: dict[Pool, int]) -> None:
        self.sizes = dict(sizes)
        self.autoscale_notes: dict[Pool, str] = {}
        self.calls: list[tuple[Pool, int]] = []
        self.events = SimpleNamespace(seen=[])
        self.events.count = lambda pool, event: self.events.seen.append((pool, event))

    def members(self, pool: Pool):
        return [
            SimpleNamespace(name=f"{pool.value}-{i}", draining=False)
            for i in range(self.sizes[pool])
        ]

    def starting(self, pool: Pool) -> int:
        return 0

    busy = False

    def changing(self, pool: Pool) -> bool:
        return self.busy

    async def save(self) -> None:
        pass

    async def scale(self, pool: Pool, n: int, drain_timeout_s: float = 60.0) -> list[str]:
        self.calls.append((pool, n))
        self.sizes[pool] = n
        return []


class FakeMetrics:
    def __init__(self) -> None:
        self.p90s: dict[str, float | None] = {"ttft": None, "tpot": None}

    def p90(self, kind: str) -> float | None:
        return self.p90s[kind]


async def decide(s) -> None:
    """Readings a second apart, as many as a change needs, then let it apply."""
    for _ in range(CONFIRM):
        s.tick()
    await asyncio.sleep(0)


def scaler(configs, sizes):
    router = SimpleNamespace(loads={}, metrics=FakeMetrics())
    pools = FakePools(sizes)
    return Autoscaler(router.loads, router.metrics, pools, configs, lambda: True), router, pools


def test_grows_within_bounds_holds_in_cool_down_and_shrinks_one_at_a_time():
    cfg = AutoscaleConfig(enabled=True, min_replicas=1, max_replicas=3, target=1000, cooldown_s=30)
    s, router, pools = scaler({Pool.PREFILL: cfg}, {Pool.PREFILL: 1, Pool.DECODE: 1})
    router.loads["prefill-0"] = WorkerLoad("prefill-0", queued_tokens=9000)

    async def go():
        s.tick()
        s.tick()
        await asyncio.sleep(0)
        assert pools.calls == []  # one long prompt's reading alone changes nothing
        s.tick()
        await asyncio.sleep(0)
        assert pools.calls == [(Pool.PREFILL, 3)]  # ceil(9) bounded by max_replicas
        assert (
            "grows 1 -> 3: queued_prefill_tokens 9e+03 vs target 1000"
            in pools.autoscale_notes[Pool.PREFILL]
        )
        for i in range(3):
            router.loads[f"prefill-{i}"] = WorkerLoad(f"prefill-{i}", queued_tokens=0)
        await decide(s)
        assert len(pools.calls) == 1  # within the cool-down: nothing
        for want in (2, 1):  # one at a time, down to min_replicas
            s.changed_at[Pool.PREFILL] -= 31
            await decide(s)
            assert pools.calls[-1] == (Pool.PREFILL, want)
        s.changed_at[Pool.PREFILL] -= 31
        await decide(s)
        assert len(pools.calls) == 3  # at min: nothing more

    asyncio.run(go())
    up, down = ("prefill", "autoscale_up"), ("prefill", "autoscale_down")
    assert pools.events.seen == [up, down, down]


def test_a_reading_that_changes_its_mind_restarts_the_count():
    cfg = AutoscaleConfig(enabled=True, max_replicas=4, target=1000, cooldown_s=0)
    s, router, pools = scaler({Pool.PREFILL: cfg}, {Pool.PREFILL: 1, Pool.DECODE: 1})

    async def go():
        for queued in (3000, 3000, 0, 3000, 3000):  # the dip breaks the run of readings
            router.loads["prefill-0"] = WorkerLoad("prefill-0", queued_tokens=queued)
            s.tick()
        await asyncio.sleep(0)
        assert pools.calls == []
        s.tick()
        await asyncio.sleep(0)
        assert pools.calls == [(Pool.PREFILL, 3)]

    asyncio.run(go())


def test_nothing_is_decided_while_another_change_holds_the_pool():
    cfg = AutoscaleConfig(enabled=True, max_replicas=4, target=1000, cooldown_s=0)
    s, router, pools = scaler({Pool.PREFILL: cfg}, {Pool.PREFILL: 1, Pool.DECODE: 1})
    router.loads["prefill-0"] = WorkerLoad("prefill-0", queued_tokens=3000)

    async def go():
        s.tick()
        s.tick()
        pools.busy = True  # an operator's scale or a healing round
        s.tick()
        pools.busy = False
        s.tick()  # readings from before that change do not count
        await asyncio.sleep(0)
        assert pools.calls == []
        await decide(s)
        assert pools.calls == [(Pool.PREFILL, 3)]

    asyncio.run(go())


def test_decode_scales_on_kv_use_and_latency_signals_default_to_idle():
    kv = AutoscaleConfig(enabled=True, max_replicas=4, cooldown_s=0)  # kv_blocks_used, 0.7
    s, router, pools = scaler({Pool.DECODE: kv}, {Pool.PREFILL: 1, Pool.DECODE: 2})
    router.loads["decode-0"] = WorkerLoad("decode-0", kv_blocks_free=10, kv_blocks_total=100)
    router.loads["decode-1"] = WorkerLoad("decode-1", kv_blocks_free=30, kv_blocks_total=100)
    asyncio.run(decide(s))  # mean use 0.8: ceil(2 x 0.8 / 0.7) = 3
    assert pools.calls == [(Pool.DECODE, 3)]

    ttft = AutoscaleConfig(enabled=True, signal="ttft_p90", target=1.0, max_replicas=4)
    s, router, pools = scaler({Pool.PREFILL: ttft}, {Pool.PREFILL: 2, Pool.DECODE: 1})
    assert s.signal(Pool.PREFILL, "ttft_p90") == 0.0  # no traffic: nothing to serve
    router.metrics.p90s["ttft"] = 2.5
    asyncio.run(decide(s))
    assert pools.calls == [(Pool.PREFILL, 4)]  # ceil(2 x 2.5 / 1.0) = 5, bounded


def test_config_refuses_bad_bounds_and_signals():
    import pytest

    from cluster import config_io
    from cluster.config import ClusterConfig

    with pytest.raises(ValueError, match="min_replicas"):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="decode.autoscale.signal.*kv_blocks_used or tpot_p90"):
        config_io.build(ClusterConfig, {"decode": {"autoscale": {"signal": "ttft_p90"}}})
    cfg = config_io.build(ClusterConfig, {"prefill": {"autoscale": {"enabled": True}}})
    assert cfg.prefill.autoscale.resolved(Pool.PREFILL) == ("queued_prefill_tokens", 2048.0)
