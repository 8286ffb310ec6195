"""Overlap scheduling: an engine that schedules and launches the next step while the last
one runs gives token-for-token the same streams as one that waits for every step, through
greedy and seeded draws, logprobs, stop tokens, stop strings, EOS, min_tokens, aborts,
preemption, grammar rows, n > 1, penalties, replays and a KV handoff. The extra token a
stop leaves in flight is computed and dropped, never returned."""

from dataclasses import replace

import pytest

from workers.engine.config import EngineConfig
from workers.engine.constraint import Constraint, ConstraintKind
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    [1, 504, 3575, 282, 4649, 314, 28, 19556],
    [1, 42, 7, 19556, 314],
    [1, 9, 8, 7, 6, 5, 4, 3, 2, 504, 3575, 282, 4649],
    [1, 1000, 2000, 3000],
]


def make_pair(tiny_llama_dir, **kw):
    cfg = EngineConfig(model=str(tiny_llama_dir), block_size=4, overlap="off", **kw)
    off = LLMEngine(cfg)
    on = LLMEngine(replace(cfg, overlap="on"), off.tokenizer, off.runner.model)
    return off, on


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    return make_pair(tiny_llama_dir, num_kv_blocks=96)


def drive(engine, arrivals, abort_after=None, max_calls=2000):
    """Step the engine to the end. `arrivals`: {step call: [(prompt, sampling, kwargs)]};
    `abort_after`: {arrival number: tokens}, aborted once the caller has seen that many.
    Returns each sequence's stream by (arrival, choice index), and the step calls made."""
    seen, names = {}, {}
    calls = 0
    while calls < max_calls and (arrivals or engine.has_unfinished()):
        for prompt, sp, kw in arrivals.pop(calls, []):
            names[engine.add_request(prompt, sp, **kw)] = len(names)
        for o in engine.step():
            k = (names[o.request_id], o.index)
            got = seen.setdefault(k, {"ids": [], "lps": [], "tops": [], "end": None, "text": None})
            assert got["end"] is None, f"{k}: output after its final one"
            got["ids"] += o.new_token_ids
            got["lps"] += o.new_logprobs or []
            got["tops"] += o.new_top_logprobs or []
            got["text"] = o.text
            if o.finished:
                got["end"] = (o.finish_reason, o.error)
        for rid, n in list((abort_after or {}).items()):
            got = seen.get((rid, 0))
            if got is not None and len(got["ids"]) >= n and got["end"] is None:
                name = next(r for r, i in names.items() if i == rid)
                assert engine.abort(name)
                got["end"] = ("aborted", None)
                del abort_after[rid]
        calls += 1
    assert not engine.has_unfinished(), "engine did not drain"
    s = engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.reserved == 0, "blocks left held"
    return seen, calls


def same_streams(engines, scenario, abort_after=None, overlapped=True):
    off, on = engines
    before = on.overlapped_steps
    want, _ = drive(off, scenario(), dict(abort_after or {}))
    got, _ = drive(on, scenario(), dict(abort_after or {}))
    assert got == want
    assert off.overlapped_steps == 0
    assert (on.overlapped_steps > before) == overlapped
    return want


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_greedy_seeded_and_logprobs_arriving_over_time(pair):
    def scenario():
        return {
            0: [
                (PROMPTS[0], greedy(12), {}),
                (
                    PROMPTS[1],
                    SamplingParams(
                        max_tokens=9, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True
                    ),
                    {},
                ),
            ],
            2: [(PROMPTS[2], greedy(7, logprobs=True, top_logprobs=3), {})],
            5: [
                (
                    PROMPTS[3],
                    SamplingParams(
                        max_tokens=10,
                        temperature=1.0,
                        top_k=20,
                        seed=8,
                        min_p=0.05,
                        ignore_eos=True,
                    ),
                    {},
                ),
                (PROMPTS[0], greedy(1), {}),
            ],
        }

    got = same_streams(pair, scenario)
    assert [len(got[(i, 0)]["ids"]) for i in range(5)] == [12, 9, 7, 10, 1]
    assert len(got[(2, 0)]["tops"]) == 7 and len(got[(2, 0)]["lps"]) == 7


