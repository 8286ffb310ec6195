"""The router's generation slots: `max_in_flight` sequences at once, a request of n choices
taking n of them. Waiters are served in arrival order, so a request wanting many slots is
not passed over for ever by a stream of small ones. Used from the router's event loop alone.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    async def acquire(self, n: int) -> None:
        """Take n slots, waiting in line for them (n must be at most `total`)."""
        if not 1 <= n <= self.total:
            raise ValueError(f"{n} slots asked of {self.total}")
        if not self._waiters and self.free >= n:
            self.free -= n
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # given, then cancelled: give them back
                self.release(n)
            else:
                fut.cancel()
                self._wake()  # a large waiter leaving may let smaller ones behind it in
            raise

    def release(self, n: int) -> None:
        self.free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, fut = self._waiters[0]
            if fut.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if n > self.free:
                return
            self._waiters.popleft()
            self.free -= n
            fut.set_result(None)

    @property
    def used(self) -> int:
        return self.total - self.free
