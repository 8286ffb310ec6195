"""The ranks of a tensor-parallel engine (`EngineConfig.tp` > 1).

Rank 0 is the engine's own process: it schedules, samples and holds every request's state.
Ranks 1.. are processes of their own, one per rank (a GPU each on CUDA), each with its part of
the model and of the KV cache (tensor_parallel.py). They run no scheduler: each step reaches
them from rank 0 as one message, the step's `SchedulerOutput`, and each runs the same step on
its part, joined by the model's collectives. The tokens rank 0 samples are broadcast back, so
that a step launched before the last one landed (overlap) reads them on every rank.

The ranks meet through a TCPStore that rank 0 hosts on loopback (they share a node), and
talk over:
- `control`, a gloo group, for the step messages; its timeout is long, because a follower
  waits in it for as long as the engine stays idle;
- the model's collectives (its all-reduces and all-gathers, and the sampled tokens): on the
  CPU a shared-memory segment (shm_collectives.py), whose waits watch the other ranks'
  processes; else a `data` group, NCCL on CUDA (gloo where shared memory cannot serve). Their
  timeout is `step_timeout_s`, after which a rank that hangs fails the step, and with it the
  engine (a worker's liveness checks then see it die).

A rank that dies is seen by the others' next collective; a follower whose rank 0 is gone
exits, whatever it is doing (tp_follower.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from workers.model.shm_collectives import (
    ShmCollectives,
    create_segment,
    shm_available,
    shm_bytes,
)
from workers.model.tensor_parallel import Collectives

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
CONTROL_TIMEOUT = datetime.timedelta(days=7)  # a follower waits this long for a step
LOAD_TIMEOUT_S = 900.0  # for every rank to load its part of the model
FRAME = 64 << 10  # bytes of a step message sent in its first broadcast


@dataclass(frozen=True)
class RankSettings:
    """What every rank is told when it starts: the engine config and where to meet."""

    config: object  # EngineConfig, resolved
    size: int
    port: int
    threads: int | None  # torch intra-op threads per rank on the CPU
    step_timeout_s: float
    shm: str | None  # the shared-memory segment for the CPU collectives
    parent: int  # rank 0's pid


def threads_per_rank(config, size: int) -> int | None:
    """CPU threads for each of `size` ranks: the config's, else this process's CPUs shared out."""
    if config.num_threads:
        return config.num_threads
    if not config.device.startswith("cpu"):
        return None
    return max(1, len(os.sched_getaffinity(0)) // size)


def rank_device(config, rank: int) -> torch.device:
    """Rank r's device: the CPU, or the r-th GPU counted from the config's."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class RankLink:
    """One rank's view of the groups: rank 0 sends, the others receive. `shm`: the path of
    the shared-memory segment for the model's collectives on the CPU (shm_collectives.py;
    None: over the data group); `peers_alive()` says whether the ranks this one waits for
    still run."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        step_s: float,
        shm: str | None = None,
        peers_alive=None,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.failed: str | None = None  # rank 0: why the ranks are out of step, once they are
        self.on_failure = None  # rank 0: called once, when they fall out of step
        self.control = _gloo(dist.PrefixStore("control/", store), rank, size, CONTROL_TIMEOUT)
        self._frame = torch.zeros(FRAME, dtype=torch.uint8)  # each message's first broadcast
        if shm is not None:
            self.collectives = ShmCollectives(shm, rank, size, step_s, peers_alive)
            self.barrier()  # every rank has it open: rank 0 may unlink it
            if rank == 0:
                os.unlink(shm)
            return
        step = datetime.timedelta(seconds=step_s)
        data_store = dist.PrefixStore("data/", store)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = step
            data = dist.ProcessGroupNCCL(data_store, rank, size, opts)
        else:
            data = _gloo(data_store, rank, size, step)
        self.collectives = Collectives(data, size)

    def fail(self, why: str) -> None:
        """Rank 0: a step failed after it was sent, so the other ranks may be waiting in a
        collective this rank will never make: every later step is refused, and the ranks
        are stopped. An engine of tp > 1 does not outlive a failed step."""
        if self.failed is None:
            self.failed = why
            log.error("tp %d: a step failed part-way (%s); stopping the ranks", self.size, why)
            if self.on_failure is not None:
                self.on_failure()

    def check(self) -> None:
        """Rank 0: raises once the ranks are out of step."""
        if self.failed is not None:
            raise RuntimeError(
                f"tp {self.size} engine is down: a step failed part-way ({self.failed}); "
                "start a new engine"
            )

    def barrier(self) -> None:
        self.control.allreduce([torch.zeros(1)]).wait()

    def send(self, message) -> None:
        """Rank 0: one message to every other rank: one frame of FRAME bytes (its length
        first), and what does not fit in a second broadcast."""
        blob = pickle.dumps(message)
        frame = self._frame.numpy()
        frame[:8].view(np.int64)[0] = len(blob)
        head = min(len(blob), FRAME - 8)
        frame[8 : 8 + head] = np.frombuffer(blob, np.uint8, head)
        self.control.broadcast(self._frame, 0).wait()
        if head < len(blob):
            rest = np.frombuffer(blob, np.uint8, offset=head).copy()  # gloo writes to it
            self.control.broadcast(torch.from_numpy(rest), 0).wait()

    def receive(self):
        """Ranks 1..: the next message from rank 0 (waits for it)."""
        self.control.broadcast(self._frame, 0).wait()
        frame = self._frame.numpy()
        length = int(frame[:8].view(np.int64)[0])
        blob = frame[8 : 8 + min(length, FRAME - 8)].tobytes()
        if len(blob) < length:
            rest = torch.empty(length - len(blob), dtype=torch.uint8)
            self.control.broadcast(rest, 0).wait()
            blob += rest.numpy().tobytes()
        return pickle.loads(blob)

    def share_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids, on every rank (in place in `token_ids`, which the others
        allocate at the step's sampled row count)."""
        return self.collectives.broadcast_first(token_ids)


