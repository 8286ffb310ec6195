"""Where a KV transfer's GPU work runs: on a CUDA stream of its pair, never on the engine's.

An NCCL send or receive first waits for everything already queued on the calling thread's
current stream. Issued from the engine's stream, a decode step would queue behind a
receive still in flight, and a send would wait for every later layer the model has queued,
losing the per-layer overlap. So each pair has a stream of its own, and the two meet only at
events:
- a send of layer i waits for the event the model recorded once layer i wrote its KV;
- a receive into reserved blocks waits for the event recorded when they were reserved (the
  engine may still be reading them from the request that held them last);
- the engine waits for the event a receive records once every byte has landed, when it admits
  the request.

CUDA's current device is a per-thread setting, so every thread that touches CUDA binds it
first (`bind`). `StreamOps` is the interface; `CudaStreams` the real one; on the CPU every
call is a no-op (`NoStreams`). Tests record the calls with a fake of the same interface.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

import torch


class StreamOps:
    """No streams and no events: the CPU, where every operation completes in order."""

    def bind(self) -> None:
        """Make this thread's current CUDA device the transfer's."""

    def new_stream(self) -> object | None:
        """A stream of its own, for one pair."""
        return None

    def using(self, stream: object | None) -> AbstractContextManager:
        """Work queued inside runs on `stream` (a no-op for None)."""
        return nullcontext()

    def record(self) -> object | None:
        """An event marking what the current stream has queued so far."""
        return None

    def wait(self, event: object | None) -> None:
        """The current stream runs nothing more until `event` has happened (None: at once)."""

    def keep(self, tensor: torch.Tensor) -> None:
        """`tensor`, made on another stream, stays allocated until what the current stream
        has queued so far has run (the caching allocator otherwise reuses its memory on the
        stream that made it as soon as it is freed)."""

    def drain(self, stream: object | None, timeout_s: float) -> bool:
        """Wait up to timeout_s for everything queued on `stream` to run; whether it has."""
        return True


NoStreams = StreamOps


class CudaStreams(StreamOps):
    def __init__(self, device: torch.device) -> None:
        self.device = indexed(device)

    def bind(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def using(self, stream) -> AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def keep(self, tensor) -> None:
        tensor.record_stream(torch.cuda.current_stream(self.device))

    def drain(self, stream, timeout_s: float) -> bool:
        # Polled, not stream.synchronize(): a kernel that never ends (a dead NCCL peer's)
        # must not hang the caller.
        deadline = time.monotonic() + timeout_s
        while stream is not None and not stream.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True


def indexed(device: torch.device | str) -> torch.device:
    """`device` with its index: plain "cuda" means whichever GPU the calling thread has
    current, which `torch.cuda.set_device` refuses to take and which another thread may see
    differently; so it is pinned, once, to the GPU current here (under Ray, the one GPU a
    worker is given is index 0)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_streams(device: torch.device) -> StreamOps:
    return CudaStreams(device) if device.type == "cuda" else NoStreams()
