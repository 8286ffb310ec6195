"""On a GPU a KV transfer runs on its pair's stream and meets the engine's only at events.
Without CUDA here, a recording fake of the stream interface (kv_transfer/streams.py) logs
every bind, stream switch, event record and event wait, interleaved with the channel's own
posts, and the order is checked: a layer leaves only after its stream waited on that layer's
event; nothing lands before the reservation's event; the landed event is recorded after the
last byte of KV and before the ack; every post is made on the pair's stream, by a thread
that bound the device first."""

import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from kv_transfer import torch_dist
from kv_transfer.channel import PagedBlocks, recv_kv, send_kv
from kv_transfer.inprocess import InProcessChannel
from kv_transfer.layout import KVLayout
from kv_transfer.protocol import TransferDescriptor
from kv_transfer.streams import StreamOps, indexed
from kv_transfer.torch_dist import PairGroup
from workers.kv_sender import LayerProgress

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


class RecordingStreams(StreamOps):
    """Logs (thread role, call, argument) into a shared list; events are strings."""

    def __init__(self, log: list, role: str) -> None:
        self.log, self.role = log, role
        self.current: dict[int, str] = {}  # thread id -> the stream it is on
        self.bound: set[int] = set()
        self.events = 0

    def _say(self, *what) -> None:
        self.log.append((self.role, *what))

    def on_stream(self) -> str:
        return self.current.get(threading.get_ident(), "default")

    def is_bound(self) -> bool:
        return threading.get_ident() in self.bound

    def bind(self) -> None:
        self.bound.add(threading.get_ident())
        self._say("bind")

    def new_stream(self):
        return f"{self.role}-pair-stream"

    @contextmanager
    def _use(self, stream):
        me = threading.get_ident()
        before = self.current.get(me, "default")
        self.current[me] = stream
        try:
            yield
        finally:
            self.current[me] = before

    def using(self, stream):
        return self._use(stream) if stream is not None else self._use(self.on_stream())

    def record(self):
        self.events += 1
        event = f"{self.role}-event-{self.events}"
        self._say("record", event, self.on_stream())
        return event

    def wait(self, event) -> None:
        if event is not None:
            self._say("wait", event, self.on_stream())


class RecordingChannel(InProcessChannel):
    """An in-process channel that logs each post with the stream it was made on."""

    def setup(self, log: list, role: str) -> "RecordingChannel":
        self.log, self.role = log, role
        self.streams = RecordingStreams(log, role)
        self.stream = self.streams.new_stream()
        return self

    def post_send(self, tensor):
        assert self.streams.is_bound(), "a thread posted before binding the device"
        self.log.append((self.role, "send", tuple(tensor.shape), self.streams.on_stream()))
        return super().post_send(tensor)

    def post_recv(self, tensor):
        assert self.streams.is_bound(), "a thread posted before binding the device"
        self.log.append((self.role, "recv", tuple(tensor.shape), self.streams.on_stream()))
        return super().post_recv(tensor)


def pair():
    log: list = []
    a, b = RecordingChannel.pair()
    return log, a.setup(log, "sender"), b.setup(log, "receiver")


def cache(seed=None):
    shape = LAYOUT.layer_shape(16)
    return [torch.randn(shape) if seed is not None else torch.zeros(shape) for _ in range(3)]


def run_transfer(log, a, b, src_ids, dst_ids):
    """One transfer; the layers' events come from a LayerProgress the 'engine' marks."""
    engine = RecordingStreams(log, "engine")
    progress = LayerProgress(LAYOUT.num_layers, torch.device("cpu"), streams=engine)
    src, dst = cache(seed=1), cache()
    desc = TransferDescriptor("r1", LAYOUT, len(src_ids), len(src_ids) * 4)
    reserved = engine.record()  # the decode engine reserves the blocks
    target = PagedBlocks(list(dst_ids), lambda i: dst[i], writable=reserved)
    out = {}
    receiver = threading.Thread(
        target=lambda: out.setdefault("got", recv_kv(b, LAYOUT, 5, target=lambda d: target))
    )
    receiver.start()

    def layer(i):
        progress.mark(i)  # the model queues layer i, then the sender may take it
        return src[i]

    source = PagedBlocks(list(src_ids), layer, ready=progress.event)
    send_kv(a, desc, source, 5)
    receiver.join(10)
    assert out["got"][0] == desc
    for s, d in zip(src, dst):
        assert torch.equal(d[list(dst_ids)], s[list(src_ids)])
    return reserved, target


def payload_sends(log, shape):
    return [i for i, e in enumerate(log) if e[:3] == ("sender", "send", shape)]


def test_each_layer_leaves_after_its_own_event_on_the_pair_stream():
    log, a, b = pair()
    run_transfer(log, a, b, [2, 3, 4], [5, 6, 7])  # one run each side: sent in place
    layer_shape = LAYOUT.layer_shape(3)
    sends = payload_sends(log, layer_shape)
    assert len(sends) == LAYOUT.num_layers
    marks = [e[2] for e in log if e[0] == "engine" and e[1] == "record"][1:]  # after reserve
    for i, at in enumerate(sends):
        waited = [j for j, e in enumerate(log) if e[:3] == ("sender", "wait", marks[i])]
        assert waited and waited[0] < at, f"layer {i} left before its event was waited on"
        # ...and not on a later layer's: the stream waits on layer i's event alone.
        later = set(marks[i + 1 :])
        assert not any(e[0] == "sender" and e[2] in later for e in log[:at] if e[1] == "wait")
    # Every post of the sender was on the pair's stream, never the engine's or a default one.
    for e in log:
        if e[0] == "sender" and e[1] in ("send", "recv", "wait"):
            assert e[-1] == "sender-pair-stream", e


