"""What the paged attention kernels (triton_decode.py, triton_prefill.py) share inside a
kernel: a tile of keys and values read through a block table, and one step of the online
softmax over it (flash-style: a running max and sum in fp32, the scores never stored)."""

from __future__ import annotations

from workers.model.triton_base import as_operand, jit, tl

MAX_HEAD_DIM = 256


def check_paged_cache(q, k_cache, v_cache) -> None:
    """What both kernels ask of their inputs beside their own: K and V caches alike, dense in
    head_dim, of q's head size (at most MAX_HEAD_DIM) and dtype. ValueError naming it."""
    dim = q.shape[-1]
    if k_cache.shape[-1] != dim or dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {dim} (cache {k_cache.shape[-1]}): need equal, <= 256")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must be alike: shapes and strides")
    if k_cache.stride(-1) != 1 or q.dtype != k_cache.dtype:
        raise ValueError("the cache must be contiguous in head_dim, in q's dtype")


@jit
def paged_kv_tile(
    k_cache, v_cache, table, pos, live, d, d_ok, kvh, c_sn, c_st, c_sh,
    BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """K and V of the tokens at positions `pos` ([TILE]; `live` where they exist) of the
    sequence whose block table starts at `table`, for KV head `kvh`: [TILE, DIM_P] each."""
    # Each token goes through the table: a tile may span small blocks or part of a big one.
    block = tl.load(table + pos // BLOCK_SIZE, mask=live, other=0)
    token = block.to(tl.int64) * c_sn + (pos % BLOCK_SIZE) * c_st + kvh * c_sh
    kv_ok = live[:, None] & d_ok[None, :]
    # Masked loads, not masked scores alone: a slot past the length may hold NaN.
    k = tl.load(k_cache + token[:, None] + d[None, :], mask=kv_ok, other=0.0)
    v = tl.load(v_cache + token[:, None] + d[None, :], mask=kv_ok, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@jit
def softmax_step(
    s, v, m_i, l_i, acc, DTYPE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr
):
    """The running (max, sum, accumulator) after one tile of scores `s` (log2-scaled, -inf
    where masked; every row needs a finite score by its first tile) over values `v`."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = as_operand(p, DTYPE, UPCAST)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc
