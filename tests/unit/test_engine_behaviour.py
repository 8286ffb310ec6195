"""The engine's request-level behaviour on a tiny random Llama: seeds, stop strings,
cancellation, logprobs, bad input, and the CPU decode kernel against torch SDPA."""

import pytest
import torch

from tests.reference import engine_logits, run_engine
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams
from workers.offline import LLM, GenerationRequest

PROMPT = [1, 504, 3575, 282, 4649, 314, 28, 19556]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4))


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = run_engine(engine, [PROMPT], sp)[0]
    other = SamplingParams(max_tokens=7, temperature=1.0, seed=99, ignore_eos=True)
    ids = [
        engine.add_request(PROMPT[:5], other),
        engine.add_request(PROMPT, sp),
        engine.add_request(PROMPT[2:], other),
    ]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert out[ids[1]] == alone
    different = run_engine(
        engine, [PROMPT], SamplingParams(max_tokens=10, temperature=0.9, seed=4321, ignore_eos=True)
    )[0]
    assert different != alone


def test_cancel_frees_blocks_and_ends_the_request(engine):
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    assert engine.abort(rid)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.has_unfinished() and not engine.abort(rid)


def test_logprobs_are_the_models_log_probabilities(engine):
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=True)
    rid = engine.add_request(PROMPT, sp)
    (out,) = engine.step()
    assert out.request_id == rid and len(out.new_logprobs) == 1
    expected = engine_logits(engine, PROMPT)[-1].log_softmax(-1)
    assert out.new_logprobs[0] == pytest.approx(expected.max().item(), abs=1e-4)
    assert out.new_token_ids[0] == expected.argmax().item()


def test_bad_prompts_are_refused_with_a_reason(engine):
    sp = SamplingParams()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], sp)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([10**7], sp)
    with pytest.raises(ValueError, match="the model's context is 512"):
        engine.add_request([5] * 600, sp)


def test_stop_strings_cut_text_and_end_the_request(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    free = llm.generate(
        [
            GenerationRequest(
                prompt_ids=tuple(PROMPT),
                sampling=SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
            )
        ]
    )[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    streamed = []
    (cut,) = llm.generate(
        [
            GenerationRequest(
                prompt_ids=tuple(PROMPT),
                sampling=SamplingParams(
                    max_tokens=30, temperature=0, ignore_eos=True, stop=(stop,)
                ),
            )
        ],
        on_delta=lambda i, d, done: streamed.append(d),
    )
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    assert "".join(streamed) == cut.text  # nothing streamed was taken back
    assert len(cut.token_ids) < len(free.token_ids)


def test_invalid_request_in_a_batch_does_not_disturb_the_rest(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    ok = GenerationRequest(prompt_ids=tuple(PROMPT), sampling=SamplingParams(max_tokens=3))
    bad = GenerationRequest(prompt_ids=(10**7,), sampling=SamplingParams(max_tokens=3))
    a, b, c = llm.generate([ok, bad, ok])
    assert b.finish_reason == "error" and "vocabulary" in b.error
    assert a.finish_reason == c.finish_reason == "length" and len(a.token_ids) == 3
    assert a.ttft_s is not None and a.e2e_s >= a.ttft_s


def test_cpu_decode_kernel_matches_sdpa(tiny_llama_dir, dtype="float32"):
    from workers.model.cpu_kernels import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the kernel could not be built")
    outs = {}
    for backend in ("torch", "torch-sdpa"):
        eng = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_dir),
                num_kv_blocks=64,
                block_size=4,
                dtype=dtype,
                attention_backend=backend,
            )
        )
        assert ("cpu-kernel" in eng.runner.backend.name) == (backend == "torch")
        prompts = [PROMPT, PROMPT[:3], list(range(200, 237))]
        outs[backend] = run_engine(
            eng, prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        )
    assert outs["torch"] == outs["torch-sdpa"]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [16, 64, 128])  # the generic kernel and both fixed head sizes
