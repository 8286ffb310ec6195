"""The torch.distributed channel: a two-rank process group per prefill-decode pair, gloo for
CPU tensors and NCCL for CUDA tensors, formed through a TCPStore rendezvous.

There is no global init_process_group: pools change size, so each pair builds its own group
when it first meets. The decode worker hosts one TCPStore; each pair, and each rebuild of it,
takes a fresh key prefix (`pair/<prefill>/<generation>`), so a rebuilt group never meets a
stale one. Every rendezvous, send and recv has a timeout; a group that failed once is shut
down and replaced by the next generation.

NCCL, made to fail like gloo does, in the caller and never by killing the process:
- the communicator is created in the handshake, not at the first transfer: both ranks check
  in through the store, then exchange one element, each step within the timeout (so a
  handshake that fails late takes up to about three timeouts); init is
  non-blocking (`config.blocking = 0`), so a rank whose peer never arrives gives up at
  TORCH_NCCL_NONBLOCKING_TIMEOUT instead of waiting inside NCCL for ever;
- a wait polls its operation's completion (a CUDA event query, never a block) against its
  deadline, timeout_s from when it is waited for, and raises at the deadline. It never
  aborts inline: torch's own timed wait notices the timeout in time, then aborts the
  communicator in the caller, and ncclCommAbort waits for the streams, which a long kernel
  ahead of the operation may hold for seconds (NVIDIA/nccl#829: a 2 s wait raised at 10 s).
  The abort runs on a reaper, a thread of its own (`reap`), never on the engine loop or an
  RPC thread, and no probe of the group runs beside it (a probe keeps the GIL while it waits
  for the communicator's lock); a quarantine (`settle`) waits for it before the buffers may
  be reused.
  Blocking wait stays on, so that torch's watchdog only marks a late operation failed and
  never tears the process down; error handling 2 (abort the communicator, keep the
  process), with the heartbeat monitor and the dump-then-exit path off, stands behind it;
- NCCL counts an operation's timeout from when it was posted, gloo from when it is waited
  for. A receiver posts every layer as soon as the header is in, then waits for each as the
  sender's model computes it, so each wait here is given the time since its post on top:
  timeout_s always means "this long with nothing arriving", as with gloo;
- the group's own timeout (the watchdog's, also counted from the post) is only a backstop,
  past the longest a transfer may take;
- torch >= 2.6: before it, `Work.wait(timeout)` ignored the timeout.
Every operation runs on the pair's own CUDA stream (kv_transfer/streams.py).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from kv_transfer.channel import KVChannel
from kv_transfer.layout import as_bytes
from kv_transfer.protocol import TransferError
from kv_transfer.streams import device_streams

log = logging.getLogger(__name__)

# Read by torch when a process group is built (TORCH_NCCL_NONBLOCKING_TIMEOUT when the first
# communicator is), so set before the first NCCL group of the process.
NCCL_ENV = {
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
NCCL_MIN_TORCH = (2, 6)


def nccl_environment(timeout_s: float) -> dict[str, str]:
    """The environment an NCCL pair group needs, for a worker whose waits last timeout_s."""
    return {**NCCL_ENV, "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, round(timeout_s)))}


TRANSFER_LIMIT_S = 3600.0  # no transfer, prefill of its prompt included, takes longer
# A wait polls its operation this often at first, backing off to the most: a layer lands in
# well under a millisecond on NVLink, and an idle wait must cost the host next to nothing.
POLL_FIRST_S, POLL_MOST_S = 20e-6, 2e-3


def completed_by(probe, deadline: float, clock=None, sleep=None) -> bool:
    """Whether `probe()` (an operation's completion, asked without blocking) is true by
    `deadline` (on `clock`, time.monotonic by default); False the moment the deadline
    passes. `probe` may raise, which ends the wait."""
    clock = clock or time.monotonic
    pause = POLL_FIRST_S
    while not probe():
        left = deadline - clock()
        if left <= 0:
            return False
        (sleep or time.sleep)(min(pause, left))
        pause = min(2 * pause, POLL_MOST_S)
    return True


# Aborts still running on reapers. A process that exits while a daemon thread is inside the
# abort's or the group's destructor's C++ frames dies with SIGABRT ("terminate called without
# an active exception": the thread is unwound when it asks for the GIL back), so exit waits
# for them, up to a bound.
_REAPING: set[threading.Event] = set()
_REAPING_LOCK = threading.Lock()
EXIT_WAIT_S = 10.0


def reap(held: list, guard: threading.Lock, name: str) -> threading.Event:
    """Abort the group in `held` (a list with its only reference) on a thread of its own,
    holding `guard` (no probe of the group runs beside the abort); the event is set once the
    abort has returned or raised and the reaper has dropped the group (gloo's destructor joins
    its threads, so it runs here too). An abort may wait for the device's streams
    (ncclCommAbort does), so nobody who must keep time makes one, and one that hangs holds up
    no other pair's."""
    done = threading.Event()
    with _REAPING_LOCK:
        _REAPING.add(done)

    def run() -> None:
        try:
            with guard:
                held[0].abort()
        except Exception:  # the group is being dropped either way
            log.debug("abort of pair group %s raised", name, exc_info=True)
        finally:
            held.clear()
            with _REAPING_LOCK:
                _REAPING.discard(done)
            done.set()

    threading.Thread(target=run, name=f"kv-reaper {name}", daemon=True).start()
    return done


def wait_for_reapers(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Whether every abort on a reaper returned within timeout_s; run at exit."""
    deadline = time.monotonic() + timeout_s
    with _REAPING_LOCK:
        pending = list(_REAPING)
    for done in pending:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            log.warning("exiting with %d pair group aborts still running", len(_REAPING))
            return False
    return True


atexit.register(wait_for_reapers)


def group_timeout(timeout_s: float) -> datetime.timedelta:
    """The process group's own timeout, counted from each operation's post: past the longest
    transfer, so that only a wait's timeout ever fires."""
    return datetime.timedelta(seconds=TRANSFER_LIMIT_S + 2 * timeout_s)


def version_before(version: str, least: tuple[int, int]) -> bool:
    """Whether a version string ("2.13.0+cpu") is older than major.minor `least`."""
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int(p) for p in parts) < least


def store_server(host: str) -> dist.TCPStore:
    """The decode worker's rendezvous store, on an ephemeral port (read `.port`), listening
    on `host` alone: a TCPStore of its own binds every interface, where anyone who reaches it
    could join a pair and write into reserved blocks. So the socket is bound here and handed
    over (the store owns it from then on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
        master_listen_fd=sock.detach(),
    )


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
    except Exception as e:
        raise TransferError(f"cannot reach the KV rendezvous store at {host}:{port}: {e}") from e


class PairGroup(KVChannel):
    """Rank 0 is the prefill worker, rank 1 the decode worker."""

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        device: torch.device,
        bind_host: str,
        timeout_s: float,
        *,
        group=None,
        backend: str | None = None,
    ) -> None:
        """Forms the pair through `store`; or, given a `group` formed elsewhere (see `over`),
        takes it as it is."""
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        self.prefix, self.rank, self.device, self.backend = prefix, rank, device, backend
        self.peer = 1 - rank
        self._closed = False
        self._aborted: threading.Event | None = None  # set once the reaper's abort returned
        # Held while a probe asks NCCL about an operation, and by the reaper for the abort:
        # is_completed() keeps the GIL while it waits for the communicator's lock, which an
        # abort holds for as long as it runs; waiting here instead, a thread lets go of it.
        self._guard = threading.Lock()
        self.pg = group
        self._posted: dict[int, float] = {}  # NCCL: id(work) -> when it was posted
        self.streams = device_streams(device)
        self.streams.bind()
        self.stream = self.streams.new_stream()
        if group is not None:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        pstore = dist.PrefixStore(prefix, store)
        try:
            if device.type == "cuda":
                self.pg = _nccl_group(pstore, rank, timeout_s)
                self._connect(pstore, timeout_s)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
                self.pg = dist.ProcessGroupGloo(pstore, rank, 2, opts)
        except Exception as e:
            self.close()
            raise TransferError(
                f"pair group {prefix} did not form within {timeout_s:.0f} s: {e}"
            ) from e

    @classmethod
    def over(cls, pg, prefix: str, rank: int, device: torch.device, backend: str) -> PairGroup:
        """A pair over a group formed elsewhere: gpu_check's one-rank NCCL group, whose
        stalled operation goes through this class's own wait; tests' counting fakes."""
        return cls(None, prefix, rank, device, "", 0.0, group=pg, backend=backend)

    def _connect(self, store: dist.Store, timeout_s: float) -> None:
        """NCCL's communicator, made now rather than by the first transfer: both ranks check
        in (a peer that never comes is a timeout here, not a hang in NCCL's init), then one
        element goes from rank 0 to rank 1, which creates the communicator sends use."""
        store.set(f"joined/{self.rank}", b"1")
        store.wait([f"joined/{self.peer}"], datetime.timedelta(seconds=timeout_s))
        with self.streams.using(self.stream):
            probe = torch.zeros(1, device=self.device)
            # Called inline: a bound method kept in this frame (held by a failed wait's
            # traceback) would keep the group alive past the reaper.
            if self.rank == 0:
                work = self.pg.send([probe], self.peer, 0)
            else:
                work = self.pg.recv([probe], self.peer, 0)
            self.wait(work, timeout_s)

    def post_send(self, tensor):
        wire = as_bytes(tensor)
        return self._post(lambda: self.pg.send([wire], self.peer, 0), "send")

    def post_recv(self, tensor):
        wire = as_bytes(tensor)
        return self._post(lambda: self.pg.recv([wire], self.peer, 0), "recv")

    def wait(self, handle, timeout_s):
        posted = self._posted.pop(id(handle), None)
        try:
            if self.backend == "nccl":
                # Polled against its deadline, timeout_s from now (not from the post: see the
                # module's doc). An operation that failed raises here, never in wait(), which
                # would abort the communicator inline; a complete one's wait returns at once
                # (its own timeout counts from the post: the time since goes on top).
                if not completed_by(lambda: self._probe(handle), time.monotonic() + timeout_s):
                    raise TimeoutError(f"did not complete within {timeout_s:g} s")
                if posted is not None:
                    timeout_s += time.monotonic() - posted
            if not handle.wait(datetime.timedelta(seconds=timeout_s)):
                raise TimeoutError("did not complete")
            if self._closed:  # closed meanwhile: an aborted operation may report success
                raise TransferError("the pair was closed while it ran")
        except Exception as e:
            self.close()
            raise TransferError(f"transfer on pair {self.prefix} failed: {e}") from e

    def _probe(self, handle) -> bool:
        """Whether an NCCL operation is complete (raises its error, or TransferError once the
        pair is closed); False while an abort holds the group."""
        if self._closed:
            raise TransferError("the pair was closed while it ran")
        if not self._guard.acquire(timeout=POLL_MOST_S):
            return False
        try:
            if self._closed:
                raise TransferError("the pair was closed while it ran")
            if not handle.is_completed():
                return False
            error = handle.exception()
            if error is not None:
                raise TransferError(f"the operation failed: {error}")
            return True
        finally:
            self._guard.release()

    def settle(self, handles, timeout_s):
        """Closing a gloo group does not cancel its posted receives: a peer still sending
        completes them. Each is waited for here: it lands, or its wait fails, and a failed
        wait (a timeout included) breaks the connection, after which nothing lands at all.
        NCCL's abort ends them; what the pair's stream still holds must run out too.
        TransferError if it does not within timeout_s (the buffers may still be written). A
        closed pair's abort, on the reaper, must have returned first."""
        if self._aborted is not None and not self._aborted.wait(timeout_s):
            raise TransferError(f"pair {self.prefix}: its abort still runs {timeout_s:.0f} s on")
        self.streams.bind()
        with self.streams.using(self.stream):  # a wait orders the current stream after it
            for h in handles:
                self._posted.pop(id(h), None)
                try:
                    h.wait(datetime.timedelta(seconds=timeout_s))
                except Exception:  # over: the connection is gone
                    log.debug("pair %s: an abandoned receive ended", self.prefix, exc_info=True)
        if not self.streams.drain(self.stream, timeout_s):
            raise TransferError(f"pair {self.prefix}: its stream still runs {timeout_s:.0f} s on")

    def _post(self, fn, what: str):
        if self._closed:
            raise TransferError(f"pair group {self.prefix} is closed")
        try:
            work = fn()
        except Exception as e:
            self.close()
            raise TransferError(f"{what} on pair {self.prefix} failed: {e}") from e
        if self.backend == "nccl":
            self._posted[id(work)] = time.monotonic()
        return work

    def close(self):
        """Never blocks: the abort (NCCL: it ends operations in flight; never shutdown(),
        which waits for them) runs on the reaper. Receives already posted may still
        complete: see settle."""
        if self._closed:  # never waits behind an abort that holds the guard
            return
        with self._guard:  # no probe is asking NCCL now, and none will once closed
            if self._closed:
                return
            self._closed = True
            held, self.pg = [self.pg], None  # the reaper drops the last reference
            if held[0] is not None and hasattr(held[0], "abort"):
                self._aborted = reap(held, self._guard, self.prefix)


def _nccl_group(store: dist.Store, rank: int, timeout_s: float):
    if not dist.is_nccl_available():
        raise TransferError("CUDA KV transfer needs NCCL, which this torch build lacks")
    if version_before(torch.__version__, NCCL_MIN_TORCH):
        raise TransferError(
            f"NCCL KV transfer needs torch >= 2.6 (this is {torch.__version__}): before it, "
            "a wait's timeout is ignored and a dead peer hangs the worker"
        )
    os.environ.update(nccl_environment(timeout_s))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = group_timeout(timeout_s)
    opts.config.blocking = 0  # non-blocking init: given up on at the timeout above
    return dist.ProcessGroupNCCL(store, rank, 2, opts)
