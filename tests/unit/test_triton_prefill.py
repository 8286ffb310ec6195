"""The Triton paged prefill kernel (workers/model/attention/triton_prefill.py) against an fp64
reference read from the same paged cache: first chunks and later ones (a cached prefix), query
groups of 1 to 16, head sizes that pad, block sizes from 1 to 256, chunks that cross the
kernel's tiles; in Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET must be set
before triton is imported), and compiled on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from tests.unit import triton_checks

# (H, KVH, D)
HEADS = [(2, 2, 64), (9, 3, 80), (8, 2, 64), (16, 1, 128)]
# (block size, tokens before the chunk, chunk): first chunks, later ones, across 64-wide tiles.
CHUNKS = [(16, 0, 70), (4, 37, 29), (1, 5, 3), (256, 300, 130), (16, 64, 64), (4, 0, 1)]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-3, 2**-8)}


def case(dtype, block_size, prefix, n, heads, kv_heads, dim, seed, device="cpu"):
    """q for the chunk's n rows (a view into fused qkv rows), and a paged cache holding the
    sequence's prefix + n tokens in scattered blocks, NaN wherever nothing was written."""
    g = torch.Generator().manual_seed(seed)
    ctx = prefix + n
    need = -(-ctx // block_size)
    num_blocks = need + 3
    table = torch.randperm(num_blocks, generator=g)[:need]
    layer = torch.full((num_blocks, 2, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    pos = torch.arange(ctx)
    layer[table[pos // block_size], :, pos % block_size] = torch.randn(
        ctx, 2, kv_heads, dim, generator=g
    ).to(dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * dim].view(n, heads, dim)
    layer = layer.to(device)
    return q, layer[:, 0], layer[:, 1], table.to(device), ctx, dim**-0.5


def reference(q, k_cache, v_cache, table, ctx, scale):
    n, heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(ctx, device=q.device)
    blocks = table.long()[pos // block_size]
    k = k_cache[blocks, pos % block_size].double().repeat_interleave(heads // kv_heads, 1)
    v = v_cache[blocks, pos % block_size].double().repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    s = s.masked_fill(pos[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def check_reference(device: str) -> None:
    from workers.model.attention.triton_prefill import paged_prefill_attention

    for dtype in TOL:
        for i, (block_size, prefix, n) in enumerate(CHUNKS):
            for j, (heads, kv_heads, dim) in enumerate(HEADS):
                args = case(dtype, block_size, prefix, n, heads, kv_heads, dim, 10 * i + j, device)
                got = paged_prefill_attention(*args)
                want = reference(*args)
                atol, rtol = TOL[dtype]
                err = ((got.double() - want).abs() - rtol * want.abs()).max().item() - atol
                what = f"{dtype} block {block_size} chunk {prefix}+{n} H={heads}/{kv_heads} D={dim}"
                assert got.shape == args[0].shape and got.dtype == dtype, what
                assert err <= 0, f"{what}: error {err:.3g} past the tolerance {TOL[dtype]}"


def check_first_launch(device: str) -> None:
    from workers.model.attention.triton_prefill import prefill_refusal

    for heads, kv_heads, dim in HEADS:
        why = prefill_refusal(torch.device(device), torch.bfloat16, heads, kv_heads, dim, 16)
        assert why is None, f"H={heads} KVH={kv_heads} D={dim}: refused: {why}"


CHECKS = {"reference": check_reference, "first_launch": check_first_launch}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    return triton_checks.interpreted("tests.unit.test_triton_prefill", "cpu")


@pytest.mark.parametrize("check", CHECKS)
def test_interpreted(interpreted: dict[str, str], check: str) -> None:
    assert interpreted[check] == "ok", interpreted[check]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernel: needs a CUDA GPU")
def test_compiled_on_cuda() -> None:
    pytest.importorskip("triton", reason="triton is not installed: no kernel to test")
    assert triton_checks.run_checks(CHECKS, "cuda") == dict.fromkeys(CHECKS, "ok")
