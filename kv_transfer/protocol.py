"""The handoff protocol, independent of transport.

One transfer moves one request's prompt KV from a prefill worker (sender) to the blocks a
decode worker (receiver) reserved for it. Before the first transfer on a pair, the two sides
compare `KVLayout`s (the handshake) and refuse to move any bytes on a mismatch. Then, per
request, in this order:

1. header: a fixed-size int64 tensor: magic, version, the layout, block count, prompt length,
   and the request id (UTF-8, zero-padded);
2. runs (sender to receiver), then placement (receiver to sender): each an int64 tensor of
   `num_blocks + 1`, a count and then that many run lengths in blocks: where that side's
   blocks for the request are consecutive in its cache. From the two, both sides cut the
   same segments (`plan_segments`), so that most segments lie within one run on both sides;
3. payload: for each layer, for each segment, its blocks, `layout.layer_shape(segment
   blocks)`: each block's K and V side by side, as the caches hold them. A segment that is one
   run on a side moves straight out of (or into) that side's cache; one that is not goes
   through a staging buffer there (a gather on the sender, a scatter on the receiver);
4. trailer: int64 `[status, n]`, then n bytes: the sender's verdict and an opaque payload
   (the workers put the first sampled tokens there). The layers may leave while the prefill
   is still computing later layers, before the first token exists: the trailer, sent last,
   carries what is known only at the end, or says the sender gave up (TRAILER_ABORTED, the
   payload then says why; the receiver drops what it got and the pair stays usable);
5. ack: the receiver answers one int64 status, so the sender knows the blocks landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.layout import DTYPE_CODES, KVLayout, LayoutMismatch

MAGIC = 0x54414E44  # "TAND"
VERSION = 4
# A request id as workers see it: with API keys, "<tenant>/<id>" (64 + 1 + 64 bytes), and
# "#<choice>" after it for n > 1.
_ID_BYTES = 160
_FIXED = 11
HEADER_LEN = _FIXED + _ID_BYTES // 8
ACK_OK = 0
ACK_REFUSED = 1
TRAILER_OK = 0
TRAILER_ABORTED = 1
TRAILER_MAX_BYTES = 1 << 20
# A piece shorter than this many blocks is merged with its short neighbours and staged: on
# gloo each message costs about 20 us, a memcpy of one block (a layer's K and V, 12 KB for
# SmolLM2 in bf16) about 2 us.
MIN_DIRECT_BLOCKS = 8
MAX_SEGMENTS = 16  # past this, the whole request is one staged segment


class TransferError(RuntimeError):
    """A transfer failed or timed out; the pair that carried it must be rebuilt."""


class TransferAborted(TransferError):
    """The sender gave up on a transfer it had begun (its prefill failed, or was cancelled),
    and said so in the trailer: nothing landed for good, and the pair is still in step."""


@dataclass(frozen=True)
class TransferDescriptor:
    request_id: str
    layout: KVLayout
    num_blocks: int
    num_tokens: int  # prompt tokens whose KV is carried

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
            0,  # reserved
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
        return cls(rid, layout, h[7], h[8])


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def trailer(ok: bool, payload: bytes) -> list[torch.Tensor]:
    """The trailer's tensors: `[status, n]`, then the n payload bytes if n > 0."""
    if len(payload) > TRAILER_MAX_BYTES:
        raise ValueError(f"trailer payload of {len(payload)} bytes (at most {TRAILER_MAX_BYTES})")
    head = torch.tensor([TRAILER_OK if ok else TRAILER_ABORTED, len(payload)], dtype=torch.int64)
    body = [torch.frombuffer(bytearray(payload), dtype=torch.uint8)] if payload else []
    return [head, *body]


def runs(block_ids: list[int]) -> list[int]:
    """The lengths of the maximal runs of consecutive ascending ids: each run is one
    contiguous slice of a cache layer."""
    out: list[int] = []
    for i, b in enumerate(block_ids):
        if i and b == block_ids[i - 1] + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def plan_segments(
    num_blocks: int,
    *sides: list[int],
    min_direct: int = MIN_DIRECT_BLOCKS,
    max_segments: int = MAX_SEGMENTS,
) -> list[int]:
    """Segment lengths covering `num_blocks`, cut wherever a run of any side ends. Pieces of
    fewer than `min_direct` blocks are merged with their short neighbours (that segment is
    staged), and past `max_segments` the whole request is one segment."""
    cuts = {num_blocks}
    for side in sides:
        edge = 0
        for r in side:
            edge += r
            cuts.add(edge)
    pieces, start = [], 0
    for edge in sorted(cuts):
        if edge > start:
            pieces.append(edge - start)
            start = edge
    segments: list[int] = []
    short = 0  # blocks of short pieces waiting to be merged
    for p in pieces:
        if p >= min_direct:
            if short:
                segments.append(short)
                short = 0
            segments.append(p)
        else:
            short += p
    if short:
        segments.append(short)
    return segments if len(segments) <= max_segments else [num_blocks]


def encode_runs(lengths: list[int], num_blocks: int) -> torch.Tensor:
    """Runs on the wire: `[count, *lengths]`, zero-padded to num_blocks + 1."""
    out = torch.zeros(num_blocks + 1, dtype=torch.int64)
    out[0] = len(lengths)
    out[1 : len(lengths) + 1] = torch.tensor(lengths, dtype=torch.int64)
    return out


def decode_runs(data: torch.Tensor, num_blocks: int, what: str) -> list[int]:
    values = data.tolist()
    count = values[0]
    if num_blocks == 0 and count == 0:
        return []
    lengths = values[1 : count + 1] if 0 < count <= num_blocks else []
    if not lengths or min(lengths) <= 0 or sum(lengths) != num_blocks:
        raise TransferError(f"bad KV {what}: {values[: count + 1]} for {num_blocks} blocks")
    return lengths
