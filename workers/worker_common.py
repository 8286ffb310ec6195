"""What prefill and decode actors share: the engine and the loop thread that drives it,
identity, and the status every worker reports."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

from kv_transfer.streams import device_streams
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine_loop import EngineLoop
from workers.messages import DecodeEndpoint, Pool, WorkerInfo, WorkerStatus
from workers.metrics import WorkerMetrics

LOOP_WAIT_S = 60.0
DOOMED_S = 5.0  # tp > 1: the most a worker outlives its ranks while a step is answered


def node_address() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (tests): the host's own address
        return socket.gethostbyname(socket.gethostname())


class LivenessPort:
    """A listening socket that accepts and closes at once: while this process lives, a
    connection to it succeeds; once it is gone, the kernel refuses it."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="liveness", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed at shutdown
                return
            conn.close()


class WorkerBase:
    """A named worker around one engine, driven by one EngineLoop thread. Subclasses set up
    their own state, then call `start_loop` with their output handler."""

    pool: Pool
    endpoint: DecodeEndpoint | None = None  # where prefill workers send KV (decode workers)
    _doomed: str | None = None  # tp > 1: why the worker ends once this step is answered
    _doomed_at = 0.0

    def __init__(
        self,
        name: str,
        engine_config: EngineConfig,
        transfer_host: str | None,
        transfer_timeout_s: float,
    ) -> None:
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s {name}: %(message)s")
        self.name = name
        # Built on the loop thread, which runs all of its tensor work (engine_loop.py).
        self.loop = EngineLoop(lambda: LLMEngine(engine_config), name=f"{name}-loop")
        try:
            self.engine = self.loop.engine
            self.layout = self.engine.kv_layout
            self.device = self.engine.device
            self.streams = device_streams(self.device)  # for the loop thread's events
            self.transfer_host = transfer_host or node_address()
            self.transfer_timeout_s = transfer_timeout_s
            self.draining = False
            self.pid = os.getpid()
            self.node = node_address()
            self.liveness = LivenessPort(self.transfer_host)
            self.metrics = WorkerMetrics(self.pool.value, name)
            if self.engine.followers is not None:  # tp > 1: a lost rank is this worker's death
                self.engine.followers.on_dead = self._rank_lost
        except BaseException:
            self.loop.stop()  # its thread must not wait for a start that never comes
            raise

    # Calls that must answer whatever the worker's long calls (a prefill waiting for its first
    # token, a KV push, a relay poll) hold: the pool manager runs each kind on threads of its
    # own, so that 64 prefills in flight cannot hold up a status call and get a live worker
    # called dead. STATUS_CALLS answer from a snapshot at once; LOOP_CALLS wait for the next
    # step boundary, and so never stand in front of a status call either.
    STATUS_CALLS: tuple[str, ...] = ("status", "ping", "set_draining", "info")
    LOOP_CALLS: tuple[str, ...] = ("cancel", "phase")

    def on_loop(self, fn, *args):
        """Run fn(*args) on the engine loop between two steps and wait for it. A step may take
        seconds on a busy CPU; past LOOP_WAIT_S the loop is called stuck (TimeoutError)."""
        try:
            return self.loop.call(fn, *args).result(LOOP_WAIT_S)
        except FutureTimeout:
            raise TimeoutError(
                f"{self.name}'s engine loop did not answer within {LOOP_WAIT_S:.0f} s"
            ) from None

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            self.name,
            self.pool,
            self.pid,
            self.node,
            self.endpoint,
            self.transfer_host,
            self.liveness.port,
        )

    def start_loop(self, on_outputs) -> None:
        def handed_on(outputs) -> None:
            try:
                on_outputs(outputs)
            finally:
                if self._doomed is not None:  # tp > 1: a failed step's requests are answered
                    self._rank_lost(self._doomed)

        self.loop.start(handed_on)

    def _rank_lost(self, why: str, at_once: bool = True) -> None:
        """This worker's tp ranks are gone, or out of step: the worker goes too, so that the
        pool replaces it and its requests are replayed, as for any dead worker. At once where
        a rank died; after the failed step's outputs are handed on where a step failed with
        every rank alive, so that its own requests end with that step's error rather than
        being replayed into the next worker (a request that breaks a step would break them
        all)."""
        if not at_once:
            self._doomed, self._doomed_at = why, time.monotonic()
            return
        logging.getLogger(__name__).error("%s: %s; exiting", self.name, why)
        self.engine.followers.kill()
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(70)

    def status(self) -> WorkerStatus:
        """Answered from the loop's last snapshot: never waits for a step to end. Brings the
        worker's metrics up to date on the way. Under tp > 1, a rank found dead here ends the
        worker (an idle worker runs no collective that would find it)."""
        followers = self.engine.followers
        if followers is not None:
            if self._doomed is not None and time.monotonic() - self._doomed_at > DOOMED_S:
                self._rank_lost(self._doomed)  # a failed step that had nothing to answer
            if self._doomed is None and not all(followers.alive()):
                self._rank_lost(f"a tp rank exited (ranks {followers.pids}: {followers.alive()})")
        s = self.loop.stats
        self.metrics.observe(s)
        return WorkerStatus(
            name=self.name,
            pool=self.pool,
            pid=self.pid,
            node=self.node,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_free=s.kv_blocks_free,
            kv_blocks_reservable=s.kv_blocks_reservable,
            kv_bytes_per_token=s.kv_bytes_per_token,
            running=s.running,
            waiting=s.waiting,
            reserved=s.reserved,
            queued_prefill_tokens=self.queued_prefill_tokens(),
            draining=self.draining,
            steps=self.loop.steps,
            preemptions=s.preemptions,
            prefix_hit_blocks=s.prefix_hit_blocks,
            stalled_s=self.loop.stalled_s,
            rank_pids=tuple(followers.pids) if followers is not None else (),
        )

    def queued_prefill_tokens(self) -> int:
        return 0

    def set_draining(self, draining: bool) -> None:
        """A draining worker takes no new requests and finishes the ones it has."""
        self.draining = draining

    def ping(self) -> str:
        return self.name
