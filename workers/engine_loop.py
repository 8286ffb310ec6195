"""The one thread that drives a worker's engine.

    build the engine -> (started) loop: apply queued commands -> step -> hand the step's
    outputs on -> (idle: wait for work)

Actor methods run on other threads; they never touch the engine directly but submit closures
with `call()`, which run between steps and return through a Future. The loop keeps a snapshot
of the engine's stats, so a status call never waits for a step to end.

The engine is built on the loop thread too, so that one thread runs all of its tensor work.
With OpenMP, every thread that runs a parallel op keeps a team of its own; once a process has
more such threads than it has cores, libgomp stops spinning between parallel regions and each
of the ~300 ops in a step waits on a futex. Built by the actor's constructor thread and
stepped here, a batch-8 decode step through the serving path took 37 ms on two cores; built
here, 23 (16 offline).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from workers.engine.engine import LLMEngine
from workers.engine.outputs import EngineStats, RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, build: Callable[[], LLMEngine], name: str = "engine-loop") -> None:
        """Build the engine with `build()` on a new loop thread and wait for it (its error,
        if it fails, is raised here). The loop steps once `start` gives it an output handler."""
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None
        self._commands: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._go = threading.Event()
        self.steps = 0
        self._step_started: float | None = None
        built: Future = Future()
        self._thread = threading.Thread(target=self._main, args=(build, built), name=name)
        self._thread.daemon = True
        self._thread.start()
        self.engine: LLMEngine = built.result()  # loading may compile kernels: no limit
        self.stats: EngineStats = self.engine.stats()

    def start(self, on_outputs: Callable[[list[RequestOutput]], None]) -> EngineLoop:
        self.on_outputs = on_outputs
        self._go.set()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._go.set()
        self._commands.put(None)
        self._thread.join(timeout_s)

    @property
    def stalled_s(self) -> float:
        """How long the step now running has taken (0 between steps): a hung step shows here."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def call(self, fn: Callable, *args, **kwargs) -> Future:
        """Run fn(*args, **kwargs) on the loop thread between two steps."""
        fut: Future = Future()
        if self._stopped.is_set():
            fut.set_exception(RuntimeError("engine loop is stopped"))
            return fut
        self._commands.put((fut, fn, args, kwargs))
        return fut

    def _main(self, build: Callable[[], LLMEngine], built: Future) -> None:
        try:
            built.set_result(build())
        except BaseException as e:  # noqa: BLE001 - raised by the constructor's thread
            built.set_exception(e)
            return
        self._go.wait()
        if not self._stopped.is_set():  # stopped before it started: its owner failed
            self._run()

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._apply(block=not self.engine.has_unfinished())
            self.stats = self.engine.stats()
            if self._stopped.is_set() or not self.engine.has_unfinished():
                continue
            self._step_started = time.monotonic()
            outputs = self.engine.step()
            self._step_started = None
            self.steps += 1
            self.stats = self.engine.stats()
            if outputs:
                try:
                    self.on_outputs(outputs)
                except Exception:  # a broken consumer must not stop generation
                    log.exception("output handler failed")

    def _apply(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fut, fn, args, kwargs = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
