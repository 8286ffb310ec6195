"""A decode worker's held requests give blocks back only once no transfer can still write
them: a KV transfer that completed records an event after its last write (staged layers are
scattered on the transfer's stream, which may still be running when the host sees the
receive done), and the engine's stream waits on it before a cancelled or failed request's
blocks return to the pool, where the next request would write them first."""

from kv_transfer.streams import StreamOps
from workers.engine.request import SamplingParams
from workers.held_requests import HeldRequests
from workers.messages import Phase, RequestSpec


class Log(list):
    pass


class Streams(StreamOps):
    def __init__(self, log: Log) -> None:
        self.log = log

    def record(self):
        return "reserved-event"

    def wait(self, event) -> None:
        if event is not None:
            self.log.append(("stream waits", event))


class Engine:
    """The engine's block bookkeeping, as the log sees it."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def reserve(self, rid, num_tokens):
        self.log.append(("reserve", rid))
        return 2

    def reserved_blocks(self, rid):
        return [4, 5]

    def abort(self, rid, choices=True):
        self.log.append(("blocks freed", rid))

    def unforked_choices(self, rid):
        return 0


class Relay:
    def __init__(self, log: Log) -> None:
        self.log = log

    def follow(self, rid, router_id):
        pass

    def end(self, cid):
        pass

    def emit(self, events):
        self.log += [("event", e.request_id, e.status) for e in events]


def held_with_kv_in_flight():
    log = Log()
    held = HeldRequests("decode-0", Engine(log), Relay(log), Streams(log), lambda rid: False)
    assert held.reserve("r1", 0, 40, "router-a", ttl_s=30) is not None
    assert held.reserved_blocks("r1", 0) == ([4, 5], "reserved-event")
    return log, held


def test_a_request_cancelled_while_its_kv_landed_frees_its_blocks_after_the_landing():
    log, held = held_with_kv_in_flight()
    assert held.cancel("r1", notify=True, attempt=0, landed="landed-event")
    waited = log.index(("stream waits", "landed-event"))
    assert waited < log.index(("blocks freed", "r1"))
    assert held.phase("r1", 0) is Phase.ABSENT


def test_a_request_failed_after_its_kv_landed_frees_its_blocks_after_the_landing():
    log, held = held_with_kv_in_flight()
    held.fail("r1", 0, "the sender gave up", landed="landed-event")
    assert log.index(("stream waits", "landed-event")) < log.index(("blocks freed", "r1"))


def test_kv_landing_for_a_request_dropped_meanwhile_is_still_waited_for():
    log, held = held_with_kv_in_flight()
    held.drop("r1")  # superseded while its KV was on the way
    spec = RequestSpec("r1", (1, 2, 3), SamplingParams(max_tokens=4, seed=7), attempt=0)
    held.admit(spec, (), landed="landed-event")
    assert ("stream waits", "landed-event") in log
    assert held.phase("r1", 0) is Phase.ABSENT
