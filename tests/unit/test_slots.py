"""The router's slots: a request of n choices takes n; waiters are served in arrival order
(a wide request is not passed over by narrow ones behind it); a waiter that goes away takes
nothing with it."""

import asyncio

import pytest

from router.slots import Slots


def test_a_wide_request_waits_its_turn_and_is_not_passed_over():
    async def go():
        slots = Slots(4)
        await slots.acquire(3)
        order = []

        async def want(name, n):
            await slots.acquire(n)
            order.append(name)

        wide = asyncio.create_task(want("wide", 4))
        await asyncio.sleep(0)
        narrow = asyncio.create_task(want("narrow", 1))  # 1 is free, but wide came first
        await asyncio.sleep(0)
        assert order == [] and slots.free == 1
        slots.release(3)
        await wide
        assert order == ["wide"] and slots.free == 0
        slots.release(4)
        await narrow
        return order, slots.free

    order, free = asyncio.run(go())
    assert order == ["wide", "narrow"] and free == 3


def test_a_waiter_that_goes_away_takes_nothing_and_lets_others_in():
    async def go():
        slots = Slots(2)
        await slots.acquire(2)
        wide = asyncio.create_task(slots.acquire(2))
        await asyncio.sleep(0)
        narrow = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        wide.cancel()  # the client went away while waiting
        with pytest.raises(asyncio.CancelledError):
            await wide
        slots.release(1)
        await narrow  # next in line, now first
        return slots.free, slots.used

    assert asyncio.run(go()) == (0, 2)


def test_slots_given_to_a_waiter_cancelled_before_it_ran_come_back():
    async def go():
        slots = Slots(1)
        await slots.acquire(1)
        waiter = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        slots.release(1)  # handed to the waiter...
        waiter.cancel()  # ...which is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return slots.free

    assert asyncio.run(go()) == 1


def test_more_than_all_slots_is_refused():
    with pytest.raises(ValueError, match="5 slots asked of 4"):
        asyncio.run(Slots(4).acquire(5))
