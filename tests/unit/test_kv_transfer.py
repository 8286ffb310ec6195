"""The handoff protocol over the in-process channel and over real gloo pair groups (two
threads of this process, a real TCPStore on loopback)."""

import dataclasses
import threading
import time

import pytest
import torch

from kv_transfer.channel import PagedBlocks, StagingBuffers, recv_kv, send_kv
from kv_transfer.inprocess import InProcessChannel
from kv_transfer.layout import KVLayout, LayoutMismatch
from kv_transfer.protocol import (
    TransferAborted,
    TransferDescriptor,
    TransferError,
    decode_runs,
    encode_runs,
    plan_segments,
    runs,
)
from kv_transfer.torch_dist import PairGroup, store_client, store_server
from workers.messages import FirstToken, decode_first, encode_first

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
CACHE_BLOCKS = 64


def make_cache(seed: int | None = None, layout: KVLayout = LAYOUT):
    """One side's paged cache, a tensor per layer (K and V of a block side by side); random,
    or zeros with no seed."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = layout.layer_shape(CACHE_BLOCKS)

    def one():
        t = torch.randn(shape, generator=gen) if gen is not None else torch.zeros(shape)
        return t.to(layout.torch_dtype)

    return [one() for _ in range(layout.num_layers)]


def paged(cache, ids, **kwargs):
    return PagedBlocks(list(ids), lambda i: cache[i], **kwargs)


def round_trip(sender, receiver, desc, src_ids, dst_ids, extra=b"first tokens"):
    """Send `src_ids` of a random cache into `dst_ids` of an empty one, receiving in a
    thread; check what arrived: every layer's blocks where they belong, nothing else
    written, and the trailer's payload. Returns the sender's plan."""
    layout = desc.layout
    src, dst = make_cache(seed=1, layout=layout), make_cache(layout=layout)
    receive = _in_thread(
        lambda: recv_kv(
            receiver, layout, 5, target=lambda d: paged(dst, dst_ids), staging=StagingBuffers()
        )
    )
    plan = send_kv(
        sender,
        desc,
        paged(src, src_ids),
        5,
        verdict=lambda: (True, extra),
        staging=StagingBuffers(),
    )
    got_desc, got_extra = receive(10)
    assert got_desc == desc and got_extra == extra
    untouched = sorted(set(range(CACHE_BLOCKS)) - set(dst_ids))
    for s, d in zip(src, dst):
        s, d = s.view(torch.uint8), d.view(torch.uint8)  # bit for bit, whatever the dtype
        assert torch.equal(d[list(dst_ids)], s[list(src_ids)])
        assert not d[untouched].any()
    return plan


def test_descriptor_round_trip_and_validation():
    d = TransferDescriptor("req-é-1", LAYOUT, 3, 10)
    assert TransferDescriptor.decode(d.encode(), LAYOUT) == d
    with pytest.raises(ValueError, match="10 tokens need 3 blocks"):
        TransferDescriptor("r", LAYOUT, 2, 10)
    other = KVLayout(3, 2, 8, 16, "bfloat16")
    with pytest.raises(TransferError, match="block_size: 16 here, 4 there"):
        TransferDescriptor.decode(d.encode(), other)


def test_layout_mismatch_names_every_field():
    with pytest.raises(LayoutMismatch) as e:
        LAYOUT.check_compatible(KVLayout(30, 3, 64, 4, "bfloat16"))
    msg = str(e.value)
    assert "num_layers: 3 here, 30 there" in msg and "dtype: 'float32' here, 'bfloat16'" in msg


def test_runs_and_segments():
    assert runs([]) == [] and runs([5]) == [1]
    assert runs([3, 4, 5, 9, 10, 2, 1]) == [3, 2, 1, 1]
    # Cut wherever either side's run ends; pieces under 8 blocks merge with short neighbours.
    assert plan_segments(30, [30], [30]) == [30]
    assert plan_segments(30, [12, 18], [10, 20]) == [10, 2, 18]
    assert plan_segments(30, [10, 1, 1, 1, 17], [30]) == [10, 3, 17]
    assert plan_segments(30, [1] * 30, [30]) == [30]  # all short: one staged segment
    many = [8, 1] * 20  # 40 pieces, over the cap: the whole request is one segment
    assert plan_segments(180, many, [180]) == [180]
    assert decode_runs(encode_runs([10, 2, 18], 30), 30, "placement") == [10, 2, 18]
    for bad in ([10, 2, 17], [30, 0], []):
        with pytest.raises(TransferError, match="bad KV placement"):
            decode_runs(encode_runs(bad, 30), 30, "placement")


@pytest.mark.parametrize(
    "src_ids, dst_ids, segments, staged",
    [
        # Both sides one run: every segment moves in place.
        (range(0, 20), range(30, 50), (20,), (0, 0)),
        # The receiver's two short blocks are staged (merged into one segment); the rest in
        # place on both sides.
        (
            [*range(0, 12), *range(40, 48)],
            [*range(50, 60), 3, 7, *range(20, 28)],
            (10, 2, 8),
            (0, 2),
        ),
        # Scattered on both sides: one segment, gathered and scattered.
        (
            [9, 2, 33, 17, 5, 40, 22, 1, 60, 11],
            [4, 61, 8, 30, 12, 0, 50, 19, 7, 45],
            (10,),
            (10, 10),
        ),
        # Runs on the sender only: sent in place, scattered on arrival.
        (range(10, 20), [4, 61, 8, 30, 12, 0, 50, 19, 7, 45], (10,), (0, 10)),
    ],
)
def test_blocks_land_where_they_belong_in_place_or_staged(src_ids, dst_ids, segments, staged):
    a, b = InProcessChannel.pair()
    n = len(src_ids)
    desc = TransferDescriptor("r1", LAYOUT, n, n * LAYOUT.block_size - 1)
    plan = round_trip(a, b, desc, src_ids, dst_ids)
    assert (plan.segments, (plan.staged_send, plan.staged_recv)) == (segments, staged)
    assert plan.staged_either == max(staged)  # here a segment staged on both counts once


def test_in_process_refusal():
    a, b = InProcessChannel.pair()
    desc = TransferDescriptor("r1", LAYOUT, 2, 7)
    src = make_cache(seed=1)
    # A receiver that does not expect the request refuses it, and both sides say so.
    receiver = _in_thread(lambda: recv_kv(b, LAYOUT, 5, target=lambda d: None))
    with pytest.raises(TransferError, match="refused"):
        send_kv(a, desc, paged(src, [4, 5]), 5)
    outcome = receiver(5)
    assert isinstance(outcome, TransferError) and "no reservation matches" in str(outcome)
    round_trip(a, b, desc, [4, 5], [9, 10])  # the pair is still in step


def test_layers_leave_as_they_are_produced_and_the_trailer_comes_last():
    """Layer i+1 is produced only once the receiver holds layer i: a sender that waited for
    every layer before sending would never finish. The trailer's payload, decided after the
    last layer, arrives with the transfer."""
    a, b = InProcessChannel.pair()
    desc = TransferDescriptor("r1", LAYOUT, 2, 7)
    src, dst = make_cache(seed=1), make_cache()
    landed = [threading.Event() for _ in range(LAYOUT.num_layers)]

    def produce(i):
        if i:
            assert landed[i - 1].wait(5), f"layer {i - 1} did not land before {i} was made"
        return src[i]

    receive = _in_thread(
        lambda: recv_kv(
            b, LAYOUT, 5, target=lambda d: paged(dst, [3, 4]), on_layer=lambda i: landed[i].set()
        )
    )
    send_kv(a, desc, PagedBlocks([0, 1], produce), 5, verdict=lambda: (True, b"\x00late\xff"))
    assert receive(10) == (desc, b"\x00late\xff")
    assert all(torch.equal(dst[i][3:5], src[i][0:2]) for i in range(LAYOUT.num_layers))


def test_an_aborted_transfer_fails_both_sides_and_keeps_the_pair():
    a, b = InProcessChannel.pair()
    desc = TransferDescriptor("r1", LAYOUT, 2, 7)
    src, dst = make_cache(seed=1), make_cache()
    receive = _in_thread(lambda: recv_kv(b, LAYOUT, 5, target=lambda d: paged(dst, [1, 2])))
    with pytest.raises(TransferAborted, match="prefill failed"):
        send_kv(a, desc, paged(src, [0, 1]), 5, verdict=lambda: (False, b"the prefill failed"))
    outcome = receive(5)
    assert isinstance(outcome, TransferAborted) and "the prefill failed" in str(outcome)
    round_trip(a, b, desc, [0, 1], [1, 2])  # still in step: the next transfer goes through


def _in_thread(fn):
    """Run fn in a thread; the returned join(timeout) gives its result or its exception."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except Exception as e:  # handed to the test's thread
            box["out"] = e

    t = threading.Thread(target=run)
    t.start()

    def join(timeout):
        t.join(timeout)
        assert not t.is_alive(), "the thread did not finish"
        return box["out"]

    return join


