import asyncio

from router.fleet.routing import RoutingPolicy, WorkerLoad
from router.requests.stream import RequestStream
from workers.engine.request import FinishReason
from workers.messages import Status, TokenEvent
from workers.model.loader import ModelSource
from workers.model.tokenizer import Tokenizer


def ev(offset, ids, finish=None):
    return TokenEvent("r", 1, offset, tuple(ids), finish_reason=finish)


def test_decode_prefers_free_blocks_and_skips_draining():
    p = RoutingPolicy(block_size=16)
    loads = [
        WorkerLoad("d0", kv_blocks_free=100, running=10),
        WorkerLoad("d1", kv_blocks_free=90),
        WorkerLoad("d2", kv_blocks_free=500, draining=True),
    ]
    assert [w.name for w in p.decode_candidates(loads)] == ["d1", "d0"]
    # A worker that just joined and has not reported yet is tried, not starved: it ranks
    # with the roomiest, less its own running penalty.
    fresh = WorkerLoad("d3")
    assert [w.name for w in p.decode_candidates([*loads, fresh])] == ["d3", "d1", "d0"]
    fresh.running = 3
    assert [w.name for w in p.decode_candidates([*loads, fresh])] == ["d1", "d3", "d0"]


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
    s = RequestStream.open("r", tok)
    s.put(ev(2, ids[2:4]))
    assert s.chunks == []  # ahead of the first token: held
    s.put(ev(0, ids[:2]))
    assert [c.offset for c in s.chunks] == [0, 2]
    s.put(ev(0, ids[:3]))
    assert len(s.chunks) == 2  # a replay of what was sent: dropped
    s.put(ev(3, ids[3:], FinishReason.STOP))
    assert s.tokens == ids and s.chunks[-1].finished
    assert s.chunks[-1].finish_reason == "stop" and s.chunks[-1].status is Status.OK
    assert "".join(c.text for c in s.chunks) == "naïve 🐝 bees"
    n = len(s.chunks)
    s.put(ev(99, [1]))
    assert len(s.chunks) == n  # nothing after the end


def test_replay_overlapping_what_was_sent_continues_exactly_once(smollm2_tokenizer_dir):
    """A replay starts over from an earlier offset (the log lagged): the overlap is dropped,
    the rest goes out once, and every follower sees the same chunks."""
    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    ids = tok.encode("one two three four five six")
    s = RequestStream.open("r", tok)

    async def go():
        follower = asyncio.create_task(_collect(s))
        s.put(ev(0, ids[:4]))
        s.put(TokenEvent("r", 2, 2, tuple(ids[2:6])))  # attempt 2 re-sends 2..3
        s.put(TokenEvent("r", 2, 6, tuple(ids[6:]), finish_reason=FinishReason.LENGTH))
        return await asyncio.wait_for(follower, 5)

    chunks = asyncio.run(go())
    got = [t for c in chunks for t in c.token_ids]
    assert got == ids and chunks[-1].finish_reason == "length"


def test_stream_ended_with_a_status_carries_it(smollm2_tokenizer_dir):
    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    s = RequestStream.open("r", tok, prior=tok.encode("already sent"))
    assert s.next_offset == len(tok.encode("already sent"))
    s.end(Status.UNAVAILABLE, "error", "gave up after 4 attempts")
    last = s.chunks[-1]
    assert last.finished and last.status is Status.UNAVAILABLE and "4 attempts" in last.error


async def _collect(stream):
    return [c async for c in stream.follow()]


def test_choices_streams_merge_as_they_come_each_tagged_until_all_end(smollm2_tokenizer_dir):
    """n > 1: the choices' streams reach the caller interleaved as their events arrive, each
    chunk tagged with its choice, and the merged stream ends once every choice has ended."""
    from router.requests.stream import follow_all

    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    ids = tok.encode("one two three four")
    streams = [RequestStream.open(f"r#{i}" if i else "r", tok, index=i) for i in range(3)]

    async def go():
        got = []

        async def take():
            async for c in follow_all(streams):
                got.append((c.index, c.token_ids, c.finished))

        task = asyncio.create_task(take())
        await asyncio.sleep(0.01)  # following all three
        streams[1].put(ev(0, ids[:2]))
        await asyncio.sleep(0.01)
        streams[0].put(ev(0, ids[:1]))
        streams[0].put(ev(1, ids[1:], FinishReason.LENGTH))
        streams[2].end(Status.OK, "cancelled")
        await asyncio.sleep(0.01)
        assert not task.done()  # choice 1 has not ended
        streams[1].put(ev(2, ids[2:], FinishReason.STOP))
        await asyncio.wait_for(task, 1)
        return got

    got = asyncio.run(go())
    assert got[0] == (1, tuple(ids[:2]), False)  # in arrival order, not index order
    assert sorted({i for i, _, _ in got}) == [0, 1, 2]
    for i, s in enumerate(streams):
        mine = [t for j, ts, _ in got if j == i for t in ts]
        assert mine == s.tokens and [f for j, _, f in got if j == i][-1]