def test_stop_tokens_eos_and_stop_strings_drop_the_token_in_flight(pair, monkeypatch):
    off, on = pair
    ref, _ = drive(off, {0: [(p, greedy(16), {}) for p in PROMPTS]})
    streams = [ref[(i, 0)]["ids"] for i in range(len(PROMPTS))]
    stop_tok, eos = streams[0][3], streams[1][4]
    text = off.tokenizer.decode(streams[2])
    stop_str = text[len(text) // 2 : len(text) // 2 + 3]
    for engine in pair:  # a token the model draws here plays EOS
        monkeypatch.setattr(engine, "eos_token_ids", (eos,))

    def scenario():
        sp = SamplingParams(max_tokens=16, temperature=0)
        return {
            0: [
                (PROMPTS[0], replace(sp, stop_token_ids=(stop_tok,)), {}),
                (PROMPTS[1], sp, {}),
                (PROMPTS[2], replace(sp, stop=(stop_str,)), {}),
                (PROMPTS[1], replace(sp, min_tokens=8), {}),  # EOS held back until 8
                (PROMPTS[3], greedy(16), {}),
            ]
        }

    computed = [e.decode_tokens for e in pair]
    got = same_streams(pair, scenario)
    assert got[(0, 0)]["ids"][-1] == stop_tok and got[(0, 0)]["end"][0] == "stop"
    assert got[(1, 0)]["ids"][-1] == eos and got[(1, 0)]["end"][0] == "stop"
    assert len(got[(1, 0)]["ids"]) == 5
    assert got[(2, 0)]["end"][0] == "stop" and stop_str not in got[(2, 0)]["text"]
    assert len(got[(3, 0)]["ids"]) >= 8
    # The overlapping engine computed the rows that the stops left in flight, and dropped them.
    extra = [e.decode_tokens - c for e, c in zip(pair, computed)]
    assert extra[1] > extra[0]


def test_aborts_end_the_stream_where_the_caller_stopped_reading(pair):
    def scenario():
        return {0: [(p, greedy(20), {}) for p in PROMPTS]}

    got = same_streams(pair, scenario, abort_after={0: 3, 2: 7})
    assert len(got[(0, 0)]["ids"]) == 3 and len(got[(2, 0)]["ids"]) == 7
    assert got[(1, 0)]["end"][0] == "length"


def test_preempted_sequences_recompute_with_a_token_in_flight(tiny_llama_dir):
    engines = make_pair(tiny_llama_dir, num_kv_blocks=14)

    def scenario():
        return {
            0: [(p, greedy(14), {}) for p in PROMPTS[:3]],
            1: [
                (
                    PROMPTS[3],
                    SamplingParams(max_tokens=14, temperature=0.7, seed=1, ignore_eos=True),
                    {},
                )
            ],
        }

    same_streams(engines, scenario)
    assert all(e.scheduler.num_preemptions > 0 for e in engines)


def test_grammar_forks_and_penalties_fall_back_to_waiting_beside_overlapped_rows(pair):
    choice = Constraint(ConstraintKind.CHOICE, choices=("yes", "no", "maybe"))

    def scenario():
        return {
            0: [(PROMPTS[0], greedy(12), {})],
            1: [(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, constraint=choice), {})],
            3: [
                (
                    PROMPTS[2],
                    SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=5, ignore_eos=True),
                    {},
                )
            ],
            8: [(PROMPTS[3], greedy(8, repetition_penalty=1.3, frequency_penalty=0.4), {})],
            14: [(PROMPTS[0], greedy(6), {})],
        }

    got = same_streams(pair, scenario)
    assert off_text(pair[0], got[(1, 0)]["ids"]) in ("yes", "no", "maybe")
    assert {k for k in got if k[0] == 2} == {(2, 0), (2, 1), (2, 2)}


def off_text(engine, ids):
    return engine.tokenizer.decode([t for t in ids if t not in engine.eos_token_ids])


def test_a_replay_continues_the_same_with_overlap(pair):
    off, _ = pair
    sp = SamplingParams(max_tokens=12, temperature=0.8, seed=21, ignore_eos=True)
    whole, _ = drive(off, {0: [(PROMPTS[2], sp, {})]})
    ids = whole[(0, 0)]["ids"]

    def scenario():
        return {0: [(PROMPTS[2], sp, {"output_ids": ids[:5]})]}

    got = same_streams(pair, scenario)
    assert got[(0, 0)]["ids"] == ids[5:]


