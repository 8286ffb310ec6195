"""Constrained decoding in the engine, on a tiny random Llama with SmolLM2's tokenizer: its
draws are noise, so only the grammar keeps them in shape. Every output of every schema
parses and validates with `jsonschema`, greedy and sampled; regex and choice outputs match;
n > 1 choices are each valid; a sequence restarted from the tokens it emitted (on another
engine: a decode worker, a replay) continues token for token; bad constraints are refused
naming the problem; blocks are free after."""

import json
import re
from dataclasses import replace

import jsonschema
import pytest

from workers.engine.config import EngineConfig
from workers.engine.constraint import Constraint, ConstraintKind
from workers.engine.engine import LLMEngine
from workers.engine.grammar import GrammarError, closed_objects
from workers.engine.request import SamplingParams

PROMPT = [1, 504, 3575, 282, 4649, 314, 28, 19556, 42, 7]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                },
                "required": ["name", "id"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "bounded_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_and_optional": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "note": {"type": "string", "maxLength": 6},
            "size": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["color"],
    },
    "number_range": {
        "type": "object",
        "properties": {"t": {"type": "number", "minimum": -1.5, "maximum": 2.5}},
        "required": ["t"],
    },
    "any_of": {
        "anyOf": [
            {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
            {"type": "string", "maxLength": 5},
        ]
    },
}
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    cfg = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=256, block_size=4)
    return LLMEngine(cfg), LLMEngine(cfg)


def run(engine, requests):
    """Runs (sampling, output_ids) requests together: each choice's tokens and finish."""
    ids = [engine.add_request(PROMPT, sp, output_ids=out) for sp, out in requests]
    got: dict[tuple[int, int], list[int]] = {}
    ends = {}
    while engine.has_unfinished():
        for o in engine.step():
            key = (ids.index(o.request_id), o.index)
            got.setdefault(key, []).extend(o.new_token_ids)
            if o.finished:
                assert o.error is None, o.error
                ends[key] = o.finish_reason.value
    s = engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total
    return got, ends


def text(engine, tokens) -> str:
    return engine.tokenizer.decode(tokens)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_output_validates_against_its_schema(engines, name, mode):
    engine, _ = engines
    schema = SCHEMAS[name]
    sp = SamplingParams(max_tokens=160, constraint=Constraint.json_schema(schema), **mode)
    got, ends = run(engine, [(sp, ())])
    out = text(engine, got[0, 0])
    assert ends[0, 0] == "stop", f"{name}: ran out at {out!r}"
    jsonschema.validate(json.loads(out), schema)


def test_n_choices_each_hold_their_own_matcher_and_all_validate(engines):
    engine, _ = engines
    schema = SCHEMAS["enum_and_optional"]
    sp = SamplingParams(n=4, max_tokens=80, constraint=Constraint.json_schema(schema), **SAMPLED)
    got, ends = run(engine, [(sp, ())])
    outs = [text(engine, got[0, i]) for i in range(4)]
    for out in outs:
        jsonschema.validate(json.loads(out), schema)
    assert all(ends[0, i] == "stop" for i in range(4))


@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_regex_and_choice_outputs_match(engines, mode):
    engine, _ = engines
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    choices = ("yes", "no", "not sure")
    gbnf = 'root ::= "a" ("b" | "c") ("b" | "c")? "."'
    constraints = [
        (30, Constraint(ConstraintKind.REGEX, pattern)),
        (30, Constraint(ConstraintKind.CHOICE, choices=choices)),
        (60, Constraint(ConstraintKind.JSON_OBJECT)),
        (30, Constraint(ConstraintKind.GRAMMAR, gbnf)),
    ]
    reqs = [(SamplingParams(max_tokens=n, constraint=c, **mode), ()) for n, c in constraints]
    got, ends = run(engine, reqs)
    assert re.fullmatch(pattern, text(engine, got[0, 0]))
    assert text(engine, got[1, 0]) in choices
    obj = text(engine, got[2, 0])
    if ends[2, 0] == "stop":
        assert isinstance(json.loads(obj), dict)
    else:
        assert obj.startswith("{")
    assert ends[3, 0] == "stop"
    assert re.fullmatch(r"a[bc][bc]?\.", text(engine, got[3, 0]))


@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_constrained_sequence_restarted_from_its_tokens_continues_token_for_token(engines, mode):
    """The decode worker's case (first token from the prefill) and a replay's (any prefix of
    the log): the matcher is rebuilt from the tokens, on another engine, and the draws after
    them are the uninterrupted run's."""
    first, second = engines
    schema = SCHEMAS["nested"]
    sp = SamplingParams(max_tokens=120, constraint=Constraint.json_schema(schema), **mode)
    whole = run(first, [(sp, ())])[0][0, 0]
    assert len(whole) > 8
    for k in (1, 5, len(whole) - 1):
        rest, ends = run(second, [(sp, whole[:k])])
        assert whole[:k] + rest[0, 0] == whole, f"restart after {k} tokens diverged"
        assert ends[0, 0] == "stop"


def test_the_grammar_end_outranks_min_tokens_and_ignore_eos(engines):
    engine, _ = engines
    c = Constraint(ConstraintKind.CHOICE, choices=("ok",))
    sp = SamplingParams(max_tokens=20, temperature=0, min_tokens=10, ignore_eos=True, constraint=c)
    got, ends = run(engine, [(sp, ())])
    assert ends[0, 0] == "stop"
    assert text(engine, got[0, 0]) == "ok"


