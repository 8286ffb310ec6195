"""The cluster's control duties, which exactly one router performs at a time: the one holding
the `controller` lease in the store. Every router, every `interval_s`:

1. writes its heartbeat (its id and gRPC address, with a TTL);
2. takes or renews the lease, or learns who holds it;
3. takes up the tenants' changes another router wrote to the store (router/admission/control.py);
4. as the controller: has the pool manager replace dead workers (pools heal), and adopts the
   requests whose router's heartbeat lapsed (their drivers start here, watching first);
   otherwise: picks up the workers the controller started.

While the store is unreachable nobody can take the lease over, so the router that held it
goes on as the controller; the others wait.
"""

from __future__ import annotations

import asyncio
import logging

from router.requests.core import Router

log = logging.getLogger(__name__)
LEASE = "controller"


class Controller:
    def __init__(
        self, router: Router, address: str, interval_s: float = 1.0, ttl_s: float = 3.0
    ) -> None:
        self.router = router
        self.address = address
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.leader = False
        self.leader_address: str | None = None
        self._heal: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._malformed: set[str] = set()  # records that do not parse: skipped, logged once

    def start(self) -> None:
        """Take up the controller duties (in a task of this event loop) until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self.run_forever())

    async def stop(self) -> None:
        self._stopped = True
        for task in (self._task, self._heal):
            if task is not None:
                task.cancel()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=5)

    async def run_forever(self) -> None:
        while not self._stopped:
            try:
                await self.tick()
            except Exception:
                # A store client may turn the cancellation of a call into its own error: a
                # stopped controller must not take that for a failed round and go on.
                if self._stopped or asyncio.current_task().cancelling():
                    raise asyncio.CancelledError from None
                log.exception("controller round failed")
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        router, store = self.router, self.router.records.store
        was_leader = self.leader
        if store is None:  # a router without a store is alone: it controls its pools
            self.leader = True
        else:
            try:
                await asyncio.wait_for(
                    store.heartbeat(router.id, self.address, self.ttl_s), self.ttl_s
                )
                self.leader = await asyncio.wait_for(
                    store.hold_lease(LEASE, router.id, self.ttl_s), self.ttl_s
                )
                if self.leader != was_leader:
                    log.warning(
                        "router %s %s the controller lease",
                        router.id,
                        "holds" if self.leader else "lost",
                    )
                if not self.leader:
                    holder = await store.lease_holder(LEASE)
                    self.leader_address = (await store.live_routers()).get(holder or "")
            except (ConnectionError, TimeoutError) as e:  # store away: keep the role we had
                log.debug("controller: store unreachable (%s)", e)
        directory = router.fleet.directory
        directory.set_control(self.leader)
        if self.leader:
            if not was_leader:  # new in the role: see the pools as they are before healing
                await directory.refresh()
            if self._heal is None or self._heal.done():
                self._heal = asyncio.get_running_loop().create_task(directory.heal())
            if store is not None and router.records.available:
                await self.adopt_orphans()
        else:
            await directory.refresh()
        if store is not None:
            await self.sync_tenants(store)

    async def sync_tenants(self, store) -> None:
        """Take up the tenants' changes in the store. What fails is logged and tried again
        next round: it never holds the control duties back."""
        try:
            await asyncio.wait_for(self.router.admission.sync(store), self.ttl_s)
        except (ConnectionError, TimeoutError) as e:
            log.debug("tenants' changes: store unreachable (%s)", e)
        except Exception:
            log.exception("tenants' changes in the store could not be read")

    async def adopt_orphans(self) -> None:
        """Take over every running request whose router is gone."""
        router, store = self.router, self.router.records.store
        live = await store.live_routers()
        for rid in await store.active():
            if router.drives(rid) or rid in self._malformed:
                continue
            try:
                rec = await store.get(rid)
            except ValueError as e:  # one bad record must not stop every later adoption
                self._malformed.add(rid)
                log.error("skipping it for good: %s", e)
                continue
            if rec is None or rec.state.terminal or rec.owner in live:
                continue
            if not await store.claim(rid, rec.owner, router.id):
                continue
            log.warning(
                "request %s: its router %s is gone; %s adopts it (attempt %d on %s)",
                rid,
                rec.owner or "?",
                router.id,
                rec.attempt,
                rec.decode or "no worker",
            )
            router.adopt(rec)
