"""The KV cache in fp8 e4m3 (kv_cache_dtype: fp8): written saturating, read by the CPU kernels
as the bf16 values they hold, so that an fp8 cache attends exactly as a bf16 cache holding the
same values would, in decode and prefill alike; twice the blocks in the same memory, half the
bytes a token; the torch fallbacks hold the same values."""

import pytest
import torch

from workers.engine.config import EngineConfig
from workers.model.attention.torch_backend import as_cached
from workers.model.cpu_kernels import cpu_kernels

KERNELS = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="Tandem's CPU kernels did not build")
FP8 = torch.float8_e4m3fn


def caches(blocks: int, block_size: int, kv_heads: int, dim: int, seed: int):
    """An fp8 layer (K and V of a block side by side, as the engine allocates it), its K and
    V views, and the same values in bf16."""
    torch.manual_seed(seed)
    layer = (torch.randn(blocks, 2, block_size, kv_heads, dim) * 4).to(FP8)
    wide = layer.to(torch.bfloat16)
    return (layer[:, 0], layer[:, 1]), (wide[:, 0], wide[:, 1])


@needs_kernels
@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 9, 3), (128, 8, 8), (64, 4, 1), (32, 4, 2)])
def test_decode_attends_as_a_bf16_cache_of_the_same_values(dim, heads, kv_heads):
    (k8, v8), (kb, vb) = caches(40, 16, kv_heads, dim, seed=dim + heads)
    q = torch.randn(6, heads, dim).to(torch.bfloat16)
    tables = torch.stack([torch.randperm(40)[:9] for _ in range(6)])
    lens = torch.tensor([1, 15, 16, 17, 100, 144])
    got = KERNELS.paged_decode_attention(q, k8, v8, tables, lens, dim**-0.5)
    want = KERNELS.paged_decode_attention(q, kb, vb, tables, lens, dim**-0.5)
    if dim in (64, 128) and KERNELS.prefill_attention_bf16_supported(dim):
        assert torch.equal(got, want)  # the AVX512-BF16 kernel: the same instructions
    else:  # the generic kernel, compiled apart for each cache type (its sums may regroup)
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    q32 = q.float()  # the generic kernel (an fp32 model, or a CPU without AVX512-BF16)
    got32 = KERNELS.paged_decode_attention(q32, k8, v8, tables, lens, dim**-0.5)
    want32 = KERNELS.paged_decode_attention(q32, kb.float(), vb.float(), tables, lens, dim**-0.5)
    assert torch.allclose(got32, want32, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dim", [64, 128])
def test_prefill_attends_as_a_bf16_cache_of_the_same_values(dim):
    if not KERNELS.prefill_attention_bf16_supported(dim):
        pytest.skip("no AVX512-BF16 prefill kernel on this CPU")
    (k8, v8), (kb, vb) = caches(30, 16, 2, dim, seed=dim)
    q = torch.randn(37, 6, dim).to(torch.bfloat16)
    table = torch.randperm(30)[:8].contiguous()
    for ctx in (37, 100):  # a first chunk, and a later one over a prefix
        got = KERNELS.prefill_attention_bf16(q, k8, v8, table, ctx, dim**-0.5)
        assert torch.equal(got, KERNELS.prefill_attention_bf16(q, kb, vb, table, ctx, dim**-0.5))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_writes_saturate_and_match_the_fallbacks_values(dtype):
    torch.manual_seed(5)
    cache = torch.zeros(8, 4, 2, 40, dtype=FP8)  # rows of 80: 16 lanes at a time, and a tail
    scales = 10 ** (torch.rand(5, 2, 1) * 8 - 5)  # magnitudes from 1e-5 (subnormal) to 1e3
    rows = (torch.randn(5, 2, 40) * scales).to(dtype)
    rows[0, 0, :4] = torch.tensor([1e4, -600.0, 449.0, 470.0])  # past e4m3's 448
    rows[1, 1, 0] = 1e-9  # below its smallest step: 0
    rows[1, 1, 1:5] = torch.tensor([2**-6, -(2**-7), 2**-10, 3 * 2**-10])  # ties and edges
    slots = torch.tensor([0, 3, 9, 17, 31])
    KERNELS.write_slots(cache, slots, rows)
    got = cache.view(-1, 2, 40)[slots]
    want = as_cached(rows, FP8).to(FP8)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got[0, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 448.0]
    assert not got.float().isnan().any()


def test_as_cached_is_the_identity_but_for_fp8():
    x = torch.randn(3, 4).to(torch.bfloat16)
    assert as_cached(x, torch.bfloat16) is x
    rounded = as_cached(x, FP8)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, x.to(FP8).to(torch.bfloat16))


def test_fp8_holds_twice_the_blocks_and_is_refused_where_it_does_not_run():
    auto = EngineConfig(dtype="bfloat16", device="cpu", kv_cache_gb=0.5).resolve()
    fp8 = EngineConfig(
        dtype="bfloat16", device="cpu", kv_cache_gb=0.5, kv_cache_dtype="fp8"
    ).resolve()
    assert fp8.kv_blocks(30, 192) == 2 * auto.kv_blocks(30, 192)
    with pytest.raises(ValueError, match="CPU only for now"):
        EngineConfig(kv_cache_dtype="fp8", device="cuda")
    with pytest.raises(ValueError, match="CPU only for now"):
        EngineConfig(kv_cache_dtype="fp8").resolve(cuda=True, bf16=True)
    with pytest.raises(ValueError, match="choose from auto, fp8"):
        EngineConfig(kv_cache_dtype="int4")


def test_an_engine_keeps_fp8_kv_and_a_prompt_reads_the_same_in_any_chunks(tiny_llama_hd64_dir):
    """A prompt's later chunks read their prefix back from the fp8 cache: the greedy tokens
    are the same whether it is prefilled whole or in chunks of 16."""
    from workers.engine.request import SamplingParams
    from workers.offline import LLM

    prompt = [1, *range(200, 260)]
    outs, stats = [], []
    for chunk in (512, 16):
        llm = LLM(
            model=str(tiny_llama_hd64_dir),
            dtype="bfloat16",
            kv_cache_dtype="fp8",
            num_kv_blocks=64,
            prefill_chunk_size=chunk,
            enable_prefix_caching=False,
        )
        engine = llm.engine
        assert engine.runner.kv_layers[0].dtype == FP8
        assert engine.kv_layout.dtype == "float8_e4m3fn"
        rid = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0))
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        outs.append(tokens)
        stats.append(engine.stats().kv_bytes_per_token)
    assert len(outs[0]) == 12 and outs[0] == outs[1]
    cfg = engine.model_config
    assert stats[0] == 2 * cfg.num_layers * cfg.kv_size  # a byte a value
