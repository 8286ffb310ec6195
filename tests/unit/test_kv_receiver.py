"""The decode worker's KV receiver, its transfer stubbed: however a transfer ends, the
request's blocks are given back only after the landing event (staged layers may still be
scattered on the transfer's stream); a client's cancel that came while the KV landed ends the
request CANCELLED, never as a failure to replay; and a cancel that comes while the request is
being admitted waits for the admission."""

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.protocol import TransferAborted
from workers import kv_receiver
from workers.engine.request import SamplingParams
from workers.kv_receiver import KVReceiver
from workers.messages import FirstToken, RequestSpec, encode_first

LAYOUT = KVLayout(2, 1, 4, 4, "float32")
SPEC = RequestSpec("r1", (1, 2, 3), SamplingParams(max_tokens=4, seed=1), attempt=1)


class Landing:
    """The held requests, as the receiver calls them: every call logged."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.during_admit = None  # run inside admit, as a concurrent call would

    def reserved(self, rid, attempt):
        return [0, 1], "writable"

    def admit(self, spec, first, landed):
        if self.during_admit is not None:
            self.during_admit()
        self.calls.append(("admit", spec.request_id, landed))

    def fail(self, rid, attempt, message, landed=None):
        self.calls.append(("fail", rid, landed))

    def cancel(self, rid, notify, attempt, landed=None):
        self.calls.append(("cancel", rid, notify, landed))
        return True


class Pair:
    def close(self):
        pass


def receiver(monkeypatch, landing, transfer):
    """A receiver whose recv_kv is `transfer(target)`."""

    def recv_kv(channel, layout, timeout_s, device, target, staging):
        return transfer(target)

    monkeypatch.setattr(kv_receiver, "recv_kv", recv_kv)
    r = KVReceiver("decode-0", LAYOUT, torch.device("cpu"), "127.0.0.1", 5, landing, None, None)
    r._pairs["prefill-0"] = (1, Pair())
    return r


def landed(target, then=None):
    """The KV lands whole: the landing event recorded, then `then` (an abort, a cancel)."""
    side = target(type("D", (), {"request_id": "r1", "num_blocks": 2})())
    side.landed = "landed-event"
    if then is not None:
        then()
    first = encode_first((FirstToken(7, -0.1, ()),))
    return None, first


def test_an_aborted_transfer_gives_the_blocks_back_after_the_landing(monkeypatch):
    landing = Landing()

    def abort():
        raise TransferAborted("the KV of r1 was aborted: cancelled during prefill")

    r = receiver(monkeypatch, landing, lambda target: landed(target, abort))
    assert not r.receive("prefill-0", 1, SPEC).ok
    assert landing.calls == [("fail", "r1", "landed-event")]


def test_a_cancel_while_the_kv_landed_ends_it_cancelled_even_when_the_transfer_fails(
    monkeypatch,
):
    landing = Landing()
    r = None

    def cancel_then_abort():
        assert r.defer_cancel("r1", True, 1)  # the client cancels: held until it has landed
        raise TransferAborted("the sender aborted")

    r = receiver(monkeypatch, landing, lambda target: landed(target, cancel_then_abort))
    r.receive("prefill-0", 1, SPEC)
    assert landing.calls == [("cancel", "r1", True, "landed-event")]


def test_a_cancel_during_the_admission_waits_for_it(monkeypatch):
    landing = Landing()
    r = receiver(monkeypatch, landing, landed)
    deferred = []
    landing.during_admit = lambda: deferred.append(r.defer_cancel("r1", True, 1))
    assert r.receive("prefill-0", 1, SPEC).ok
    assert deferred == [True]  # not applied at once, to blocks not yet admitted
    assert landing.calls == [("admit", "r1", "landed-event"), ("cancel", "r1", True, None)]
    assert not r.receiving("r1")
