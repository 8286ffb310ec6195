"""The engine's API for disaggregation and replay, without Ray: a prefill engine keeps a
prompt's KV, a second engine imports it layer by layer and decodes, and a request restarted
from the tokens it already produced continues exactly as if it had never stopped."""

from dataclasses import replace

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams, choice_id, choice_seed
from workers.engine.scheduler_output import SampledToken

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


def run_logged(engine, requests):
    """Runs (prompt, sampling, output_ids) requests together: each one's tokens and logprobs."""
    ids = {engine.add_request(p, sp, output_ids=out): i for i, (p, sp, out) in enumerate(requests)}
    got = [([], []) for _ in requests]
    while engine.has_unfinished():
        for o in engine.step():
            tokens, logprobs = got[ids[o.request_id]]
            tokens += o.new_token_ids
            logprobs += o.new_logprobs
    return got


def bf16_kernels_take(head_dim: int) -> bool:
    from workers.model.cpu_kernels import cpu_kernels

    k = cpu_kernels()
    return bool(
        k is not None and k.linear_bf16_supported() and k.prefill_attention_bf16_supported(head_dim)
    )


@pytest.mark.skipif(
    not bf16_kernels_take(64), reason="bit-for-bit rows need the bf16 CPU kernels (AVX512-BF16)"
)
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_a_replay_recomputes_its_tokens_bit_for_bit(tiny_llama_hd64_dir, caching):
    """The tokens a replay computes again attend as the decode steps that first computed them
    (not as prompt rows), so every logprob after them equals the first run's exactly. In
    bf16 a prefill's attention and a decode's round differently, and a replayed greedy request
    used to drift from the first run at the next near-tie. The replays run together, in
    chunks of 16 (without the prefix cache, a replay's prompt and tokens span several), so
    neither the batch nor the chunking may count; nor may a prompt cached whole. (In fp32
    torch's linears are not batch-invariant: test_a_replay_from_emitted_tokens_continues_...
    compares tokens there.)"""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_hd64_dir),
            dtype="bfloat16",
            num_kv_blocks=256,
            block_size=4,
            prefill_chunk_size=16,
            enable_prefix_caching=caching,
        )
    )
    sps = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True, logprobs=True),
    ]
    prompts = [PROMPT + [11, 12, 13], PROMPT[::-1] * 3]  # 13: a 1-token chunk once cached
    whole = [run_logged(engine, [(p, sp, ())])[0] for p, sp in zip(prompts, sps)]
    # Again, together (and with the cache, the prompts cached but their last token, which
    # is still a prompt row).
    assert run_logged(engine, list(zip(prompts, sps, [(), ()]))) == whole
    for k in (1, 13, 39):
        replays = run_logged(engine, [(p, sp, w[0][:k]) for p, sp, w in zip(prompts, sps, whole)])
        for (tokens, logprobs), w in zip(replays, whole):
            assert tokens == w[0][k:], f"replay from {k} tokens diverged"
            assert logprobs == w[1][k:], f"replay from {k} tokens: logprobs differ"
    assert free(engine)


def handoff(prefill, decode, sp, prior=()):
    """What a prefill worker and a decode worker do, in one process: the outputs of each
    choice (one unless sp.n > 1), by index."""
    rid = prefill.add_request(PROMPT, sp, output_ids=prior, stop_after=len(prior) + 1, keep_kv=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    outs.sort(key=lambda o: o.index)
    assert [o.index for o in outs] == list(range(sp.n))
    assert all(o.request_id == rid and o.finished and len(o.new_token_ids) == 1 for o in outs)
    last = outs[0]  # choice 0 holds the prompt's KV; the others only drew a first token
    assert all(o.kv_blocks is None for o in outs[1:])
    num_tokens = len(PROMPT) + len(prior)
    assert len(last.kv_blocks) == -(-num_tokens // 4)
    assert decode.reserve(rid, num_tokens) == len(last.kv_blocks)
    target = decode.reserved_blocks(rid)
    for layer in range(decode.kv_layout.num_layers):
        decode.import_kv_layer(layer, target, prefill.export_kv_layer(layer, last.kv_blocks))
    prefill.release_kv(last.kv_blocks)
    outputs = [[*prior, o.new_token_ids[0]] for o in outs]
    siblings = tuple(SampledToken(choice_id(rid, o.index), o.new_token_ids[0]) for o in outs[1:])
    ended = decode.add_prefilled(rid, PROMPT, outputs[0], sp, sp.seed or 0, siblings=siblings)
    assert all(o.request_id == rid and o.finished for o in ended)
    assert len(ended) == (sp.n if sp.max_tokens == 1 else 0)
    while decode.has_unfinished():
        for o in decode.step():
            assert o.request_id == rid
            outputs[o.index] += o.new_token_ids
    return outputs


def test_kept_kv_moved_to_another_engine_decodes_the_same(engines):
    prefill, decode = engines
    for sp in (
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True),
    ):
        whole = run(prefill, PROMPT, sp)
        assert handoff(prefill, decode, sp) == [whole]
        # A replayed attempt: the prefill computes prompt + 6 emitted tokens, decode goes on.
        assert handoff(prefill, decode, sp, prior=whole[:6]) == [whole]
        assert free(prefill) and free(decode)


def test_n_choices_prefilled_once_fork_on_the_decode_side_as_lone_requests(engines):
    """n > 1 across the handoff: one prefill draws every choice's first token, one KV moves,
    the decode engine forks the choices on the shared blocks; choice i equals a lone request
    seeded seed + i, token for token, and every block is free afterwards."""
    prefill, decode = engines
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=11, ignore_eos=True, n=4)
    choices = handoff(prefill, decode, sp)
    lone = [run(prefill, PROMPT, replace(sp, seed=choice_seed(11, i), n=1)) for i in range(sp.n)]
    assert choices == lone
    assert len({tuple(c) for c in choices}) > 1  # they are different draws
    assert free(prefill) and free(decode)


