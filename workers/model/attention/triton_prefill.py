"""Paged prefill attention as a Triton kernel: a prompt chunk's queries against the keys its
sequence's block table names, the cached prefix and the chunk itself alike, causally, for CUDA
machines without flash-attn.

It reads the paged cache in place (the chunk's own K/V are written there first), so a later
chunk or a prefix-cache hit needs no gather of its prefix, and it needs no mask tensor: the
causal bound is a comparison of positions inside the kernel. SDPA would take neither: a
boolean mask with GQA sends it to its math backend, in fp32, with the scores materialised.

One program per (tile of BLOCK_M queries, query head) walks the keys up to its last query's
position in tiles of TILE tokens, flash-style: a running max and sum in fp32, the scores never
stored. Tile sizes come from the head size and dtype alone.
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
    first_launch_failure,
    interpreting,
    jit,
    tl,
    triton,
)


@jit(do_not_specialize=["offset", "q_len"])  # they change with every chunk: one compile
def _prefill_kernel(
    q, k_cache, v_cache, table, out, scale_log2, offset, q_len,
    q_st, q_sh, c_sn, c_st, c_sh, o_st, o_sh,
    GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIM_P: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    tile_m, head = tl.program_id(0), tl.program_id(1)
    kvh = head // GROUP
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    d, offs = tl.arange(0, DIM_P), tl.arange(0, TILE)
    d_ok = d < DIM
    q_ok = (rows < q_len)[:, None] & d_ok[None, :]
    qt = tl.load(q + rows[:, None] * q_st + head * q_sh + d[None, :], mask=q_ok, other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    dtype = out.dtype.element_ty
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P], tl.float32)
    qpos = offset + rows  # each query's absolute position: it sees the keys up to it
    end = offset + tl.minimum(q_len, (tile_m + 1) * BLOCK_M)  # the tile's last position, + 1
    for start in range(0, end, TILE):
        pos = start + offs
        live = pos < end
        k, v = paged_kv_tile(
            k_cache, v_cache, table, pos, live, d, d_ok, kvh, c_sn, c_st, c_sh, BLOCK_SIZE, UPCAST
        )
        s = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * scale_log2
        # Finite somewhere in each row: the first tile holds position 0, which every query sees.
        s = tl.where(live[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        m_i, l_i, acc = softmax_step(s, v, m_i, l_i, acc, dtype, UPCAST, PRECISION)
    o = as_operand(acc / l_i[:, None], dtype, UPCAST)
    tl.store(out + rows[:, None] * o_st + head * o_sh + d[None, :], o.to(dtype), mask=q_ok)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chunk's queries q [n, H, D], the last n of its sequence's `ctx_len` tokens, each
    attending to the keys up to its own position among the `ctx_len` that `block_table`
    addresses in k_cache/v_cache [num_blocks, block_size, KVH, D] (the chunk's own written
    already); query head h reads KV head h // (H // KVH). Returns [n, H, D] in q's dtype."""
    if triton is None:
        raise RuntimeError(f"triton paged prefill attention: {IMPORT_ERROR}")
    q_len, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads: not a whole group")
    check_paged_cache(q, k_cache, v_cache)
    if not 0 < q_len <= ctx_len or block_table.numel() * block_size < ctx_len:
        raise ValueError(f"{q_len} queries of {ctx_len} tokens over {block_table.numel()} blocks")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q_len, heads, dim, dtype=q.dtype, device=q.device)
    dim_p = max(16, triton.next_power_of_2(dim))
    big = dim_p * q.element_size() > 256  # a K row over 256 bytes: smaller tiles
    tile, block_m = (32, 32) if big else (64, 64)
    warps = 8 if big else 4
    # The interpreter multiplies bfloat16 dot operands as raw bits (triton-lang/triton#11584):
    # there, operands go in as fp32 holding the values a GPU would feed its tensor cores.
    upcast = interpreting()
    _prefill_kernel[(triton.cdiv(q_len, block_m), heads)](
        q, k_cache, v_cache, block_table, out, scale * math.log2(math.e), ctx_len - q_len, q_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, DIM=dim, BLOCK_SIZE=block_size, DIM_P=dim_p, BLOCK_M=block_m,
        TILE=tile, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=upcast,
        num_warps=warps, enable_fp_fusion=True,
    )  # fmt: skip
    return out


def prefill_refusal(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                    head_dim: int, block_size: int) -> str | None:  # fmt: skip
    """Why the kernel cannot serve a model of these shapes on `device` (None: it can): its
    first launch is made here, at start, so a kernel that cannot compile is found then."""
    if not kv_heads or heads % kv_heads or head_dim > MAX_HEAD_DIM:
        return f"{heads} heads over {kv_heads} KV heads of {head_dim}: not a shape it takes"

    def launch() -> None:
        q = torch.zeros(2, heads, head_dim, dtype=dtype, device=device)
        cache = torch.zeros(1, 2, max(block_size, 2), kv_heads, head_dim, dtype=dtype)
        cache = cache.to(device)
        table = torch.zeros(1, dtype=torch.long, device=device)
        paged_prefill_attention(q, cache[:, 0], cache[:, 1], table, 2, 1.0)

    return first_launch_failure(launch, device)
