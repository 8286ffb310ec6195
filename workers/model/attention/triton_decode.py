"""Paged decode attention as a Triton kernel: one query token per row against the KV blocks
its block table names, for CUDA machines without flash-attn.

The contract is the CPU kernel's (csrc/paged_attention_cpu.cpp `paged_decode_attention`) and
`TorchAttentionBackend._decode`'s. One program per (row, KV head) walks its own row's length,
read from `context_lens` on the device: no host sync, no data-dependent shape, so the launch
can be captured in a CUDA graph; and no tile size or loop bound depends on the batch, so a
row comes out the same bits whatever shares its batch.
"""

from __future__ import annotations

import math

import torch

from workers.model.attention.triton_tiles import (
    MAX_HEAD_DIM,
    check_paged_cache,
    paged_kv_tile,
    softmax_step,
)
from workers.model.triton_base import (
    IMPORT_ERROR,
    as_operand,
    interpreting,
    jit,
    tl,
    triton,
    triton_unavailable,
)

GROUP_PAD = 16  # tl.dot wants M >= 16: a query group is padded to 16 rows (the kernel's 16)


@jit
def _decode_kernel(
    q, k_cache, v_cache, tables, lens, out, scale_log2,
    q_sb, q_sh, c_sn, c_st, c_sh, t_sb, o_sb, o_sh,
    GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIM_P: tl.constexpr,
    TILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    row, kvh = tl.program_id(0), tl.program_id(1)
    g, d, offs = tl.arange(0, 16), tl.arange(0, DIM_P), tl.arange(0, TILE)
    d_ok = d < DIM
    head = kvh * GROUP + g
    q_ok = (g < GROUP)[:, None] & d_ok[None, :]
    qg = tl.load(q + row * q_sb + head[:, None] * q_sh + d[None, :], mask=q_ok, other=0.0)
    if UPCAST:
        qg = qg.to(tl.float32)
    dtype = out.dtype.element_ty
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, DIM_P], tl.float32)
    length = tl.load(lens + row)
    for start in range(0, length, TILE):
        pos = start + offs
        live = pos < length
        k, v = paged_kv_tile(
            k_cache, v_cache, tables + row * t_sb, pos, live, d, d_ok, kvh, c_sn, c_st, c_sh,
            BLOCK_SIZE, UPCAST,
        )  # fmt: skip
        s = tl.dot(qg, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(live[None, :], s, float("-inf"))  # every tile has a live position
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, dtype, UPCAST, PRECISION)
    o = as_operand(acc / l_i[:, None], dtype, UPCAST)
    tl.store(out + row * o_sb + head[:, None] * o_sh + d[None, :], o.to(dtype), mask=q_ok)


def triton_refusal(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> str | None:
    """Why the kernel cannot serve a model of these shapes on `device`; None if it can.
    Beyond the shapes it takes and triton's presence, it is launched once at these shapes, so
    that a kernel that cannot compile here (no C compiler in the image, a GPU this triton does
    not know) is found at start, not at the first decode step."""
    group = heads // kv_heads if kv_heads else 0
    if not kv_heads or heads % kv_heads or not 1 <= group <= GROUP_PAD:
        return (
            f"{heads} query heads over {kv_heads} KV heads: the kernel takes groups of "
            f"1..{GROUP_PAD}"
        )
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim}: the kernel takes up to {MAX_HEAD_DIM}"
    why = triton_unavailable()
    if why is not None:
        return why
    try:
        q = torch.zeros(1, heads, head_dim, dtype=dtype, device=device)
        cache = torch.zeros(1, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device)
        tables = torch.zeros(1, 1, dtype=torch.long, device=device)
        lens = torch.ones(1, dtype=torch.long, device=device)
        paged_decode_attention(q, cache[:, 0], cache[:, 1], tables, lens, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # whatever the compiler or driver raised
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"its first launch failed: {type(e).__name__}: {first}"
    return None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row i of q [B, H, D] attends to the first context_lens[i] tokens that block_tables[i]
    addresses in k_cache/v_cache [num_blocks, block_size, KVH, D]; query head h reads KV
    head h // (H // KVH). Returns [B, H, D] in q's dtype, written into `out` when given."""
    if triton is None:  # callers ask triton_unavailable() first; this is the hot path
        raise RuntimeError(f"triton paged decode attention: {IMPORT_ERROR}")
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if heads != group * kv_heads or group > GROUP_PAD:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: need a group of 1..16")
    check_paged_cache(q, k_cache, v_cache)
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("block_tables must be [B, W] and context_lens [B]")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must be like q: [B, H, D], its dtype, contiguous in D")
    if batch == 0:
        return out
    dim_p = max(16, triton.next_power_of_2(dim))
    # 64 tokens a tile while a token's K row is at most 256 bytes (bf16 D<=128, fp32 D<=64),
    # else 32, so K and V tiles stay small. From the shapes alone: batch-invariant.
    tile = 64 if dim_p * q.element_size() <= 256 else 32
    # 8 warps for tiles over 16 KiB (fp32, D>128), which take 234 registers a thread at 4.
    warps = 4 if tile * dim_p * q.element_size() <= 16384 else 8
    # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584):
    # there, operands go in as fp32 holding the values a GPU would feed its tensor cores.
    upcast = interpreting()
    _decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, DIM=dim, BLOCK_SIZE=block_size, DIM_P=dim_p, TILE=tile,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=upcast,
        num_warps=warps, enable_fp_fusion=True,  # fusion pinned: 3.10 changes the default
    )  # fmt: skip
    return out
