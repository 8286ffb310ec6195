"""A channel is one ordered, two-way link between a prefill worker (rank 0) and a decode worker
(rank 1). The handoff protocol (send_kv / recv_kv) runs over any channel.

Invariants: every call takes a timeout and raises TransferError when it passes; after any
error the channel is broken for good (close it, and open a new one for the next transfer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.protocol import (
    ACK_OK,
    ACK_REFUSED,
    TRAILER_ABORTED,
    TRAILER_MAX_BYTES,
    TRAILER_OK,
    TransferAborted,
    TransferDescriptor,
    TransferError,
    empty_header,
    trailer,
)


class KVChannel(ABC):
    device = torch.device("cpu")  # where the protocol's own small tensors must live (NCCL: GPU)

    @abstractmethod
    def post_send(self, tensor: torch.Tensor) -> object:
        """Start sending one tensor; returns a handle for `wait`. Sends arrive in post order."""

    @abstractmethod
    def post_recv(self, tensor: torch.Tensor) -> object:
        """Start filling one preallocated tensor from the peer; returns a handle for `wait`."""

    @abstractmethod
    def wait(self, handle: object, timeout_s: float) -> None:
        """Block until a posted operation completes; TransferError past the timeout."""

    @abstractmethod
    def close(self) -> None:
        """Release the link; safe to call twice and after errors."""

    def send(self, tensors: list[torch.Tensor], timeout_s: float) -> None:
        for h in [self.post_send(t) for t in tensors]:
            self.wait(h, timeout_s)

    def recv(self, tensors: list[torch.Tensor], timeout_s: float) -> None:
        for h in [self.post_recv(t) for t in tensors]:
            self.wait(h, timeout_s)


class StagingBuffers:
    """Reusable receive buffers, one per layer, grown on demand: allocating (and faulting in)
    fresh memory for every transfer costs more than the transfer itself."""

    def __init__(self) -> None:
        self._flat: list[torch.Tensor] = []

    def get(self, layout: KVLayout, num_blocks: int, device) -> list[torch.Tensor]:
        shape = layout.layer_shape(num_blocks)
        numel = 1
        for d in shape:
            numel *= d
        if (
            len(self._flat) != layout.num_layers
            or self._flat[0].numel() < numel
            or self._flat[0].dtype != layout.torch_dtype
        ):
            self._flat = [
                torch.empty(numel, dtype=layout.torch_dtype, device=device)
                for _ in range(layout.num_layers)
            ]
        return [f[:numel].view(shape) for f in self._flat]


def send_kv(
    channel: KVChannel,
    desc: TransferDescriptor,
    layers,
    timeout_s: float,
    verdict: Callable[[], tuple[bool, bytes]] | None = None,
) -> None:
    """Sender side: header, per-layer payload, trailer, then wait for the receiver's ack.

    `layers` may be a lazy iterable: each layer is posted as soon as it is produced, so
    producing layer i+1 (computing it, gathering it out of the cache) overlaps with sending
    layer i. `verdict()`, called once every layer is posted, gives the trailer: (True,
    payload) to deliver the payload with the KV, or (False, reason) to abort the transfer
    (the receiver drops it; TransferAborted is raised here too). Without it: (True, b"")."""
    dev = channel.device
    channel.send([desc.encode().to(dev)], timeout_s)
    handles = [channel.post_send(t.contiguous()) for t in layers]
    if len(handles) != desc.layout.num_layers:
        raise ValueError(f"{len(handles)} layers given, layout has {desc.layout.num_layers}")
    ok, payload = verdict() if verdict is not None else (True, b"")
    for h in handles:
        channel.wait(h, timeout_s)
    channel.send([t.to(dev) for t in trailer(ok, payload)], timeout_s)
    ack = torch.zeros(1, dtype=torch.int64, device=dev)
    channel.recv([ack], timeout_s)
    if not ok:
        reason = payload.decode(errors="replace")
        raise TransferAborted(f"the KV of {desc.request_id} was aborted: {reason}")
    if ack.item() != ACK_OK:
        raise TransferError(f"receiver refused the KV of {desc.request_id} (status {ack.item()})")


def recv_kv(
    channel: KVChannel,
    layout: KVLayout,
    timeout_s: float,
    device: torch.device | str = "cpu",
    accept=None,
    staging: StagingBuffers | None = None,
    on_layer=None,
) -> tuple[TransferDescriptor, bytes]:
    """Receiver side: read the header, check it against our layout (and `accept(desc)`, which
    may refuse a request it does not expect), read the layers and the trailer, ack. Returns
    the header and the trailer's payload; TransferAborted if the sender aborted.

    With `on_layer(i, tensor)`, each layer is handed over as soon as it lands (to be copied
    into the reserved blocks) while later layers are still arriving. With `staging`, the
    layers are views of reused buffers, valid only until the next transfer."""
    header = empty_header().to(device)
    channel.recv([header], timeout_s)
    desc = TransferDescriptor.decode(header.cpu(), layout)
    if staging is not None:
        layers = staging.get(layout, desc.num_blocks, device)
    else:
        layers = [
            torch.empty(
                layout.layer_shape(desc.num_blocks), dtype=layout.torch_dtype, device=device
            )
            for _ in range(layout.num_layers)
        ]
    ok = accept is None or accept(desc)
    handles = [channel.post_recv(t) for t in layers]
    for i, h in enumerate(handles):
        channel.wait(h, timeout_s)
        if ok and on_layer is not None:
            on_layer(i, layers[i])
    head = torch.zeros(2, dtype=torch.int64, device=device)
    channel.recv([head], timeout_s)
    status, size = head.tolist()
    if status not in (TRAILER_OK, TRAILER_ABORTED) or not 0 <= size <= TRAILER_MAX_BYTES:
        raise TransferError(f"bad KV trailer for {desc.request_id}: status {status}, {size} B")
    body = torch.zeros(size, dtype=torch.uint8, device=device)
    if size:
        channel.recv([body], timeout_s)
    payload = body.cpu().numpy().tobytes()
    channel.send(
        [torch.tensor([ACK_OK if ok else ACK_REFUSED], dtype=torch.int64, device=device)], timeout_s
    )
    if status == TRAILER_ABORTED:
        reason = payload.decode(errors="replace")
        raise TransferAborted(f"the sender aborted the KV of {desc.request_id}: {reason}")
    if not ok:
        raise TransferError(f"refused KV for {desc.request_id}: no reservation matches it")
    return desc, payload
