"""A pool's size is bounded: a Scale past `max_replicas` is refused with nothing changed (no
target stored, no worker started), a target found in the store past it is cut to it, and the
pool's last live worker cannot be drained away."""

import asyncio

import pytest

from cluster.actors import PoolSpec
from cluster.config import AutoscaleConfig, ClusterConfig, PoolConfig
from cluster.pools import POOLS_KEY, PoolManager
from router.fleet.directory import PoolRefusal, WorkerRef
from workers.engine.config import EngineConfig
from workers.messages import Pool, Status, WorkerInfo


class Store:
    """The shared pool state, as the store keeps it."""

    def __init__(self, state=None) -> None:
        self.state = {POOLS_KEY: state} if state else {}
        self.writes = 0

    async def put_json(self, name, value):
        self.writes += 1
        self.state[name] = value

    async def get_json(self, name):
        return self.state.get(name)


def manager(store: Store, max_replicas: int = 4) -> PoolManager:
    spec = PoolSpec(1, EngineConfig(), max_replicas=max_replicas)
    return PoolManager({Pool.PREFILL: spec, Pool.DECODE: spec}, None, store=store)


def worker(name: str, pool: Pool) -> WorkerRef:
    info = WorkerInfo(name=name, pool=pool, pid=1, node="n", endpoint=None)
    return WorkerRef(name, pool, handle=None, info=info)


def test_a_scale_past_the_limit_changes_nothing():
    store = Store()
    pools = manager(store)
    with pytest.raises(PoolRefusal) as e:
        asyncio.run(pools.scale(Pool.DECODE, 100_000))
    assert e.value.status is Status.INVALID_ARGUMENT
    assert "0..4 workers (decode.max_replicas)" in str(e.value)
    assert pools.targets[Pool.DECODE] == 1 and store.writes == 0


def test_a_stored_target_past_the_limit_is_cut_to_it():
    pools = manager(Store({"targets": {"decode": 100_000, "prefill": "many"}}))
    asyncio.run(pools.load())
    assert pools.targets[Pool.DECODE] == 4  # what a router that took the lease heals toward
    assert pools.targets[Pool.PREFILL] == 1  # not a number: the target it had


def test_the_last_live_worker_of_a_pool_is_not_drained():
    store = Store()
    pools = manager(store)
    last = worker("decode-0", Pool.DECODE)
    pools.workers[Pool.DECODE][last.name] = last
    with pytest.raises(PoolRefusal) as e:
        asyncio.run(pools.drain("decode-0", 5))
    assert e.value.status is Status.FAILED_PRECONDITION and "last live worker" in str(e.value)
    assert not last.draining and pools.targets[Pool.DECODE] == 1 and store.writes == 0


def test_the_config_bounds_replicas_and_autoscaling_by_max_replicas():
    with pytest.raises(ValueError, match="replicas=5: more than max_replicas=4"):
        PoolConfig(replicas=5, max_replicas=4)
    with pytest.raises(ValueError, match="autoscale.max_replicas=8: more than max_replicas=4"):
        PoolConfig(max_replicas=4, autoscale=AutoscaleConfig(enabled=True, max_replicas=8))
    assert ClusterConfig().pool(Pool.DECODE).max_replicas == 64
