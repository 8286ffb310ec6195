"""A channel is one ordered, two-way link between a prefill worker (rank 0) and a decode worker
(rank 1). The handoff protocol (send_kv / recv_kv) runs over any channel.

Invariants: every call takes a timeout and raises TransferError when it passes; after any
error the channel is broken for good (close it, and open a new one for the next transfer).
On a GPU a channel has a stream of its own (kv_transfer/streams.py): send_kv and recv_kv queue
their work there, and meet the engine's stream only at events.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.layout import KVLayout, as_bytes
from kv_transfer.protocol import (
    ACK_OK,
    ACK_REFUSED,
    TRAILER_ABORTED,
    TRAILER_MAX_BYTES,
    TRAILER_OK,
    TransferAborted,
    TransferDescriptor,
    TransferError,
    decode_runs,
    empty_header,
    encode_runs,
    plan_segments,
    runs,
    trailer,
)
from kv_transfer.streams import NoStreams, StreamOps


class KVChannel(ABC):
    device = torch.device("cpu")  # where the protocol's own small tensors must live (NCCL: GPU)
    streams: StreamOps = NoStreams()
    stream: object | None = None  # the stream its transfers run on (None: the current one)

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
        """Release the link; safe to call twice and after errors. Operations already posted
        may still complete (gloo does not cancel them): see `settle`."""

    def settle(self, handles: list, timeout_s: float) -> None:
        """Return once none of these posted, then abandoned, receives can write into its
        buffer any more. Here receives land only in `wait`: nothing to do."""

    def send(self, tensors: list[torch.Tensor], timeout_s: float) -> None:
        for h in [self.post_send(t) for t in tensors]:
            self.wait(h, timeout_s)

    def recv(self, tensors: list[torch.Tensor], timeout_s: float) -> None:
        for h in [self.post_recv(t) for t in tensors]:
            self.wait(h, timeout_s)


class StagingBuffers:
    """Reusable staging buffers, one per layer, grown on demand: allocating (and faulting in)
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


@dataclass
class PagedBlocks:
    """One side's blocks for a transfer: their ids, in the order of the request's positions,
    and `layer(i)`, that layer's cache, `layout.layer_shape(cache_blocks)` (a block's K and V
    side by side).

    Sender: `layer(i)` may block until the model has queued layer i, and `ready(i)`, called
    next, gives the event after which layer i holds its KV (the transfer's stream waits on
    it); `gather(cache, ids, out)` copies blocks to be staged out of it (index_select when
    None). Receiver: the transfer's stream waits on `writable` (the event after which the
    blocks' last reader is done) before anything lands; `scatter(cache, ids, blocks)` writes
    staged blocks into place; once all is in, recv_kv sets `landed`, the event that whoever
    reads the blocks next waits on (None on the CPU)."""

    block_ids: list[int]
    layer: Callable[[int], torch.Tensor]
    scatter: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    gather: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    ready: Callable[[int], object | None] | None = None
    writable: object | None = None
    landed: object | None = None


@dataclass(frozen=True)
class TransferPlan:
    """How a transfer was cut: segment lengths, the blocks staged on each side, and those
    staged on either (each counted once)."""

    segments: tuple[int, ...]
    staged_send: int
    staged_recv: int
    staged_either: int


class _Placed:
    """The segments on one side: each is either one run of that side's cache (moved in
    place) or staged at its offset in the layer's staging buffer. Without block ids (a
    refused transfer) every segment is staged and goes nowhere."""

    def __init__(self, block_ids: list[int] | None, segments: list[int], device) -> None:
        self.parts: list[tuple[int, int, int | None, torch.Tensor | None]] = []
        staged = _staged_in(runs(block_ids), segments) if block_ids is not None else None
        offset = 0
        for j, n in enumerate(segments):
            if staged is None:
                self.parts.append((offset, n, None, None))
            elif not staged[j]:
                self.parts.append((offset, n, block_ids[offset], None))
            else:
                ids = block_ids[offset : offset + n]
                self.parts.append((offset, n, None, torch.tensor(ids, device=device)))
            offset += n
        self.staged = sum(n for _, n, start, _ in self.parts if start is None)

    def tensors(self, cache, buf: torch.Tensor | None):
        """Per segment, `(blocks, index)`: a view of the cache for a run (index None), or of
        the staging buffer with the cache block ids its blocks belong at."""
        for offset, n, start, index in self.parts:
            if start is not None:
                yield cache[start : start + n], None
            else:
                yield buf[offset : offset + n], index