def test_in_process_timeout():
    a, _ = InProcessChannel.pair()
    with pytest.raises(TransferError, match="no data from the peer"):
        a.recv([torch.zeros(1)], 0.2)


def _pair(store_port, server, name, timeout=5.0):
    """Both ranks of one pair group, built concurrently as two workers would."""
    groups = {}

    def rank1():
        groups[1] = PairGroup(server, name, 1, torch.device("cpu"), "127.0.0.1", timeout)

    t = threading.Thread(target=rank1)
    t.start()
    groups[0] = PairGroup(
        store_client("127.0.0.1", store_port, timeout),
        name,
        0,
        torch.device("cpu"),
        "127.0.0.1",
        timeout,
    )
    t.join(timeout + 5)
    return groups[0], groups[1]


def test_gloo_pair_moves_kv_and_survives_a_dead_peer():
    server = store_server("127.0.0.1")
    sender, receiver = _pair(server.port, server, "pair/p0/1")
    assert sender.backend == "gloo"
    desc = TransferDescriptor("r1", LAYOUT, 12, 47)
    runs_ = [*range(0, 12)], [*range(40, 52)]
    assert round_trip(sender, receiver, desc, *runs_).staged_send == 0
    scattered = [9, 2, 33, 17, 5, 40, 22, 1, 60, 11, 14, 27]
    plan = round_trip(sender, receiver, desc, runs_[0], scattered)  # pair reused
    assert (plan.staged_send, plan.staged_recv) == (0, 12)

    # The peer goes away: the send fails within its timeout instead of hanging.
    receiver.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        send_kv(sender, desc, paged(make_cache(seed=1), runs_[0]), 1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TransferError, match="closed"):
        sender.send([torch.zeros(1)], 1.0)

    # The next generation of the pair forms afresh and works.
    sender2, receiver2 = _pair(server.port, server, "pair/p0/2")
    round_trip(sender2, receiver2, desc, *runs_)
    sender2.close()
    receiver2.close()