def test_kv_lands_after_the_reservation_event_and_is_marked_before_the_ack():
    log, a, b = pair()
    reserved, target = run_transfer(log, a, b, [0, 1], [9, 3])  # staged: scattered on arrival
    mine = [(i, e) for i, e in enumerate(log) if e[0] == "receiver"]
    layer_recvs = [i for i, e in mine if e[1] == "recv" and e[2] == LAYOUT.layer_shape(2)]
    [(waited, _)] = [(i, e) for i, e in mine if e[1] == "wait" and e[2] == reserved]
    assert waited < layer_recvs[0], "KV could land before the blocks' last reader was done"
    [(landed_at, landed)] = [(i, e) for i, e in mine if e[1] == "record"]
    assert target.landed == landed[2] and landed[3] == "receiver-pair-stream"
    assert landed_at > layer_recvs[-1]
    ack = [i for i, e in mine if e[1] == "send"][-1]  # the receiver's last send: its ack
    assert landed_at < ack
    for _, e in mine:
        if e[1] in ("send", "recv", "wait", "record"):
            assert e[-1] == "receiver-pair-stream", e


def test_layer_progress_records_on_the_marking_thread_and_waits_on_the_host_only():
    log: list = []
    engine = RecordingStreams(log, "engine")
    progress = LayerProgress(4, torch.device("cpu"), streams=engine)
    progress.mark(1)  # layers 0 and 1 queued in one go: both take this event
    assert progress.event(0) == progress.event(1) == "engine-event-1"
    assert progress.event(2) is None
    progress.wait(1, timeout_s=1)  # returns at once: marked
    progress.mark(3)
    assert progress.event(3) == "engine-event-2" and progress.event(2) == "engine-event-2"
    assert [e[1] for e in log] == ["record", "record"]  # no wait: the host never syncs


class FakeWork:
    """An NCCL-like operation: records the timeout its wait is given and the stream the
    waiting thread is on."""

    def __init__(self, streams: RecordingStreams) -> None:
        self.streams = streams
        self.waits: list[tuple[float, str]] = []

    def wait(self, timeout):
        self.waits.append((timeout.total_seconds(), self.streams.on_stream()))
        return True

    def is_completed(self) -> bool:
        return True  # done by the time it is waited for: the wait's own timeout is shown

    def exception(self):
        return None


class FakeGroup:
    def __init__(self, streams: RecordingStreams) -> None:
        self.streams = streams

    def send(self, tensors, peer, tag):
        return FakeWork(self.streams)

    recv = send


def bare_pair(device: str) -> PairGroup:
    """A PairGroup on `device` around a fake process group: its own bookkeeping alone."""
    g = PairGroup.__new__(PairGroup)
    g.prefix, g.rank, g.peer, g.device = "pair/t/1", 1, 0, torch.device(device)
    g.backend = "nccl" if device == "cuda" else "gloo"
    g._closed, g._posted, g._aborted, g._guard = False, {}, None, threading.Lock()
    g.streams = RecordingStreams([], "receiver")
    g.stream = g.streams.new_stream()
    g.pg = FakeGroup(g.streams)
    return g


def test_cuda_without_an_index_is_pinned_to_the_current_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with pytest.raises(ValueError):  # what set_device makes of a bare "cuda"
        torch.cuda._utils._get_device_index(torch.device("cuda"))
    assert indexed("cuda") == torch.device("cuda", 3)
    assert torch.cuda._utils._get_device_index(indexed(torch.device("cuda"))) == 3
    assert indexed("cuda:1") == torch.device("cuda", 1)
    assert indexed("cpu") == torch.device("cpu")


def test_an_nccl_wait_counts_its_timeout_from_the_wait_not_the_post(monkeypatch):
    """NCCL's clock starts at the post; a receive posted while the sender's model still
    computes must get timeout_s from when it is waited for, as with gloo."""
    now = [100.0]
    monkeypatch.setattr(torch_dist, "time", SimpleNamespace(monotonic=lambda: now[0]))
    g = bare_pair("cuda")
    early, late = g.post_recv(torch.zeros(1)), g.post_recv(torch.zeros(1))
    now[0] += 40.0  # the prefill of a long prompt
    g.wait(early, 5)
    now[0] += 2.0
    g.wait(late, 5)
    assert early.waits[0][0] == pytest.approx(45.0)
    assert late.waits[0][0] == pytest.approx(47.0)
    assert not g._posted  # nothing kept once waited for
    assert torch_dist.group_timeout(5).total_seconds() > 45.0  # the backstop stays behind


def test_a_gloo_wait_gets_its_timeout_as_given():
    g = bare_pair("cpu")
    work = g.post_send(torch.zeros(1))
    g.wait(work, 5)
    assert work.waits[0][0] == 5.0


def test_settle_waits_for_abandoned_receives_on_the_pair_stream():
    """A wait orders the waiting thread's current stream after the operation: settling
    must do that to the pair's stream, never to the engine's."""
    g = bare_pair("cuda")
    handles = [g.post_recv(torch.zeros(1)) for _ in range(3)]
    g.settle(handles, 1)
    assert [w[1] for h in handles for w in h.waits] == ["receiver-pair-stream"] * 3
    assert not g._posted