def _staged_in(runs_: list[int], segments: list[int]) -> list[bool]:
    """For each segment, whether it does not lie within one of these runs."""
    edges, edge = set(), 0
    for r in runs_:
        edge += r
        edges.add(edge)
    staged, offset = [], 0
    for n in segments:
        staged.append(any(e in edges for e in range(offset + 1, offset + n)))
        offset += n
    return staged


def send_kv(
    channel: KVChannel,
    desc: TransferDescriptor,
    source: PagedBlocks,
    timeout_s: float,
    verdict: Callable[[], tuple[bool, bytes]] | None = None,
    staging: StagingBuffers | None = None,
) -> TransferPlan:
    """Sender side: header and our runs, then the receiver's placement (both sides cut the
    same segments from the two), the payload layer by layer, the trailer, and the receiver's
    ack. Returns how the transfer was cut.

    Each layer is posted as soon as `source.layer(i)` returns it, so computing layer i+1
    overlaps with sending layer i. A segment that is one run of our cache is sent from the
    cache itself; any other is first gathered into `staging`. The cache blocks must stay
    unchanged until this returns. `verdict()`, called once every layer is posted, gives the
    trailer: (True, payload) to deliver the payload with the KV, or (False, reason) to abort
    the transfer (the receiver drops it; TransferAborted is raised here too). Without it:
    (True, b"")."""
    channel.streams.bind()
    with channel.streams.using(channel.stream):
        return _send_kv(channel, desc, source, timeout_s, verdict, staging)


def _send_kv(channel, desc, source, timeout_s, verdict, staging) -> TransferPlan:
    dev, n = channel.device, desc.num_blocks
    if len(source.block_ids) != n:
        raise ValueError(f"{len(source.block_ids)} blocks given, the header says {n}")
    mine = runs(source.block_ids)
    channel.send([desc.encode().to(dev), encode_runs(mine, n).to(dev)], timeout_s)
    placement = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    channel.recv([placement], timeout_s)
    theirs = decode_runs(placement.cpu(), n, "placement")
    segments = plan_segments(n, mine, theirs)
    placed = _Placed(source.block_ids, segments, dev)
    bufs = None
    if placed.staged:
        bufs = (staging or StagingBuffers()).get(desc.layout, n, dev)
    gather = source.gather or _index_select
    handles = []
    for i in range(desc.layout.num_layers):
        cache = source.layer(i)
        if source.ready is not None:
            channel.streams.wait(source.ready(i))
        for blocks, index in placed.tensors(cache, bufs[i] if bufs else None):
            if index is not None:  # staged: gathered out of the cache first
                gather(cache, index, blocks)
            handles.append(channel.post_send(blocks))
    ok, payload = verdict() if verdict is not None else (True, b"")
    for h in handles:
        channel.wait(h, timeout_s)
    # Only once every layer has left: a trailer saying OK must never follow a send that failed.
    channel.send([t.to(dev) for t in trailer(ok, payload)], timeout_s)
    ack = torch.zeros(1, dtype=torch.int64, device=dev)
    channel.recv([ack], timeout_s)
    if not ok:
        reason = payload.decode(errors="replace")
        raise TransferAborted(f"the KV of {desc.request_id} was aborted: {reason}")
    if ack.item() != ACK_OK:
        raise TransferError(f"receiver refused the KV of {desc.request_id} (status {ack.item()})")
    here, there = _staged_in(mine, segments), _staged_in(theirs, segments)
    return TransferPlan(
        tuple(segments),
        placed.staged,
        sum(n for n, s in zip(segments, there) if s),
        sum(n for n, a, b in zip(segments, here, there) if a or b),
    )


def recv_kv(
    channel: KVChannel,
    layout: KVLayout,
    timeout_s: float,
    device: torch.device | str = "cpu",
    target: Callable[[TransferDescriptor], PagedBlocks | None] | None = None,
    staging: StagingBuffers | None = None,
    on_layer: Callable[[int], None] | None = None,
) -> tuple[TransferDescriptor, bytes]:
    """Receiver side: read the header (checked against our layout) and the sender's runs,
    answer with our placement, read the layers and the trailer, ack. Returns the header and the
    trailer's payload; TransferAborted if the sender aborted.

    A failure raises TransferError (and closes the channel) with `pending`: the receives
    already posted, which gloo does not cancel: until `channel.settle(pending)` returns,
    late bytes may still land in their buffers, the target's blocks among them.

    `target(desc)` gives the blocks the request's KV goes into, or None to refuse a request
    we do not expect (its bytes are then read into `staging` and dropped). A segment that is
    one run of the target's blocks lands in the cache in place; any other lands in `staging`
    and is scattered into its blocks as soon as its layer is in. Without a target nothing is
    refused and the layers land in `staging` (valid until the next transfer). `on_layer(i)`
    is called as each layer is complete."""
    channel.streams.bind()
    with channel.streams.using(channel.stream):
        return _recv_kv(channel, layout, timeout_s, device, target, staging, on_layer)