@pytest.mark.parametrize(
    "constraint, problem",
    [
        (Constraint(ConstraintKind.REGEX, "a(b"), "unclosed group"),
        (Constraint(ConstraintKind.GRAMMAR, "start: nothere"), "nothere"),
        (Constraint.json_schema({"type": "wat"}), "wat"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_problem(engines, constraint, problem):
    engine, _ = engines
    with pytest.raises(GrammarError, match=problem):
        engine.add_request(PROMPT, SamplingParams(constraint=constraint))
    assert not engine.has_unfinished()


def test_constraint_shapes_are_checked_before_compiling():
    with pytest.raises(ValueError, match="not JSON"):
        Constraint(ConstraintKind.JSON_SCHEMA, "{nope")
    with pytest.raises(ValueError, match="at least one"):
        Constraint(ConstraintKind.CHOICE)
    with pytest.raises(ValueError, match="use one of"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="max_constraint_bytes"):
        Constraint(ConstraintKind.REGEX, "a" * 70_000)


def test_a_hostile_pattern_compiles_within_bounds(engines):
    """A repetition that takes other compilers minutes is bounded by llguidance's fuel."""
    engine, _ = engines
    c = Constraint.json_schema({"type": "string", "pattern": "^[a-z]{1,50000}$"})
    sp = SamplingParams(max_tokens=4, temperature=0, constraint=c)
    got, _ = run(engine, [(sp, ())])
    assert re.fullmatch(r'"[a-z]*', text(engine, got[0, 0]))


def test_closed_objects_keep_what_the_schema_allows():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}}},
        "patternProperties": {"^x": {}},
        "$defs": {"d": {"properties": {"c": {}}}},
    }
    out = closed_objects(schema)
    assert "additionalProperties" not in out  # patternProperties speaks of others
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert closed_objects({"properties": {}, "additionalProperties": True})["additionalProperties"]


def test_constraints_compose_with_every_sampling_field(engines):
    """Bias, penalties, min_p/top-k, logprobs and a stop string under a grammar: the output
    stays within it, a stop string still cuts it, and logprobs come with every token."""
    engine, _ = engines
    schema = SCHEMAS["enum_and_optional"]
    tok = engine.tokenizer
    rich = dict(
        temperature=0.9,
        seed=8,
        top_k=50,
        min_p=0.01,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={tok.encode('"red')[0]: 5.0},
        logprobs=True,
        top_logprobs=2,
    )
    whole = SamplingParams(max_tokens=80, constraint=Constraint.json_schema(schema), **rich)
    ids = engine.add_request(PROMPT, whole)
    out, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == ids
            out += o.new_token_ids
            lps += o.new_logprobs
    assert len(lps) == len(out)
    text_out = text(engine, out)
    jsonschema.validate(json.loads(text_out), schema)
    # The same draw cut by a stop string that its output holds.
    cut = text_out[: text_out.index(":") + 1]
    sp = SamplingParams(
        max_tokens=80, constraint=Constraint.json_schema(schema), stop=(":",), **rich
    )
    rid = engine.add_request(PROMPT, sp)
    got = []
    while engine.has_unfinished():
        for o in engine.step():
            got.append(o)
    assert got[-1].finish_reason.value == "stop" and got[-1].request_id == rid
    assert got[-1].text == cut[:-1]  # cut before the stop string, as vLLM cuts


def test_constrained_and_free_rows_share_a_batch_without_touching_each_other(engines):
    engine, _ = engines
    free = SamplingParams(max_tokens=24, temperature=0.9, seed=2, ignore_eos=True)
    alone = run(engine, [(free, ())])[0][0, 0]
    schema = SCHEMAS["nested"]
    guided = SamplingParams(max_tokens=120, constraint=Constraint.json_schema(schema), **GREEDY)
    got, ends = run(engine, [(guided, ()), (free, ()), (guided, ())])
    assert got[1, 0] == alone
    for i in (0, 2):
        jsonschema.validate(json.loads(text(engine, got[i, 0])), schema)


def test_preempted_constrained_sequences_recompute_and_go_on_the_same(tiny_llama_dir):
    """A pool too small for all of them: sequences are preempted and recomputed, their
    matchers kept (or rebuilt) in step with their tokens."""
    schema = SCHEMAS["bounded_array"]
    sp = SamplingParams(max_tokens=60, constraint=Constraint.json_schema(schema), **SAMPLED)
    roomy = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=256, block_size=4))
    want, _ = run(roomy, [(replace(sp, seed=i), ()) for i in range(6)])
    tight = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=24, block_size=4))
    got, _ = run(tight, [(replace(sp, seed=i), ()) for i in range(6)])
    assert tight.stats().preemptions > 0
    assert got == want


def test_tokens_that_break_the_grammar_end_the_request_in_error(engines):
    """A replay whose logged tokens the grammar refuses (another version's log, a corrupt
    record): an error naming it, never a silent "stop"."""
    engine, _ = engines
    c = Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))
    bad = engine.tokenizer.encode("maybe")
    engine.add_request(PROMPT, SamplingParams(max_tokens=8, constraint=c), output_ids=bad)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason.value == "error"
    assert "breaks its grammar" in outs[-1].error
    s = engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total