def test_a_handoff_decodes_the_same_on_an_overlapping_decode_engine(pair, tiny_llama_dir):
    prefill = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4),
        pair[0].tokenizer,
        pair[0].runner.model,
    )
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True)
    rid = prefill.add_request(PROMPTS[0], sp, stop_after=1, keep_kv=True)
    (first,) = [o for _ in range(10) for o in prefill.step()][:1]
    assert first.finished and not prefill.has_unfinished()
    streams = []
    for decode in pair:
        assert decode.reserve(rid, len(PROMPTS[0])) == len(first.kv_blocks)
        target = decode.reserved_blocks(rid)
        for layer in range(decode.kv_layout.num_layers):
            decode.import_kv_layer(layer, target, prefill.export_kv_layer(layer, first.kv_blocks))
        decode.add_prefilled(rid, PROMPTS[0], list(first.new_token_ids), sp, sp.seed)
        out = list(first.new_token_ids)
        while decode.has_unfinished():
            out += [t for o in decode.step() for t in o.new_token_ids]
        streams.append(out)
    prefill.release_kv(first.kv_blocks)
    assert streams[0] == streams[1] and len(streams[0]) == 10
    assert pair[1].overlapped_steps > 0


@pytest.mark.parametrize("where", ["launch", "result"])
def test_a_failing_step_fails_its_requests_after_the_step_before_streams(pair, monkeypatch, where):
    """The 4th step raises as it is launched, or as its tokens are read: with overlap as
    without, every token of the steps before it reaches the caller, then each request it
    ran ends in error, and every block comes back."""
    for engine in pair:
        launch, calls = engine.runner.launch, [0]

        def failing(*args, launch=launch, calls=calls, **kwargs):
            calls[0] += 1
            if calls[0] == 4 and where == "launch":
                raise RuntimeError("device lost")
            step = launch(*args, **kwargs)
            if calls[0] == 4:

                def broken():
                    raise RuntimeError("device lost")

                step.result = broken
            return step

        monkeypatch.setattr(engine.runner, "launch", failing)

    def scenario():
        return {0: [(p, greedy(10), {}) for p in PROMPTS[:3]], 1: [(PROMPTS[3], greedy(10), {})]}

    got = same_streams(pair, scenario)
    assert all(g["end"][0] == "error" and "device lost" in g["end"][1] for g in got.values())
    assert [len(got[(i, 0)]["ids"]) for i in range(4)] == [3, 3, 3, 2]  # steps 1 to 3


def test_an_id_ended_and_taken_again_while_a_step_runs_is_another_request(pair):
    """Aborted with its token in flight, then its id given to a new request before the step
    lands: the landing drops the old request's token, and never touches the new one."""
    fresh, _ = drive(pair[0], {0: [(PROMPTS[1], greedy(6), {})]})
    for engine in pair:
        engine.add_request(PROMPTS[0], greedy(20), request_id="r")
        for _ in range(4):
            engine.step()
        assert engine.abort("r")
        engine.add_request(PROMPTS[1], greedy(6), request_id="r")
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert [t for o in outs for t in o.new_token_ids] == fresh[(0, 0)]["ids"]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        s = engine.stats()
        assert s.kv_blocks_free == s.kv_blocks_total


def test_pacing_charges_a_span_to_the_step_whose_tokens_it_waited_for(tiny_llama_dir):
    """With a step left running, the span between two steps' starts is spent waiting for
    the step before: pacing learns each step's cost under that step's shape."""
    from tests.unit.sched_helpers import make_request, make_scheduler
    from workers.engine.scheduler_output import SampledToken

    clock = [100.0]
    s = make_scheduler(
        num_blocks=512, block_size=4, prefill_chunk_size=16, max_num_batched_tokens=64,
        target_tpot_ms=50.0, clock=lambda: clock[0],
    )  # fmt: skip
    seen = []
    s.gates.pacer.observe = lambda d, p, seconds, now: seen.append((d, p, round(seconds, 6)))
    for i in range(3):
        s.add_request(make_request(f"r{i}", prompt_len=40, max_tokens=6))

    def cost(out):  # what the device takes for a step of this shape
        return 0.010 + 0.001 * len(out.decodes) + 0.0001 * sum(p.num_tokens for p in out.prefills)

    flight = None
    for _ in range(12):
        out = s.schedule()
        if not out.scheduled:
            break
        if flight is not None:  # wait for the step in flight, then land it
            clock[0] += cost(flight)
            s.resolve(flight, [SampledToken(r.request_id, 7) for r in flight.scheduled if r.sample])
        s.advance(out)
        flight = out
    assert len(seen) >= 6 and {p > 0 for _, p, _ in seen} == {True, False}  # both kinds
    for d, p, seconds in seen:
        assert seconds == round(0.010 + 0.001 * d + 0.0001 * p, 6), (d, p, seconds)