def test_gloo_pair_moves_an_fp8_cache_as_its_bytes():
    """kv_cache_dtype: fp8 ships a byte a value: gloo has no fp8 dtype, so the pair sends the
    bytes, in place and staged alike."""
    server = store_server("127.0.0.1")
    sender, receiver = _pair(server.port, server, "pair/fp8/1")
    layout = dataclasses.replace(LAYOUT, dtype="float8_e4m3fn")
    assert layout.bytes_per_token * 4 == KVLayout(3, 2, 8, 4, "float32").bytes_per_token
    desc = TransferDescriptor("r8", layout, 12, 47)
    assert round_trip(sender, receiver, desc, [*range(12)], [*range(40, 52)]).staged_send == 0
    plan = round_trip(
        sender, receiver, desc, [*range(12)], [9, 2, 33, 17, 5, 40, 22, 1, 60, 11, 14, 27]
    )
    assert plan.staged_recv == 12
    sender.close()
    receiver.close()


def test_rendezvous_with_nobody_times_out():
    server = store_server("127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="did not form"):
        PairGroup(
            store_client("127.0.0.1", server.port, 1.0),
            "pair/lonely/1",
            0,
            torch.device("cpu"),
            "127.0.0.1",
            1.0,
        )
    assert time.monotonic() - t0 < 15


def test_first_tokens_round_trip_through_the_trailer_payload():
    first = (
        FirstToken(17),
        FirstToken(4, -0.25, ((4, -0.25), (9, -1.5))),
    )
    assert decode_first(encode_first(first)) == first
    with pytest.raises(ValueError, match="not a first-token payload"):
        decode_first(b"\x00garbage")


def test_a_stopped_sender_gives_back_every_push_it_will_never_send():
    """Pushes queued behind a stop, or submitted after it, are released and answered."""
    from workers.engine.request import SamplingParams
    from workers.kv_sender import KVSender, LayerProgress, Push
    from workers.messages import DecodeEndpoint, RequestSpec

    released, done = [], []
    sender = KVSender(
        "p",
        DecodeEndpoint("d", "127.0.0.1", 1),
        LAYOUT,
        torch.device("cpu"),
        "127.0.0.1",
        1.0,
        cache_layer=None,
        release=released.append,
        on_done=lambda push, result: done.append((push.request_id, result)),
    )
    sender.stop()
    sender.thread.join(5)
    assert not sender.thread.is_alive()
    spec = RequestSpec("r1", (1, 2, 3), SamplingParams(seed=1))
    desc = TransferDescriptor("r1", LAYOUT, 1, 3)
    sender.submit(Push(spec, [7], desc, LayerProgress(LAYOUT.num_layers, torch.device("cpu"))))
    assert released == [[7]]
    assert [(rid, r.ok, r.error) for rid, r in done] == [("r1", False, "sender stopped")]


def _stalled_send(name: str):
    """A gloo pair whose sender stops after the first layer until `go` is set (the rest of
    its prefill comes after the receiver has given up)."""
    server = store_server("127.0.0.1")
    sender, receiver = _pair(server.port, server, name)
    desc = TransferDescriptor("r1", LAYOUT, 4, 15)
    src, dst = make_cache(seed=1), make_cache()
    go = threading.Event()

    def produce(i):
        if i == 1:
            assert go.wait(10)
        return src[i]

    send = _in_thread(lambda: send_kv(sender, desc, PagedBlocks([0, 1, 2, 3], produce), 3.0))
    return sender, receiver, src, dst, go, send


def test_a_receiver_that_gives_up_settles_its_posted_receives_before_the_blocks_go():
    """gloo does not cancel a posted receive when its group is closed. A receiver that fails
    mid-transfer (here its own code raises after the first layer, the connection still up)
    gets the receives still posted; the sender's later layers do land in the cache, and
    `settle` returns only once they have. The decode worker frees the blocks after it."""
    sender, receiver, src, dst, go, send = _stalled_send("pair/late/1")

    def landed(i):
        raise RuntimeError("the receiver broke")

    with pytest.raises(TransferError, match="the receiver broke") as failed:
        recv_kv(receiver, LAYOUT, 5, target=lambda d: paged(dst, [8, 9, 10, 11]), on_layer=landed)
    settled = _in_thread(lambda: receiver.settle(failed.value.pending, 5.0))
    go.set()
    assert settled(10) is None
    assert torch.equal(dst[2][8:12], src[2][0:4])  # written after the receiver gave up
    assert isinstance(send(15), TransferError)  # no ack ever comes
    sender.close()


def test_after_a_receive_timeout_nothing_lands_and_settle_returns_at_once():
    """A receive that times out breaks gloo's connection: the receives posted after it fail
    at once, and the sender's later layers never land."""
    sender, receiver, src, dst, go, send = _stalled_send("pair/late/2")
    with pytest.raises(TransferError, match="Timed out") as failed:
        recv_kv(receiver, LAYOUT, 1.0, target=lambda d: paged(dst, [8, 9, 10, 11]))
    go.set()
    assert isinstance(send(15), TransferError)  # the connection is gone
    t0 = time.monotonic()
    receiver.settle(failed.value.pending, 5.0)
    assert time.monotonic() - t0 < 2.5
    assert not dst[1][8:12].any() and not dst[2][8:12].any()  # nothing landed late
    sender.close()


def listening_addresses(port: int) -> set[str]:
    """The local addresses a socket listens on at `port`, from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_the_rendezvous_store_listens_on_its_host_alone():
    """Whoever reaches a decode worker's store could join a pair and write KV into a reserved
    request's blocks: it listens on the transfer host only, never every interface."""
    server = store_server("127.0.0.1")
    assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    client = store_client("127.0.0.1", server.port, 5)
    client.set("k", b"v")
    assert server.get("k") == b"v"
