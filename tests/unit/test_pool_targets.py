"""The pool manager's targets when a change is cut short, without Ray: a grow whose workers do
not start keeps the target a healer can still reach; a shrink cancelled midway leaves the
target at what still serves; a healing round counts what is missing under the pool's lock,
after any scale that held it."""

import asyncio

import pytest

from cluster.actors import PoolSpec
from cluster.pools import PoolManager
from router.fleet.directory import WorkerRef
from workers.engine.config import EngineConfig
from workers.messages import Pool

P = Pool.DECODE


def manager(live: int, dead: int = 0) -> PoolManager:
    pm = PoolManager({P: PoolSpec(1, EngineConfig())}, None)
    for i in range(live + dead):
        name = f"decode-{i}"
        pm.workers[P][name] = WorkerRef(name, P, None, None, alive=i < live)
    pm.targets[P] = live + dead
    return pm


def test_a_grow_that_cannot_start_keeps_a_reachable_target():
    async def refuse(pool):
        raise ValueError("not enough GPU")

    pm = manager(live=1)
    pm.spawn = refuse
    with pytest.raises(ValueError, match="2 of 2 workers did not start"):
        asyncio.run(pm.scale(P, 3))
    assert pm.targets[P] == 1  # not 3: nothing heals toward workers that cannot start

    pm = manager(live=0, dead=1)  # only a dead worker, and its replacement fails too
    pm.spawn = refuse
    with pytest.raises(ValueError):
        asyncio.run(pm.scale(P, 1))
    assert pm.targets[P] == 1  # not 0: healing keeps trying


def test_a_shrink_cancelled_midway_leaves_the_target_at_what_serves():
    pm = manager(live=3)
    drained = []

    async def drain(name, timeout_s):
        if drained:  # the second drain: its caller goes away
            raise asyncio.CancelledError
        drained.append(name)
        del pm.workers[P][name]
        pm.targets[P] = 2
        return True, "drained"

    pm._drain = drain

    async def go():
        with pytest.raises(asyncio.CancelledError):
            await pm.scale(P, 1)

    asyncio.run(go())
    assert drained == ["decode-2"]
    assert pm.targets[P] == 2  # two still serve; heal never shrinks, so 1 would stick


def test_healing_counts_what_is_missing_after_a_scale_that_held_the_lock():
    pm = manager(live=1)
    started = []

    async def spawn(pool):
        started.append(pool)
        name = f"decode-{len(pm.workers[P])}"
        pm.workers[P][name] = WorkerRef(name, P, None, None)
        return pm.workers[P][name]

    pm.spawn = spawn

    async def go():
        await pm._locks[P].acquire()  # a scale is under way
        pm.targets[P] = 3
        healing = asyncio.create_task(pm._heal_pool(P))
        await asyncio.sleep(0)
        for _ in range(2):  # the scale starts its two workers
            await spawn(P)
        pm._locks[P].release()
        await healing

    asyncio.run(go())
    assert len(started) == 2 and len(pm.members(P)) == 3  # the healer started none more


def test_workers_control_calls_exist_and_run_in_their_own_concurrency_groups():
    """A worker's status calls, and its calls that wait for the engine loop, run on threads
    its long calls cannot all hold, each kind on its own (a cancel waiting for a step never
    stands in front of a status call): the names must be the worker's methods, and its actor
    class must mark each."""
    from cluster.actors import LOOP, STATUS, actor_class
    from workers.decode import DecodeWorker
    from workers.prefill import PrefillWorker

    for cls in (PrefillWorker, DecodeWorker):
        assert "status" in cls.STATUS_CALLS and {"cancel", "phase"} <= set(cls.LOOP_CALLS)
        actor = actor_class(cls)
        assert actor.__name__ == cls.__name__ and issubclass(actor, cls)
        for names, group in ((cls.STATUS_CALLS, STATUS), (cls.LOOP_CALLS, LOOP)):
            for name in names:
                assert callable(getattr(cls, name)), name
                assert getattr(actor, name).__ray_concurrency_group__ == group, name
        long_call = actor.prefill if cls is PrefillWorker else actor.poll
        assert not hasattr(long_call, "__ray_concurrency_group__")
