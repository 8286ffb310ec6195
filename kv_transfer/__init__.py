"""The KV handoff between a prefill and a decode worker: what a transfer carries, in what order,
and the transports that carry it (in-process for tests, torch.distributed for real use)."""

from kv_transfer.layout import KVLayout, LayoutMismatch
from kv_transfer.protocol import TransferDescriptor, TransferError

__all__ = ["KVLayout", "LayoutMismatch", "TransferDescriptor", "TransferError"]