@pytest.mark.parametrize("batch", [2, 9])  # one KV head per work item, and all heads per item
@pytest.mark.parametrize("group", [3, 9])  # 9 query heads a KV head: past the bf16 path's 8
@pytest.mark.parametrize("paired", [False, True])  # K and V apart, or a block's side by side
def test_kernel_numerics_against_a_dense_reference(dtype, tol, d, batch, group, paired):
    from workers.model.cpu_kernels import cpu_kernels

    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("no C++ compiler: the kernel could not be built")
    torch.manual_seed(0)
    blocks, bs, kvh, width = 64, 4, 2, 5
    heads = kvh * group
    k_cache, v_cache = _cache_pair(torch.randn, blocks, bs, kvh, d, dtype, paired)
    tables = torch.stack([torch.randperm(blocks)[:width] for _ in range(batch)])
    lens = torch.tensor([1 + (7 * b + 12) % (width * bs) for b in range(batch)])
    q = torch.randn(batch, heads, d).to(dtype)
    out = kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
    assert out.dtype == dtype
    for b in range(batch):
        keys = k_cache[tables[b]].reshape(-1, kvh, d)[: lens[b]].repeat_interleave(group, dim=1)
        vals = v_cache[tables[b]].reshape(-1, kvh, d)[: lens[b]].repeat_interleave(group, dim=1)
        w = torch.einsum("hd,lhd->hl", q[b].float(), keys.float()).mul(d**-0.5).softmax(-1)
        want = torch.einsum("hl,lhd->hd", w, vals.float())
        torch.testing.assert_close(out[b].float(), want, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="outside 1.."):
        kernel.paged_decode_attention(q, k_cache, v_cache, tables, lens * 0, d**-0.5)
    bad = tables.clone()
    bad[0, 0] = blocks  # one past the cache: refused, not read
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_decode_attention(q, k_cache, v_cache, bad, lens, d**-0.5)


def _cache_pair(make, blocks, bs, kvh, d, dtype, paired):
    """A layer's K and V caches: two tensors, or (paired) views of one allocation holding a
    block's K and V side by side, as the engine allocates them."""
    if paired:
        layer = make(blocks, 2, bs, kvh, d).to(dtype)
        return layer[:, 0], layer[:, 1]
    return make(blocks, bs, kvh, d).to(dtype), make(blocks, bs, kvh, d).to(dtype)


