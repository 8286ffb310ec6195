"""n > 1 on a tiny random Llama: the prompt is computed once, the choices share its blocks
copy-on-write, and choice i equals a lone request seeded choice_seed(seed, i)."""

import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams, choice_seed
from workers.offline import LLM, GenerationRequest

PROMPT = [1, 504, 3575, 282, 4649, 314, 28]  # 7 tokens: the last block is shared half full


def engine(tiny_llama_dir, **kw) -> LLMEngine:
    cfg = {"model": str(tiny_llama_dir), "num_kv_blocks": 128, "block_size": 4, **kw}
    return LLMEngine(EngineConfig(**cfg))


def run(e: LLMEngine, requests: list[tuple[list[int], SamplingParams]]):
    """Every choice's tokens, by (request index, choice), and the most blocks held at once."""
    ids = [e.add_request(p, sp) for p, sp in requests]
    out: dict[tuple[int, int], list[int]] = {}
    ended = set()
    peak = 0
    while e.has_unfinished():
        for o in e.step():
            key = (ids.index(o.request_id), o.index)
            out.setdefault(key, []).extend(o.new_token_ids)
            if o.finished:
                assert o.error is None, o.error
                ended.add(key)
        peak = max(peak, e.pool.num_blocks - e.pool.num_free_blocks)
    assert ended == set(out)
    return out, peak


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__dataclass_fields__}


def lone(sp: SamplingParams, i: int) -> SamplingParams:
    """Choice i of `sp` as a request of its own."""
    return SamplingParams(**{**_fields(sp), "n": 1, "seed": choice_seed(sp.seed, i)})


def lone_choices(e: LLMEngine, sp: SamplingParams) -> list[list[int]]:
    return [run(e, [(PROMPT, lone(sp, i))])[0][0, 0] for i in range(sp.n)]


SAMPLED = SamplingParams(
    n=8,
    max_tokens=12,
    temperature=1.0,
    top_p=0.95,
    seed=11,
    ignore_eos=True,
    repetition_penalty=1.2,
)


def test_choices_equal_lone_requests_with_derived_seeds_and_free_every_block(tiny_llama_dir):
    e = engine(tiny_llama_dir)
    out, _ = run(e, [(PROMPT, SAMPLED)])
    assert sorted(out) == [(0, i) for i in range(8)]
    expected = lone_choices(e, SAMPLED)
    assert [out[0, i] for i in range(8)] == expected
    assert len({tuple(t) for t in expected}) > 1  # the choices differ
    assert e.pool.num_free_blocks == e.pool.num_blocks


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_forked_choices_hold_fewer_blocks_than_lone_requests(tiny_llama_dir, prefix_caching):
    sp = SamplingParams(**{**_fields(SAMPLED), "max_tokens": 3})
    long_prompt = PROMPT * 6  # 42 tokens: 10 full blocks and a shared half-full one
    # Fresh engines: separate requests arriving together find nothing cached yet.
    e = engine(tiny_llama_dir, enable_prefix_caching=prefix_caching)
    _, forked = run(e, [(long_prompt, sp)])
    e = engine(tiny_llama_dir, enable_prefix_caching=prefix_caching)
    _, separate = run(e, [(long_prompt, lone(sp, i)) for i in range(8)])
    # Forked: 11 prompt blocks once, plus one copy-on-write block per choice but the last.
    assert forked == 11 + 7
    assert separate == 8 * 11


def test_choices_survive_preemption_and_greedy_choices_agree(tiny_llama_dir):
    # 14 blocks for 8 choices of 7 + 12 tokens: choices get preempted and recomputed.
    e = engine(tiny_llama_dir, num_kv_blocks=14)
    out, _ = run(e, [(PROMPT, SAMPLED)])
    assert e.scheduler.num_preemptions > 0
    assert [out[0, i] for i in range(8)] == lone_choices(engine(tiny_llama_dir), SAMPLED)
    assert e.pool.num_free_blocks == e.pool.num_blocks
    greedy = SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True)
    out, _ = run(e, [(PROMPT, greedy)])
    assert out[0, 0] == out[0, 1] == out[0, 2]


def test_abort_ends_every_choice_and_the_offline_api_returns_them_apart(tiny_llama_dir):
    e = engine(tiny_llama_dir)
    rid = e.add_request(PROMPT, SAMPLED)
    e.step()  # the prompt: the choices fork
    assert e.stats().running == 8
    assert e.abort(rid)
    assert not e.has_unfinished() and e.pool.num_free_blocks == e.pool.num_blocks

    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=128, block_size=4)
    sp = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=5, ignore_eos=True)
    got = llm.generate(
        [
            GenerationRequest(prompt_ids=tuple(PROMPT), sampling=sp),
            GenerationRequest(prompt_ids=tuple(PROMPT), sampling=SamplingParams(max_tokens=2)),
        ]
    )
    assert [(c.index, c.choice) for c in got] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert all(len(c.token_ids) == 5 for c in got[:3]) and len(got[3].token_ids) == 2
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n > 1"):
        e.add_request(PROMPT, sp, output_ids=[5])
