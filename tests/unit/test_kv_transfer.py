"""The handoff protocol over the in-process channel and over real gloo pair groups (two
threads of this process, a real TCPStore on loopback)."""

import threading
import time

import pytest
import torch

from kv_transfer.channel import StagingBuffers, recv_kv, send_kv
from kv_transfer.inprocess import InProcessChannel
from kv_transfer.layout import KVLayout, LayoutMismatch
from kv_transfer.protocol import TransferAborted, TransferDescriptor, TransferError
from kv_transfer.torch_dist import PairGroup, store_client, store_server
from workers.messages import FirstToken, decode_first, encode_first

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def payload(desc):
    torch.manual_seed(1)
    return [torch.randn(LAYOUT.layer_shape(desc.num_blocks)) for _ in range(LAYOUT.num_layers)]


def round_trip(sender, receiver, desc, layers, extra=b"first tokens"):
    """Send on one side while the other receives in a thread; check what arrived: every
    layer, and the trailer's payload."""
    got = {}
    staging = StagingBuffers()
    receive = _in_thread(
        lambda: recv_kv(
            receiver, LAYOUT, 5, staging=staging, on_layer=lambda i, t: got.update({i: t.clone()})
        )
    )
    send_kv(sender, desc, layers, 5, verdict=lambda: (True, extra))
    got_desc, got_extra = receive(10)
    assert got_desc == desc and got_extra == extra
    assert sorted(got) == list(range(LAYOUT.num_layers))
    assert all(torch.equal(got[i], layer) for i, layer in enumerate(layers))


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


def test_in_process_round_trip_and_refusal():
    a, b = InProcessChannel.pair()
    desc = TransferDescriptor("r1", LAYOUT, 2, 7)
    layers = payload(desc)
    round_trip(a, b, desc, layers)
    # A receiver that does not expect the request refuses it, and both sides say so.
    receiver = _in_thread(lambda: recv_kv(b, LAYOUT, 5, accept=lambda d: False))
    with pytest.raises(TransferError, match="refused"):
        send_kv(a, desc, layers, 5)
    outcome = receiver(5)
    assert isinstance(outcome, TransferError) and "no reservation matches" in str(outcome)


def test_layers_leave_as_they_are_produced_and_the_trailer_comes_last():
    """Layer i+1 is produced only once the receiver holds layer i: a sender that waited for
    every layer before sending would never finish. The trailer's payload, decided after the
    last layer, arrives with the transfer."""
    a, b = InProcessChannel.pair()
    desc = TransferDescriptor("r1", LAYOUT, 2, 7)
    layers = payload(desc)
    landed = [threading.Event() for _ in layers]

    def produce():
        for i, layer in enumerate(layers):
            if i:
                assert landed[i - 1].wait(5), f"layer {i - 1} did not land before {i} was made"
            yield layer

    receive = _in_thread(lambda: recv_kv(b, LAYOUT, 5, on_layer=lambda i, t: landed[i].set()))
    send_kv(a, desc, produce(), 5, verdict=lambda: (True, b"\x00late\xff"))
    assert receive(10) == (desc, b"\x00late\xff")


def test_an_aborted_transfer_fails_both_sides_and_keeps_the_pair():
    a, b = InProcessChannel.pair()
    desc = TransferDescriptor("r1", LAYOUT, 2, 7)
    layers = payload(desc)
    receive = _in_thread(lambda: recv_kv(b, LAYOUT, 5))
    with pytest.raises(TransferAborted, match="prefill failed"):
        send_kv(a, desc, layers, 5, verdict=lambda: (False, b"the prefill failed"))
    outcome = receive(5)
    assert isinstance(outcome, TransferAborted) and "the prefill failed" in str(outcome)
    round_trip(a, b, desc, layers)  # still in step: the next transfer goes through


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
    desc = TransferDescriptor("r1", LAYOUT, 3, 12)
    layers = payload(desc)
    round_trip(sender, receiver, desc, layers)
    round_trip(sender, receiver, desc, layers)  # staging buffers reused, pair reused

    # The peer goes away: the send fails within its timeout instead of hanging.
    receiver.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        send_kv(sender, desc, layers, 1.0)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TransferError, match="closed"):
        sender.send([torch.zeros(1)], 1.0)

    # The next generation of the pair forms afresh and works.
    sender2, receiver2 = _pair(server.port, server, "pair/p0/2")
    round_trip(sender2, receiver2, desc, layers)
    sender2.close()
    receiver2.close()


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
        gather=None,
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
