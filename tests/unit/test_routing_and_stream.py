from router.routing import RoutingPolicy, WorkerLoad
from router.stream import Event, RequestStream
from workers.model.loader import ModelSource
from workers.model.tokenizer import Tokenizer


def test_decode_prefers_free_blocks_and_skips_draining():
    p = RoutingPolicy(block_size=16)
    loads = [
        WorkerLoad("d0", kv_blocks_free=100, running=10),
        WorkerLoad("d1", kv_blocks_free=90),
        WorkerLoad("d2", kv_blocks_free=500, draining=True),
    ]
    assert [w.name for w in p.decode_candidates(loads)] == ["d1", "d0"]


def test_prefill_affinity_within_slack_else_least_loaded():
    p = RoutingPolicy(block_size=4, affinity_slack_tokens=100)
    a, b = WorkerLoad("p0"), WorkerLoad("p1")
    prompt = list(range(40))
    assert p.pick_prefill([a, b], prompt).name == "p0"
    a.queued_tokens = 50  # still within the slack: the cached prefix wins
    assert p.pick_prefill([a, b], prompt + [1]).name == "p0"
    a.queued_tokens = 500
    assert p.pick_prefill([a, b], prompt).name == "p1"
    assert p.pick_prefill([a, b], [7, 8, 9]).name == "p1"  # no full block: least loaded
    assert p.pick_prefill([WorkerLoad("x", alive=False)], prompt) is None


def test_stream_orders_dedupes_and_never_splits_characters(smollm2_tokenizer_dir):
    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    ids = tok.encode("naïve 🐝 bees")
    s = RequestStream("r", tok, ())
    assert s.order(Event(2, ids[2:4])) == []  # ahead of the first token: held
    first = s.order(Event(0, ids[:2]))
    assert [c.offset for c in first] == [0, 2]
    assert s.order(Event(0, ids[:3])) == []  # a replay of what was sent: dropped
    rest = s.order(Event(3, ids[3:], finished=True, finish_reason="stop"))
    assert s.tokens == ids and rest[-1].finished
    text = "".join(c.text for c in first + rest)
    assert text == "naïve 🐝 bees"
    assert s.order(Event(99, [1])) == []  # nothing after the end