def _recv_kv(channel, layout, timeout_s, device, target, staging, on_layer):
    device = torch.device(device)
    header = empty_header().to(device)
    channel.recv([header], timeout_s)
    desc = TransferDescriptor.decode(header.cpu(), layout)
    posted: list = []  # receives posted, not yet waited for: after a failure they may land
    try:
        payload, aborted, ok = _recv_payload(
            channel, layout, timeout_s, device, desc, target, staging, on_layer, posted
        )
    except Exception as e:
        err = (
            e
            if isinstance(e, TransferError)
            else TransferError(f"receiving the KV of {desc.request_id} failed: {e}")
        )
        err.pending = posted
        channel.close()  # out of step for good
        raise err from (None if err is e else e)
    # Every byte was read and acked: the pair is in step whatever the verdict.
    if aborted:
        reason = payload.decode(errors="replace")
        raise TransferAborted(f"the sender aborted the KV of {desc.request_id}: {reason}")
    if not ok:
        raise TransferError(f"refused KV for {desc.request_id}: no reservation matches it")
    return desc, payload


def _recv_payload(channel, layout, timeout_s, device, desc, target, staging, on_layer, posted):
    """recv_kv after the header: (the trailer's payload, whether it aborts, whether we took
    the KV). `posted` holds the receives it has posted and not yet waited for."""
    n = desc.num_blocks
    side = target(desc) if target is not None else None
    ok = target is None or side is not None
    ids = None
    if side is not None:
        if len(side.block_ids) < n:
            raise ValueError(f"{len(side.block_ids)} target blocks for {n} blocks of KV")
        ids = side.block_ids[:n]
    if side is not None:  # nothing lands before the blocks' last reader is done
        channel.streams.wait(side.writable)
    theirs = torch.zeros(n + 1, dtype=torch.int64, device=device)
    channel.recv([theirs], timeout_s)
    theirs = decode_runs(theirs.cpu(), n, "sender's runs")
    mine = runs(ids) if ids is not None else [n] if n else []
    channel.send([encode_runs(mine, n).to(device)], timeout_s)
    placed = _Placed(ids, plan_segments(n, theirs, mine), device)
    bufs = None
    if placed.staged:
        bufs = (staging or StagingBuffers()).get(layout, n, device)
    layers = []
    for i in range(layout.num_layers):
        cache = side.layer(i) if side is not None else None
        parts = list(placed.tensors(cache, bufs[i] if bufs else None))
        handles = [channel.post_recv(blocks) for blocks, _ in parts]
        posted += handles
        layers.append((cache, parts, handles))
    head = torch.zeros(2, dtype=torch.int64, device=device)
    head_handle = channel.post_recv(head)
    posted.append(head_handle)
    for i, (cache, parts, handles) in enumerate(layers):
        for h in handles:
            _wait_posted(channel, h, timeout_s, posted)
        for blocks, index in parts:
            if index is not None:  # staged: scattered into place
                _scatter(side, cache, index, blocks)
        if ok and on_layer is not None:
            on_layer(i)
    if side is not None:
        side.landed = channel.streams.record()
    _wait_posted(channel, head_handle, timeout_s, posted)
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
    return payload, status == TRAILER_ABORTED, ok


def _wait_posted(channel: KVChannel, handle, timeout_s: float, posted: list) -> None:
    """Wait for a posted receive; done or failed, it is no longer pending."""
    try:
        channel.wait(handle, timeout_s)
    finally:  # by identity: a handle may be a tensor, whose == compares elements
        del posted[next(i for i, h in enumerate(posted) if h is handle)]


def _index_select(cache: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(cache, 0, index, out=out)


def _scatter(side: PagedBlocks, cache: torch.Tensor, index: torch.Tensor, rows) -> None:
    if side.scatter is not None:
        side.scatter(cache, index, rows)
    else:
        as_bytes(cache).index_copy_(0, index, as_bytes(rows))