def _gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


class Followers:
    """Rank 0's handle on ranks 1..: their processes, started before rank 0 loads its own part,
    so that all load at once."""

    def __init__(self, config, step_timeout_s: float = 300.0) -> None:
        from kv_transfer.torch_dist import store_server

        size = config.tp
        self.store = store_server(HOST)
        self.store.set_timeout(datetime.timedelta(seconds=LOAD_TIMEOUT_S))
        shm = _segment(config, size, self.store.port)
        self.settings = RankSettings(
            config,
            size,
            self.store.port,
            threads_per_rank(config, size),
            step_timeout_s,
            shm,
            os.getpid(),
        )
        self.procs: list[subprocess.Popen] = []
        self.link: RankLink | None = None
        # Called with (why, a rank died) once the ranks are lost (a worker ends itself:
        # worker_common.py).
        self.on_dead: Callable[[str, bool], None] | None = None
        # Unless closed first, the ranks are stopped at once when this goes (or at exit), and
        # the segment goes with them.
        self._finalizer = weakref.finalize(self, _stop, self.procs, 0.0, shm)
        # Each rank a fresh interpreter running tp_follower: nothing forked from a process
        # that holds threads, and nothing of the caller's __main__ run again.
        blob = pickle.dumps(self.settings).hex().encode() + b"\n"
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        try:
            for r in range(1, size):
                cmd = [sys.executable, "-m", "workers.engine.tp_follower", str(r)]
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env))
                self.procs[-1].stdin.write(blob)
                self.procs[-1].stdin.close()
            # Every rank watches every other: a follower waiting on a dead sibling stops too.
            self.store.set("pids", ",".join(map(str, [os.getpid(), *self.pids])))
        except BaseException:
            self._finalizer()
            raise
        log.info("tp %d: started ranks 1..%d, pids %s", size, size - 1, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def connect(self, device: torch.device) -> RankLink:
        """Once rank 0's part is loaded: wait for every rank's (a rank that fails to load,
        or exits, is named with its error), then form the groups."""
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        for rank, proc in enumerate(self.procs, start=1):
            while not self.store.check([f"ready/{rank}"]):
                if self.store.check([f"failed/{rank}"]):
                    why = self.store.get(f"failed/{rank}").decode()
                    self.close()
                    raise RuntimeError(f"tp rank {rank} failed to load its part: {why}")
                if proc.poll() is not None:
                    self.close()
                    raise RuntimeError(
                        f"tp rank {rank} (pid {proc.pid}) exited with code {proc.returncode} "
                        "while loading its part of the model"
                    )
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"tp rank {rank} did not load in {LOAD_TIMEOUT_S:.0f} s")
                try:
                    proc.wait(0.05)  # waits on the process, woken early if it exits
                except subprocess.TimeoutExpired:
                    pass
        settings = self.settings
        self.link = RankLink(
            self.store,
            0,
            settings.size,
            device,
            settings.step_timeout_s,
            settings.shm,
            lambda: all(self.alive()),
        )
        # A step that fails part-way leaves the ranks out of step: they are stopped at once.
        self.link.on_failure = self._lost
        return self.link

    def _lost(self) -> None:
        """The ranks fell out of step: a rank died (every request it was running is lost
        with it), or a step failed with all of them alive (the engine fails that step's
        requests, as under tp 1, and `on_dead` is told it need not act before they are
        answered)."""
        died = not all(self.alive())
        self.kill()
        if self.on_dead is not None:
            why = f"tp ranks out of step: {self.link.failed if self.link else ''}"
            self.on_dead(why, died)

    def kill(self) -> None:
        """Stop every rank now, without asking."""
        _stop(self.procs, 0.0, self.settings.shm)

    def alive(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def close(self) -> None:
        """Ask the ranks to stop, and stop those that do not within a few seconds."""
        grace = 0.0
        if self.link is not None and all(self.alive()):
            try:
                self.link.send(("close",))
                grace = 5.0
            except Exception as e:  # a rank already gone: stopped below
                log.debug("tp close message not delivered: %s", e)
        self.link = None
        _stop(self.procs, grace, self.settings.shm)
        self._finalizer()


def _segment(config, size: int, port: int) -> str | None:
    """The shared-memory segment for CPU ranks' collectives, reserved whole now (a tmpfs
    too small to hold it would kill a rank with SIGBUS at its first large step); None where
    the ranks use gloo instead, and why is logged."""
    if config.device != "cpu":
        return None
    why = shm_available()
    if why is None:
        try:
            return create_segment(f"tandem-tp-{os.getpid()}-{port}", size)
        except OSError as e:
            why = f"/dev/shm cannot hold {shm_bytes(size) >> 20} MiB: {e}"
    log.warning("tp %d: collectives over gloo, about 1 ms each (%s)", size, why)
    return None


def _stop(procs, grace_s: float, shm: str | None) -> None:
    """Each rank gone: given `grace_s` to exit on its own, then terminated, then killed; the
    segment unlinked if no rank got as far as unlinking it."""
    if shm is not None and os.path.exists(shm):
        os.unlink(shm)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
