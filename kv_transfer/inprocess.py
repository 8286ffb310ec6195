"""An in-process channel pair (two queues): for unit tests and warm-up, no network involved.

On a GPU the two ends run on streams of their own: a sent copy carries the event of its
making, which the receiving end's stream waits on before reading it."""

from __future__ import annotations

import queue

import torch

from kv_transfer.channel import KVChannel
from kv_transfer.protocol import TransferError
from kv_transfer.streams import device_streams


class InProcessChannel(KVChannel):
    def __init__(self, outbox: queue.Queue, inbox: queue.Queue) -> None:
        self._out, self._in = outbox, inbox
        self._closed = False

    @classmethod
    def pair(cls) -> tuple[InProcessChannel, InProcessChannel]:
        a, b = queue.Queue(), queue.Queue()
        return cls(a, b), cls(b, a)

    def post_send(self, tensor):
        if self._closed:
            raise TransferError("channel closed")
        copy = tensor.detach().clone()
        self._out.put((copy, device_streams(copy.device).record()))
        return None

    def post_recv(self, tensor):
        if self._closed:
            raise TransferError("channel closed")
        return tensor  # filled in order by wait()

    def wait(self, handle, timeout_s):
        if handle is None:
            return
        try:
            got, made = self._in.get(timeout=timeout_s)
        except queue.Empty:
            self._closed = True
            raise TransferError(f"no data from the peer within {timeout_s:.1f} s") from None
        if got.shape != handle.shape or got.dtype != handle.dtype:
            self._closed = True
            raise TransferError(
                f"peer sent {tuple(got.shape)} {got.dtype}, "
                f"expected {tuple(handle.shape)} {handle.dtype}"
            )
        streams = device_streams(handle.device)
        streams.wait(made)
        with torch.no_grad():
            handle.copy_(got)
        streams.keep(got)  # made on the sender's stream, read on ours

    def close(self):
        self._closed = True
