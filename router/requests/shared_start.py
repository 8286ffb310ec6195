"""The first attempt of an n > 1 request, shared by its choices' drivers (router/requests/
driver.py): one reservation, one prefill that draws every choice's first token, one KV push,
and the decode worker forks the choices on the prompt's blocks."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from router.requests.driver import RequestDriver, SiblingFailed
from router.requests.driving import DriverEnv
from router.requests.stream import RequestStream
from workers.messages import PrefillJob, RequestSpec, first_event


class SharedStart:
    """The first attempt of an n > 1 request, shared by its choices' drivers: a reservation
    on one decode worker and a prefill on one prefill worker, under the request's own id; the
    prefill draws every choice's first token and pushes the KV once; the decode worker forks
    the choices. The placement runs once, in a task of its own, whichever driver asks first,
    so that one choice's cancellation does not stop the others'."""

    def __init__(
        self, env: DriverEnv, spec: RequestSpec, streams: list[RequestStream], tenant: str = ""
    ) -> None:
        """`streams`: one per choice, by index; each choice's driver is made here."""
        self.spec = spec
        self.attempt = spec.attempt
        n = len(streams)
        # Places the request; follows nothing.
        self.lead = RequestDriver(env, spec, None, tenant, n)
        self.local = self.lead.runs_whole(spec)  # prefilled on its decode worker
        self.drivers = [  # by choice index
            RequestDriver(env, spec.choice(i), stream, tenant, n, shared=self)
            for i, stream in enumerate(streams)
        ]
        self.task: asyncio.Task | None = None

    async def begin(self) -> None:
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._place())
        await asyncio.shield(self.task)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def failed(self, driver: RequestDriver, reason: str) -> None:
        """One choice's attempt failed before the KV landed: so did every other's."""
        for d in self.drivers:
            if d is not driver:
                d.deliver(SiblingFailed(self.attempt, reason))

    async def _place(self) -> None:
        lead = self.lead
        spec = replace(self.spec, router_id=lead.env.router_id)
        try:
            if self.local:
                d = await lead.place_whole(spec)
                self._began("", d.name)
                return
            d = await lead.reserve_decode(spec)
            for driver in self.drivers:  # its death is news to them from now on
                driver.placed(None, d.name)
            p = await lead.pick_prefill()
            lead.placed(p.name, d.name)
            self._began(p.name, d.name)
            r = await lead.prefill_on(p, PrefillJob(spec, d.endpoint))
            for driver, first in zip(self.drivers, r.first):
                driver.put(first_event(spec, first, driver.stream.index))
        except BaseException:  # failed or cancelled: free what the request holds
            if not lead.env.leaving():  # (a router leaving hands its requests over)
                await lead.clean_up()
            raise

    def _began(self, prefill: str, decode: str) -> None:
        for d in self.drivers:
            d.placed(prefill or None, decode)
            d.began(self.attempt, prefill, decode)