def test_choices_that_their_first_token_ends_end_at_admission(engines):
    prefill, decode = engines
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=3, n=3)
    assert [len(c) for c in handoff(prefill, decode, sp)] == [1, 1, 1]
    assert free(prefill) and free(decode)


def test_choice_ids_cannot_be_taken_by_other_requests(engines):
    engine, _ = engines
    sp = SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=3)
    rid = engine.add_request(PROMPT, sp)
    for taken in (rid, choice_id(rid, 1), choice_id(rid, 2)):
        with pytest.raises(ValueError, match="in use"):
            engine.add_request(PROMPT, replace(sp, n=1), taken)
    engine.add_request(PROMPT, replace(sp, n=1), choice_id(rid, 3))  # no such choice: free
    while engine.has_unfinished():
        engine.step()
    assert free(engine)


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


@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "whole-prompt-cached"])
def test_kv_completing_names_the_step_and_each_layer_is_final_when_marked(tiny_llama_dir, cached):
    """The hook a prefill worker streams from: called as the step that completes a keep_kv
    request's KV begins (also when that step computes one token only, its prompt being in the
    prefix cache), with the blocks the request keeps; each layer is marked once, in order,
    and its KV is then already what it ends as."""
    cfg = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    engine = LLMEngine(cfg)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = PROMPT[:9]  # two full blocks and one token
    if cached:
        run(engine, prompt, sp)  # leaves the two full blocks in the prefix cache
    calls, marked, snapshots = [], [], {}

    def completing(done):
        calls.append(done)
        [(_, blocks, _)] = done

        def layer_done(i):
            marked.append(i)
            snapshots[i] = engine.export_kv_layer(i, blocks).clone()

        return layer_done

    engine.on_kv_completing = completing
    rid = engine.add_request(prompt, sp, stop_after=1, keep_kv=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.on_kv_completing = None
    [out] = outs
    assert len(calls) == 1, "called once, for the step that completes the KV"
    assert calls[0] == [(rid, out.kv_blocks, len(prompt))]
    layers = engine.kv_layout.num_layers
    assert marked == list(range(layers))
    for i in range(layers):
        assert torch.equal(snapshots[i], engine.export_kv_layer(i, out.kv_blocks))
    engine.release_kv(out.kv_blocks)
    assert free(engine)


def test_a_prompt_waits_for_blocks_held_for_transfers_and_fails_only_past_the_whole_cache(
    tiny_llama_dir,
):
    """A prefill worker's blocks may all be held by finished prefills whose KV is being
    pushed: nothing runs, but they will come back, so the next prompt waits for them (it
    used to fail as one that can never fit). A prompt bigger than the whole cache is
    refused."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, block_size=4))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    kept = []
    for prompt in (PROMPT, PROMPT[::-1]):  # 3 blocks each, held after their first token
        engine.add_request(prompt, sp, stop_after=1, keep_kv=True)
        while engine.has_unfinished():
            kept += [o.kv_blocks for o in engine.step() if o.kv_blocks]
    assert len(kept) == 2 and engine.stats().kv_blocks_free == 2
    rid = engine.add_request(PROMPT[1:] + [5], sp)  # 3 blocks: waits for a release
    for _ in range(3):
        assert not [o for o in engine.step() if o.request_id == rid and o.finished]
    engine.release_kv(kept.pop())
    out = run_to_end(engine, rid)
    assert out.finish_reason.value == "length" and out.error is None
    engine.release_kv(kept.pop())
    with pytest.raises(ValueError, match="whole KV cache"):
        engine.add_request(list(range(3, 40)), sp)  # 10 blocks of the 8
    assert free(engine)


def run_to_end(engine, rid):
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o
    raise AssertionError(f"{rid} never finished")


def test_a_constrained_request_handed_off_decodes_the_same(engines):
    """The prefill draws the first token under the grammar; the decode engine rebuilds the
    matcher from it (and a replay's prior tokens) and goes on as one engine would, choices
    of n > 1 each on their own matcher."""
    import json

    from workers.engine.constraint import Constraint

    prefill, decode = engines
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"enum": ["x", "yy", "zzz"]}},
        "required": ["a", "b"],
    }  # fmt: skip
    c = Constraint.json_schema(schema)
    for sp in (
        SamplingParams(max_tokens=40, temperature=0, constraint=c),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, constraint=c),
    ):
        whole = run(prefill, PROMPT, sp)
        json.loads(prefill.tokenizer.decode(whole))
        assert handoff(prefill, decode, sp) == [whole]
        assert handoff(prefill, decode, sp, prior=whole[:4]) == [whole]
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=7, constraint=c, n=3)
    choices = handoff(prefill, decode, sp)
    lone = [run(prefill, PROMPT, replace(sp, seed=choice_seed(7, i), n=1)) for i in range(3)]
    assert choices == lone
    assert free(prefill) and free(decode)
