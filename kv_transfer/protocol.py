"""The handoff protocol, independent of transport.

One transfer moves one request's prompt KV from a prefill worker (sender) to the blocks a
decode worker (receiver) reserved for it. Before the first transfer on a pair, the two sides
compare `KVLayout`s (the handshake) and refuse to move any bytes on a mismatch. Then, per
request, in this order:

1. header: a fixed-size int64 tensor: magic, version, the layout, block count, prompt length,
   the first sampled token, and the request id (UTF-8, zero-padded);
2. payload: one tensor per layer, `[2, num_blocks, block_size, kv_heads, head_dim]` (K, V);
3. ack: the receiver answers one int64 status, so the sender knows the blocks landed.

The first token travels with the KV, so the decode worker can start generating at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.layout import DTYPE_CODES, KVLayout, LayoutMismatch

MAGIC = 0x54414E44  # "TAND"
VERSION = 1
_ID_BYTES = 64
_FIXED = 11
HEADER_LEN = _FIXED + _ID_BYTES // 8
ACK_OK = 0
ACK_REFUSED = 1


class TransferError(RuntimeError):
    """A transfer failed or timed out; the pair that carried it must be rebuilt."""


@dataclass(frozen=True)
class TransferDescriptor:
    request_id: str
    layout: KVLayout
    num_blocks: int
    num_tokens: int  # prompt tokens whose KV is carried
    first_token: int

    def __post_init__(self) -> None:
        if len(self.request_id.encode()) > _ID_BYTES:
            raise ValueError(f"request id longer than {_ID_BYTES} bytes: {self.request_id!r}")
        need = -(-self.num_tokens // self.layout.block_size)
        if self.num_blocks != need:
            raise ValueError(f"{self.num_tokens} tokens need {need} blocks, not {self.num_blocks}")

    def encode(self) -> torch.Tensor:
        lay = self.layout
        fixed = [
            MAGIC,
            VERSION,
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.block_size,
            DTYPE_CODES[lay.dtype],
            self.num_blocks,
            self.num_tokens,
            self.first_token,
            0,
        ]
        rid = self.request_id.encode().ljust(_ID_BYTES, b"\0")
        packed = torch.frombuffer(bytearray(rid), dtype=torch.int64)
        return torch.cat([torch.tensor(fixed, dtype=torch.int64), packed])

    @classmethod
    def decode(cls, header: torch.Tensor, expected: KVLayout) -> TransferDescriptor:
        h = header.tolist()
        if h[0] != MAGIC or h[1] != VERSION:
            raise TransferError(f"not a Tandem KV header (magic {h[0]:#x}, version {h[1]})")
        codes = {v: k for k, v in DTYPE_CODES.items()}
        if h[6] not in codes:
            raise TransferError(f"unknown dtype code {h[6]} in KV header")
        layout = KVLayout(h[2], h[3], h[4], h[5], codes[h[6]])
        try:
            expected.check_compatible(layout)
        except LayoutMismatch as e:
            raise TransferError(str(e)) from e
        rid = header[_FIXED:].contiguous().numpy().tobytes().rstrip(b"\0").decode()
        return cls(rid, layout, h[7], h[8], h[9])


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)