def _prefill_case(dtype, offset, q_len, d=16, bs=4, kvh=2, heads=6, seed=0, paired=False):
    """A prompt chunk after `offset` cached tokens, its K/V already in scattered blocks."""
    from workers.model.attention.base import PrefillSlice, slot_index

    torch.manual_seed(seed)
    ctx = offset + q_len
    k_all, v_all = torch.randn(ctx, kvh, d).to(dtype), torch.randn(ctx, kvh, d).to(dtype)
    q = torch.randn(q_len, heads, d).to(dtype)
    blocks = -(-ctx // bs) + 8
    table = torch.randperm(blocks)[: -(-ctx // bs)]
    k_cache, v_cache = _cache_pair(torch.zeros, blocks, bs, kvh, d, dtype, paired)
    slots = torch.tensor([int(table[i // bs]) * bs + i % bs for i in range(ctx)])
    k_cache[slot_index(slots, bs)] = k_all
    v_cache[slot_index(slots, bs)] = v_all
    part = PrefillSlice(0, q_len, ctx, table)
    return q, k_all, v_all, k_cache, v_cache, part


def _prefill_kernel_backend():
    from workers.model.attention.torch_backend import TorchAttentionBackend

    backend = TorchAttentionBackend(torch.device("cpu"))
    probe = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    if not backend._prefill_kernel(probe, cache, cache, torch.zeros(1, dtype=torch.long)):
        pytest.skip("no bf16 prefill kernel here (no compiler or no AVX512-BF16)")
    return backend


@pytest.mark.parametrize(
    "dtype, tol, d, kernel",
    [
        (torch.float32, 1e-5, 16, False),
        (torch.bfloat16, 2e-2, 16, False),
        (torch.bfloat16, 2e-2, 64, True),  # the compiled kernel's head sizes
        (torch.bfloat16, 2e-2, 128, True),
    ],
)
@pytest.mark.parametrize("offset, q_len", [(0, 9), (5, 1), (12, 7), (37, 40), (70, 45)])
@pytest.mark.parametrize("paired", [False, True])
def test_prefill_chunk_attention_against_a_dense_reference(
    dtype, tol, d, kernel, offset, q_len, paired
):
    """A prompt chunk after `offset` cached tokens (its prefix read from scattered blocks: the
    CPU's two-pass path, or the bf16 kernel), or a first chunk (offset 0), against causal
    attention written out in fp32."""
    from workers.model.attention.torch_backend import TorchAttentionBackend

    heads, kvh = 6, 2
    q, k_all, v_all, k_cache, v_cache, part = _prefill_case(
        dtype, offset, q_len, d=d, paired=paired
    )
    if kernel:
        backend = _prefill_kernel_backend()
    else:
        backend = TorchAttentionBackend(torch.device("cpu"), use_kernel=False)
    out = backend._prefill(q, k_all[offset:], v_all[offset:], k_cache, v_cache, part, d**-0.5)
    keys = k_all.float().repeat_interleave(heads // kvh, dim=1)
    vals = v_all.float().repeat_interleave(heads // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * d**-0.5
    seen = torch.arange(offset + q_len)[None, :] <= torch.arange(q_len)[:, None] + offset
    w = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khd->qhd", w, vals)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_prefill_kernel_rows_do_not_depend_on_chunking_or_threads():
    """A query row's output is the same bits whether its prompt is prefilled in one chunk or
    several, and on one thread or two: chunk sizes and pools do not change a greedy output."""
    backend = _prefill_kernel_backend()
    q, k_all, v_all, k_cache, v_cache, whole = _prefill_case(torch.bfloat16, 0, 203, d=64)
    full = backend._prefill(q, k_all, v_all, k_cache, v_cache, whole, 0.125)
    for start, stop in [(0, 37), (37, 40), (40, 203)]:  # chunks that cut 8-row tiles
        part = type(whole)(0, stop - start, stop, whole.block_table)
        got = backend._prefill(
            q[start:stop], k_all[start:stop], v_all[start:stop], k_cache, v_cache, part, 0.125
        )
        assert torch.equal(got, full[start:stop]), (start, stop)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(backend._prefill(q, k_all, v_all, k_cache, v_cache, whole, 0.125), full)
    finally:
        torch.set_num_threads(threads)
    bad = whole.block_table.clone()
    bad[-1] = k_cache.shape[0]  # one past the cache: refused, not read
    with pytest.raises(RuntimeError, match="out of range"):
        backend.kernel.prefill_attention_bf16(q, k_cache, v_cache, bad, 203, 0.125)


def test_min_tokens_holds_back_eos_and_stop_strings(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    eos = llm.engine.eos_token_ids[0]
    # EOS made the most likely token: it comes exactly once min_tokens are out.
    (early, held) = llm.generate(
        [
            GenerationRequest(
                prompt_ids=tuple(PROMPT),
                sampling=SamplingParams(
                    max_tokens=20, temperature=0, logit_bias={eos: 100.0}, min_tokens=n
                ),
            )
            for n in (0, 5)
        ]
    )
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    assert held.token_ids[-1] == eos and len(held.token_ids) == 6
    assert eos not in held.token_ids[:-1] and held.finish_reason == "stop"
    # A stop string in the first token ends the request only without min_tokens.
    free = llm.generate([GenerationRequest(prompt_ids=tuple(PROMPT), sampling=GREEDY_LONG)])[0]
    first = llm.tokenizer.decode(free.token_ids[:1])
    stop = first.strip()[:2]
    assert stop, "the tiny model's first token is printable"
    cut, late = llm.generate(
        [
            GenerationRequest(
                prompt_ids=tuple(PROMPT),
                sampling=SamplingParams(
                    max_tokens=30, temperature=0, ignore_eos=True, stop=(stop,), min_tokens=n
                ),
            )
            for n in (0, 3)
        ]
    )
    assert len(cut.token_ids) == 1 and cut.finish_reason == "stop"
    assert len(late.token_ids) > 3 and late.token_ids == free.token_ids[: len(late.token_ids)]
    assert late.text.startswith(first)
    # A replay that resumes after the first two tokens (the stop string among them, held back
    # by min_tokens) goes on to the same end.
    engine = llm.engine
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(stop,), min_tokens=3)
    rid = engine.add_request(PROMPT, sp, output_ids=late.token_ids[:2])
    replayed = list(late.token_ids[:2])
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            replayed += o.new_token_ids
    assert replayed == late.token_ids


GREEDY_LONG = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def test_top_logprobs_come_with_every_token(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), num_kv_blocks=64, block_size=4)
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=True, top_logprobs=4)
    (c,) = llm.generate([GenerationRequest(prompt_ids=tuple(PROMPT), sampling=sp)])
    assert len(c.top_logprobs) == len(c.token_ids) == len(c.logprobs) == 6
    for token, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
        assert len(top) == 4
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert lp <= values[0] + 1e-6
        if token in dict(top):
            assert dict(top)[token] == pytest.approx(lp, abs=1e-5)


def test_a_short_stop_string_in_text_already_searched_does_not_match_later(tiny_llama_dir):
    from workers.engine.stop_strings import StopStringMatcher
    from workers.model.loader import resolve_model
    from workers.model.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model(str(tiny_llama_dir)))
    a, nl, b = (tok.encode(t) for t in ("a", "\n", "b"))
    m = StopStringMatcher(tok, ("\n", "###END"))
    assert m.push(a, search=False) is None and m.push(nl, search=False) is None  # min_tokens
    assert m.push(b) is None and m.text == "a\nb"  # the held-back "\n" stays held back
    assert m.push(nl) == "\n" and m.text == "a\nb"
