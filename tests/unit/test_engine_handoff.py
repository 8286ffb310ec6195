"""The engine's API for disaggregation and replay, without Ray: a prefill engine keeps a
prompt's KV, a second engine imports it layer by layer and decodes, and a request restarted
from the tokens it already produced continues exactly as if it had never stopped."""

import pytest

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams

PROMPT = [1, 504, 3575, 282, 4649, 314, 28, 19556, 42, 7]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    cfg = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    return LLMEngine(cfg), LLMEngine(cfg)


def run(engine, prompt, sp, output_ids=()):
    rid = engine.add_request(prompt, sp, output_ids=output_ids)
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            out += o.new_token_ids
    return out


def free(engine) -> bool:
    s = engine.stats()
    return s.kv_blocks_free == s.kv_blocks_total and s.reserved == 0


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=77, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_replay_from_emitted_tokens_continues_token_for_token(engines, sp):
    engine, _ = engines
    whole = run(engine, PROMPT, sp)
    for k in (1, 9, 23):
        rest = run(engine, PROMPT, sp, output_ids=whole[:k])
        assert rest == whole[k:], f"replay from {k} tokens diverged"
    assert free(engine)


def handoff(prefill, decode, sp, prior=()):
    """What a prefill worker and a decode worker do, in one process."""
    rid = prefill.add_request(PROMPT, sp, output_ids=prior, stop_after=len(prior) + 1, keep_kv=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (last,) = outs
    assert last.request_id == rid and last.finished and len(last.new_token_ids) == 1
    num_tokens = len(PROMPT) + len(prior)
    assert len(last.kv_blocks) == -(-num_tokens // 4)
    assert decode.reserve(rid, num_tokens) == len(last.kv_blocks)
    target = decode.reserved_blocks(rid)
    for layer in range(decode.kv_layout.num_layers):
        decode.import_kv_layer(layer, target, prefill.export_kv_layer(layer, last.kv_blocks))
    prefill.release_kv(last.kv_blocks)
    outputs = [*prior, last.new_token_ids[0]]
    done = decode.add_prefilled(rid, PROMPT, outputs, sp, sp.seed or 0)
    assert done is None
    while decode.has_unfinished():
        for o in decode.step():
            outputs += o.new_token_ids
    return outputs


def test_kept_kv_moved_to_another_engine_decodes_the_same(engines):
    prefill, decode = engines
    for sp in (
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True),
    ):
        whole = run(prefill, PROMPT, sp)
        assert handoff(prefill, decode, sp) == whole
        # A replayed attempt: the prefill computes prompt + 6 emitted tokens, decode goes on.
        assert handoff(prefill, decode, sp, prior=whole[:6]) == whole
        assert free(prefill) and free(decode)


def test_a_reservation_is_given_back_and_kept_kv_outlives_abort(engines):
    prefill, decode = engines
    assert decode.reserve("r", 9) == 3
    assert decode.reserved_blocks("r") is not None and not free(decode)
    assert decode.release("r") and free(decode)
    assert decode.reserved_blocks("r") is None and not decode.release("r")
    sp = SamplingParams(max_tokens=8, temperature=0)
    rid = prefill.add_request(PROMPT, sp, stop_after=1, keep_kv=True)
    (out,) = prefill.step()
    assert out.finished and out.kv_blocks
    assert not prefill.abort(rid)  # it has ended: its kept blocks stay until released
    assert not free(prefill)
    prefill.release_kv(out.kv_blocks)
    assert free(prefill)
