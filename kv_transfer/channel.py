"""A channel is one ordered, two-way link between a prefill worker (rank 0) and a decode worker
(rank 1). The handoff protocol (send_kv / recv_kv) runs over any channel.

Invariants: every call takes a timeout and raises TransferError when it passes; after any
error the channel is broken for good (close it, and open a new one for the next transfer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.protocol import (
    ACK_OK,
    ACK_REFUSED,
    TransferDescriptor,
    TransferError,
    empty_header,
)


class KVChannel(ABC):
    @abstractmethod
    def send(self, tensors: list[torch.Tensor], timeout_s: float) -> None:
        """Send tensors in order; returns once they have been handed to the peer."""

    @abstractmethod
    def recv(self, tensors: list[torch.Tensor], timeout_s: float) -> None:
        """Fill preallocated tensors, in order, from the peer."""

    @abstractmethod
    def close(self) -> None:
        """Release the link; safe to call twice and after errors."""


def send_kv(channel: KVChannel, desc: TransferDescriptor, layers: list[torch.Tensor],
            timeout_s: float) -> None:
    """Sender side: header, per-layer payload, then wait for the receiver's ack."""
    if len(layers) != desc.layout.num_layers:
        raise ValueError(f"{len(layers)} layers given, layout has {desc.layout.num_layers}")
    channel.send([desc.encode()], timeout_s)
    channel.send([t.contiguous() for t in layers], timeout_s)
    ack = torch.zeros(1, dtype=torch.int64)
    channel.recv([ack], timeout_s)
    if ack.item() != ACK_OK:
        raise TransferError(f"receiver refused the KV of {desc.request_id} (status {ack.item()})")


def recv_kv(channel: KVChannel, layout: KVLayout, timeout_s: float,
            device: torch.device | str = "cpu", accept=None) -> tuple[TransferDescriptor, list]:
    """Receiver side: read the header, check it against our layout (and `accept(desc)`, which
    may refuse a request it does not expect), read the layers, ack."""
    header = empty_header().to(device)
    channel.recv([header], timeout_s)
    desc = TransferDescriptor.decode(header.cpu(), layout)
    layers = [torch.empty(layout.layer_shape(desc.num_blocks), dtype=layout.torch_dtype,
                          device=device) for _ in range(layout.num_layers)]
    channel.recv(layers, timeout_s)
    ok = accept is None or accept(desc)
    channel.send([torch.tensor([ACK_OK if ok else ACK_REFUSED], dtype=torch.int64,
                               device=device)], timeout_s)
    if not ok:
        raise TransferError(f"refused KV for {desc.request_id}: no reservation matches it")
    return desc, layers
